"""``ds4quant publish``: verify an artifact, then write (and optionally upload) a release folder."""

from __future__ import annotations

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, fidelity_option, imatrix_option, json_option, mode_option, protocol_option, source_option
from ds4quant.cli.output import command_progress, emit_json


@cli.command("publish")
@click.argument("artifact", type=PATH)
@click.argument("outdir", type=PATH)
@source_option(help="Verify against this checkpoint first; the model card then shows decoded fidelity.")
@imatrix_option(help="Importance matrix for the weighted error (needs --source).")
@click.option("--hf-repo", default=None, metavar="NAME",
              help="Also upload the release folder to this Hugging Face repo (one commit).")
@fidelity_option(help="Also measure fidelity through the bundled runtime (KL, top-1, exact copy; needs --source); "
                      "the model card carries the figures.")
@protocol_option(help="With --fidelity: run this protocol too.")
@mode_option(help="With --fidelity: the runtime's mode.")
@click.option("--reference", "reference", default=None, type=PATH,
              help="With --fidelity: a reference base from `ds4quant reference` (read, not run).")
@click.option("--force", is_flag=True, help="Replace an earlier release in OUTDIR (only a folder publish wrote: "
                                            "every file listed in its SHA256SUMS).")
@json_option()
def publish_cmd(artifact, outdir, source, imatrix, hf_repo, fidelity, protocol, mode, reference, force, as_json):
    """Verify an artifact, then write a release folder: the artifact files,
    manifest.json, SHA256SUMS, the verify report with plots, and a model card
    README.md. An unsound artifact is refused (exit 1).

    \b
    Examples:
      ds4quant publish out/tiny-mix release/tiny-mix --source samples/ds4-tiny
      ds4quant publish out/tiny-mix release/tiny-mix --hf-repo me/ds4-tiny-rocmfpx
      ds4quant publish out/copy-mix release/copy-mix --source samples/ds4-copy --fidelity --protocol exact-copy
    """
    from ds4quant.publish import publish

    if (fidelity or protocol) and source is None:
        from ds4quant.errors import BadInputError

        raise BadInputError("--fidelity and --protocol need --source", where=str(artifact))
    rep = publish(artifact, outdir, source=source, imatrix=imatrix, hf_repo=hf_repo, overwrite=force,
                  fidelity=fidelity or protocol is not None or reference is not None, protocol=protocol, mode=mode,
                  progress=command_progress(as_json, wanted=source is not None), reference=reference)
    for line in rep.stale:
        click.echo(f"ds4quant: note: {line}", err=True)
    if as_json:
        emit_json(rep.to_json())
        return
    click.echo(f"release {rep.release}: {len(rep.files)} files, {rep.bytes:,} bytes; check it with "
               f"`cd {rep.release} && sha256sum -c SHA256SUMS`")
    if rep.url:
        click.echo(f"uploaded: {rep.url}")
