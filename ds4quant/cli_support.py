"""What the click commands share besides the commands: option parsing and the
progress lines they print (ds4quant.cli stays a list of thin commands)."""

from __future__ import annotations

from pathlib import Path

import click


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


def sensitivity_file(given, imatrix, say: bool):
    """--sensitivity: a path, 'none', or (not given) the calibrate run's own file beside --imatrix."""
    from ds4quant.calib.sensitivity import SENSITIVITY_FILE

    if given is not None:
        return None if given.lower() == "none" else given
    if imatrix is None or not (Path(imatrix).parent / SENSITIVITY_FILE).is_file():
        return None
    found = str(Path(imatrix).parent / SENSITIVITY_FILE)
    if say:
        click.echo(f"adaptive: allocating by predicted KL from {found} (beside --imatrix; "
                   "--sensitivity none to ignore)", err=True)
    return found


def parse_fit_effort(text: str) -> dict:
    from ds4quant.errors import BadInputError

    try:
        it, rs, rows = (int(v) for v in text.split(","))
    except ValueError:
        raise BadInputError(f"expected ITER,RESTARTS,ROWS, got {text!r}", where="--fit-effort") from None
    if it < 0 or rs < 0 or rows < 1:
        raise BadInputError(f"iterations and restarts must be >= 0 and rows >= 1, got {text!r}", where="--fit-effort")
    return {"fit_iterations": it, "fit_restarts": rs, "fit_max_rows": rows}


def fmt_db(v) -> str:
    if v is None:
        return "-"
    return "exact" if v == float("inf") else f"{v:.2f}"


def verify_progress(enabled: bool):
    if not enabled:
        return None

    def show(ev: dict) -> None:
        sq = ev.get("sqnr_db")
        click.echo(f"[{ev['index']:>4}/{ev['total']}] {ev['name']:<40} {ev['qtype']:<14} {fmt_db(sq):>7} dB "
                   f"{ev['seconds']:6.2f}s", err=True)

    return show


def size_cell(n) -> str:
    return "-" if n is None else f"{n:,}"
