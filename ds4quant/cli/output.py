"""What the commands print besides their own lines: JSON, aligned tables, and
the progress lines of long runs (on a TTY only; ``--json`` keeps stderr quiet)."""

from __future__ import annotations

import json
from typing import Sequence

import click


def emit_json(obj) -> None:
    """One JSON object on stdout, as every ``--json`` prints it."""
    click.echo(json.dumps(obj, indent=1, sort_keys=False))


def table_lines(header: Sequence[str], rows: Sequence[Sequence[str]], *, rstrip: bool = True) -> list[str]:
    """Columns left-aligned to their widest cell, two spaces apart; the header first.
    ``rstrip=False`` keeps the last column's padding (inspect's table has always had it)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in (header, *rows)]
    return [line.rstrip() for line in lines] if rstrip else lines


def echo_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, rstrip: bool = True) -> None:
    for line in table_lines(header, rows, rstrip=rstrip):
        click.echo(line)


def echo_excluded(excluded) -> None:
    """One line per engine that cannot load the artifact, with why (artifact.runtimes.decide)."""
    for eng, why in excluded.items():
        click.echo(f"not loadable by {eng}: {'; '.join(why)}")


def size_cell(n) -> str:
    return "-" if n is None else f"{n:,}"


def eta_text(ev) -> str:
    return "ETA  warm-up" if ev.warming_up else f"ETA {ev.eta:6.0f}s" if ev.eta is not None else "ETA      ?"


def progress_printer(enabled: bool):
    """One line per ProgressEvent on stderr, with ETA (moving window) and source MB/s (TTY only)."""
    if not enabled:
        return None

    def show(ev) -> None:
        d = ev.detail
        if ev.stage == "measure":
            click.echo(f"[measure {ev.done:>5}/{ev.total}] {ev.item} expert {d['expert']:<4} "
                       f"{ev.elapsed:7.1f}s  {eta_text(ev)}", err=True)
            return
        sq = d.get("sqnr_db")
        sqs = f"{sq:6.2f} dB" if isinstance(sq, float) and sq != float("inf") else "   exact "
        tag = " (resumed)" if d.get("reused") else ""
        click.echo(
            f"[{ev.done:>4}/{ev.total}] {ev.item:<36} {d['qtype']:<13} {sqs} "
            f"{d['seconds']:6.2f}s  {eta_text(ev)}{tag}",
            err=True,
        )

    return show


def verify_progress(enabled: bool):
    """verify's per-tensor lines (index, name, qtype, SQNR, seconds) on stderr."""
    if not enabled:
        return None
    from ds4quant.publish.report import fmt_db

    def show(ev: dict) -> None:
        sq = ev.get("sqnr_db")
        click.echo(f"[{ev['index']:>4}/{ev['total']}] {ev['name']:<40} {ev['qtype']:<14} {fmt_db(sq):>7} dB "
                   f"{ev['seconds']:6.2f}s", err=True)

    return show
