"""What the commands print besides their own lines: JSON, aligned tables, and
the progress lines of long runs (on a TTY only; ``--json`` keeps stderr quiet)."""

from __future__ import annotations

import json
import math
import sys
from typing import Sequence

import click

from ds4quant.progress import EventKind


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
    """The ETA cell: rounded up, so a run with work left never reads "0s"
    (``Meter`` gives 0.0 only when nothing is left: the last item, no phase pending)."""
    if ev.warming_up and ev.eta is None:
        return "ETA  warm-up"
    if ev.eta is None:
        return "ETA      ?"
    return f"ETA {math.ceil(ev.eta):6d}s"


def _encode_line(ev) -> str:
    d = ev.detail
    sq = d.get("sqnr_db")
    sqs = f"{sq:6.2f} dB" if isinstance(sq, float) and sq != float("inf") else "   exact "
    tag = " (resumed)" if d.get("reused") else ""
    return (f"[{ev.done:>4}/{ev.total}] {ev.item:<36} {d['qtype']:<13} {sqs} "
            f"{d['seconds']:6.2f}s  {eta_text(ev)}{tag}")


def _measure_line(ev) -> str:
    return (f"[measure {ev.done:>5}/{ev.total}] {ev.item} expert {ev.detail['expert']:<4} "
            f"{ev.elapsed:7.1f}s  {eta_text(ev)}")


def _decode_line(ev) -> str:
    from ds4quant.publish.report import fmt_db

    d = ev.detail
    return (f"[{ev.done:>4}/{ev.total}] {ev.item:<40} {d['qtype']:<14} {fmt_db(d.get('sqnr_db')):>7} dB "
            f"{d['seconds']:6.2f}s  {eta_text(ev)}")


def _step_line(ev) -> str:
    """Any other stage: [stage done/total unit] item, elapsed, ETA, tok/s when tokens are counted."""
    w = len(str(ev.total))
    line = f"[{ev.stage} {ev.done:>{w}}/{ev.total} {ev.unit}] {ev.item}  {ev.elapsed:7.1f}s  {eta_text(ev)}"
    tokens = ev.detail.get("tokens")
    if isinstance(tokens, int) and ev.elapsed > 0:
        line += f"  {tokens:,} tokens, {tokens / ev.elapsed:,.0f} tok/s"
    return line


# stage -> its STEP/TICK line; a stage not named here gets the generic line
STEP_LINES = {"encode": _encode_line, "measure": _measure_line, "decode": _decode_line}


def progress_line(ev) -> str:
    """The line a TTY shows for one ProgressEvent (any stage, any kind)."""
    if ev.kind is EventKind.PHASE:
        return f"[{ev.stage}] {ev.item} ...  ({ev.elapsed:.1f}s)"
    if ev.kind is EventKind.DONE:
        if ev.total == 0:  # a stage of phases only
            return f"[{ev.stage}] done in {ev.elapsed:.1f}s"
        unit = ev.unit if ev.total == 1 else ev.unit + ("es" if ev.unit.endswith(("s", "x", "ch", "sh")) else "s")
        return f"[{ev.stage}] done: {ev.total} {unit} in {ev.elapsed:.1f}s"
    line = STEP_LINES.get(ev.stage, _step_line)(ev)
    if ev.pending and ev.done >= ev.total:  # the counted items are done, not the stage
        line += f"  (next: {ev.pending[0]})"
    return line


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def command_progress(as_json: bool, wanted: bool = True):
    """A command's progress printer: on a TTY when ``wanted``; None under ``--json``
    (stderr stays quiet, stdout holds the one JSON object) or when stderr is no TTY."""
    return progress_printer(wanted and not as_json and stderr_is_tty())


def progress_printer(enabled: bool, tick_every: float = 1.0, step_every: float = 0.0, indent: str = ""):
    """One line per ProgressEvent on stderr (``progress_line``, after ``indent``);
    None when not ``enabled`` (not a TTY, or ``--json``: stderr stays quiet).
    A stage's TICK lines come at most once per ``tick_every`` seconds and its
    STEP lines at most once per ``step_every`` seconds of its own clock (the
    last item, phases and the end always show)."""
    if not enabled:
        return None
    shown: dict[tuple[str, EventKind], float] = {}

    def show(ev) -> None:
        every = {EventKind.TICK: tick_every, EventKind.STEP: step_every}.get(ev.kind)
        if every and not (ev.kind is EventKind.STEP and ev.done >= ev.total):
            key = (ev.stage, ev.kind)
            if ev.elapsed - shown.get(key, -math.inf) < every:
                return
            shown[key] = ev.elapsed
        click.echo(indent + progress_line(ev), err=True)

    return show
