"""``ds4quant run``: the MoE layers of an artifact on an expert-parallel cluster of local ranks."""

from __future__ import annotations

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, json_option, mode_option
from ds4quant.cli.output import command_progress, emit_json


@cli.command("run")
@click.argument("artifact", type=PATH)
@click.option("--ranks", type=int, required=True, help="Ranks to start on this host (torch.distributed).")
@click.option("--placement", required=True, type=PATH,
              help="A rank placement (ds4quant place --ranks N).")
@click.option("--tokens", type=int, default=1, show_default=True, help="Seeded synthetic tokens per layer.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layers", default=None, metavar="L1,L2,...", help="MoE layers to run (default: all).")
@mode_option(default="exact")
@click.option("--owner", "owners", multiple=True, metavar="NAME",
              help="Local owner(s) of each rank, {local_rank} substituted (default: the placement's).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option("--launcher", type=click.Choice(["spawn", "torchrun"]), default="spawn", show_default=True,
              help="spawn: one child per rank, nothing listens beyond loopback; torchrun: torch's agent "
                   "store also listens on every interface while the run lasts (docs/cluster-security.md).")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds a collective may wait for a peer before every rank fails.")
@click.option("--no-verify-payloads", "no_verify", is_flag=True,
              help="Skip hashing the artifact against its manifest before loading (for a folder you verified).")
@click.option("--out", default=None, type=PATH, help="Write the result JSON here.")
@json_option(help="Print the result JSON instead of lines.")
def run_cmd(artifact, ranks, placement, tokens, seed, layers, mode, owners, backend, launcher, timeout, no_verify,
            out, as_json):
    """Run the MoE layers of ARTIFACT on --ranks processes (an expert-parallel cluster)."""
    from ds4quant.runtime.cluster import result_lines, run_cluster_layers

    lay = None
    if layers:
        try:
            lay = [int(v) for v in layers.split(",")]
        except ValueError:
            raise click.BadParameter("must be comma-separated layer numbers", param_hint="--layers") from None
    run = run_cluster_layers(artifact, placement, tokens=tokens, n_ranks=ranks, mode=mode, timeout_s=timeout,
                             layers=lay, owners=list(owners) or None, backend=backend, launcher=launcher, seed=seed,
                             verify_payloads=not no_verify, progress=command_progress(as_json))
    j = run.to_json()
    if out:
        from ds4quant.artifact.atomic import atomic_write_bytes, json_bytes

        atomic_write_bytes(out, json_bytes(j))
    if as_json:
        emit_json(j)
    else:
        click.echo("\n".join(result_lines(run)))
