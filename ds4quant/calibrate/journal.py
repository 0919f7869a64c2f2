"""The calibrate run's work folder and journal: what ``--resume`` continues from.

``OUT/.ds4quant-work`` holds, while a run is unfinished:

- ``journal.json``: the options that decide the output bytes (``FIXED``) and
  the last layer whose work is complete (``finished``, -1 before layer 0);
- ``sums/L.npz``: layer L's imatrix and routing sums (``collect.LayerSums``);
- ``sens/L.npz``: layer L's sensitivity piece, when the run measures one;
- ``states/K/KEY/I.npy``: the hidden streams entering layer K for sequence I
  (``KEY`` ``main``, or a sensitivity branch).

A layer's pieces and the next layer's states are written first, then the
journal names the layer finished (an atomic replace), then the previous
states go. So a run killed anywhere resumes at the first unfinished layer,
with every byte it would have had. ``--resume`` refuses, on one line naming
each difference, a journal whose source, tokens or options differ from the
asked run's.

    j = Journal.start(work, options)       # a fresh run
    j = Journal.resume(work, options)      # ResumeMismatchError naming what changed
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ds4quant.errors import BadInputError, ResumeMismatchError
from ds4quant.names import WORK_DIR_NAME

__all__ = ["FIXED", "JOURNAL", "Journal", "WORK_DIR_NAME", "check_out_dir"]

JOURNAL = "journal.json"
JOURNAL_VERSION = 1

# option -> how a refusal names it. Every one decides output bytes.
FIXED: Mapping[str, str] = MappingProxyType({
    "source": "source fingerprint",
    "tokens": "tokens (sha256)",
    "tokens_file": "token file name",
    "tool_version": "ds4quant version",
    "versions": "torch/transformers versions",
    "device": "--device",
    "sensitivity_method": "--sensitivity-method",
    "sensitivity_seqs": "--sensitivity-seqs",
    "batch": "--batch-size",
})


def _show(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, str):
        return v[:16] if len(v) == 64 else v  # a sha256: its head names it well enough
    return json.dumps(v, sort_keys=True)


@dataclass
class Journal:
    work: Path
    options: dict
    finished: int = -1

    def save(self) -> None:
        from ds4quant.artifact.atomic import atomic_write_json

        atomic_write_json(self.work / JOURNAL, {"version": JOURNAL_VERSION, "options": self.options,
                                                "finished": self.finished})

    # -- start / resume ------------------------------------------------------------
    @classmethod
    def start(cls, work: Path, options: Mapping) -> "Journal":
        if work.exists():
            shutil.rmtree(work)
        work.mkdir()
        j = cls(work, dict(options))
        j.save()
        return j

    @classmethod
    def resume(cls, work: Path, options: Mapping) -> "Journal":
        path = work / JOURNAL
        try:
            d = json.loads(path.read_text())
            if d.get("version") != JOURNAL_VERSION:
                raise ValueError(f"version {d.get('version')}, this ds4quant writes {JOURNAL_VERSION}")
            stored, finished = dict(d["options"]), int(d["finished"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ResumeMismatchError(f"journal is unreadable ({exc})", where=str(path),
                                      hint="start over with --force") from None
        diff = [f"{what}: journal {_show(stored.get(k))}, this run {_show(options.get(k))}"
                for k, what in FIXED.items() if stored.get(k) != options.get(k)]
        if diff:
            raise ResumeMismatchError("cannot resume: " + "; ".join(diff), where=str(path),
                                      hint="run with the journal's inputs, or start over with --force")
        return cls(work, stored, finished)

    @staticmethod
    def stored_option(work: Path, key: str):
        """Option ``key`` of the journal in ``work``, or None where it has none
        (``resume`` checks the journal; this only reads what it can)."""
        try:
            value = json.loads((work / JOURNAL).read_text())["options"].get(key)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    # -- paths -----------------------------------------------------------------------
    def sums_path(self, layer: int) -> Path:
        return self.work / "sums" / f"{layer}.npz"

    def sens_path(self, layer: int) -> Path:
        return self.work / "sens" / f"{layer}.npz"

    def states(self, layer: int) -> Path:
        return self.work / "states" / str(layer)

    def finish_layer(self, layer: int) -> None:
        """Layer ``layer``'s pieces and the next states are on disk: record it, drop its inputs."""
        self.finished = layer
        self.save()
        shutil.rmtree(self.states(layer), ignore_errors=True)

    def drop_stale_states(self) -> None:
        """States of any layer but the next one (a killed layer's partial outputs) go."""
        root = self.work / "states"
        if root.is_dir():
            for p in root.iterdir():
                if p.name != str(self.finished + 1):
                    shutil.rmtree(p, ignore_errors=True)


def check_out_dir(out: Path, resume: bool, force: bool) -> bool:
    """Whether to resume: OUT may be absent, a folder of files to replace, or
    hold an unfinished run's work folder (then --resume or --force is needed)."""
    if out.exists() and not out.is_dir():
        raise BadInputError("exists and is not a folder", where=str(out))
    if not out.exists() and not out.parent.is_dir():
        raise BadInputError(f"parent folder {out.parent} does not exist", where=str(out))
    work = out / WORK_DIR_NAME
    has_work = (work / JOURNAL).is_file()
    if resume and force:
        raise BadInputError("--resume and --force exclude each other", where="options")
    if has_work and not (resume or force):
        raise BadInputError("holds an interrupted calibrate run", where=str(out),
                            hint="pass --resume to continue it, or --force to start over")
    if resume and not has_work:
        raise BadInputError("holds no interrupted calibrate run to resume", where=str(out),
                            hint="run without --resume")
    return resume
