"""The cluster cleans up and stays local (docs/cluster-security.md):

- killing the caller (SIGKILL: no finally runs) ends every rank and removes the
  run's folder ``ds4q-cluster-*`` within the collective timeout, under both
  launchers;
- every socket a rank listens on is bound to loopback (the store rank 0 binds,
  gloo's own listeners);
- no pickled object crosses between ranks: the object collectives are made to
  raise in every rank (a sitecustomize on the ranks' path) and runs still pass;
- a failure on rank 0 itself is reported (its own status row is read), and a
  rank's failure under torchrun names the rank and its error;
- ``ds4quant run`` spawns its ranks unless asked for torchrun, whose agent store
  listens on every interface: nothing of a default run listens beyond loopback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from ds4quant import runtime  # noqa: E402
from ds4quant.convert import convert  # noqa: E402
from ds4quant.runtime.cluster import FAULT_ENV, ClusterError, ClusterOptions, run_cluster_layers  # noqa: E402
from ds4quant.runtime.cluster.store import home_alive, home_token, is_loopback, parse_address  # noqa: E402
from ds4quant.errors import BadInputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
TIMEOUT = 10


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("clsec")
    convert(SAMPLE, root / "strix", "rocmfp2-strix", threads=1)
    return root / "strix"


@pytest.fixture(scope="module")
def placement(art, tmp_path_factory):
    from ds4quant.calib.routing import read_routing
    from ds4quant.deploy.place import artifact_fingerprint
    from ds4quant.artifact.view import open_artifact
    from ds4quant.runtime.placement import write_placement
    from ds4quant.runtime.planning import plan_ranks

    with open_artifact(art) as v:
        fp = artifact_fingerprint(v)
    p = plan_ranks(read_routing(ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"), 2, "uniform", 0,
                   owner="torch-cpu:0", artifact=fp)
    return write_placement(tmp_path_factory.mktemp("clsec-p") / "c2.json", p)


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.fixture(scope="module")
def no_pickles(tmp_path_factory):
    """A folder whose sitecustomize makes torch.distributed's object collectives raise
    in every process that has it on PYTHONPATH (the ranks)."""
    d = tmp_path_factory.mktemp("nopickle")
    (d / "sitecustomize.py").write_text(
        "import torch.distributed as _d\n"
        "def _refuse(*a, **k):\n"
        "    raise RuntimeError('a pickled object between ranks')\n"
        "for _n in ('all_gather_object', 'broadcast_object_list', 'gather_object', 'scatter_object_list',\n"
        "           'send_object_list', 'recv_object_list'):\n"
        "    setattr(_d, _n, _refuse)\n")
    return {"PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _mine(d: Path) -> tuple[list[int], list[str]]:
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if str(d).encode() in (p / "cmdline").read_bytes():
                    procs.append(int(p.name))
            except OSError:
                pass
    return procs, sorted(str(x) for x in d.glob("ds4q-cluster-*"))


def _listening(pids) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket the processes hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    t = os.readlink(fd)
                except OSError:
                    continue
                if t.startswith("socket:["):
                    inodes[t[8:-1]] = pid
        except OSError:
            pass
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr = f[1].split(":")[0]
            raw = bytes.fromhex(hexaddr)
            if v6:
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                import ipaddress

                addr = str(ipaddress.IPv6Address(b"".join(words)))
            else:
                addr = ".".join(str(b) for b in raw[::-1])
            out.append((inodes[f[9]], addr))
    return out


def _rank_pids(tmp: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if str(tmp).encode() in cmd and b"ds4quant.runtime.cluster" in cmd and b"torch.distributed.run" not in cmd:
                pids.append(int(p.name))
    return pids


def test_store_parsing_and_home_token():
    assert parse_address("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("127.0.0.1", ":80", "h:port", "h:70000"):
        with pytest.raises(BadInputError):
            parse_address(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("0.0.0.0")
    assert home_alive(home_token())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    tok = home_token(p.pid)
    p.wait()
    assert not home_alive(tok)
    assert not home_alive(f"{os.getpid()}:1")  # the pid of another (older) process: recycled


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_group_listens_on_loopback_only_sends_no_pickles_and_reports_rank_0(art, placement, own_tmp, no_pickles,
                                                                           launcher):
    x = torch.randn((3, 256), generator=torch.Generator().manual_seed(3))
    tok = torch.tensor([5, 17, 100])
    with runtime.load(art, placement={L: {"torch-cpu:0": tuple(range(16))} for L in range(4)}) as one:
        ref = [one.moe(L, x, tok) for L in (0, 2)]
    opts = ClusterOptions(timeout_s=TIMEOUT, launcher=launcher, env={**no_pickles, FAULT_ENV: "0:3:raise"})
    with runtime.load(art, placement, cluster=opts) as grp:
        # every rank's listening sockets: the store rank 0 bound, gloo's own; all on loopback
        pids = _rank_pids(own_tmp)
        assert len(pids) == 2, pids
        socks = _listening(pids)
        assert socks and all(is_loopback(a) for _, a in socks), socks
        # the same bytes as one process, without one pickled object between the ranks
        for L, want in zip((0, 2), ref):
            assert torch.equal(grp.moe(L, x, tok), want)
        # a failure on rank 0 itself: its own status row is read, the call refused
        with pytest.raises(ClusterError, match="rank 0: injected failure on layer 3"):
            grp.moe(3, x, tok)
    assert _mine(own_tmp) == ([], [])


def test_a_rank_failure_under_torchrun_names_the_rank_and_its_error(art, placement, own_tmp, no_pickles):
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    with pytest.raises(ClusterError) as ei:
        run_cluster_layers(art, placement, x, token_ids=[1, 2], n_ranks=2, layers=[2], timeout_s=TIMEOUT,
                           launcher="torchrun", threads=1, env={**no_pickles, FAULT_ENV: "1:2:raise"})
    msg = str(ei.value)
    assert "rank 1: injected failure on layer 2" in msg and "=====" not in msg and "\n" not in msg, msg
    assert _mine(own_tmp) == ([], [])


HOME = """
import sys
import numpy as np
from ds4quant.runtime.cluster import run_cluster_layers
print("go", flush=True)
x = np.zeros((2, 256), np.float32)
run_cluster_layers(sys.argv[1], sys.argv[2], x, token_ids=[1, 2], n_ranks=2, layers=[2], timeout_s=float(sys.argv[4]),
                   launcher=sys.argv[3], threads=1, env={"DS4QUANT_CLUSTER_FAULT": "1:2:hang"})
