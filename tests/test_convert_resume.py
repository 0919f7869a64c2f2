"""`convert --resume`: the policy table of options that may and may not change.

A killed run leaves a journal; resuming with any option that decides tensor
bytes changed is refused with one line naming that option, the journal's value
and this run's value in full. Paths, threads, split size and name may change.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ds4quant import __version__
from ds4quant.plan import AdaptiveOptions
from ds4quant.artifact import read_gguf_set, sha256_file
from ds4quant.convert import FIXED, WORK_DIR, convert
from ds4quant.convert.resume import JOURNAL, Journal, differences, resume_options
from ds4quant.errors import ResumeMismatchError
from ds4quant.sources import open_any_source

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "ds4-tiny"
IMATRIX = ROOT / "samples" / "ds4-tiny-calib" / "imatrix.gguf"
ROUTING = ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"


class _Kill(BaseException):
    """Stands in for SIGKILL/Ctrl-C: not a Ds4quantError, so the journal stays."""


def _killer(after: int):
    seen = []

    def kill(ev):
        if ev.stage == "encode":
            seen.append(ev.item)
            if len(seen) == after:
                raise _Kill()

    return kill


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(a private copy of the sample, an interrupted rocmfp2-strix job on it, its finished twin)."""
    root = tmp_path_factory.mktemp("resume")
    src = root / "src"
    shutil.copytree(SAMPLE, src)
    job = root / "job"
    with pytest.raises(_Kill):
        convert(src, job, "rocmfp2-strix", progress=_killer(20))
    ref = root / "ref"
    convert(src, ref, "rocmfp2-strix", name="tiny")
    return src, job, ref


def _copy_job(job: Path, tmp_path: Path) -> Path:
    out = tmp_path / "job"
    shutil.copytree(job, out)
    return out


def _gguf(out: Path) -> Path:
    return next(p for p in sorted(out.iterdir()) if p.suffix == ".gguf")


def _refusal(src, out, recipe="rocmfp2-strix", **kw) -> str:
    with pytest.raises(ResumeMismatchError) as ei:
        convert(src, out, recipe, resume=True, **kw)
    msg = ei.value.one_line()
    assert "\n" not in msg and "cannot resume" in msg
    # a refusal leaves the journal as it was, so the right run can still resume
    assert (out / WORK_DIR / JOURNAL).is_file() and not list(out.glob("*.gguf"))
    return msg


@pytest.mark.parametrize("kw, named", [
    (dict(recipe="rocmfp3"), "--recipe: journal rocmfp2-strix, this run rocmfp3"),
    (dict(tensor_types=[r"blk\.0\..*exps=rocmfp4"]),
     r'--tensor-type: journal [], this run ["blk\\.0\\..*exps=rocmfp4"]'),
    (dict(dense_qtype="f16"), "--dense-type: journal bf16, this run f16"),
    (dict(imatrix=IMATRIX), f"--imatrix (sha256): journal none, this run {sha256_file(IMATRIX)}"),
])
def test_changing_an_option_that_decides_bytes_is_refused_by_name(killed, tmp_path, kw, named):
    src, job, _ = killed
    out = _copy_job(job, tmp_path)
    assert named in _refusal(src, out, **kw)


def test_a_changed_source_with_the_same_recipe_is_refused(killed, tmp_path):
    src, job, _ = killed
    out = _copy_job(job, tmp_path)
    other = tmp_path / "src2"
    shutil.copytree(src, other)
    # the same tensors, another config.json byte: another checkpoint as far as resume can tell
    cfg = other / "config.json"
    cfg.write_text(cfg.read_text() + "\n")
    with open_any_source(src) as a, open_any_source(other) as b:
        old, new = a.fingerprint(), b.fingerprint()
    assert old != new
    msg = _refusal(other, out)
    assert f"source fingerprint: journal {old}, this run {new}" in msg
    assert "--recipe" not in msg  # only what differs is named


def test_a_changed_tool_version_is_refused(killed, tmp_path, monkeypatch):
    import ds4quant.convert as conv

    src, job, _ = killed
    out = _copy_job(job, tmp_path)
    monkeypatch.setattr(conv, "__version__", "0.0.0-other")
    assert f"ds4quant version: journal {__version__}, this run 0.0.0-other" in _refusal(src, out)


_A0 = dict(target_bpw=3.0, granularity="tensor", fitter="optimized", candidates=("rocmfp2", "rocmfp3"),
           fit_iterations=2, fit_restarts=0, fit_max_rows=64, routing=None, lucebox=True)


