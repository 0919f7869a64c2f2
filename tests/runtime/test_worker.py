"""The worker-process owner and its shared-memory arenas.

Most tests host tests/runtime/_fake_owner.py's float64 owner (no numba, so a
worker starts in a fraction of a second); the identity test also hosts the
numba CPU owner when ds4quant.runtime.owners.cpu exists.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ds4quant.errors import Ds4quantError, WorkerError
from ds4quant.runtime.arena import PREFIX, Arena, SharedBuffer, leftover_segments, shm_dir
from ds4quant.runtime.owners.worker import WorkerOwner, measure_call_cost, owner_class
from tests.runtime._fake_owner import FakeOwner, make_layer

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests.runtime._fake_owner:FakeOwner"
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
HIDDEN, FFN, LAYER = 64, 32, 3
IDS = (1, 4, 6, 9)


def own_segments(pid: int | None = None) -> list[Path]:
    """Segments this process (or ``pid``) created that still have a name."""
    tag = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    return [p for p in leftover_segments() if p.name.startswith(tag)]


def mapped_segments() -> list[str]:
    """This process's live mappings of its own segments (nameless, so /proc
    shows them as '... (deleted)'): what a leak would look like."""
    tag = f"/{PREFIX}{os.getpid()}-"
    return [ln for ln in Path("/proc/self/maps").read_text().splitlines() if tag in ln]


def gone(pid: int) -> bool:
    """No such process, or only a zombie nobody will reap in a container."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def fake_worker(**kw) -> WorkerOwner:
    kw.setdefault("timeout_s", 5.0)
    w = WorkerOwner("worker:0", owner=FAKE, env=ENV, **kw)
    for s in make_layer(LAYER, IDS, HIDDEN, FFN):
        w.add_stack(s)
    return w


def batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, HIDDEN)).astype(np.float32)
    return x, np.asarray(IDS, np.int64)[np.arange(n) % len(IDS)]


# -- arenas ---------------------------------------------------------------------


def test_segment_is_nameless_while_alive_and_shared():
    buf = SharedBuffer.create(4096)
    try:
        assert own_segments() == []  # unlinked as soon as it was opened
        other = SharedBuffer(os.dup(buf.fd), 4096)  # a second mapping, like the worker's
        buf.array(np.int64, (4,))[...] = [1, 2, 3, 4]
        assert other.array(np.int64, (4,)).tolist() == [1, 2, 3, 4]
        other.close()
    finally:
        buf.close()
    assert own_segments() == []


def test_arena_grows_by_replacement_and_never_shrinks():
    a = Arena("t", min_bytes=1024)
    assert a.ensure(10) is not None and a.nbytes == 1024 and a.generation == 1
    assert a.ensure(1024) is None and a.generation == 1
    fresh = a.ensure(1025)
    assert fresh is a.buffer and a.nbytes == 2048 and a.generation == 2
    fresh.close_fd()
    assert a.ensure(100) is None and a.nbytes == 2048
    with pytest.raises(ValueError, match="exceeds"):
        a.buffer.array(np.float32, (513,))
    a.close()
    assert own_segments() == []


def test_shm_dir_is_dev_shm_on_linux():
    assert shm_dir() == Path("/dev/shm") or not Path("/dev/shm").is_dir()


# -- identity with the in-process owner -------------------------------------------


