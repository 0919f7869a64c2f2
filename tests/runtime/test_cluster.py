"""The expert-parallel cluster (runtime.cluster): N gloo ranks on localhost give
the single-process bytes; each rank reads and holds exactly its experts; a
mismatch or a dead/hung rank ends every rank with a clear error in time.

Ranks are child processes (torch.distributed, gloo, CPU); several placements
and artifacts run as jobs of one process group so each test starts its ranks
once. Exact-mode outputs are compared by sha256, never a tolerance."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from ds4quant import formats, runtime  # noqa: E402
from tests.runtime._synth import identity_rows, write_identity_artifact, sha32  # noqa: E402
from ds4quant.artifact import read_gguf_set  # noqa: E402
from ds4quant.artifact.view import open_artifact  # noqa: E402
from ds4quant.convert import convert  # noqa: E402
from ds4quant.names import PROJS, parse_stack  # noqa: E402
from ds4quant.deploy.place import artifact_fingerprint  # noqa: E402
from ds4quant.calib.routing import read_routing  # noqa: E402
from ds4quant.runtime.cluster import FAULT_ENV, ClusterError, run_cluster_jobs, run_cluster_layers  # noqa: E402
from ds4quant.runtime.placement import write_placement  # noqa: E402
from ds4quant.runtime.planning import plan_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
CALIB = ROOT / "samples" / "ds4-tiny-calib"
E = 16
LAYERS = (0, 2)  # a hash-routed and a top-k layer
COMBINE_LAYER = 2
OWNER = "torch-cpu:0"
PLACEMENTS = {"uniform": ("uniform", 0), "balanced": ("balanced", 0), "replicate-hot": ("balanced", 2)}
TIMEOUT = 60


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """rocmfp2-strix always; the adaptive ones (minutes on busy cores) are built by ``adaptive_arts``."""
    root = tmp_path_factory.mktemp("cluster")
    convert(SAMPLE, root / "strix", "rocmfp2-strix", threads=1)
    return {"strix": root / "strix"}


@pytest.fixture(scope="module")
def adaptive_arts(arts, tmp_path_factory):
    from ds4quant.plan import AdaptiveOptions

    root = tmp_path_factory.mktemp("cluster-adaptive")
    out = dict(arts)
    for g in ("tensor", "expert"):
        opts = AdaptiveOptions(routing=str(CALIB / "routing.csv"), cache_dir=str(root / "cache"), fit_iterations=1,
                               fit_restarts=0, fit_max_rows=32, target_bpw=2.7, granularity=g,
                               candidates=("rocmfp2", "rocmfp2_mix", "rocmfp4"))
        convert(SAMPLE, root / g, "adaptive", imatrix=CALIB / "imatrix.gguf", adaptive=opts)
        out[f"adaptive-{g}"] = root / g
    return out


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn((3, 256), generator=g) * 2
    x[1, :32] = 0.0  # an all-zero activation block
    return x, torch.tensor([5, 17, 100])


def _placements(art: Path, n: int, where: Path, owner: str = OWNER) -> dict[str, Path]:
    prof = read_routing(CALIB / "routing.csv")
    with open_artifact(art) as v:
        fp = artifact_fingerprint(v)
    out = {}
    for name, (strategy, k) in PLACEMENTS.items():
        p = plan_ranks(prof, n, strategy, k, owner=owner, artifact=fp)
        out[name] = write_placement(where / f"{art.name}-{n}-{name}-{owner.replace(':', '')}.json", p)
    return out


def _routing_with_combine_case(art: Path, x, tok):
    """Layer COMBINE_LAYER's router output with token 0 replaced by slots
    (A, B, A, C) weighted [1e20, 1, -1e20, 1]: A on rank 0, B and C elsewhere
    for uniform placements, so per-rank partial sums would differ from the
    canonical sequential combine."""
    with runtime.load(art, placement={L: {OWNER: tuple(range(E))} for L in range(4)}) as rt:
        idx, w = rt.route(COMBINE_LAYER, x, tok)
    idx, w = idx.clone(), w.clone()
    idx[0] = torch.tensor([0, 1, 0, 3])
    w[0] = torch.tensor([1e20, 1.0, -1e20, 1.0])
    return {COMBINE_LAYER: (idx, w)}


def _reference(art: Path, x, tok, routing):
    """Single process, one owner holding everything, one thread (the ranks run one
    thread each; the router's float32 matmul depends on BLAS threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with runtime.load(art, placement={L: {OWNER: tuple(range(E))} for L in range(4)}) as rt:
            out = {}
            for L in LAYERS:
                idx, w = routing[L] if L in routing else rt.route(L, x, tok)
                res = rt.run_layer(L, x, idx, w, shared=rt.shared(L, x))
                out[L] = (sha32(res.out), res, rt.shared(L, x), idx, w)
            return out
    finally:
        torch.set_num_threads(n)


def _dense_bytes(art: Path) -> int:
    g = read_gguf_set(next(art.glob("*.gguf")))
    return sum(t.nbytes for n, t in g.tensors.items() if parse_stack(n) is None)


def _check_runs(runs, jobs, refs, n):
    for job, run in zip(jobs, runs):
        art, pname = job["artifact"], job["placement"]
        ref = refs[art]
        assert run.n_ranks == n and len(run.ranks) == n
        for L in LAYERS:
            assert run.sha256[L] == ref[L][0], f"{art.name} {pname.name} layer {L}"
            assert sha32(run.outputs[L]) == ref[L][0]
        with open_artifact(art) as v:
            nb = v.expert_nbytes()
        from ds4quant.runtime.placement import read_placement

        plc = read_placement(pname)
        total = int(nb.sum())
        with open_artifact(art) as v:
            mix = [s for s in v.stacks if formats.QTYPES[s.qtype].is_mix]
        for r, rep in enumerate(run.ranks):
            mine = [[e for e in range(E) if plc.ranks.owner[L][e] in (r, -1)] for L in range(4)]
            share = sum(int(nb[L, e]) for L in range(4) for e in mine[L])
            # decode tables: every MIX stack this rank holds experts of, registered for exactly those
            tables: dict = {}
            for per_owner in rep["tables"].values():
                for t, ids in per_owner.items():
                    tables[t] = sorted(set(tables.get(t, ())) | set(ids))
            want = {s.name: sorted(e for e in s.expert_ids if e in mine[s.layer]) for s in mix}
            assert tables == {t: ids for t, ids in want.items() if ids}, f"rank {r} tables"
            # the counting reader: exactly the rank's own + replicated experts, once, plus dense tensors
            assert rep["expert_bytes_read"] == share == rep["share_bytes"] < total
            assert rep["dense_bytes_read"] <= _dense_bytes(art)  # 0 on a rank with no rows of the shared expert
            assert rep["experts"] == mine
            assert sum(rep["resident_bytes"].values()) >= share
            assert sorted(rep["owners"]) == sorted(job.get("owners") or [OWNER])
        assert run.ranks[0]["dense_bytes_read"] > 0  # rank 0 routes
        # every slot computed exactly once across the ranks
        for i, L in enumerate(LAYERS):
            assert sum(rep["layers"][i]["slots"] for rep in run.ranks) == 3 * 4


def _jobs_and_refs(artifacts: dict, n: int, inputs, tmp: Path):
    x, tok = inputs
    routing = _routing_with_combine_case(artifacts["strix"], x, tok)
    jobs, refs = [], {}
    for art in artifacts.values():
        refs[art] = _reference(art, x, tok, routing)
        for p in _placements(art, n, tmp).values():
            jobs.append({"artifact": art, "placement": p, "layers": LAYERS})
    return jobs, refs, routing


@pytest.mark.parametrize("n", [2, 4])
def test_exact_bytes_of_n_ranks_equal_one_process_strix(arts, inputs, tmp_path, n):
    x, tok = inputs
    jobs, refs, routing = _jobs_and_refs(arts, n, inputs, tmp_path)
    # every rank routes itself and the routing digests are compared (layer 0; layer 2's routing is given)
    jobs.append({**jobs[1], "route": "local"})
    # each rank with a torch and a numba CPU owner of its own (its experts interleaved over them)
    jobs.append({**jobs[2], "owners": [OWNER, "cpu:1"]})
    # plus fast mode (partial sums per rank, all_reduced) on the uniform placement
    jobs.append({**jobs[0], "mode": "fast"})
    runs = run_cluster_jobs(jobs, n, x, token_ids=tok, routing=routing, timeout_s=TIMEOUT, threads=1)
    _check_runs(runs[:-1], jobs[:-1], refs, n)
    for rep in runs[-2].ranks:  # both owners did slots
        assert all(rep["resident_bytes"][o] > 0 for o in (OWNER, "cpu:1")), rep["resident_bytes"]
    # the [1e20, 1, -1e20, 1] token: canonical order keeps slot 3 only; per-rank partial sums do not
    ref = refs[arts["strix"]][COMBINE_LAYER]
    res, shared, _, w = ref[1], ref[2], ref[3], ref[4]
    want = runs[0].outputs[COMBINE_LAYER][0]
    y = res.slots[0]
    canon = ((w[0, 0] * y[0] + w[0, 1] * y[1]) + w[0, 2] * y[2]) + w[0, 3] * y[3] + shared[0]
    assert np.array_equal(want, canon.numpy())
    partial = (w[0, 0] * y[0] + w[0, 2] * y[2]) + (w[0, 1] * y[1] + w[0, 3] * y[3]) + shared[0]
    assert not np.array_equal(want, partial.numpy())
    # fast mode: close on ordinary tokens, its distance reported, not hidden
    fast = runs[-1]
    for L in LAYERS:
        a, b = fast.outputs[L][1:], runs[0].outputs[L][1:]
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        assert rel < 5e-2, f"fast vs exact layer {L}: {rel}"


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_exact_bytes_of_n_ranks_equal_one_process_adaptive(adaptive_arts, inputs, tmp_path, n):
    x, tok = inputs
    arts = {k: v for k, v in adaptive_arts.items() if k != "strix"}
    arts_all = {"strix": adaptive_arts["strix"], **arts}
    jobs, refs, routing = _jobs_and_refs(arts_all, n, inputs, tmp_path)
    jobs = [j for j in jobs if j["artifact"] != adaptive_arts["strix"]]
    with open_artifact(arts["adaptive-expert"]) as v:
        assert any(s.compact for s in v.stacks) and any(formats.QTYPES[s.qtype].is_mix for s in v.stacks)
    runs = run_cluster_jobs(jobs, n, x, token_ids=tok, routing=routing, timeout_s=TIMEOUT, threads=1)
    _check_runs(runs, jobs, refs, n)


# --------------------------------------------------------------------------
# identity-encoded experts: every rank holds exactly its experts


@pytest.fixture(scope="module")
def identity_artifact(arts, tmp_path_factory):
    return write_identity_artifact(arts["strix"], tmp_path_factory.mktemp("ident") / "ident")


def test_identity_experts_every_rank_holds_exactly_its_placement(identity_artifact, inputs, tmp_path):
    x, tok = inputs
    plc = _placements(identity_artifact, 2, tmp_path)["replicate-hot"]
    run = run_cluster_layers(identity_artifact, plc, x, token_ids=tok, n_ranks=2, mode="fast", layers=[0],
                             holdings=True, timeout_s=TIMEOUT, threads=1)
    from ds4quant.runtime.placement import read_placement

    p = read_placement(plc)
    with open_artifact(identity_artifact) as v:
        shapes = {(s.layer, s.proj.value): (s.rows, s.cols) for s in v.stacks}
    seen = set()
    for r, rep in enumerate(run.ranks):
        for L in range(4):
            held = rep["holdings"][str(L)][OWNER]
            want = {e for e in range(E) if p.ranks.owner[L][e] in (r, -1)}
            assert {int(e) for e in held} == want, f"rank {r} layer {L}"
            for e, projs in held.items():
                for i, proj in enumerate(PROJS):
                    rows, cols = shapes[(L, proj.value)]
                    enc = formats.encode("bf16", identity_rows(L, int(e), i, rows, cols))
                    assert projs[proj.value] == hashlib.sha256(enc.tobytes()).hexdigest()[:32]
                    seen.add((L, int(e), r))
    # owned experts on one rank, replicated (2 per layer) on both
    assert len(seen) == 4 * (E + 2)


# --------------------------------------------------------------------------
# guards: mismatch, dead rank, hung rank


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """The cluster's temporary folder goes under this test's own folder, so what is
    left over is this test's alone (other runs on a shared machine make their own)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _mine(d: Path) -> tuple[list[int], list[str]]:
    """Live processes started for folder ``d`` and cluster folders left in it."""
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(d).encode() in (p / "cmdline").read_bytes():
                    procs.append(int(p.name))
            except OSError:
                pass
    return procs, sorted(str(x) for x in d.glob("ds4q-cluster-*"))


def test_placement_and_fingerprint_mismatch_is_an_error_on_every_rank(arts, identity_artifact, inputs, tmp_path,
                                                                    own_tmp):
    x, tok = inputs
    ps = _placements(arts["strix"], 2, tmp_path)
    job = {"artifact": arts["strix"], "placement": ps["uniform"], "layers": [0]}
    with pytest.raises(ClusterError) as ei:
        run_cluster_jobs([job], 2, x, token_ids=tok, timeout_s=TIMEOUT, threads=1,
                         rank_jobs=[{}, {0: {"placement": str(ps["balanced"])}}])
    msg = str(ei.value)
    assert msg.count("placement sha256 differs across ranks") == 2, msg
    assert "rank 0: placement" in msg and "rank 1: placement" in msg
    # rank 1 on another artifact (same shapes, other bytes): the fingerprint guard, on both ranks
    free = plan_ranks(read_routing(CALIB / "routing.csv"), 2, "uniform", 0, owner=OWNER)  # no artifact recorded
    fp = write_placement(tmp_path / "free.json", free)
    job = {"artifact": arts["strix"], "placement": fp, "layers": [0]}
    with pytest.raises(ClusterError) as ei:
        run_cluster_jobs([job], 2, x, token_ids=tok, timeout_s=TIMEOUT, threads=1,
                         rank_jobs=[{}, {0: {"artifact": str(identity_artifact)}}])
    msg = str(ei.value)
    assert msg.count("artifact fingerprint differs across ranks") == 2, msg
    assert _mine(own_tmp) == ([], [])


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_rank_that_dies_or_hangs_mid_layer_ends_every_rank_in_time(arts, inputs, tmp_path, own_tmp, fault):
    x, tok = inputs
    shm = _shm()
    ps = _placements(arts["strix"], 2, tmp_path)
    timeout = 8
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as ei:
        run_cluster_layers(arts["strix"], ps["uniform"], x, token_ids=tok, n_ranks=2, layers=[0, 2],
                           timeout_s=timeout, threads=1, env={FAULT_ENV: f"1:2:{fault}"})
    took = time.monotonic() - t0
    msg = str(ei.value)
    if fault == "kill":
        assert "rank 1: killed by signal 9" in msg
    else:
        assert "rank 1: still running at the deadline; killed" in msg or "rank 1" in msg
    assert "rank 0: layer 2 exchange failed: a peer rank died, hung or left" in msg, msg
    # start-up (imports, loading) plus at most the collective timeout and the launcher's grace
    assert took < 120, took
    assert _mine(own_tmp) == ([], []) and _shm() == shm  # gloo is TCP: nothing in shared memory


def test_a_rank_error_is_named_on_every_rank(arts, inputs, tmp_path):
    x, tok = inputs
    ps = _placements(arts["strix"], 2, tmp_path)
    with pytest.raises(ClusterError) as ei:
        run_cluster_layers(arts["strix"], ps["uniform"], x, token_ids=tok, n_ranks=2, layers=[0],
                           timeout_s=TIMEOUT, threads=1, env={FAULT_ENV: "1:0:raise"})
    msg = str(ei.value)
    assert "rank 1: injected failure on layer 0" in msg
    assert "rank(s) [1] failed computing their slots" in msg, msg


def test_cli_run_writes_the_result_a_torchrun_command_line_also_gives(arts, inputs, tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    ps = _placements(arts["strix"], 2, tmp_path)
    out = tmp_path / "result.json"
    r = CliRunner().invoke(cli, ["run", str(arts["strix"]), "--ranks", "2", "--placement", str(ps["balanced"]),
                                 "--tokens", "2", "--layers", "2", "--timeout", str(TIMEOUT), "--out", str(out)])
    assert r.exit_code == 0, r.output
    import json

    j = json.loads(out.read_text())
    assert j["n_ranks"] == 2 and [lay["layer"] for lay in j["layers"]] == [2]
    assert len(j["layers"][0]["sha256"]) == 64 and "sha256" in r.output
    # the same run as the documented torchrun command line (a torchrun the user starts): the same bytes
    import subprocess
    import sys

    direct = tmp_path / "direct.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "ds4quant.runtime.cluster", str(arts["strix"]), "--placement", str(ps["balanced"]), "--tokens", "2",
           "--layers", "2", "--timeout", str(TIMEOUT), "--out", str(direct)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(direct.read_text())["layers"][0]["sha256"] == j["layers"][0]["sha256"]
    r = CliRunner().invoke(cli, ["run", str(arts["strix"]), "--ranks", "4", "--placement", str(ps["balanced"]),
                                 "--tokens", "2", "--launcher", "spawn"])
    assert r.exit_code == 2 and "placement is for 2 ranks, this cluster has 4" in r.output, r.output
    assert os.path.exists(out)


# --------------------------------------------------------------------------
# the persistent rank group (runtime.cluster.group): started once, serving calls; the
# executor runtime.load returns for a rank placement


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("n", [4])  # 2 ranks: tests/verify/test_fidelity_cluster.py, through a whole model
def test_rank_group_serves_many_calls_with_the_one_process_bytes(arts, inputs, tmp_path, own_tmp, n):
    from ds4quant.runtime.cluster import ClusterOptions, RankGroup
    from ds4quant.runtime.executor import Executor
    from ds4quant.runtime.placement import read_placement

    x, tok = inputs
    art = arts["strix"]
    routing = _routing_with_combine_case(art, x, tok)
    ref = _reference(art, x, tok, routing)
    # the ranks run the numba CPU owner, the reference the torch one: exact mode is owner-independent
    pname = _placements(art, n, tmp_path, owner="cpu")["replicate-hot"]
    plc = read_placement(pname)
    shm = _shm()
    with open_artifact(art) as v:
        nb = v.expert_nbytes()
    with runtime.load(art, pname, "exact", cluster=ClusterOptions(timeout_s=TIMEOUT)) as grp:
        assert isinstance(grp, RankGroup) and isinstance(grp, Executor) and grp.n_ranks == n
        pids = [p.pid for p in grp._procs]
        assert len(pids) == n and grp.start_s > 0
        assert sorted(_mine(own_tmp)[0]) == sorted(pids) and len(_mine(own_tmp)[1]) == 1
        for L in (*LAYERS, LAYERS[0]):  # the same ranks serve every call
            _, res, shared, idx, w = ref[L]
            got = grp.run_layer(L, x, idx, w, shared=shared)
            assert sha32(got.out) == ref[L][0], f"{n} ranks, layer {L}"
        assert [p.pid for p in grp._procs] == pids and all(p.poll() is None for p in grp._procs)
        st = grp.stats()
        assert st["calls"] == 3 and st["n_ranks"] == n
        for r, rep in enumerate(grp.ranks):
            mine = [[e for e in range(E) if plc.ranks.owner[L][e] in (r, -1)] for L in range(4)]
            share = sum(int(nb[L, e]) for L in range(4) for e in mine[L])
            # each rank read exactly its own + replicated experts and no dense tensor (the home routes)
            assert rep["experts"] == mine
            assert rep["expert_bytes_read"] == share == rep["share_bytes"] < int(nb.sum())
            assert rep["dense_bytes_read"] == 0
        assert sum(grp.resident_bytes().values()) == sum(sum(r["resident_bytes"].values()) for r in grp.ranks)
        # the executor interface, as in process: routing and the shared expert at home, the routed
        # experts on the ranks, and transformers' experts call; exact mode gives the one-process bytes
        with runtime.load(art, placement={L: {OWNER: tuple(range(E))} for L in range(4)}) as one:
            assert isinstance(one, Executor) and one.n_ranks == 0
            L = LAYERS[1]
            assert sha32(grp.moe(L, x, tok)) == sha32(one.moe(L, x, tok))
            idx, w = one.route(L, x, tok)
            assert sha32(grp.experts(L)(x, idx, w)) == sha32(one.experts(L)(x, idx, w))
            assert one.stats()["calls"] == 2 and grp.stats()["calls"] == 5
    # the combine case: canonical order keeps slot 3 only
    _, res, shared, _, w = ref[COMBINE_LAYER]
    y = res.slots[0]
    canon = ((w[0, 0] * y[0] + w[0, 1] * y[1]) + w[0, 2] * y[2]) + w[0, 3] * y[3] + shared[0]
    assert np.array_equal(res.out[0].numpy(), canon.numpy())
    partial = (w[0, 0] * y[0] + w[0, 2] * y[2]) + (w[0, 1] * y[1] + w[0, 3] * y[3]) + shared[0]
    assert not np.array_equal(res.out[0].numpy(), partial.numpy())  # so the sha above tells them apart
    assert _mine(own_tmp) == ([], []) and _shm() == shm
    with pytest.raises(ClusterError, match="ranks are gone"):
        grp.run_layer(0, x, ref[0][3], ref[0][4])


def test_rank_group_refuses_an_artifact_other_than_the_callers(arts, tmp_path, own_tmp):
    from ds4quant.runtime.cluster import ClusterOptions, RankGroup
    from ds4quant.runtime.placement import read_placement

    pname = _placements(arts["strix"], 2, tmp_path, owner="cpu")["uniform"]
    with pytest.raises(ClusterError) as ei, open_artifact(arts["strix"]) as v:
        RankGroup(v, read_placement(pname), options=ClusterOptions(timeout_s=TIMEOUT),
                  expect_fingerprint="sha256:" + "0" * 64)
    msg = str(ei.value)
    # both ranks refuse it (each checks its own view), in one line
    assert "\n" not in msg and msg.count("is not the caller's sha256:0000") >= 2, msg
    assert _mine(own_tmp) == ([], [])


def test_rank_group_ends_by_itself_when_its_caller_dies(arts, tmp_path, own_tmp):
    import signal
    import subprocess
    import sys

    pname = _placements(arts["strix"], 2, tmp_path, owner="cpu")["uniform"]
    code = ("import sys, time\nfrom ds4quant import runtime\nfrom ds4quant.runtime.cluster import ClusterOptions\n"
            "g = runtime.load(sys.argv[1], sys.argv[2], cluster=ClusterOptions(timeout_s=10))\n"
            "print(g._tmp, flush=True)\ntime.sleep(600)\n")
    home = subprocess.Popen([sys.executable, "-c", code, str(arts["strix"]), str(pname)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "TMPDIR": str(own_tmp)})
    try:
        tmp = home.stdout.readline().strip()
        assert tmp.startswith(str(own_tmp)) and os.path.isdir(tmp)
        assert len(_mine(own_tmp)[0]) == 2  # the ranks are up
        os.kill(home.pid, signal.SIGKILL)  # no close(), no finally: the ranks must notice by themselves
        home.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _mine(own_tmp) != ([], []):
            time.sleep(0.2)
        assert _mine(own_tmp) == ([], [])
    finally:
        if home.poll() is None:
            home.kill()
            home.wait()
