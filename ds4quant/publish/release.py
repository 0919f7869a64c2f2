"""`ds4quant publish`: verify an artifact, then write a release folder anyone can check.

The release folder never overlaps an input (the artifact, ``source``, the
imatrix: ``artifact.overlap``), and ``overwrite`` replaces only a release
publish wrote (``SHA256SUMS`` lists every file in it). It is built as
``OUT.partial-<pid>`` (marked and locked as publish's own) and renamed into
place, so a failed run leaves no half-made release; a killed run's partial is
removed by the next run, any other one reported (``PublishReport.stale``)::

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
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from ds4quant.artifact import atomic_write_bytes, clear_stale_partials, publish_dir
from ds4quant.artifact.overlap import check_no_overlap
from ds4quant.artifact.sums import write_sums
from ds4quant.errors import BadInputError, Ds4quantError, IntegrityError, OutputError
from ds4quant.progress import ProgressFn
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
    stale: tuple[str, ...] = ()  # leftover OUT.partial-<pid> folders of killed runs: removed or left, and why

    def to_json(self) -> dict:
        return {"release": str(self.release), "files": list(self.files), "bytes": self.bytes, "url": self.url,
                "ok": self.verify.ok, "summary": self.verify.summary, "stale_partials": list(self.stale)}


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
    progress: Optional[ProgressFn] = None,
    reference: "str | os.PathLike | None" = None,
) -> PublishReport:
    """Verify ``artifact`` (an artifact folder with manifest.json) and write the
    release folder ``outdir``; optionally upload it to ``hf_repo``.

    fidelity / protocol / mode: measure fidelity through the runtime (``verify(fidelity=True)``,
    needs ``source``); the model card then carries the figures. progress: verify's
    ProgressEvents (``verify(progress=...)``). reference: a reference base
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
    out = check_release_folder(outdir, art, source=source, imatrix=imatrix, overwrite=overwrite)

    def may_replace(o: Path) -> Optional[str]:  # why an old folder at ``o`` must stay (None: it may go)
        return _not_replaceable(o, (art, source, imatrix))

    stale = clear_stale_partials(out, may_remove_old=may_replace)
    rep = verify(art, source=source, imatrix=imatrix, threshold_db=threshold_db, fidelity=fidelity,
                 protocol=protocol, mode=mode, progress=progress, reference=reference)
    if not rep.ok:
        bad = rep.failed
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise UnsoundArtifactError(f"{len(bad)} check(s) failed: " + "; ".join(c.one_line() for c in bad[:3]) + more,
                                   where=str(art), hint="run ds4quant verify on it; publish refuses unsound artifacts")
    man = rep.manifest
    names = [f.name for f in man.files]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with publish_dir(out, overwrite=overwrite, may_replace=may_replace) as tmp:
            known = {}
            for f in man.files:
                dst = tmp / f.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                known[f.name] = _copy_hashed(art / f.name, dst)
                if known[f.name] != f.sha256:
                    raise IntegrityError("changed while it was copied (sha256 differs from manifest.json)",
                                         where=str(art / f.name), hint="publish again")
            man_shown = _release_manifest(art / MANIFEST, tmp / MANIFEST, man)
            # the report and card describe the release, not where the artifact happened to be: no
            # absolute path of this machine in anything that ships (artifact.portable)
            shown = replace(rep, artifact=Path(out.name), files=tuple(tmp / n for n in names), manifest=man_shown,
                            checks=_portable_checks(rep.checks, art, (art, source, imatrix)))
            from ds4quant.publish.report import PLOT_BITS, PLOT_ERROR, PLOT_FIDELITY, PLOT_HIST, write_report

            write_report(shown, tmp / REPORT_DIR, title=f"Verify report: {out.name}")
            plots = tuple(f for f in (PLOT_ERROR, PLOT_BITS, PLOT_HIST, PLOT_FIDELITY)
                          if (tmp / REPORT_DIR / f).is_file())
            atomic_write_bytes(tmp / README, model_card(shown, out.name, hf_repo, plots).encode("utf-8"))
            write_sums(tmp, known)
    except OSError as e:
        # a full disk, a read-only or unreachable OUT: the partial folder is gone (publish_dir)
        raise OutputError(f"cannot write the release ({e.strerror or e}); nothing was published",
                          where=str(e.filename or out)) from None
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    size = sum((out / f).stat().st_size for f in files)
    url = _upload(out, hf_repo, hub_token) if hf_repo is not None else None
    return PublishReport(out, tuple(files), size, rep, url, tuple(p.one_line() for p in stale))


