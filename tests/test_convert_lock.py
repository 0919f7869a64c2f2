"""convert's lock and journal trust no link and no hand edit; the command line errors are one line.

Each test fails on the code before the fix: a planted ``.ds4quant.lock`` link made convert
truncate its target (any file outside OUTDIR) and write its pid there; deleting the lock file by
hand let a second convert into a folder one was writing; a journal ``done`` entry that was a
string or lacked its sha256 was a traceback; ``--cache-dir`` on a file was a traceback;
``--granularity foo`` and ``--jobs 0`` printed click's four-line usage block.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4quant.cli import cli
from ds4quant.convert import WORK_DIR, convert
from ds4quant.convert.outdir import LOCK_NAME, OutLock
from ds4quant.convert.resume import JOURNAL
from ds4quant.errors import OutputError, OutputLockedError

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "ds4-tiny"


class _Kill(BaseException):
    """Stands in for SIGKILL: not a Ds4quantError, so nothing is cleaned up."""


def _one_line_exit_2(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: "), res.output
    return lines[0]


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / LOCK_NAME).symlink_to(victim)
    line = _one_line_exit_2(CliRunner().invoke(cli, ["convert", str(SAMPLE), str(out), "--recipe", "rocmfp3"]))
    assert "symbolic link" in line and LOCK_NAME in line
    assert victim.read_text() == "precious\n" and (out / LOCK_NAME).is_symlink()
    # a dangling link too: following it would create a file outside OUTDIR
    (out / LOCK_NAME).unlink()
    (out / LOCK_NAME).symlink_to(tmp_path / "created-outside")
    with pytest.raises(OutputError, match="symbolic link"):
        OutLock(out).acquire()
    assert not (tmp_path / "created-outside").exists()


def test_a_hand_deleted_lock_file_still_keeps_a_second_convert_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with OutLock(out):
        (out / LOCK_NAME).unlink()  # by hand, while the holder runs
        line = _one_line_exit_2(CliRunner().invoke(cli, ["convert", str(SAMPLE), str(out), "--recipe", "rocmfp3"]))
        assert "another convert" in line
        with pytest.raises(OutputLockedError):
            OutLock(out).acquire()
    with OutLock(out):  # released with its holder
        pass


def test_the_lock_file_of_a_killed_run_stays_and_blocks_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"

    def kill(*a, **k):
        raise _Kill()

    monkeypatch.setattr("ds4quant.artifact.sums.write_sums", kill)
    with pytest.raises(_Kill):
        convert(SAMPLE, out, "rocmfp3", name="tiny")
    assert (out / LOCK_NAME).is_file() and (out / WORK_DIR / JOURNAL).is_file()
    monkeypatch.undo()
    rep = convert(SAMPLE, out, "rocmfp3", name="tiny", resume=True)
    assert rep.reused == len(rep.plan)
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "manifest.json", "tiny.gguf"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A rocmfp3 run killed before SHA256SUMS: its work folder and journal are on disk."""
    out = tmp_path_factory.mktemp("jr") / "job"
    with pytest.MonkeyPatch.context() as m:
        m.setattr("ds4quant.artifact.sums.write_sums", lambda *a, **k: (_ for _ in ()).throw(_Kill()))
        with pytest.raises(_Kill):
            convert(SAMPLE, out, "rocmfp3", name="tiny")
    return out


@pytest.mark.parametrize("damage", ["string", "no-sha256", "sha-not-hex", "list", "done-not-object", "link"])
def test_a_damaged_journal_is_one_line_naming_it(killed, tmp_path, damage):
    out = tmp_path / "job"
    shutil.copytree(killed, out, symlinks=True)
    jp = out / WORK_DIR / JOURNAL
    d = json.loads(jp.read_text())
    first = next(iter(d["done"]))
    if damage == "string":
        d["done"][first] = "done"
    elif damage == "no-sha256":
        del d["done"][first]["sha256"]
    elif damage == "sha-not-hex":
        d["done"][first]["sha256"] = "z" * 64
    elif damage == "list":
        d["done"][first] = [1, 2]
    elif damage == "done-not-object":
        d["done"] = ["x"]
    jp.write_text(json.dumps(d))
    if damage == "link":  # a journal planted as a link to a file outside OUTDIR
        outside = tmp_path / "elsewhere.json"
        jp.rename(outside)
        jp.symlink_to(outside)
    res = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(out), "--recipe", "rocmfp3", "--name", "tiny",
                                   "--resume"])
    line = _one_line_exit_2(res)
    assert str(jp) in line and "journal" in line
    if damage != "link":
        assert first in line or damage == "done-not-object"


def test_cache_dir_on_a_file_is_one_line_before_any_work(tmp_path):
    f = tmp_path / "cache"
    f.write_text("x")
    out = tmp_path / "out"
    for cache in (f, f / "sub"):
        line = _one_line_exit_2(CliRunner().invoke(cli, [
            "convert", str(SAMPLE), str(out), "--recipe", "adaptive", "--target-bpw", "3", "--cache-dir", str(cache)]))
        assert "--cache-dir" in line and "not a folder" in line
    assert not out.exists()


@pytest.mark.parametrize("args, words", [
    (["--granularity", "foo"], ["--granularity", "foo"]),
    (["--jobs", "0"], ["--jobs", "0"]),
    (["--fitter", "nope"], ["--fitter"]),
    (["--no-such-option"], ["--no-such-option"]),
])
def test_click_usage_errors_are_one_line_exit_2(tmp_path, args, words):
    res = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "out"), "--recipe", "adaptive",
                                   "--target-bpw", "3", *args])
    line = _one_line_exit_2(res)
    assert all(w in line for w in words) and "ds4quant convert --help" in line
    assert "Usage:" not in res.output and not (tmp_path / "out").exists()
    line = _one_line_exit_2(CliRunner().invoke(cli, ["no-such-command"]))
    assert "no-such-command" in line
    line = _one_line_exit_2(CliRunner().invoke(cli, ["verify"]))
    assert "ARTIFACT" in line


def test_convert_refuses_an_outdir_holding_the_imatrix_by_the_shared_check(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    imx = out / "imatrix.gguf"
    shutil.copyfile(ROOT / "samples" / "ds4-tiny-calib" / "imatrix.gguf", imx)
    before = imx.read_bytes()
    line = _one_line_exit_2(CliRunner().invoke(cli, ["convert", str(SAMPLE), str(out), "--recipe", "rocmfp3",
                                                     "--imatrix", str(imx), "--force"]))
    assert "output folder holds the imatrix" in line and "real paths" in line
    assert imx.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["imatrix.gguf"]


def test_a_second_process_is_kept_out_after_the_lock_file_is_deleted(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom ds4quant.convert.outdir import OutLock\n"
                               "with OutLock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(60)\n",
         str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / LOCK_NAME).unlink()  # by hand, while the other process runs
        res = subprocess.run([sys.executable, "-m", "ds4quant", "convert", str(SAMPLE), str(out), "--recipe",
                              "rocmfp3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "another convert" in res.stderr, res.stderr
        assert sorted(p.name for p in out.iterdir()) == []  # it wrote nothing, not even a lock file
    finally:
        holder.kill()
        holder.wait()
