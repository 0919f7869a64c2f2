"""The model card: ``README.md`` of a release folder.

What the artifact is, where it came from (source, recipe, command line),
sizes and qtypes per layer, fidelity figures, the report's plots, how to
load it, which runtimes can, and the checksums of its files.

    text = model_card(rep, "tiny-mix", hf_repo="me/ds4-tiny-rocmfpx", plots=("error_per_layer.png",))
"""

from __future__ import annotations

from typing import Optional

from ds4quant.artifact.sums import SUMS_NAME
from ds4quant.publish.report import (
    PLOT_BITS,
    PLOT_ERROR,
    PLOT_FIDELITY,
    PLOT_HIST,
    REPORT_DIR,
    fidelity_rows,
    fidelity_section,
    fmt_db,
    fmt_num,
    md_table,
    qtype_text,
)
from ds4quant.records import EXPERT_SURFACES, VerifyReport

__all__ = ["model_card", "model_title", "load_snippet", "runtimes"]


def runtimes(rep: VerifyReport) -> tuple[str, ...]:
    """Runtimes that can load the artifact: the view's decision from its whole header
    (``artifact.runtimes.decide``), which verify also holds the stored key to."""
    return tuple(rep.runtimes)


def _layer_qtype_table(rep: VerifyReport) -> list[str]:
    surfaces = [s for s in EXPERT_SURFACES + ("shexp", "attn")
                if any(g.surface == s for g in rep.groups)]
    layers = sorted({g.layer for g in rep.groups if g.layer is not None})
    by = {(g.layer, g.surface): g for g in rep.groups}
    rows = []
    for layer in layers:
        r = [str(layer)]
        for s in surfaces:
            g = by.get((layer, s))
            r.append("-" if g is None else f"{qtype_text(g.qtypes)} ({g.bpw:.2f})")
        rows.append(r)
    return md_table(["layer"] + [f"{s} (bpw)" for s in surfaces], rows)


def load_snippet(folder: str) -> list[str]:
    """The card's Python lines that open the release ``folder`` and decode one routed expert:
    they run as printed on every artifact kind (uniform, MXFP4, MIX with codebooks, compact
    per-expert stacks); a test executes them on each."""
    return ["from ds4quant.artifact.view import open_artifact", "",
            f"v = open_artifact({folder!r})               # reads and checks the folder",
            "st = v.stacks[0]                              # the first routed-expert stack",
            "w = v.expert_weights(st.name, st.expert_ids[0])  # its first expert: float32 [rows, cols]",
            "print(st.name, st.qtype, w.shape)"]


def model_title(rep: VerifyReport, fallback: str) -> str:
    """The model's name: the GGUF's ``general.name`` (convert writes the source's name and the
    recipe, or ``--name``), else the source's name from the manifest, else ``fallback``."""
    from ds4quant.artifact.portable import portable_path

    kv = rep.kv.get("general.name") if rep.kv else None
    if isinstance(kv, str) and kv.strip():
        return kv.strip()
    src = (rep.manifest.to_json().get("source") or {}) if rep.manifest is not None else {}
    if isinstance(src.get("path"), str) and src["path"]:
        return portable_path(src["path"])
    return fallback


