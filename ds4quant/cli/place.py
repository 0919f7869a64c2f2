"""``ds4quant place``: plan (or check) which owner holds which routed expert."""

from __future__ import annotations

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import OWNER_BUDGET, PATH, json_option
from ds4quant.cli.output import echo_table, emit_json, size_cell


@cli.command("place")
@click.argument("artifact", type=PATH)
@click.option("--routing", required=True, type=PATH,
              help="Routing profile: Lucebox hotness CSV or ds4quant routing JSON (ds4quant calibrate writes both).")
@click.option("--owner", "owners", multiple=True, type=OWNER_BUDGET, metavar="NAME=BYTES",
              help="An owner and its byte budget (50G, 512M, 1024; NAME alone: no budget); repeatable, "
                   "first = hot. Names: cpu, cpu:N, cuda:N, hip:N, torch-cpu:N, worker:N.")
@click.option("--min-hot", type=int, default=0, show_default=True, help="Hot experts per layer on the first owner.")
@click.option("--speed-ratio", type=float, default=None,
              help="First owner's speed over the others: critical-path balancing (Lucebox MAIN_TO_PEER_RATE).")
@click.option("--cold", default=None, metavar="none|OWNER",
              help="Where experts that fit no budget go: an owner, or 'none' (held outside this process).")
@click.option("--ranks", type=int, default=None, help="A cluster placement over N ranks instead.")
@click.option("--strategy", type=click.Choice(["uniform", "balanced"]), default="uniform", show_default=True,
              help="--ranks: e % N, or longest-processing-time by hotness.")
@click.option("--replicate-hot", type=int, default=0, show_default=True,
              help="--ranks: replicate the K hottest experts of each layer on every rank.")
@click.option("--out", type=PATH, default=None, help="Placement file to write (JSON).")
@click.option("--check", "check", type=PATH, default=None, metavar="PLACEMENT",
              help="Instead of planning: validate an existing placement file against ARTIFACT and report it.")
@json_option(help="Print the report as one JSON object.")
def place_cmd(artifact, routing, owners, min_hot, speed_ratio, cold, ranks, strategy, replicate_hot, out, check,
              as_json):
    """Plan which owner holds which routed expert: greedy by routed slots per
    byte within each owner's budget, with a per-layer floor of hot experts
    (Lucebox's byte-budget placement), or a cluster placement over ranks.

    \b
    Examples:
      ds4quant place out/tiny --routing calib/routing.csv --owner cuda:0=8G --owner cpu --cold cpu --out p.json
      ds4quant place out/tiny --routing calib/routing.csv --owner cuda:0=2G --cold none --min-hot 4 --out p.json
      ds4quant place out/tiny --routing calib/routing.csv --ranks 2 --strategy balanced --out cluster.json
    """
    from ds4quant.deploy.place import check_placement, place
    from ds4quant.errors import BadInputError

    if check is not None:
        if out is not None or owners or ranks is not None:
            raise BadInputError("--check reports an existing placement; it takes no --out, --owner or --ranks",
                                where="--check")
        _p, rep = check_placement(artifact, routing, check)
    else:
        if out is None:
            raise BadInputError("name the placement file to write", where="--out")
        if not owners and ranks is None:
            raise BadInputError("give at least one --owner NAME=BYTES (or --ranks N)", where="--owner")
        _p, rep = place(artifact, routing, owners, cold=cold, min_hot=min_hot, speed_ratio=speed_ratio, ranks=ranks,
                        strategy=strategy, replicate_hot=replicate_hot, out=out)
    j = rep.to_json()
    if as_json:
        emit_json({**j, "out": out})
        return
    if j["kind"] == "ranks":
        rows = [(str(r["rank"]), str(r["experts"]), size_cell(r["bytes"]), f"{100 * r['slot_share']:.2f}%")
                for r in j["ranks"]]
        header = ("rank", "experts", "bytes", "slots")
    else:
        rows = [(o["name"], size_cell(o["budget"]), size_cell(o["bytes"]), str(o["experts"])) for o in j["owners"]]
        if j["none"]["experts"]:
            rows.append(("none", "-", size_cell(j["none"]["bytes"]), str(j["none"]["experts"])))
        header = ("owner", "budget", "bytes", "experts")
    echo_table(header, rows)
    if j["kind"] == "owners":
        click.echo(f"slot-resident rate {100 * j['slot_resident_rate']:.2f}%, token-resident rate "
                   f"{100 * j['token_resident_rate']:.2f}% ({j['token_resident_method']}) on {j['owners'][0]['name']}")
    for n in j["notes"]:
        click.echo(f"note: {n}")
    click.echo(f"{'wrote' if check is None else 'checked'} {out or check} "
               f"(content sha256 {j['placement_sha256'][:16]})")
