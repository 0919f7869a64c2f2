"""Stage 2 of convert: the job's journal and its resume policy.

A run records, at start, every option that decides tensor bytes (``FIXED``)
with the value it ran with; ``--resume`` compares them with the asked run and
refuses with one line naming each differing option, its stored and its asked
value. Options that never change bytes (``MAY_CHANGE``: paths, threads,
output mode, cache dir) are not compared. The plan fingerprint is the last
guard: everything it covers is already one of the named options, so it only
fires on a bug or a hand-edited journal.

    opts = resume_options(recipe=..., source_fingerprint=..., ...)
    check_resume(journal, opts, plan_fp)     # ResumeMismatchError naming every difference
"""

from __future__ import annotations

import errno
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

from ds4quant.artifact import atomic_write_json
from ds4quant.convert.outdir import LOCK_NAME, WORK_DIR, stale_temp_files
from ds4quant.errors import BadInputError, OutputError, ResumeMismatchError
from ds4quant.names import MANIFEST_NAME, SUMS_NAME

JOURNAL = "journal.json"
JOURNAL_VERSION = 3
_JOURNAL_EVERY_S = 2.0

# option -> what it is, as a refusal names it. FIXED options decide tensor bytes.
FIXED: Mapping[str, str] = MappingProxyType({
    "source": "source fingerprint",
    "tool_version": "ds4quant version",
    "recipe": "--recipe",
    "tensor_types": "--tensor-type",
    "dense_type": "--dense-type",
    "imatrix": "--imatrix (sha256)",
    "target_bpw": "--target-bpw",
    "max_bytes": "--max-bytes",
    "candidates": "--candidates",
    "granularity": "--granularity",
    "fitter": "--fitter",
    "fit_effort": "--fit-effort",
    "routing": "--routing (sha256)",
    "sensitivity": "--sensitivity (sha256)",
    "lucebox": "--no-lucebox",
})
# Never compared: they change where or how fast, not which bytes.
MAY_CHANGE: tuple[str, ...] = ("outdir", "source path", "--threads", "--jobs", "--device", "--name",
                               "--split-max-size", "--loose-sidecars", "--json", "--cache-dir", "--imatrix path",
                               "--routing path", "--sensitivity path")


def resume_options(*, source_fingerprint: str, tool_version: str, recipe: str, tensor_types, dense_type,
                   imatrix_sha: Optional[str], routing_sha: Optional[str], adaptive,
                   sensitivity_sha: Optional[str] = None) -> dict:
    """The FIXED options of a run, as JSON values (see ``FIXED``)."""
    d = {
        "source": source_fingerprint,
        "tool_version": tool_version,
        "recipe": recipe,
        "tensor_types": list(tensor_types),
        "dense_type": dense_type,
        "imatrix": imatrix_sha,
        "target_bpw": None, "max_bytes": None, "candidates": None, "granularity": None, "fitter": None,
        "fit_effort": None, "routing": routing_sha, "lucebox": None, "sensitivity": sensitivity_sha,
    }
    if adaptive is not None:
        d.update(target_bpw=adaptive.target_bpw, max_bytes=adaptive.max_bytes, candidates=list(adaptive.candidates),
                 granularity=adaptive.granularity.value, fitter=adaptive.fitter.value,
                 fit_effort=[adaptive.fit_iterations, adaptive.fit_restarts, adaptive.fit_max_rows],
                 lucebox=adaptive.lucebox)
    if set(d) != set(FIXED):  # a bug: the table and the recorded options must agree
        raise RuntimeError(f"resume options {sorted(d)} differ from the policy table {sorted(FIXED)}")
    return d


def _show(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, str):
        return v
    return json.dumps(v)


def differences(stored: Mapping, asked: Mapping) -> list[str]:
    """'WHAT: journal X, this run Y' for every FIXED option that differs, in table order."""
    out = []
    for key, what in FIXED.items():
        a, b = stored.get(key), asked.get(key)
        if a != b:
            out.append(f"{what}: journal {_show(a)}, this run {_show(b)}")
    return out


