"""`ds4quant publish`: verify an artifact, then write a release folder anyone can check.

Release folder (built as ``OUT.partial-<pid>`` and renamed into place, so a
failed run leaves no half-made release)::

    NAME.gguf (or the splits)    the artifact files, byte for byte
    NAME.gguf.*.bin              loose codebook sidecars, when the artifact has them
    manifest.json                the artifact's manifest, byte for byte
    report/                      the verify report: report.md, verify.json, PNG plots
    README.md                    the model card
    SHA256SUMS                   every file above; `sha256sum -c SHA256SUMS` accepts it

``hf_repo``: after the local release is complete, create the Hugging Face
repo (which also proves the hub is reachable and the token works) and upload
the folder in one commit. A hub failure raises ``HubError`` (exit 2) and
leaves the local release complete; no commit means nothing half-uploaded.

    rel = publish("out/tiny-mix", "release/tiny-mix", source="samples/ds4-tiny")
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from ds4quant.artifact import atomic_write_bytes, publish_dir
from ds4quant.artifact.sums import SUMS_NAME, write_sums
from ds4quant.errors import BadInputError, Ds4quantError, IntegrityError
from ds4quant.records import EXPERT_SURFACES, MANIFEST, VerifyReport
from ds4quant.verify import verify

REPORT_DIR = "report"
README = "README.md"
_CHUNK = 8 << 20
_HF_REPO = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class UnsoundArtifactError(IntegrityError):
    """verify found failed checks; publishing is refused (exit 1, like verify)."""

    exit_code = 1


class HubError(Ds4quantError):
    """The Hugging Face hub could not be reached or refused the upload."""


@dataclass(frozen=True)
class PublishReport:
    release: Path
    files: tuple[str, ...]  # relative names, sorted, SHA256SUMS included
    bytes: int
    verify: VerifyReport
    url: Optional[str] = None

    def to_json(self) -> dict:
        return {"release": str(self.release), "files": list(self.files), "bytes": self.bytes, "url": self.url,
                "ok": self.verify.ok, "summary": self.verify.summary}


def check_hf_repo(name: str) -> str:
    """``owner/name`` or ``name`` as the hub accepts them (checked before any work)."""
    if not isinstance(name, str) or not _HF_REPO.match(name) or ".." in name or name.endswith((".git", ".")):
        raise BadInputError(f"{name!r} is not a Hugging Face repo name", where="--hf-repo",
                            hint="use OWNER/NAME with letters, digits, '.', '_' or '-'")
    return name


def publish(
    artifact: "str | os.PathLike",
    outdir: "str | os.PathLike",
    *,
    source: "str | os.PathLike | None" = None,
    imatrix: "str | os.PathLike | None" = None,
    hf_repo: Optional[str] = None,
    overwrite: bool = False,
    threshold_db: Optional[float] = None,
    hub_token: Optional[str] = None,
    fidelity: bool = False,
    protocol: Optional[str] = None,
    mode: str = "fast",
) -> PublishReport:
    """Verify ``artifact`` (an artifact folder with manifest.json) and write the
    release folder ``outdir``; optionally upload it to ``hf_repo``.

    fidelity / protocol / mode: measure fidelity through the runtime (``verify(fidelity=True)``,
    needs ``source``); the model card then carries the figures.
    Raises UnsoundArtifactError when a check fails (nothing is written),
    HubError when the upload fails (the local release stays complete).
    """
    if hf_repo is not None:
        check_hf_repo(hf_repo)
    art = Path(artifact)
    if not art.is_dir():
        raise BadInputError("publish takes an artifact folder (GGUF + manifest.json)", where=str(art),
                            hint="convert writes one: ds4quant convert SRC OUTDIR")
    out = Path(outdir)
    if out.resolve() == art.resolve() or art.resolve() in out.resolve().parents:
        raise BadInputError("the release folder must lie outside the artifact folder", where=str(out))
    rep = verify(art, source=source, imatrix=imatrix, threshold_db=threshold_db, fidelity=fidelity,
                 protocol=protocol, mode=mode)
    if not rep.ok:
        bad = rep.failed
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise UnsoundArtifactError(f"{len(bad)} check(s) failed: " + "; ".join(c.one_line() for c in bad[:3]) + more,
                                   where=str(art), hint="run ds4quant verify on it; publish refuses unsound artifacts")
    man = rep.manifest
    names = [f.name for f in man.files]
    out.parent.mkdir(parents=True, exist_ok=True)
    with publish_dir(out, overwrite=overwrite) as tmp:
        known = {}
        for f in man.files:
            dst = tmp / f.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            known[f.name] = _copy_hashed(art / f.name, dst)
            if known[f.name] != f.sha256:
                raise IntegrityError("changed while it was copied (sha256 differs from manifest.json)",
                                     where=str(art / f.name), hint="publish again")
        shutil.copyfile(art / MANIFEST, tmp / MANIFEST)
        # the report and card describe the release, not where the artifact happened to be
        shown = replace(rep, artifact=Path(out.name), files=tuple(tmp / n for n in names))
        from ds4quant.report import PLOT_BITS, PLOT_ERROR, PLOT_FIDELITY, PLOT_HIST, write_report

        write_report(shown, tmp / REPORT_DIR, title=f"Verify report: {out.name}")
        plots = tuple(f for f in (PLOT_ERROR, PLOT_BITS, PLOT_HIST, PLOT_FIDELITY) if (tmp / REPORT_DIR / f).is_file())
        atomic_write_bytes(tmp / README, model_card(shown, out.name, hf_repo, plots).encode("utf-8"))
        write_sums(tmp, known)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    size = sum((out / f).stat().st_size for f in files)
    url = _upload(out, hf_repo, hub_token) if hf_repo is not None else None
    return PublishReport(out, tuple(files), size, rep, url)


def _copy_hashed(src: Path, dst: Path) -> str:
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while True:
            b = fi.read(_CHUNK)
            if not b:
                break
            h.update(b)
            fo.write(b)
    return h.hexdigest()


def _upload(folder: Path, repo: str, token: Optional[str]) -> str:
    """Create the repo (reachability and auth check), then one commit of the folder."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        from ds4quant.errors import MissingDependencyError

        raise MissingDependencyError("huggingface_hub is not installed", where="--hf-repo",
                                     hint=f"pip install huggingface_hub; the release is complete in {folder}") from None
    api = HfApi(token=token)
    done = f"the local release {folder} is complete; upload it later with `hf upload {repo} {folder}`"
    try:
        url = api.create_repo(repo, repo_type="model", exist_ok=True)
    except Exception as e:  # noqa: BLE001 - the hub client raises many types; all mean "not reachable/allowed"
        raise HubError(f"cannot create or reach the repo ({_why(e)}); nothing was uploaded", where=f"hub {repo}",
                       hint=done) from None
    try:
        api.upload_folder(repo_id=repo, folder_path=str(folder), repo_type="model",
                          commit_message=f"ds4quant publish {folder.name}")
    except Exception as e:  # noqa: BLE001
        raise HubError(f"upload failed ({_why(e)}); the upload is one commit, so the repo did not change",
                       where=f"hub {repo}", hint=done) from None
    return str(url)


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "no message"
    return f"{type(e).__name__}: {text[:200]}"