@pytest.mark.parametrize("spec", ["fake", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_run_slots_bitwise_equal_to_in_process(spec, mode):
    if spec == "fake":
        name, cls, kw = FAKE, FakeOwner, {"noisy": True}  # stray prints must not corrupt frames
    else:
        name, cls, kw = "cpu", pytest.importorskip("ds4quant.runtime.owners.cpu").CpuOwner, {}
    local = cls(**kw)
    stacks = make_layer(LAYER, IDS, HIDDEN, FFN)
    for s in stacks:
        local.add_stack(s)
    with WorkerOwner("worker:0", owner=name, env=ENV, timeout_s=30.0, **kw) as w:
        for s in stacks:
            w.add_stack(s)
        assert w.experts(LAYER) == tuple(local.experts(LAYER)) == IDS
        assert w.experts(LAYER + 1) == tuple(local.experts(LAYER + 1))
        assert w.resident_bytes() == local.resident_bytes() > 0
        if spec == "fake":  # the hosted owner took the identity the worker gave it
            assert w.inner_identity == "worker:0/FakeOwner"
        for n in (1, 7, 64):
            x, ids = batch(n, seed=n)
            got = w.run_slots(LAYER, x, ids, mode)
            want = local.run_slots(LAYER, x, ids, mode)
            assert got.dtype == np.float32 and got.shape == (n, HIDDEN)
            assert got.tobytes() == want.tobytes()
    local.close()
    assert own_segments() == []


def _encoded_layer(qtype: str):
    """gate/up/down stacks of IDS encoded as ``qtype`` (+ MIX entries), seeded;
    hidden = ffn = 128 (MIX rows need a multiple of 128)."""
    from ds4quant import formats
    from ds4quant.codebooks import CodebookEntry
    from ds4quant.runtime.owners.base import ExpertStack

    rng = np.random.default_rng(7)
    L = formats.QTYPES[qtype].codebook_levels if formats.QTYPES[qtype].is_mix else 0
    stacks, books = [], []
    for proj in ("gate", "up", "down"):
        rows = cols = 128
        name = f"blk.{LAYER}.ffn_{proj}_exps.{qtype}.weight"
        kw, per = {}, []
        if L:
            bk = formats.bf16_round(np.sort(rng.uniform(-1, 1, (len(IDS), 2, L)), axis=-1).astype(np.float32))
            modes = np.array([1, 0, 1, 1][: len(IDS)], np.uint8)
            books.append((name, IDS, CodebookEntry(name, qtype, modes, bk, IDS, 16)))
        for k, _e in enumerate(IDS):
            w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
            if L:
                kw = {"codebooks": books[-1][2].books[k], "mode": int(books[-1][2].modes[k])}
            per.append(formats.encode(qtype, w, **kw))
        stacks.append(ExpertStack(name, LAYER, proj, qtype, rows, cols, IDS, np.stack(per)))
    return stacks, books


@pytest.mark.parametrize("qtype", ["q8_0", "rocmfp2", "rocmfp2_mix"])
def test_cpu_owner_through_the_worker_gives_in_process_bytes(qtype):
    cpu = pytest.importorskip("ds4quant.runtime.owners.cpu")
    stacks, books = _encoded_layer(qtype)
    local = cpu.CpuOwner("cpu:0")
    with WorkerOwner("worker:0", owner="cpu", env=ENV, timeout_s=60.0) as w:
        for o in (local, w):
            for s in stacks:
                o.add_stack(s)
            for tensor, ids, entry in books:
                o.register_books(tensor, ids, entry)
        assert w.inner_identity == "worker:0/cpu:0"
        assert w.resident_bytes() == local.resident_bytes()
        for mode in ("exact", "fast"):
            x = np.random.default_rng(3).standard_normal((9, 128)).astype(np.float32)
            ids = np.asarray(IDS, np.int64)[np.arange(9) % len(IDS)]
            assert w.run_slots(LAYER, x, ids, mode).tobytes() == local.run_slots(LAYER, x, ids, mode).tobytes()
    local.close()


def test_arenas_grow_on_a_bigger_batch_and_results_stay_correct():
    local = FakeOwner()
    for s in make_layer(LAYER, IDS, HIDDEN, FFN):
        local.add_stack(s)
    with fake_worker() as w:
        arenas = w._conn.arenas
        x, ids = batch(2)
        assert w.run_slots(LAYER, x, ids, "exact").tobytes() == local.run_slots(LAYER, x, ids, "exact").tobytes()
        small = (arenas["in"].nbytes, arenas["out"].nbytes, arenas["in"].generation)
        big_x, big_ids = batch(300, seed=1)  # 300 x 64 floats = 76800 bytes > the 64 KiB start
        got = w.run_slots(LAYER, big_x, big_ids, "exact")
        assert arenas["in"].nbytes > small[0] and arenas["out"].nbytes > small[1]
        assert arenas["in"].generation == small[2] + 1
        assert got.tobytes() == local.run_slots(LAYER, big_x, big_ids, "exact").tobytes()
        grown = arenas["in"].nbytes
        again = w.run_slots(LAYER, x, ids, "exact")  # a small batch after: no shrink, same bytes
        assert arenas["in"].nbytes == grown
        assert again.tobytes() == local.run_slots(LAYER, x, ids, "exact").tobytes()
        assert own_segments() == []
    assert own_segments() == []


def test_books_reach_the_hosted_owner():
    from ds4quant.codebooks import CodebookEntry

    books4 = np.array([[-1, -0.25, 0.25, 1], [-0.5, -0.125, 0.125, 0.5]], np.float32)
    entry = CodebookEntry("blk.3.ffn_gate_exps.rocmfp2_mix.weight", "rocmfp2_mix", [1, 0],
                          np.stack([books4, books4]), (4, 9), 16)
    with fake_worker() as w:
        before = w.resident_bytes()
        w.register_books(entry.name, (4, 9), entry)
        assert w.resident_bytes() == before + entry.books.nbytes + entry.modes.nbytes
        with pytest.raises(WorkerError, match=r"register_books failed .*ValueError: .*ids \(4, 6\)"):
            w.register_books(entry.name, (4, 6), entry)  # the hosted owner's refusal, in one line


def test_threads_share_one_worker_safely():
    local = FakeOwner()
    for s in make_layer(LAYER, IDS, HIDDEN, FFN):
        local.add_stack(s)
    inputs = [batch(n, seed=n) for n in (1, 5, 40, 300, 2, 77)]  # 300 grows the arenas mid-run
    want = [local.run_slots(LAYER, x, ids, "exact").tobytes() for x, ids in inputs]
    got = [None] * len(inputs)
    with fake_worker() as w:
        def work(i):
            got[i] = w.run_slots(LAYER, *inputs[i], "exact").tobytes()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == want


def test_empty_batch_and_bad_inputs():
    with fake_worker() as w:
        assert w.run_slots(LAYER, np.zeros((0, HIDDEN), np.float32), np.zeros(0, np.int64), "exact").shape == (0, HIDDEN)
        x, ids = batch(3)
        with pytest.raises(Ds4quantError, match="float32"):
            w.run_slots(LAYER, x.astype(np.float64), ids, "exact")
        with pytest.raises(Ds4quantError, match="expert_ids"):
            w.run_slots(LAYER, x, ids[:2], "exact")
        with pytest.raises(Ds4quantError, match="unknown mode"):
            w.run_slots(LAYER, x, ids, "fastest")
        assert not w.closed  # refused before anything was sent


# -- failures -------------------------------------------------------------------------


def _assert_reaped(w: WorkerOwner):
    proc = w._conn.proc
    assert proc.returncode is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # already reaped: no zombie


def test_worker_killed_mid_call_is_a_clear_error_and_the_caller_recovers():
    w = fake_worker(sleep_s=3.0, timeout_s=10.0)
    pid = w.pid
    x, ids = batch(4)
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        w.run_slots(LAYER, x, ids, "exact")
    elapsed = time.monotonic() - t0
    killer.join()
    msg = str(info.value)
    assert elapsed < 2.5, elapsed  # the death is seen, not the 10 s timeout nor the 3 s sleep
    assert f"worker process {pid} died during run" in msg and "SIGKILL" in msg and "\n" not in msg
    assert msg.startswith("worker:0: ")
    assert w.closed and own_segments() == [] and mapped_segments() == []
    _assert_reaped(w)
    with pytest.raises(WorkerError, match="closed worker"):
        w.experts(LAYER)
    w.close()  # idempotent after a failure
    local = FakeOwner()  # other owners keep working
    for s in make_layer(LAYER, IDS, HIDDEN, FFN):
        local.add_stack(s)
    with fake_worker() as fresh:
        assert fresh.run_slots(LAYER, x, ids, "exact").tobytes() == local.run_slots(LAYER, x, ids, "exact").tobytes()


def test_child_exception_is_reported_in_one_line():
    w = fake_worker(fail_layer=LAYER)
    x, ids = batch(2)
    with pytest.raises(WorkerError) as info:
        w.run_slots(LAYER, x, ids, "exact")
    e = info.value
    assert "run failed in worker process" in str(e)
    assert "ValueError: fake failure on layer 3 (at _fake_owner.py:" in str(e) and "\n" not in str(e)
    assert e.op == "run" and e.remote_type == "ValueError"
    assert "Traceback" in e.remote_traceback and "fake failure" in e.remote_traceback
    assert w.closed and own_segments() == []
    _assert_reaped(w)


def test_a_hung_worker_times_out_and_is_killed():
    w = fake_worker(sleep_s=30.0, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"did not answer run within 0.5 s; killed it"):
        w.run_slots(LAYER, *batch(1), "exact")
    assert time.monotonic() - t0 < 2.0
    _assert_reaped(w)
    assert w._conn.proc.returncode == -signal.SIGKILL


def test_a_slow_start_times_out():
    # 10 ms is far less than an interpreter start plus the numpy import.
    with pytest.raises(WorkerError, match=r"did not answer init within 0.01 s; killed it"):
        WorkerOwner("worker:0", owner=FAKE, env=ENV, start_timeout_s=0.01)
    assert own_segments() == []


def test_constructor_errors_in_the_child_are_reported():
    with pytest.raises(WorkerError, match=r"init failed .*TypeError: .*unexpected keyword argument 'bogus'"):
        WorkerOwner("worker:0", owner=FAKE, env=ENV, timeout_s=5.0, bogus=1)
    with pytest.raises(WorkerError, match=r"ModuleNotFoundError: No module named 'no_such_pkg'"):
        WorkerOwner("worker:0", owner="no_such_pkg.mod:Owner", env=ENV, timeout_s=5.0)
    with pytest.raises(Ds4quantError, match="unknown owner 'gpu-please'"):
        owner_class("gpu-please")
    with pytest.raises(Ds4quantError, match="cannot send init to the worker"):
        WorkerOwner("worker:0", owner=FAKE, env=ENV, timeout_s=5.0, sleep_s=lambda: 0)  # not picklable


def test_missing_interpreter_is_a_clear_error():
    with pytest.raises(WorkerError) as info:
        WorkerOwner("worker:1", python="/nonexistent/bin/python3", timeout_s=5.0)
    msg = str(info.value)
    assert msg.startswith("worker:1: cannot start the worker interpreter '/nonexistent/bin/python3'")
    assert "--worker-python" in msg and info.value.op == "start"


def test_interpreter_without_ds4quant_is_a_clear_error(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'ds4quant'\" >&2\nexit 1\n")
    fake_python.chmod(0o755)
    with pytest.raises(WorkerError, match=r"died during init \(exit code 1\): ModuleNotFoundError: No module named 'ds4quant'"):
        WorkerOwner("worker:0", python=str(fake_python), timeout_s=5.0)
    assert own_segments() == []


# -- lifetime ------------------------------------------------------------------------


def test_close_reaps_the_child_and_is_idempotent():
    w = fake_worker()
    w.run_slots(LAYER, *batch(2), "exact")
    assert len(mapped_segments()) == 2  # the in and out arenas
    w.close()
    assert mapped_segments() == []
    assert w._conn.proc.returncode == 0  # it exited on the close request, not by a kill
    _assert_reaped(w)
    w.close()
    with pytest.raises(WorkerError, match="closed worker"):
        w.run_slots(LAYER, *batch(1), "exact")


def test_garbage_collection_stops_the_child():
    w = fake_worker()
    proc = w._conn.proc
    del w
    gc.collect()
    assert proc.returncode == 0


def test_child_exits_when_its_parent_dies():
    # A primary killed with SIGKILL: its worker sees stdin close and exits, and
    # neither side leaves a /dev/shm name.
    script = textwrap.dedent(f"""
        import os, sys, numpy as np
        from ds4quant.runtime.owners.worker import WorkerOwner
        from tests.runtime._fake_owner import make_layer
        w = WorkerOwner("worker:0", owner={FAKE!r}, timeout_s=5.0)
        for s in make_layer(3, (1, 4), 64, 32):
            w.add_stack(s)
        w.run_slots(3, np.ones((2, 64), np.float32), np.array([1, 4]), "exact")
        print(os.getpid(), w.pid, flush=True)
        sys.stdin.read()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, **ENV}, cwd=ROOT, text=True)
    try:
        ppid, child = (int(v) for v in parent.stdout.readline().split())
        assert not gone(child)
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 5
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
        assert own_segments(ppid) == [] and own_segments(child) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)


def test_measure_call_cost_runs_and_agrees():
    stacks = make_layer(LAYER, IDS, HIDDEN, FFN)
    costs = measure_call_cost(FAKE, stacks, LAYER, batches=(1, 4), repeats=3, env=ENV)
    assert [c.batch for c in costs] == [1, 4]
    assert all(c.identical and c.worker_us > 0 and c.in_process_us > 0 for c in costs)