"""


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_killing_the_caller_takes_the_ranks_and_the_folder_within_the_timeout(art, placement, own_tmp, launcher):
    env = {**os.environ, "TMPDIR": str(own_tmp), "OMP_NUM_THREADS": "1"}
    home = subprocess.Popen([sys.executable, "-c", HOME, str(art), str(placement), launcher, str(TIMEOUT)],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert home.stdout.readline().strip() == "go"
        # wait until both ranks run (the fault hangs rank 1 on layer 2: the run cannot end by itself)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rank_pids(own_tmp)) < 2:
            time.sleep(0.2)
        assert len(_rank_pids(own_tmp)) == 2 and _mine(own_tmp)[1]
        time.sleep(1.0)
        os.kill(home.pid, signal.SIGKILL)  # no finally, no kill_ranks: the ranks must see it themselves
        home.wait(timeout=10)
        until = time.monotonic() + TIMEOUT
        while time.monotonic() < until and _mine(own_tmp) != ([], []):
            time.sleep(0.2)
        assert _mine(own_tmp) == ([], []), _mine(own_tmp)
    finally:
        if home.poll() is None:
            home.kill()
        for pid in _mine(own_tmp)[0]:
            try:
                os.kill(pid, signal.SIGKILL)  # only what this test started (found by its own folder)
            except ProcessLookupError:
                pass


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid)."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


def test_ds4quant_run_by_default_listens_on_loopback_only(art, placement, own_tmp):
    """The command line's default launcher is spawn: no process of the run (the command,
    its ranks, or a torchrun between them) listens beyond loopback. Under ``--launcher
    torchrun`` torch's agent store would (docs/cluster-security.md)."""
    env = {**os.environ, "TMPDIR": str(own_tmp), "OMP_NUM_THREADS": "1", FAULT_ENV: "1:2:hang"}
    cmd = [sys.executable, "-m", "ds4quant", "run", str(art), "--ranks", "2", "--placement", str(placement),
           "--layers", "2", "--timeout", str(TIMEOUT), "--no-verify-payloads"]
    home = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        # rank 1 hangs on layer 2, so the run holds its sockets until it is killed
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rank_pids(own_tmp)) < 2:
            time.sleep(0.2)
        assert len(_rank_pids(own_tmp)) == 2
        # past the rendezvous: the store and gloo's listeners are up (polled: on a loaded
        # 2-core box the ranks can take seconds to get there)
        until = time.monotonic() + 60
        socks = []
        while time.monotonic() < until and not socks:
            time.sleep(0.5)
            pids = _tree(home.pid)
            socks = _listening(pids)
        time.sleep(1.0)  # and a moment more for listeners that come up later
        pids = _tree(home.pid)
        socks = _listening(pids) or socks
        assert socks and all(is_loopback(a) for _, a in socks), socks
        assert not any(b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids
                       if Path(f"/proc/{p}").exists())
    finally:
        home.kill()
        home.wait(timeout=10)
        until = time.monotonic() + TIMEOUT
        while time.monotonic() < until and _mine(own_tmp) != ([], []):
            time.sleep(0.2)
        for pid in _mine(own_tmp)[0]:
            try:
                os.kill(pid, signal.SIGKILL)  # only what this test started (found by its own folder)
            except ProcessLookupError:
                pass
    assert _mine(own_tmp) == ([], [])


def test_the_worker_channel_is_anonymous_and_only_the_parent_holds_its_other_end():
    """A worker owner unpickles requests and imports what init names: only the parent may
    write to it. Its channel is the child's stdin pipe and a socketpair, nothing bound to a
    path or a port (docs/cluster-security.md, "Worker owners")."""
    from ds4quant.runtime.owners.kinds import make_owner

    o = make_owner("worker:0/torch-cpu:0", swiglu_limit=10.0)
    try:
        child = o._conn.proc.pid
        fds = {}
        for fd in Path(f"/proc/{child}/fd").iterdir():
            try:
                fds[int(fd.name)] = os.readlink(fd)
            except OSError:
                pass
        # requests: the stdin pipe the parent writes (the child moves it off fd 0 at start)
        assert any(t.startswith("pipe:") for t in fds.values())
        inodes = {t[8:-1] for t in fds.values() if t.startswith("socket:[")}
        assert inodes  # the socketpair that carries file descriptors
        assert not _listening([child])  # no TCP/TCP6 listener at all
        bound = {}
        for row in Path("/proc/net/unix").read_text().splitlines()[1:]:
            f = row.split()
            if f[6] in inodes:
                bound[f[6]] = f[7] if len(f) > 7 else ""
        assert set(bound) == inodes and not any(bound.values()), bound  # unnamed: a socketpair, no path
    finally:
        o.close()