@dataclass
class Journal:
    """The job record in ``OUTDIR/.ds4quant-work``: options, plan fingerprint, finished tensors."""

    path: Path
    options: dict
    plan_fingerprint: str
    done: dict = field(default_factory=dict)
    _saved: float = 0.0

    def save(self, force: bool = True) -> None:
        # fsyncs cost; between tensors a few seconds of lost progress is fine
        if not force and time.monotonic() - self._saved < _JOURNAL_EVERY_S:
            return
        atomic_write_json(self.path, {
            "version": JOURNAL_VERSION,
            "options": self.options,
            "plan_fingerprint": self.plan_fingerprint,
            "done": self.done,
        })
        self._saved = time.monotonic()

    @classmethod
    def load(cls, path: Path) -> "Journal":
        try:
            d = json.loads(_read_no_follow(path))
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if d.get("version") != JOURNAL_VERSION:
                raise ValueError(f"version {d.get('version')}, this ds4quant writes {JOURNAL_VERSION}")
            if not isinstance(d["options"], dict):
                raise ValueError("options is not an object")
            if not isinstance(d["done"], dict):
                raise ValueError("done is not an object")
            for name, entry in d["done"].items():
                why = _bad_done_entry(entry)
                if why is not None:
                    raise ValueError(f"done entry {name!r} {why}")
            return cls(path, dict(d["options"]), str(d["plan_fingerprint"]), dict(d["done"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ResumeMismatchError(f"journal is unreadable ({exc})", where=str(path),
                                      hint="start over with --force") from None


# what a finished tensor's journal entry must hold (TensorResult.to_journal), and each value's type
_DONE_FIELDS = {"name": str, "qtype": str, "bytes": int, "sha256": str, "n_weights": int, "sse": (int, float),
                "ssx": (int, float)}
_HEX = frozenset("0123456789abcdef")


def _bad_done_entry(entry) -> Optional[str]:
    """Why a journal ``done`` entry cannot be trusted to reuse a piece, or None."""
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object"
    for key, kind in _DONE_FIELDS.items():
        v = entry.get(key)
        if v is None:
            return f"lacks {key}"
        if not isinstance(v, kind) or isinstance(v, bool):
            return f"has a {type(v).__name__} {key}"
    sha = entry["sha256"]
    if len(sha) != 64 or not set(sha) <= _HEX:
        return "has a sha256 that is not 64 hex digits"
    if entry["bytes"] < 0:
        return "has a negative byte count"
    return None


def _read_no_follow(path: Path) -> str:
    """The journal's text, refusing a link in its place (a planted link would make a resume read,
    and trust, a file outside the output folder)."""
    import os

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError("it is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8")


def check_resume(journal: Journal, options: Mapping, plan_fp: str) -> None:
    """Refuse to resume when a FIXED option or the plan differs, naming every difference."""
    diff = differences(journal.options, options)
    if not diff and journal.plan_fingerprint != plan_fp:
        diff = [f"plan fingerprint: journal {journal.plan_fingerprint}, this run {plan_fp}"]
    if diff:
        raise ResumeMismatchError(
            "cannot resume: " + "; ".join(diff), where=str(journal.path),
            hint="run with the journal's options, or start over with --force",
        )


class flush_on_exit:
    """Save the journal however the encode loop ends (Ctrl-C included), so a
    resume loses at most the tensor in flight; SIGKILL loses at most
    _JOURNAL_EVERY_S seconds of finished tensors."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.journal.save()
        except OSError:
            if exc_type is None:
                raise
            # already failing (a full disk, say): the journal on disk stays as last saved
        return False


def is_finished(out: Path) -> bool:
    """A folder a convert run completed: manifest.json and SHA256SUMS, no work folder."""
    return (out / MANIFEST_NAME).is_file() and (out / SUMS_NAME).is_file() and not (out / WORK_DIR).exists()


def check_outdir(out: Path, resume: bool, force: bool) -> None:
    """OUTDIR must be absent, empty, a resumable job or a finished artifact (--resume),
    or replaceable (--force, which clears only convert's own files: outdir.clear_for_force)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise BadInputError("exists and is not a folder", where=str(out))
    entries = [p.name for p in out.iterdir() if p.name != LOCK_NAME]  # a killed run's lock is stale
    if not entries or force or (resume and (WORK_DIR in entries or is_finished(out))):
        return
    raise BadInputError(
        "output folder is not empty", where=str(out),
        hint="pass --resume to continue an interrupted run, or --force to replace its contents",
    )


def finished_report(out: Path, art_name: str, src, rec, plan, options, overrides, imx_sha, source_fp,
                    adaptive_info, t_start: float):
    """``--resume`` on a folder a run already completed: recognise it when its manifest
    records this run's source, version, recipe, overrides, imatrix and plan, and report
    it as is (every tensor reused); otherwise refuse, naming what differs."""
    from ds4quant.artifact import read_manifest
    from ds4quant.convert.report import TensorResult, build_report

    man = read_manifest(out / MANIFEST_NAME)
    r = man.to_json()["recipe"]  # plain JSON values, as the plan's to_json gives
    imx = r.get("imatrix") or {}
    got = {
        "source fingerprint": (man.to_json()["source"].get("fingerprint"), source_fp),
        "ds4quant version": (man.tool_version, options["tool_version"]),
        "--recipe": (r.get("name"), rec.name),
        "--tensor-type": (list(r.get("tensor_types") or []), [o.pattern + "=" + o.qtype for o in overrides]),
        "--imatrix (sha256)": (imx.get("sha256") if isinstance(imx, dict) else None, imx_sha),
        # compared as JSON values: the manifest holds lists where the plan has tuples
        "plan": (json.loads(json.dumps(list(r.get("plan") or []))), json.loads(json.dumps([c.to_json() for c in plan]))),
    }
    names = {f.name for f in man.files}
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    diff = [f"{what}: artifact {_show(a)}, this run {_show(b)}" for what, (a, b) in got.items()
            if a != b and what != "plan"]
    if not diff and got["plan"][0] != got["plan"][1]:
        diff = ["the tensor plan differs"]
    if not diff and not any(n == f"{art_name}.gguf" or n.startswith(f"{art_name}-00001-of-") for n in ggufs):
        diff = [f"artifact name: folder holds {', '.join(ggufs) or 'no GGUF'}, this run {art_name}"]
    if diff:
        raise ResumeMismatchError("cannot resume: the folder holds a finished artifact of another run: "
                                  + "; ".join(diff), where=str(out), hint="start over with --force")
    for p in stale_temp_files(out, art_name):
        p.unlink()
    entries = {t.name: t for t in man.tensors}
    results = []
    for c in plan:
        t = entries[c.name]
        e = t.errors or {}
        results.append(TensorResult(c.name, t.qtype, t.bytes, t.sha256, int(math.prod(t.shape)),
                                    float(e.get("sse", 0.0)), float(e.get("ssx", 0.0)), e.get("weighted_sse"),
                                    e.get("weighted_ssx"), 0.0, reused=True))
    files = [out / f.name for f in man.files if f.name.endswith(".gguf") or ".gguf." in f.name]
    cb = 0
    if ggufs:
        from ds4quant.artifact import read_gguf_set
        from ds4quant.names import KEY_CODEBOOKS

        g = read_gguf_set(out / ggufs[0])
        cb = len(g.blob(KEY_CODEBOOKS)) if KEY_CODEBOOKS in g.kv else 0
    return build_report(out, files, plan, results, cb, rec, source_fp, tuple(r.get("runtimes") or ()), adaptive_info,
                        t_start)


def fs_error(e: OSError, out: Path, work: Path, created_out: bool) -> OutputError:
    """A file-system error while writing: one line naming the path and the cause, and
    what became of the work folder (kept for --resume when its journal is on disk)."""
    path = e.filename or out
    cause = e.strerror or type(e).__name__
    if (work / JOURNAL).is_file():
        fate = f"the work folder {work} is kept: fix the cause, then rerun with --resume"
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        if created_out:
            shutil.rmtree(out, ignore_errors=True)
        fate = "nothing resumable was left"
    return OutputError(f"cannot write ({cause}); {fate}", where=str(path))