def _release_manifest(src: Path, dst: Path, man):
    """Copy manifest.json into the release byte for byte, unless it records an absolute path
    (convert before it recorded portable paths): then write it with those paths made portable.
    Returns the Manifest the card and report show."""
    from ds4quant.artifact import json_bytes
    from ds4quant.artifact.manifest import manifest_from_json
    from ds4quant.artifact.portable import portable_manifest_json

    raw = src.read_bytes()
    d = json.loads(raw)
    pd = portable_manifest_json(d)
    if pd == d:
        atomic_write_bytes(dst, raw)
        return man
    atomic_write_bytes(dst, json_bytes(pd))
    return manifest_from_json(pd, where=str(src))


def _portable_checks(checks, art: Path, inputs) -> tuple:
    """Checks with their file fields relative to the artifact (or names) and the inputs' paths
    in their details replaced by names."""
    from ds4quant.artifact.portable import portable_path

    spelled = {}
    for p in inputs:
        if p is None:
            continue
        for form in {os.fspath(p), os.path.abspath(os.fspath(p)), os.path.realpath(os.fspath(p))}:
            spelled[form] = portable_path(form) or form
    order = sorted(spelled, key=len, reverse=True)  # longest first: a folder's path is a prefix of its files'

    def clean(text):
        if text is None:
            return None
        for form in order:
            if os.path.isabs(form):
                text = text.replace(form, spelled[form])
        return text

    return tuple(replace(c, file=portable_path(c.file, art), detail=clean(c.detail)) for c in checks)


def check_release_folder(outdir: "str | os.PathLike", artifact: "str | os.PathLike", *,
                         source: "str | os.PathLike | None" = None, imatrix: "str | os.PathLike | None" = None,
                         overwrite: bool = False) -> Path:
    """The release folder as a path with a name (``.`` -> the absolute path), checked before any
    work: it overlaps none of the artifact, the source checkpoint and the imatrix (real paths and
    folder identities: links and bind mounts, ``artifact.overlap``); an existing non-empty one
    is refused unless ``overwrite``, and even then unless publish wrote it (``_not_replaceable``)."""
    out = Path(outdir)
    if out.name in ("", ".", ".."):
        out = Path(os.path.abspath(out))
    check_no_overlap(out, {"artifact": artifact, "source checkpoint": source, "imatrix": imatrix},
                     what="release folder")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BadInputError("exists and is not a folder", where=str(out), hint="choose another output path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise BadInputError("folder exists and is not empty", where=str(out),
                                hint="choose a new folder, or pass --force to replace an earlier release")
        why = _not_replaceable(out, (artifact, source, imatrix))
        if why is not None:
            raise BadInputError(f"--force will not replace this folder: {why}", where=str(out),
                                hint="--force replaces only a release publish wrote; move it away or choose "
                                     "another folder")
    return out


# what every release publish writes lists in its SHA256SUMS
_RELEASE_FILES = (README, MANIFEST, f"{REPORT_DIR}/verify.json")


def _not_replaceable(out: Path, inputs) -> Optional[str]:
    """Why ``--force`` may not remove the folder ``out``, or None when it is a release publish
    wrote: its SHA256SUMS lists the card, the manifest and the report, and every file in it
    (no link, nothing unlisted), and none of them is a hard link to an input's file."""
    from ds4quant.artifact.overlap import shared_files
    from ds4quant.artifact.sums import list_files, read_sums
    from ds4quant.names import SUMS_NAME

    if not (out / SUMS_NAME).is_file() or (out / SUMS_NAME).is_symlink():
        return f"it has no {SUMS_NAME}, so it is no release publish wrote"
    try:
        listed = {n for n, _ in read_sums(out / SUMS_NAME)}
        present = list_files(out)
    except Ds4quantError as e:
        return f"{e.one_line()}"
    missing = [n for n in _RELEASE_FILES if n not in listed]
    if missing:
        return f"its {SUMS_NAME} does not list {', '.join(missing)}, so it is no release publish wrote"
    extra = [n for n in present if n not in listed]
    if extra:
        shown = ", ".join(extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        return f"it holds files publish did not write: {shown}"
    linked = shared_files([out / n for n in present], inputs)
    if linked:
        return f"{linked[0].name} is a hard link to a file of the artifact, source or imatrix"
    return None


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
