"""The verify report for people: ``report.md`` with PNG plots, plus ``verify.json``.

    write_report(rep, "out/report")     # report.md, verify.json, *.png

Plots (matplotlib's Agg canvas, no pyplot state, fixed size and dpi, no
software/date metadata in the PNGs, so the same report gives the same bytes):

- ``error_per_layer.png``: SQNR per layer, one line per surface;
- ``bits_heatmap.png``: bits per weight, layer x surface;
- ``error_histogram.png``: per-expert SQNR (decoded) or per-tensor SQNR
  (convert-time figures).

- ``fidelity_per_layer.png``: with ``verify --fidelity``, the MoE output's
  relative error per layer against the reference (local: the layer fed the
  reference's input; propagated: in the candidate's own run), log scale.

The section "Fidelity through the runtime" sits between two marker comments
(``RUNTIME_BEGIN`` / ``RUNTIME_END``): the measured figures when the report
has them (``fidelity_section``), else a placeholder; ``runtime_section``
replaces it.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Optional, Sequence

from ds4quant.artifact import atomic_write_bytes, atomic_write_json
from ds4quant.errors import BadInputError, OutputError
from ds4quant.metrics import ErrorFigures
from ds4quant.records import SURFACES, GroupRecord, VerifyReport

REPORT_DIR = "report"  # the report's folder inside a release (publish)
REPORT_MD = "report.md"
REPORT_JSON = "verify.json"
PLOT_ERROR = "error_per_layer.png"
PLOT_BITS = "bits_heatmap.png"
PLOT_HIST = "error_histogram.png"
PLOT_FIDELITY = "fidelity_per_layer.png"
RUNTIME_BEGIN = "<!-- ds4quant:runtime-fidelity:begin -->"
RUNTIME_END = "<!-- ds4quant:runtime-fidelity:end -->"
RUNTIME_PLACEHOLDER = (
    "_Not measured yet._ `ds4quant verify ARTIFACT --source SRC --fidelity [--protocol exact-copy]` runs the model "
    "through the bundled runtime against the transformers reference: MoE output error per layer, logit KL "
    "divergence, top-1 agreement, perplexity ratio, response hashes, identity across placements and the "
    "exact-copy protocol (see DESIGN.md, \"Fidelity\")."
)
FIGSIZE = (7.0, 4.0)  # inches
DPI = 100
_RC = {"font.family": "DejaVu Sans", "font.size": 9.0, "axes.titlesize": 10.0, "svg.hashsalt": "ds4quant"}


def fmt_db(v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == math.inf:
        return "exact"
    return f"{v:.2f}"


def fmt_num(v: Optional[float], spec: str = ".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def layer_label(layer: Optional[int]) -> str:
    return "global" if layer is None else str(layer)


def _sqnr_or_none(e: Optional[ErrorFigures]) -> Optional[float]:
    return None if e is None else e.sqnr_db


# ----------------------------------------------------------------------------
# plots


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # metadata Software=None drops matplotlib's version stamp; PNGs carry no date by default
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _layers(groups: Sequence[GroupRecord]) -> list[int]:
    return sorted({g.layer for g in groups if g.layer is not None})


def plot_error_per_layer(rep: VerifyReport) -> Optional[bytes]:
    """SQNR (dB) per layer, one line per surface; None when there are no figures."""
    import matplotlib

    series = {}
    for s in SURFACES:
        pts = [(g.layer, _sqnr_or_none(g.errors)) for g in rep.groups if g.surface == s and g.layer is not None]
        pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
        if pts:
            series[s] = pts
    if not series:
        return None
    with matplotlib.rc_context(_RC):
        fig = _figure()
        ax = fig.add_subplot(1, 1, 1)
        markers = "osD^vx"
        for i, (s, pts) in enumerate(series.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=s)
        ax.set_xlabel("layer")
        ax.set_ylabel("SQNR (dB, higher is better)")
        origin = "decoded vs source" if rep.numbers_from == "source" else "convert-time figures"
        ax.set_title(f"Error per layer and surface ({origin}; exact surfaces not shown)")
        ax.set_xticks(_layers(rep.groups))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        return _png(fig)


def plot_bits_heatmap(rep: VerifyReport) -> Optional[bytes]:
    """Bits per weight, layers x surfaces; None without per-layer tensors."""
    import matplotlib
    import numpy as np

    layers = _layers(rep.groups)
    surfaces = [s for s in SURFACES if any(g.surface == s and g.layer is not None for g in rep.groups)]
    if not layers or not surfaces:
        return None
    grid = np.full((len(layers), len(surfaces)), np.nan)
    names = {}
    for g in rep.groups:
        if g.layer is not None and g.surface in surfaces:
            grid[layers.index(g.layer), surfaces.index(g.surface)] = g.bpw
            names[(layers.index(g.layer), surfaces.index(g.surface))] = _short_qtypes(g.qtypes)
    with matplotlib.rc_context(_RC):
        fig = _figure()
        ax = fig.add_subplot(1, 1, 1)
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xticks(range(len(surfaces)), labels=surfaces)
        ax.set_yticks(range(len(layers)), labels=[str(x) for x in layers])
        ax.set_xlabel("surface")
        ax.set_ylabel("layer")
        ax.set_title("Plan: qtype and bits per weight per layer and surface")
        if grid.size <= 400:
            finite = grid[np.isfinite(grid)]
            mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
            for (r, c), v in np.ndenumerate(grid):
                if np.isfinite(v):
                    ax.text(c, r, f"{names.get((r, c), '')}\n{v:.2f}", ha="center", va="center", fontsize=6,
                            color="black" if v > mid else "white")
        fig.colorbar(im, ax=ax, label="bpw")
        fig.tight_layout()
        return _png(fig)


def _short_qtypes(qtypes) -> str:
    """The cell label: the qtype, or the qtypes of a per-expert mix by share."""
    if not qtypes:
        return ""
    if len(qtypes) == 1:
        return next(iter(qtypes))
    total = sum(qtypes.values())
    top = sorted(qtypes.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
    return "\n".join(f"{q} {100 * n / total:.0f}%" for q, n in top) + ("\n..." if len(qtypes) > 2 else "")


def histogram_values(rep: VerifyReport) -> tuple[list[float], str]:
    """Per-expert SQNR of the expert stacks when decoded, else per-tensor SQNR."""
    vals: list[float] = []
    for t in rep.tensors:
        if t.errors is None:
            continue
        if t.errors.expert_sqnr_db:
            vals += [v for v in t.errors.expert_sqnr_db if math.isfinite(v)]
        else:
            v = t.errors.sqnr_db
            if v is not None and math.isfinite(v):
                vals.append(v)
    what = "per expert (stacks) and per tensor" if rep.numbers_from == "source" else "per tensor"
    return vals, what


def plot_error_histogram(rep: VerifyReport) -> Optional[bytes]:
    import matplotlib

    vals, what = histogram_values(rep)
    if not vals:
        return None
    with matplotlib.rc_context(_RC):
        fig = _figure()
        ax = fig.add_subplot(1, 1, 1)
        ax.hist(sorted(vals), bins=min(40, max(5, len(vals) // 4)), color="#4477aa", edgecolor="white")
        ax.set_xlabel("SQNR (dB)")
        ax.set_ylabel("count")
        ax.set_title(f"Error histogram, {what} (lossy only; n = {len(vals)})")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        return _png(fig)


def plot_fidelity_per_layer(rep: VerifyReport) -> Optional[bytes]:
    """MoE output relative error per layer (log scale); None without fidelity figures."""
    import matplotlib

    rows = rep.fidelity.layers
    if not rows:
        return None
    floor = 1e-12  # an exact layer (error 0) is drawn at the floor of the log axis
    with matplotlib.rc_context(_RC):
        fig = _figure()
        ax = fig.add_subplot(1, 1, 1)
        xs = [r.layer for r in rows]
        ax.plot(xs, [max(floor, r.local) for r in rows], marker="o", label="local (reference input)")
        ax.plot(xs, [max(floor, r.propagated) for r in rows], marker="s", label="propagated (candidate run)")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xlabel("layer")
        ax.set_ylabel("MoE output relative error (lower is better)")
        f = rep.fidelity
        ax.set_title(f"MoE output vs reference ({f.mode} mode; KL mean {f.logits.kl_mean:.3g})")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        return _png(fig)


# ----------------------------------------------------------------------------
# markdown


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return out


def qtype_text(qtypes) -> str:
    """``{"rocmfp2": n}`` -> "rocmfp2"; several -> "rocmfp2 75% + rocmfp3 25%" (share of weights)."""
    total = sum(qtypes.values())
    if len(qtypes) == 1:
        return next(iter(qtypes))
    parts = sorted(qtypes.items(), key=lambda kv: (-kv[1], kv[0]))
    return " + ".join(f"{q} {100 * n / total:.0f}%" for q, n in parts)


def fidelity_rows(rep: VerifyReport) -> tuple[list[str], list[list[str]]]:
    """Per layer and surface: qtypes, bpw and the error figures available."""
    src = rep.numbers_from == "source"
    header = ["layer", "surface", "qtype", "bpw", "SQNR dB", "rel MSE"]
    if any(g.errors is not None and g.errors.weighted_rel_error is not None for g in rep.groups):
        header.append("weighted rel err")
    if src:
        header += ["cosine", "max abs err"]
    rows = []
    for g in rep.groups:
        e = g.errors
        r = [layer_label(g.layer), g.surface, qtype_text(g.qtypes), f"{g.bpw:.3f}",
             fmt_db(None if e is None else e.sqnr_db), "-" if e is None else fmt_num(e.rel_mse, ".4g")]
        if "weighted rel err" in header:
            r.append("-" if e is None else fmt_num(e.weighted_rel_error, ".4g"))
        if src:
            r += ["-" if e is None else fmt_num(e.cosine, ".6f"), "-" if e is None else fmt_num(e.max_abs, ".4g")]
        rows.append(r)
    return header, rows


def fidelity_section(rep: VerifyReport, plots: dict, plot_prefix: str = "") -> Optional[str]:
    """Markdown of the measured fidelity figures (None when not measured)."""
    f = rep.fidelity
    if not f.measured:
        return None
    m, ec, sp = f.logits, f.exact_copy, f.second
    L = [f"Measured by `verify --fidelity` in **{f.mode}** mode on placement(s) "
         f"{', '.join(f'`{p}`' for p in f.placements)}: the transformers reference over the source against the "
         f"same model with every dense tensor from the artifact and the runtime's routed experts; "
         f"{f.eval_tokens} evaluation tokens ({f.eval}; tokenizer: {f.tokenizer}).", ""]
    rows = [["KL mean / p99 (nats)", f"{fmt_num(m.kl_mean, '.4g')} / {fmt_num(m.kl_p99, '.4g')}"],
            ["top-1 agreement", f"{100 * m.top1:.2f}%"],
            ["perplexity ratio (candidate / reference)", fmt_num(m.ppl_ratio, ".5f")],
            ["greedy response sha256", f"`{f.response_sha256}`" +
             (" (= reference)" if f.response_matches_reference else " (differs from the reference)")]]
    if f.moe_output_sha256:
        rows.append(["MoE output sha256 (exact mode)", f"`{f.moe_output_sha256}`"])
    if sp:
        rows.append(["second placement", ("identical" if f.identical else "**different**") +
                     f" (MoE `{sp.moe_output_sha256[:16]}`, response `{sp.response_sha256[:16]}`)"])
    if ec:
        rows.append(["exact-copy protocol", f"**{ec.passes}/{ec.trials}** (task `{ec.task}`; the source "
                                            f"{ec.reference_passes}/{ec.trials})"])
    L += md_table(["", ""], rows) + [""]
    if PLOT_FIDELITY in plots:
        L += [f"![MoE output error per layer]({plot_prefix}{plots[PLOT_FIDELITY]})", ""]
    L += md_table(["layer", "MoE rel. error (local)", "MoE rel. error (propagated)"],
                [[str(r.layer), fmt_num(r.local, ".3e"), fmt_num(r.propagated, ".3e")] for r in f.layers]) + [""]
    if ec and ec.failed:
        L += [f"Failed exact-copy trials ({len(ec.failed)}):", ""]
        L += md_table(["identifier", "repeat", "expected", "got"],
                    [[f"`{x['identifier']}`", str(x["repeat"]), f"`{x['expected']}`", f"`{x['got']}`"]
                     for x in ec.failed[:20]]) + [""]
        if len(ec.failed) > 20:
            L += [f"(and {len(ec.failed) - 20} more in verify.json)", ""]
    return "\n".join(L).rstrip("\n")


def render_markdown(rep: VerifyReport, plots: dict, runtime_section: Optional[str] = None,
                    title: Optional[str] = None) -> str:
    s = rep.summary
    name = rep.artifact.name or str(rep.artifact)
    L = [f"# {title or f'Verify report: {name}'}", ""]
    verdict = "**sound**" if rep.ok else f"**NOT SOUND**: {s['n_failed']} of {s['n_checks']} checks failed"
    origin = {"source": f"decoded and compared with the source (fingerprint `{(rep.source_fingerprint or '?')[:16]}`)",
              "manifest": "convert-time figures recorded in manifest.json (not re-measured)",
              None: "none (pass --source to decode and compare)"}[rep.numbers_from]
    rows = [["artifact", f"`{name}` ({rep.kind})"], ["result", verdict],
            ["files", ", ".join(f"`{p.name}` ({p.stat().st_size:,} B)" for p in rep.files if p.exists())],
            ["tensors", f"{s['n_tensors']}, {s['tensor_bytes']:,} bytes" +
             (f", {s['bpw']:.3f} bpw overall" if s["bpw"] else "")],
            ["routed experts", "-" if s["bpw_experts"] is None else
             f"{s['expert_weights']:,} weights, {s['expert_bytes']:,} bytes, {s['bpw_experts']:.4f} bpw"],
            ["error figures", origin]]
    if s["expert_sqnr_db"] is not None:
        rows.append(["expert SQNR", f"{s['expert_sqnr_db']:.2f} dB (rel MSE {s['expert_rel_mse']:.4g})"])
    if s["expert_weighted_rel_error"] is not None:
        rows.append(["expert weighted rel error", f"{s['expert_weighted_rel_error']:.4g}"])
    un = s.get("experts_unreached")
    if un:
        rows.append(["experts the calibration never reached",
                     f"{un['experts']} ({un['tensor_experts']} expert matrices; left out of the weighted error), "
                     f"unweighted SQNR {fmt_db(un['sqnr_db'])} dB"])
    if s["min_cosine"] is not None:
        rows.append(["min cosine / max abs error", f"{s['min_cosine']:.6f} / {fmt_num(s['max_abs_error'], '.4g')}"])
    if rep.codebook_tables:
        rows.append(["codebook tables", ", ".join(f"`{t}`" for t in rep.codebook_tables)])
    L += md_table(["", ""], rows) + [""]

    L += ["## Checks", ""]
    checks = sorted(rep.checks, key=lambda c: c.ok)
    L += md_table(["check", "result", "where", "detail"],
                [[c.name, "ok" if c.ok else "**FAIL**", " / ".join(f"`{w}`" for w in (c.file, c.tensor) if w) or "-",
                  c.detail] for c in checks]) + [""]

    L += ["## Error per layer and surface", ""]
    if PLOT_ERROR in plots:
        L += [f"![error per layer and surface]({plots[PLOT_ERROR]})", ""]
    header, frows = fidelity_rows(rep)
    L += md_table(header, frows) + [""]
    L += ["## Bits per weight", ""]
    if PLOT_BITS in plots:
        L += [f"![bits per weight, layer x surface]({plots[PLOT_BITS]})", ""]
    totals: dict[str, list[int]] = {}
    for t in rep.tensors:
        d = totals.setdefault(t.qtype, [0, 0, 0])
        d[0] += 1
        d[1] += t.bytes
        d[2] += t.n_weights
    L += md_table(["qtype", "tensors", "bytes", "bpw"],
                [[q, str(d[0]), f"{d[1]:,}", f"{8 * d[1] / d[2]:.3f}"] for q, d in sorted(totals.items())]) + [""]

    L += ["## Error distribution", ""]
    if PLOT_HIST in plots:
        L += [f"![error histogram]({plots[PLOT_HIST]})", ""]
    lossy = [t for t in rep.tensors if t.errors is not None and t.errors.sqnr_db is not None
             and t.errors.sqnr_db != math.inf]
    if lossy:
        worst = sorted(lossy, key=lambda t: (t.errors.sqnr_db, t.name))[:10]
        L += ["Lowest SQNR tensors:", ""]
        L += md_table(["tensor", "qtype", "SQNR dB", "floor dB", "flagged"],
                    [[f"`{t.name}`", t.qtype, fmt_db(t.errors.sqnr_db), fmt_num(t.floor_db, "g"),
                      "**yes**" if t.flagged else "no"] for t in worst]) + [""]
    else:
        L += ["No lossy error figures.", ""]

    section = runtime_section or fidelity_section(rep, plots) or RUNTIME_PLACEHOLDER
    L += ["## Fidelity through the runtime", "", RUNTIME_BEGIN, section, RUNTIME_END, ""]
    return "\n".join(L)


def check_report_dir(out_dir: "str | os.PathLike", artifact: "str | os.PathLike") -> None:
    """Refuse a report folder inside the artifact folder it describes (writing it
    would change the artifact). Call it before verifying, to fail early."""
    art = Path(artifact)
    if not art.is_dir():
        return  # a bare .gguf: its folder is not the artifact
    rd, folder = Path(out_dir).resolve(), art.resolve()
    if rd == folder or folder in rd.parents:
        raise BadInputError("the report folder lies inside the artifact it checks; writing it would change "
                            "the artifact", where=str(out_dir), hint="choose a folder outside it")


def write_report(rep: VerifyReport, out_dir: "str | os.PathLike", *, runtime_section: Optional[str] = None,
                 title: Optional[str] = None) -> Path:
    """Write report.md, verify.json and the PNG plots into ``out_dir`` (created
    if missing; its parent must exist). Returns the path of report.md. A file
    that cannot be written (a full disk, a read-only folder) is an OutputError
    naming it; a folder this call created is removed again."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BadInputError("exists and is not a folder", where=str(out))
    if not out.parent.is_dir():
        raise BadInputError(f"folder {out.parent} does not exist", where=str(out), hint="create it first")
    created = not out.exists()
    try:
        out.mkdir(exist_ok=True)
        plots = {}
        for fname, fn in ((PLOT_ERROR, plot_error_per_layer), (PLOT_BITS, plot_bits_heatmap),
                          (PLOT_HIST, plot_error_histogram), (PLOT_FIDELITY, plot_fidelity_per_layer)):
            png = fn(rep)
            if png is not None:
                atomic_write_bytes(out / fname, png)
                plots[fname] = fname
            elif (out / fname).exists():
                (out / fname).unlink()  # a stale plot from an earlier run would contradict this report
        atomic_write_json(out / REPORT_JSON, rep.to_json())
        md = render_markdown(rep, plots, runtime_section, title).encode("utf-8")
        return atomic_write_bytes(out / REPORT_MD, md)
    except OSError as e:
        if created:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise OutputError(f"cannot write the report ({e.strerror or e})"
                          + ("; nothing was written" if created else ""), where=str(e.filename or out)) from None
