"""Tests that fail on small, plausible bugs planted in verify's pipeline code.

- ``verify/fidelity.py``: two placements called identical when the MoE output hash OR the
  response hash agree (both must); a placement file's artifact fingerprint left unchecked
  for a single-process placement (only a cluster one checked);
- ``verify/manifest.py``: a ``.tmp`` file (or a hidden file, or a GGUF-set file) listed in
  SHA256SUMS accepted as a release extra.
"""

from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ds4quant.artifact.sums import write_sums
from ds4quant.artifact.view import open_artifact
from ds4quant.errors import IntegrityError
from ds4quant.records import Check, FidelityReport, LogitFigures, PlacementRun
from ds4quant.verify import verify
from tests._verify_util import SAMPLE, strix_artifact

# the module (ds4quant.verify exports a function of the same name)
vf = importlib.import_module("ds4quant.verify.fidelity")


@pytest.fixture(scope="module")
def strix(tmp_path_factory):
    return strix_artifact(tmp_path_factory.mktemp("planted") / "strix")


# ---------------------------------------------------------------- fidelity.identity


@dataclass
class _Ctx:
    """The part of verify's Context the fidelity checks write to."""

    checks: list = field(default_factory=list)
    first: str = "x.gguf"

    def ok(self, name, detail, file=None):
        self.checks.append(Check(name, True, detail, file))

    def fail(self, name, detail, file=None, tensor=None):
        self.checks.append(Check(name, False, detail, file, tensor))

    def passed_if_clean(self, name, detail, file=None):
        if not any(c.name == name and not c.ok for c in self.checks):
            self.ok(name, detail, file)


def _report(second: PlacementRun, mode: str = "exact") -> FidelityReport:
    return FidelityReport(requested=True, measured=True, mode=mode, tokenizer="t", eval="e", eval_tokens=8,
                          runs=(PlacementRun("cpu:0", "a" * 64, "b" * 64), second),
                          logits=LogitFigures(0.0, 0.0, 1.0, 1.0))


@pytest.mark.parametrize("moe, resp, same", [("a", "b", True), ("c", "b", False), ("a", "c", False),
                                             ("c", "c", False)])
def test_two_placements_are_identical_only_when_both_hashes_agree(moe, resp, same):
    rep = _report(PlacementRun("placement", moe * 64, resp * 64))
    assert rep.identical is same
    ctx = _Ctx()
    vf.report_checks(ctx, rep)
    ident = [c for c in ctx.checks if c.name == "fidelity.identity"]
    assert len(ident) == 1 and ident[0].ok is same, ident
    if not same:
        assert "placements differ" in ident[0].detail


def test_identity_is_not_claimed_in_fast_mode():
    ctx = _Ctx()
    vf.report_checks(ctx, _report(PlacementRun("placement", "c" * 64, "c" * 64), mode="fast"))
    assert not [c for c in ctx.checks if c.name == "fidelity.identity"]


# ---------------------------------------------------------------- a placement for another artifact


def test_a_single_process_placement_for_another_artifact_is_refused_before_measuring(strix, tmp_path):
    from ds4quant.runtime.placement import placement_for_one_owner, write_placement

    v = open_artifact(strix)
    h = v.header
    used = h.n_expert_used or 1
    foreign = write_placement(tmp_path / "foreign.json", placement_for_one_owner(
        h.n_layer, h.n_expert, "cpu:0", used, artifact="sha256:" + "b" * 64))
    own = write_placement(tmp_path / "own.json", placement_for_one_owner(
        h.n_layer, h.n_expert, "cpu:0", used, artifact=v.fingerprint()))
    assert len(vf.placement_runs(v, [own])) == 1  # planned for this artifact: taken
    with pytest.raises(IntegrityError, match="planned for artifact") as ei:
        vf.placement_runs(v, [foreign])
    assert "foreign.json" in ei.value.one_line()
    with pytest.raises(IntegrityError, match="planned for artifact"):
        vf.placement_runs(v, [own, foreign])  # the second one is checked too
    with pytest.raises(IntegrityError, match="planned for artifact"):  # through verify, before any model runs
        verify(strix, source=SAMPLE, fidelity=True, placements=(foreign,))


# ---------------------------------------------------------------- release extras


@pytest.mark.parametrize("extra", ["report/notes.tmp", ".hidden", "report/.x", "report/more.gguf", "more.bin",
                                   ".strix.gguf.k1ll3d.tmp"])
def test_a_file_no_release_may_carry_is_refused_even_when_sha256sums_lists_it(strix, tmp_path, extra):
    rel = tmp_path / "rel"
    shutil.copytree(strix, rel)
    (rel / extra).parent.mkdir(parents=True, exist_ok=True)
    (rel / extra).write_bytes(b"x")
    write_sums(rel)  # listed, with its right hash
    rep = verify(rel)
    bad = [c for c in rep.failed if c.name == "complete"]
    assert bad and bad[0].file == extra, [c.one_line() for c in rep.failed]


def test_a_listed_card_is_a_release_extra(strix, tmp_path):
    rel = tmp_path / "rel"
    shutil.copytree(strix, rel)
    (rel / "README.md").write_text("# card\n")
    (rel / "report").mkdir()
    (rel / "report" / "report.md").write_text("# report\n")
    write_sums(rel)
    assert verify(rel).ok
