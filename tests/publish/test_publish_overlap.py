"""publish never destroys its inputs: overlaps refused, --force removes only a release publish
wrote, and a killed publish's half-made folder is cleaned up (or reported) by the next run.

Each test fails on the code before the fix: ``--force`` deleted the artifact when OUT held it and
the checkpoint when OUT was ``--source``; ``publish ART . --force`` was a traceback; a foreign
folder was emptied by ``--force``; ``OUT.partial-<pid>`` of a killed run stayed forever; a
``--force`` replace killed between its renames left ``OUT.old-<pid>`` (reported, never removed)
and a finished but unmarked partial.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4quant.artifact import PARTIAL_MARK, clear_stale_partials, publish_dir
from ds4quant.artifact.overlap import check_no_overlap, overlap_reason
from ds4quant.artifact.sums import SUMS_NAME
from ds4quant.cli import cli
from ds4quant.errors import BadInputError
from ds4quant.publish import publish
from tests._verify_util import SAMPLE, strix_artifact

REPO = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """root/ckpt (a copy of the sample), root/art (its rocmfp2-strix artifact), root/imatrix.dat."""
    root = tmp_path_factory.mktemp("pubo")
    ckpt = root / "ckpt"
    shutil.copytree(SAMPLE, ckpt)
    art = strix_artifact(root / "art")
    (root / "imatrix.dat").write_bytes(b"not read: refused before")
    return root


def _run(*args: str):
    return CliRunner().invoke(cli, ["publish", *map(str, args)])


def _one_line_exit_2(res) -> str:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


@pytest.mark.parametrize("case", ["out-is-art", "out-inside-art", "out-holds-art", "out-is-src", "out-inside-src",
                                  "out-holds-src", "link-to-art", "link-to-src-parent", "out-holds-imatrix"])
def test_every_overlap_of_out_with_an_input_is_refused_and_nothing_changes(world, tmp_path, case):
    art, ckpt, imx = world / "art", world / "ckpt", world / "imatrix.dat"
    link = tmp_path / "link"
    if case == "link-to-art":
        link.symlink_to(art, target_is_directory=True)
    if case == "link-to-src-parent":
        link.symlink_to(world, target_is_directory=True)
    out = {"out-is-art": art, "out-inside-art": art / "rel", "out-holds-art": world, "out-is-src": ckpt,
           "out-inside-src": ckpt / "rel", "out-holds-src": world, "link-to-art": link,
           "link-to-src-parent": link / "ckpt", "out-holds-imatrix": world}[case]
    before = _tree(world)
    line = _one_line_exit_2(_run(art, out, "--source", ckpt, "--imatrix", imx, "--force"))
    assert "release folder" in line and "real paths" in line
    assert _tree(world) == before


def test_publish_into_the_working_folder_with_force_is_one_line(world, tmp_path, monkeypatch):
    art = world / "art"
    monkeypatch.chdir(world)  # "." holds the artifact
    before = _tree(world)
    line = _one_line_exit_2(_run(art, ".", "--force"))
    assert "holds the artifact" in line
    other = tmp_path / "work"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    monkeypatch.chdir(other)  # "." is the user's own folder: not a release, so --force refuses it
    line = _one_line_exit_2(_run(art, ".", "--force"))
    assert "has no SHA256SUMS" in line
    assert (other / "notes.txt").read_text() == "mine" and _tree(world) == before


def test_force_replaces_only_a_release_publish_wrote(world, tmp_path):
    art = world / "art"
    out = tmp_path / "rel"
    publish(art, out)
    first = _tree(out)
    rep = publish(art, out, overwrite=True)  # its own release: replaced, same bytes
    assert _tree(out) == first and rep.stale == ()
    (out / "notes.txt").write_text("mine")  # now it holds a file publish did not write
    line = _one_line_exit_2(_run(art, out, "--force"))
    assert "notes.txt" in line and "publish did not write" in line
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    # a file of the release hard-linked to the artifact's: --force would not lose data, but such a
    # folder is no plain release any more, and replacing it is refused
    gguf = next(p.name for p in art.iterdir() if p.suffix == ".gguf")
    (out / gguf).unlink()
    os.link(art / gguf, out / gguf)
    line = _one_line_exit_2(_run(art, out, "--force"))
    assert "hard link" in line and (art / gguf).is_file()


def test_the_shared_check_covers_bind_mounts(world, tmp_path):
    """A bind mount shows the artifact under another real path; its folder identity gives it away.
    Run in a private mount namespace (``unshare``), so nothing outlives the test."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    art = world / "art"
    script = textwrap.dedent(f"""
        import sys
        from ds4quant.artifact.overlap import overlap_reason
        print(overlap_reason({str(mnt)!r}, {str(art)!r}), overlap_reason({str(mnt / 'x')!r}, {str(art)!r}),
              overlap_reason({str(tmp_path / 'elsewhere')!r}, {str(art)!r}), sep="|")
        from ds4quant.cli import cli
        cli.main(["publish", {str(art)!r}, {str(mnt)!r}, "--force"], prog_name="ds4quant")
    """)
    cmd = ["unshare", "-rm", "sh", "-c", f'mount --bind "$0" "$1" && exec "$2" -c "$3"', str(art), str(mnt),
           sys.executable, script]
    before = _tree(world)
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    if "mount" in res.stderr and res.returncode != 2 or "unshare" in res.stderr:
        pytest.skip(f"no private bind mount here: {res.stderr.strip()[:200]}")
    assert res.stdout.strip() == "is|is inside|None", res.stdout + res.stderr
    assert res.returncode == 2 and "release folder is the artifact itself" in res.stderr, res.stderr
    assert _tree(world) == before