def model_card(rep: VerifyReport, name: str, hf_repo: Optional[str] = None, plots: tuple[str, ...] = ()) -> str:
    """README.md of a release: what it is, where it came from, sizes, fidelity,
    plots (file names under report/), how to load it, which runtimes can, checksums."""
    from ds4quant.artifact.portable import portable_command, portable_path

    man = rep.manifest
    s = rep.summary
    recipe = man.to_json()["recipe"] if man is not None else {}
    src = man.to_json()["source"] if man is not None else {}
    rts = runtimes(rep)
    L = ["---", "tags:", "- gguf", "- deepseek-v4", "- rocmfpx", "- moe", "- quantized", "---", "",
         f"# {model_title(rep, name)}", ""]
    L += [f"A ROCmFPX expert artifact of a DeepSeek-V4 checkpoint made by ds4quant "
          f"{man.tool_version if man is not None else ''}: recipe `{recipe.get('name', '?')}` "
          f"({recipe.get('description', '')}). Routed experts are stored at "
          f"{fmt_num(s['bpw_experts'], '.4f')} bits per weight; every tensor carries an explicit qtype tag "
          "(ggml type ids are ambiguous between forks).", ""]
    L += ["## Source model", ""]
    L += md_table(["", ""], [["source", f"`{portable_path(src.get('path')) or '?'}` ({src.get('format', '?')})"],
                           ["source fingerprint", f"`{src.get('fingerprint', '?')}`"]]) + [""]
    L += ["## Recipe and command line", "", "```",
          " ".join(_shell_quote(a) for a in portable_command(man.command)) if man else "", "```", ""]
    rows = [["recipe", f"`{recipe.get('name', '?')}`"],
            ["experts (gate / up / down)", " / ".join(str((recipe.get("experts") or {}).get(k, "?"))
                                                      for k in ("gate", "up", "down"))],
            ["dense qtype", f"`{recipe.get('dense_qtype', '?')}`"]]
    if recipe.get("tensor_types"):
        rows.append(["overrides", ", ".join(f"`{t}`" for t in recipe["tensor_types"])])
    if recipe.get("imatrix"):
        rows.append(["importance matrix", f"`{portable_path(recipe['imatrix'].get('path'))}` sha256 "
                                          f"`{recipe['imatrix'].get('sha256', '')[:16]}...`"])
    L += md_table(["", ""], rows) + [""]

    L += ["## Size", ""]
    L += md_table(["", ""], [
        ["files", ", ".join(f"`{p.name}` ({p.stat().st_size:,} bytes)" for p in rep.files)],
        ["tensors", f"{s['n_tensors']} ({s['tensor_bytes']:,} bytes, {fmt_num(s['bpw'], '.3f')} bpw overall)"],
        ["routed experts", f"{s['expert_weights']:,} weights in {s['expert_bytes']:,} bytes: "
                           f"**{fmt_num(s['bpw_experts'], '.4f')} bpw**"]]) + [""]
    L += ["### Qtype per layer", ""] + _layer_qtype_table(rep) + [""]

    L += ["## Fidelity", ""]
    if rep.numbers_from == "source":
        L += [f"Decoded and compared with the source by `ds4quant verify --source` (every tensor, every "
              f"expert). Routed experts: SQNR **{fmt_db(s['expert_sqnr_db'])} dB**, relative MSE "
              f"{fmt_num(s['expert_rel_mse'], '.4g')}" +
              (f", importance-weighted relative error {fmt_num(s['expert_weighted_rel_error'], '.4g')}"
               if s["expert_weighted_rel_error"] is not None else "") +
              f"; lowest cosine {fmt_num(s['min_cosine'], '.6f')}.", ""]
    elif rep.numbers_from == "manifest":
        L += [f"Convert-time figures from manifest.json (not re-measured at publish; publish with --source to "
              f"decode and compare). Routed experts: SQNR **{fmt_db(s['expert_sqnr_db'])} dB**, relative MSE "
              f"{fmt_num(s['expert_rel_mse'], '.4g')}.", ""]
    else:
        L += ["No error figures were recorded.", ""]
    header, frows = fidelity_rows(rep)
    L += md_table(header, frows) + [""]
    L += ["### Through the runtime", ""]
    sec = fidelity_section(rep, {p: p for p in plots}, plot_prefix=f"{REPORT_DIR}/")
    L += [sec if sec is not None else "Not measured at publish (`ds4quant publish --fidelity` measures it).", ""]
    titles = {PLOT_ERROR: "error per layer and surface", PLOT_BITS: "bits per weight", PLOT_HIST: "error histogram",
              PLOT_FIDELITY: "MoE output error per layer"}
    L += ["## Plots", ""]
    L += [f"![{titles.get(f, f)}]({REPORT_DIR}/{f})" for f in plots] + [""]
    L += [f"The full verify report is [{REPORT_DIR}/report.md]({REPORT_DIR}/report.md) "
          f"(machine-readable: [{REPORT_DIR}/verify.json]({REPORT_DIR}/verify.json)).", ""]

    L += ["## How to load it", ""]
    L += ["```bash", "pip install -e .   # in a ds4quant checkout"]
    if hf_repo:
        L += [f"hf download {hf_repo} --local-dir {name}"]
    L += [f"(cd {name} && sha256sum -c {SUMS_NAME})   # every file intact",
          f"ds4quant verify {name}      # structure, tags, codebooks, hashes, SHA256SUMS",
          f"ds4quant inspect {name}     # every tensor: qtype, shape, bytes, bpw", "```", ""]
    L += ["```python", *load_snippet(name), "```", ""]
    from ds4quant.formats import QTYPES

    mix = [t for t in rep.tensors if t.qtype in QTYPES and QTYPES[t.qtype].is_mix]
    if mix:
        L += [f"{len(mix)} tensor(s) use MIX qtypes: their per-expert codebooks are in the GGUF KV "
              "`ds4quant.codebooks` (and, where Lucebox can load them, `deepseek4.*.sidecar`); "
              "`expert_weights` decodes with them (a bare `formats.decode` needs `codebooks=` and `modes=`).", ""]
    L += ["## Runtimes", ""]
    from ds4quant.artifact.runtimes import needs

    L += ["Runtimes that can load every tensor of this artifact: " +
          (", ".join(f"**{r}**" for r in rts) if rts else "none listed") + ".", ""]
    L += [f"- **{r}**: {needs(r)}" for r in rts] + ([""] if rts else [])
    L += [f"Not loadable by **{eng}**: {'; '.join(why)}." for eng, why in rep.runtimes_excluded.items()]
    L += [""] if rep.runtimes_excluded else []
    L += ["## Checksums", "", f"`{SUMS_NAME}` lists every file of this folder (`sha256sum -c {SUMS_NAME}`). "
                              "The artifact files:", ""]
    L += md_table(["file", "bytes", "sha256"], [[f"`{f.name}`", f"{f.bytes:,}", f"`{f.sha256}`"] for f in man.files]
                if man is not None else []) + [""]
    return "\n".join(L)


def _shell_quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