# ----------------------------------------------------------------------------
# model card


def runtimes(rep: VerifyReport) -> tuple[str, ...]:
    """Runtimes that can load the artifact: the view's decision from its whole header
    (``artifact.runtimes.decide``), which verify also holds the stored key to."""
    return tuple(rep.runtimes)


def _layer_qtype_table(rep: VerifyReport) -> list[str]:
    from ds4quant.report import _table, qtype_text

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
    return _table(["layer"] + [f"{s} (bpw)" for s in surfaces], rows)


def model_card(rep: VerifyReport, name: str, hf_repo: Optional[str] = None, plots: tuple[str, ...] = ()) -> str:
    """README.md of a release: what it is, where it came from, sizes, fidelity,
    plots (file names under report/), how to load it, which runtimes can, checksums."""
    from ds4quant.report import (
        PLOT_BITS,
        PLOT_ERROR,
        PLOT_FIDELITY,
        PLOT_HIST,
        _table,
        fidelity_rows,
        fidelity_section,
        fmt_db,
        fmt_num,
    )

    man = rep.manifest
    s = rep.summary
    recipe = man.to_json()["recipe"] if man is not None else {}
    src = man.to_json()["source"] if man is not None else {}
    gguf = [p.name for p in rep.files if p.name.endswith(".gguf")]
    rts = runtimes(rep)
    L = ["---", "tags:", "- gguf", "- deepseek-v4", "- rocmfpx", "- moe", "- quantized", "---", "",
         f"# {name}", ""]
    L += [f"A ROCmFPX expert artifact of a DeepSeek-V4 checkpoint made by ds4quant "
          f"{man.tool_version if man is not None else ''}: recipe `{recipe.get('name', '?')}` "
          f"({recipe.get('description', '')}). Routed experts are stored at "
          f"{fmt_num(s['bpw_experts'], '.4f')} bits per weight; every tensor carries an explicit qtype tag "
          "(ggml type ids are ambiguous between forks).", ""]
    L += ["## Source model", ""]
    L += _table(["", ""], [["source", f"`{src.get('path', '?')}` ({src.get('format', '?')})"],
                           ["source fingerprint", f"`{src.get('fingerprint', '?')}`"]]) + [""]
    L += ["## Recipe and command line", "", "```", " ".join(_shell_quote(a) for a in man.command) if man else "", "```",
          ""]
    rows = [["recipe", f"`{recipe.get('name', '?')}`"],
            ["experts (gate / up / down)", " / ".join(str((recipe.get("experts") or {}).get(k, "?"))
                                                      for k in ("gate", "up", "down"))],
            ["dense qtype", f"`{recipe.get('dense_qtype', '?')}`"]]
    if recipe.get("tensor_types"):
        rows.append(["overrides", ", ".join(f"`{t}`" for t in recipe["tensor_types"])])
    if recipe.get("imatrix"):
        rows.append(["importance matrix", f"`{recipe['imatrix'].get('path')}` sha256 "
                                          f"`{recipe['imatrix'].get('sha256', '')[:16]}...`"])
    L += _table(["", ""], rows) + [""]

    L += ["## Size", ""]
    L += _table(["", ""], [
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
    L += _table(header, frows) + [""]
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
    L += ["```python", "from ds4quant.artifact import read_gguf_set", "from ds4quant import formats", "",
          f"g = read_gguf_set(\"{name}/{gguf[0] if gguf else 'MODEL.gguf'}\")",
          "info = g.tensors[\"blk.0.ffn_down_exps.weight\"]      # qtype from the tensor's tag",
          "raw = g.tensor_data(info.name)                        # uint8 memmap",
          "w = formats.decode(info.qtype, raw[: raw.size // info.shape[2]], info.shape[0])  # expert 0, float32",
          "```", ""]
    from ds4quant.formats import QTYPES

    mix = [t for t in rep.tensors if t.qtype in QTYPES and QTYPES[t.qtype].is_mix]
    if mix:
        L += [f"{len(mix)} tensor(s) use MIX qtypes: their per-expert codebooks are in the GGUF KV "
              "`ds4quant.codebooks` (and, where Lucebox can load them, `deepseek4.*.sidecar`); pass "
              "`codebooks=` and `modes=` to `formats.decode`.", ""]
    L += ["## Runtimes", ""]
    from ds4quant.artifact.runtimes import needs

    L += ["Runtimes that can load every tensor of this artifact: " +
          (", ".join(f"**{r}**" for r in rts) if rts else "none listed") + ".", ""]
    L += [f"- **{r}**: {needs(r)}" for r in rts] + ([""] if rts else [])
    L += [f"Not loadable by **{eng}**: {'; '.join(why)}." for eng, why in rep.runtimes_excluded.items()]
    L += [""] if rep.runtimes_excluded else []
    L += ["## Checksums", "", f"`{SUMS_NAME}` lists every file of this folder (`sha256sum -c {SUMS_NAME}`). "
                              "The artifact files:", ""]
    L += _table(["file", "bytes", "sha256"], [[f"`{f.name}`", f"{f.bytes:,}", f"`{f.sha256}`"] for f in man.files]
                if man is not None else []) + [""]
    return "\n".join(L)


def _shell_quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
