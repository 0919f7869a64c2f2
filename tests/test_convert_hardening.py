"""convert never loses the source, survives kills, and refuses what it cannot do.

Each test fails on the code before the fix: an OUTDIR overlapping the source
was emptied by --force; --force removed foreign files; temp files of a killed
GGUF write survived into SHA256SUMS; a folder killed before SHA256SUMS (or a
finished one) was refused by --resume; no lock kept two runs apart; a full
disk or a read-only folder was a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4quant.artifact import read_gguf_set, sha256_file
from ds4quant.artifact.sums import read_sums
from ds4quant.cli import cli
from ds4quant.convert import WORK_DIR, convert
from ds4quant.convert.outdir import LOCK_NAME, OutLock
from ds4quant.errors import BadInputError, OutputError, OutputLockedError, ResumeMismatchError
from ds4quant.plan import Override, get_recipe, plan_tensors
from ds4quant.sources import open_any_source

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "ds4-tiny"


class _Kill(BaseException):
    """Stands in for SIGKILL: not a Ds4quantError, so nothing is cleaned up."""


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _gguf(out: Path) -> Path:
    return next(p for p in sorted(out.iterdir()) if p.suffix == ".gguf")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "ckpt"
    shutil.copytree(SAMPLE, d)
    return d


# ---------------------------------------------------------------- data loss


@pytest.mark.parametrize("layout", ["same", "out-inside-src", "src-inside-out", "symlink"])
def test_an_outdir_overlapping_the_source_is_refused_before_anything_is_touched(tmp_path, layout):
    src = tmp_path / "ckpt"
    if layout == "src-inside-out":
        src = tmp_path / "outer" / "ckpt"
    shutil.copytree(SAMPLE, src)
    before = _tree(tmp_path)
    out = {"same": src, "out-inside-src": src / "out", "src-inside-out": tmp_path / "outer",
           "symlink": tmp_path / "link"}[layout]
    if layout == "symlink":
        out.symlink_to(src, target_is_directory=True)
        before = _tree(tmp_path)
    res = CliRunner().invoke(cli, ["convert", str(src), str(out), "--recipe", "rocmfp3", "--force"])
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("ds4quant: error: ") and "source" in line
    assert _tree(tmp_path) == before  # not one byte of the checkpoint (or anything) changed


def test_force_never_removes_a_file_convert_did_not_write(src, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(BadInputError) as ei:
        convert(src, out, "rocmfp3", force=True)
    assert "notes.txt" in ei.value.one_line() and "other.gguf" in ei.value.one_line()
    assert (out / "notes.txt").read_text() == "mine" and (out / "other.gguf").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "other.gguf"]


# ---------------------------------------------------------------- the lock


def test_a_second_convert_into_a_locked_outdir_exits_2_naming_the_holder(src, tmp_path):
    out = tmp_path / "locked"
    out.mkdir()
    with OutLock(out):
        with pytest.raises(OutputLockedError) as ei:
            convert(src, out, "rocmfp3")
        assert f"pid {os.getpid()}" in ei.value.one_line()
        res = CliRunner().invoke(cli, ["convert", str(src), str(out), "--recipe", "rocmfp3", "--resume"])
        assert res.exit_code == 2 and f"pid {os.getpid()}" in res.output
    assert not (out / WORK_DIR).exists()
    # released: the refused runs removed nothing of the holder's; a stale file (a killed holder's) blocks nothing
    (out / LOCK_NAME).write_text("999999\n")
    with OutLock(out):
        pass


# ---------------------------------------------------------------- file system errors


def test_a_read_only_location_is_one_line_exit_2_and_leaves_nothing(src, tmp_path, monkeypatch):
    import ds4quant.artifact.atomic as atomic

    def refuse(*a, dir=None, **k):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(dir, "x.tmp"))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    out = tmp_path / "ro"
    res = CliRunner().invoke(cli, ["convert", str(src), str(out), "--recipe", "rocmfp3"])
    assert res.exit_code == 2, res.output
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert "Read-only file system" in line and str(out) in line and "nothing resumable" in line
    assert not out.exists()


def test_a_full_disk_keeps_a_resumable_work_folder_and_says_so(src, tmp_path, monkeypatch):
    import ds4quant.artifact.gguf_writer as gw

    def full(f, t):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "full"
    with monkeypatch.context() as m:
        m.setattr(gw, "_write_payload", full)
        with pytest.raises(OutputError) as ei:
            convert(src, out, "rocmfp4", name="tiny")
    line = ei.value.one_line()
    assert "No space left on device" in line and "tiny.gguf" in line and "--resume" in line
    assert (out / WORK_DIR / "journal.json").is_file() and not list(out.glob("*.gguf"))
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    # the space is back: the run resumes from every finished piece, and is complete
    rep = convert(src, out, "rocmfp4", name="tiny", resume=True)
    assert rep.reused == len(rep.plan)
    assert (out / "SHA256SUMS").is_file() and not (out / WORK_DIR).exists()


# ---------------------------------------------------------------- kills around assembly


@pytest.fixture(scope="module")
def killed_at_sums(src, tmp_path_factory):
    """A run killed after the GGUF and manifest.json, before SHA256SUMS, with the temp file a
    killed GGUF write leaves; and the GGUF's sha256 as that run wrote it."""
    out = tmp_path_factory.mktemp("ks") / "job"

    def kill(*a, **k):
        raise _Kill()

    with pytest.MonkeyPatch.context() as m:
        m.setattr("ds4quant.artifact.sums.write_sums", kill)
        with pytest.raises(_Kill):
            convert(src, out, "rocmfp2-strix", name="tiny")
    assert (out / "manifest.json").is_file() and not (out / "SHA256SUMS").exists()
    (out / ".tiny.gguf.k1ll3d.tmp").write_bytes(b"partial")  # what SIGKILL mid-write leaves
    return out, sha256_file(out / "tiny.gguf")