def test_overlap_reason_by_path_and_identity(tmp_path):
    a = tmp_path / "a"
    (a / "sub").mkdir(parents=True)
    (tmp_path / "l").symlink_to(a, target_is_directory=True)
    f = a / "imatrix.dat"
    f.write_bytes(b"x")
    assert overlap_reason(a, a) == "is" and overlap_reason(tmp_path / "l", a) == "is"
    assert overlap_reason(tmp_path / "l" / "new", a) == "is inside"
    assert overlap_reason(tmp_path, a) == "holds" and overlap_reason(a, f) == "holds"
    assert overlap_reason(tmp_path / "b", a) is None
    with pytest.raises(BadInputError, match="holds the imatrix"):
        check_no_overlap(a, {"source": None, "imatrix": f})


# ---------------------------------------------------------------- a publish killed mid-copy

_KILLED = """
import os, signal, sys
import ds4quant.publish.release as r
real = r._copy_hashed
def copy_then_die(src, dst):
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(fi.read(1000))  # half a file, as SIGKILL mid-copy leaves it
    os.kill(os.getpid(), signal.SIGKILL)
r._copy_hashed = copy_then_die
r.publish(sys.argv[1], sys.argv[2])
"""


def test_a_killed_publish_leaves_a_marked_partial_the_next_run_removes(world, tmp_path):
    art, out = world / "art", tmp_path / "rel"
    res = subprocess.run([sys.executable, "-c", _KILLED, str(art), str(out)], cwd=REPO, capture_output=True,
                         timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr
    partial = [p for p in tmp_path.iterdir() if p.name.startswith("rel.partial-")]
    assert len(partial) == 1 and (partial[0] / PARTIAL_MARK).is_file() and not out.exists()
    rep = publish(art, out)
    assert not partial[0].exists()
    assert len(rep.stale) == 1 and rep.stale[0].startswith(f"removed {partial[0]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel"]


def test_a_partial_in_use_or_not_marked_is_left_and_reported(tmp_path):
    out = tmp_path / "rel"
    unmarked = tmp_path / "rel.partial-1"  # not ours: no mark
    unmarked.mkdir()
    (unmarked / "data").write_text("someone's")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = tmp_path / f"rel.partial-{live.pid}"  # marked, but its pid runs
        alive.mkdir()
        (alive / PARTIAL_MARK).write_text(f"{live.pid}\n")
        with publish_dir(out) as building:  # this process's own build: marked and locked
            found = {p.path.name: p for p in clear_stale_partials(out)}
            assert not found[building.name].removed and "locked" in found[building.name].why
        assert not found["rel.partial-1"].removed and "no .ds4quant-partial mark" in found["rel.partial-1"].why
        assert not found[alive.name].removed and "still running" in found[alive.name].why
        assert unmarked.is_dir() and alive.is_dir() and out.is_dir()
    finally:
        live.kill()
        live.wait()
    # the pid gone, its marked partial is a killed build's leftover
    old = tmp_path / f"rel.old-{_dead_pid()}"  # what a replace killed between its two renames leaves
    old.mkdir()
    found = {p.path.name: p for p in clear_stale_partials(out)}
    assert found[alive.name].removed and not alive.exists()
    assert not found["rel.partial-1"].removed and unmarked.is_dir()
    assert not found[old.name].removed and "moved aside" in found[old.name].why and old.is_dir()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_replace_killed_between_its_renames_is_settled(tmp_path):
    out = tmp_path / "rel"
    # killed before the new folder came in: the earlier release goes back in place
    old = tmp_path / f"rel.old-{_dead_pid()}"
    old.mkdir()
    (old / "card").write_text("earlier release")
    found = clear_stale_partials(out, may_remove_old=lambda o: None)
    assert (out / "card").read_text() == "earlier release" and not old.exists()
    assert "moved back" in found[0].why
    # killed after it came in: the earlier one is removed only when the caller's rule allows it
    old.mkdir()
    (old / "card").write_text("earlier release")
    kept = clear_stale_partials(out, may_remove_old=lambda o: "holds files publish did not write")
    assert old.is_dir() and not kept[0].removed and "did not write" in kept[0].why
    gone = clear_stale_partials(out, may_remove_old=lambda o: None)
    assert gone[0].removed and not old.exists() and (out / "card").is_file()


_KILLED_REPLACE = """
import os, shutil, signal, sys
from ds4quant.publish import publish
art, out, when = sys.argv[1:]
publish(art, out)  # the earlier release
real_replace, real_rmtree = os.replace, shutil.rmtree
def replace(src, dst):
    real_replace(src, dst)
    if when == "aside" and ".old-" in os.fspath(dst):
        os.kill(os.getpid(), signal.SIGKILL)  # the earlier release moved aside, the new one not in yet
def rmtree(path, *a, **k):
    if when == "came-in" and ".old-" in os.fspath(path) and os.path.exists(path):
        os.kill(os.getpid(), signal.SIGKILL)  # the new release in, the earlier one not yet removed
    real_rmtree(path, *a, **k)
os.replace, shutil.rmtree = replace, rmtree
publish(art, out, overwrite=True)
"""


@pytest.mark.parametrize("when", ["aside", "came-in"])
def test_a_publish_killed_mid_replace_is_settled_by_the_next_run(world, tmp_path, when):
    art, out = world / "art", tmp_path / "rel"
    res = subprocess.run([sys.executable, "-c", _KILLED_REPLACE, str(art), str(out), when], cwd=REPO,
                         capture_output=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr
    old = [p for p in tmp_path.iterdir() if p.name.startswith("rel.old-")]
    assert len(old) == 1 and (old[0] / SUMS_NAME).is_file() and out.is_dir() == (when == "came-in")
    rep = publish(art, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel"]
    if when == "aside":
        # the earlier release went back in place (then this run replaced it); the new one,
        # still marked as the killed run's partial, was removed
        partial = old[0].with_name(old[0].name.replace(".old-", ".partial-"))
        assert len(rep.stale) == 2 and rep.stale[0].startswith(f"left {old[0]}: moved back to rel"), rep.stale
        assert rep.stale[1].startswith(f"removed {partial}: a killed build's leftover"), rep.stale
    else:  # its pid is gone and it is a release publish wrote: removed
        assert len(rep.stale) == 1 and rep.stale[0].startswith(f"removed {old[0]}"), rep.stale
    (tmp_path / "fresh").mkdir()
    publish(art, tmp_path / "fresh" / "rel")  # the release names its folder: the same name
    assert _tree(out) == _tree(tmp_path / "fresh" / "rel")


def test_an_old_folder_publish_did_not_write_or_whose_pid_runs_is_reported_not_removed(world, tmp_path):
    art, out = world / "art", tmp_path / "rel"
    publish(art, out)
    foreign = tmp_path / f"rel.old-{_dead_pid()}"  # the name, but not a release publish wrote
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f"rel.old-{live.pid}"  # a release publish wrote, but its pid still runs
        shutil.copytree(out, busy)
        rep = publish(art, out, overwrite=True)
        why = {line.split(": ", 1)[0]: line for line in rep.stale}
        assert why[f"left {foreign}"].endswith("not removed: it has no SHA256SUMS, so it is no release publish wrote")
        assert why[f"left {busy}"].endswith(f"pid {live.pid} is still replacing rel")
        assert (foreign / "notes.txt").read_text() == "mine" and (busy / SUMS_NAME).is_file()
    finally:
        live.kill()
        live.wait()
    # its pid gone, the release beside OUT is removed by the next publish; the foreign folder stays
    rep = publish(art, out, overwrite=True)
    assert not busy.exists() and any(line.startswith(f"removed {busy}") for line in rep.stale)
    assert (foreign / "notes.txt").read_text() == "mine"