@pytest.mark.parametrize("change, named", [
    (dict(target_bpw=2.5), "--target-bpw: journal 3.0, this run 2.5"),
    (dict(target_bpw=None, max_bytes=10_000_000), "--max-bytes: journal none, this run 10000000"),
    (dict(candidates=("rocmfp2", "rocmfp4")), '--candidates: journal ["rocmfp2", "rocmfp3"], this run ["rocmfp2", "rocmfp4"]'),
    (dict(granularity="expert"), "--granularity: journal tensor, this run expert"),
    (dict(fitter="reference"), "--fitter: journal optimized, this run reference"),
    (dict(fit_iterations=3), "--fit-effort: journal [2, 0, 64], this run [3, 0, 64]"),
    (dict(routing=str(ROUTING)), f"--routing (sha256): journal none, this run {sha256_file(ROUTING)}"),
    (dict(lucebox=False), "--no-lucebox: journal true, this run false"),
])
def test_changing_an_adaptive_option_is_refused_before_measuring(killed, tmp_path, monkeypatch, change, named):
    src, job, _ = killed
    out = _copy_job(job, tmp_path)
    with open_any_source(src) as s:
        fp = s.fingerprint()
    # the journal of an adaptive run with options _A0 (its pieces are never reached)
    j = Journal.load(out / WORK_DIR / JOURNAL)
    j.options = resume_options(source_fingerprint=fp, tool_version=__version__, recipe="adaptive", tensor_types=[],
                               dense_type="bf16", imatrix_sha=None, routing_sha=None,
                               adaptive=AdaptiveOptions(**_A0))
    j.save()
    from ds4quant.plan import planner

    monkeypatch.setattr(planner, "measure", lambda *a, **k: pytest.fail("measured before refusing"))
    asked = AdaptiveOptions(**{**_A0, **change, "cache_dir": str(tmp_path / "cache")})
    assert named in _refusal(src, out, "adaptive", adaptive=asked)


def test_threads_paths_split_size_and_cache_dir_may_change(killed, tmp_path):
    src, job, ref = killed
    out = _copy_job(job, tmp_path)
    moved = tmp_path / "moved-src"
    shutil.copytree(src, moved)  # same bytes at another path
    # the job ran as src-rocmfp2-strix; the name, the source path and the threads change here
    rep = convert(moved, out, "rocmfp2-strix", resume=True, threads=1, name="tiny")
    assert rep.reused >= 19
    assert sha256_file(_gguf(out)) == sha256_file(_gguf(ref))

    out2 = _copy_job(job, tmp_path / "b")
    rep = convert(src, out2, "rocmfp2-strix", resume=True, split_max_size="1M", name="renamed")
    assert rep.reused >= 19 and len(rep.files) > 1
    a, b = read_gguf_set(rep.files[0]), read_gguf_set(_gguf(ref))
    assert all(bytes(a.tensor_data(n)) == bytes(b.tensor_data(n)) for n in b.tensors)


def test_every_fixed_option_is_recorded_and_compared():
    a = resume_options(source_fingerprint="s", tool_version="v", recipe="r", tensor_types=[], dense_type="bf16",
                       imatrix_sha=None, routing_sha=None, adaptive=AdaptiveOptions(**_A0))
    assert set(a) == set(FIXED)
    for key in FIXED:
        b = dict(a)
        b[key] = "changed"
        (line,) = differences(a, b)
        assert line.startswith(FIXED[key] + ": journal ") and line.endswith(", this run changed")
    assert differences(a, dict(a)) == []


def test_a_damaged_or_truncated_piece_is_encoded_again_not_reused(killed, tmp_path):
    src, job, ref = killed
    out = _copy_job(job, tmp_path)
    j = Journal.load(out / WORK_DIR / JOURNAL)
    pieces = sorted((out / WORK_DIR / "pieces").glob("*.bin"))
    done = [p for p in pieces if p.stat().st_size > 8][:2]
    assert len(j.done) >= 19 and len(done) == 2
    same_size, truncated = done
    raw = bytearray(same_size.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one flipped bit: the size the journal holds, other bytes
    same_size.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    rep = convert(src, out, "rocmfp2-strix", resume=True, name="tiny")
    assert rep.reused == len(j.done) - 2
    assert sha256_file(_gguf(out)) == sha256_file(_gguf(ref))