def test_resume_finishes_a_run_killed_before_sha256sums_without_stale_temp_files(killed_at_sums, src, tmp_path):
    job, sha = killed_at_sums
    out = tmp_path / "job"
    shutil.copytree(job, out)
    rep = convert(src, out, "rocmfp2-strix", name="tiny", resume=True)
    assert rep.reused == len(rep.plan)
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "manifest.json", "tiny.gguf"]
    assert {n for n, _ in read_sums(out / "SHA256SUMS")} == {"manifest.json", "tiny.gguf"}
    assert sha256_file(out / "tiny.gguf") == sha

    # a finished folder is recognised as finished: nothing is rewritten
    before = {p.name: (p.stat().st_mtime_ns, sha256_file(p)) for p in out.iterdir()}
    again = convert(src, out, "rocmfp2-strix", name="tiny", resume=True)
    assert again.reused == len(again.plan) and again.runtimes == rep.runtimes
    assert {p.name: (p.stat().st_mtime_ns, sha256_file(p)) for p in out.iterdir()} == before
    # ... and a finished folder of another recipe is refused, naming the difference
    with pytest.raises(ResumeMismatchError) as ei:
        convert(src, out, "rocmfp3", name="tiny", resume=True)
    assert "--recipe: artifact rocmfp2-strix, this run rocmfp3" in ei.value.one_line()


# ---------------------------------------------------------------- smaller refusals


def _specs():
    from ds4quant.convert.plan import tensor_specs

    with open_any_source(SAMPLE) as s:
        return [t for t, _ in tensor_specs(s)]


@pytest.mark.parametrize("pattern", [r"norm\.weight$", r"attn_sinks", r"exp_probs_b", r"tid2eid"])
def test_block_qtypes_on_tensors_that_keep_source_precision_are_refused(pattern):
    specs = _specs()
    with pytest.raises(BadInputError) as ei:
        plan_tensors(get_recipe("rocmfp3"), specs, [Override.parse(f"{pattern}=rocmfp2")])
    assert "must keep source precision" in ei.value.one_line() and pattern in ei.value.one_line()
    if pattern != "tid2eid":  # float types stay allowed on float tensors
        plan = plan_tensors(get_recipe("rocmfp3"), specs, [Override.parse(f"{pattern}=f32")])
        assert any(c.qtype == "f32" and c.rule == f"override:{pattern}" for c in plan)


def test_a_tensor_type_pattern_that_matches_nothing_is_an_error_naming_it():
    specs = _specs()
    with pytest.raises(BadInputError) as ei:
        plan_tensors(get_recipe("rocmfp3"), specs, [Override.parse(r"blk\.0\..*exps=rocmfp4"),
                                                    Override.parse(r"blk\.99\.=rocmfp4")])
    assert ei.value.one_line().startswith(r"--tensor-type: pattern 'blk\.99\.' matches no tensor")
    res = CliRunner().invoke(cli, ["convert", str(SAMPLE), "/nonexistent-w1/out", "--tensor-type", "nrom=f32"])
    assert res.exit_code == 2 and "'nrom' matches no tensor" in res.output


def test_a_tensor_larger_than_the_split_limit_gets_its_own_split_and_is_reported(tmp_path):
    from ds4quant.artifact import GGUFWriter

    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=1024)
    w.add_tensor("a", "f32", (64,), bytes(256))
    w.add_tensor("big", "f32", (1024,), bytes(4096))
    w.add_tensor("b", "f32", (64,), bytes(256))
    files = w.write()
    assert len(files) == 3
    assert w.oversize == ((files[1].name, 4096, "big"),)
    assert all(f.stat().st_size > 0 for f in files)


def test_convert_reports_and_warns_about_splits_over_the_limit(src, tmp_path):
    out = tmp_path / "split"
    res = CliRunner().invoke(cli, ["convert", str(src), str(out), "--recipe", "rocmfp4", "--split-max-size", "64K",
                                   "--json"])
    assert res.exit_code == 0, res.output
    warned = [x for x in res.output.splitlines() if x.startswith("ds4quant: warning: ")]
    d = json.loads(res.output[res.output.index("{"):])
    over = {o["file"]: o for o in d["oversize_splits"]}
    assert over and len(warned) == len(over)
    for p in out.glob("*.gguf"):
        g = read_gguf_set(p)
        data = sum(-(-t.nbytes // 32) * 32 for n, t in g.tensors.items() if Path(t.path) == p)
        assert (p.name in over) == (data > 64 << 10), p.name
        if p.name in over:
            assert len([t for t in g.tensors.values() if Path(t.path) == p]) == 1
            assert over[p.name]["bytes"] == data
