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
from ds4quant.artifact.sums import write_sums
from ds4quant.errors import BadInputError, Ds4quantError, IntegrityError
from ds4quant.publish.card import model_card
from ds4quant.publish.report import REPORT_DIR
from ds4quant.records import MANIFEST, VerifyReport
from ds4quant.verify import verify

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
    reference: "str | os.PathLike | None" = None,
) -> PublishReport:
    """Verify ``artifact`` (an artifact folder with manifest.json) and write the
    release folder ``outdir``; optionally upload it to ``hf_repo``.

    fidelity / protocol / mode: measure fidelity through the runtime (``verify(fidelity=True)``,
    needs ``source``); the model card then carries the figures. reference: a reference base
    (``ds4quant reference``) read instead of running the reference.
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
                 protocol=protocol, mode=mode, reference=reference)
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
        from ds4quant.publish.report import PLOT_BITS, PLOT_ERROR, PLOT_FIDELITY, PLOT_HIST, write_report

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
