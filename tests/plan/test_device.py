"""The measure stage in parallel and on a device gives the same bytes.

- the codebook fitter and ``measure_matrix`` give the same books, modes and
  float64 figures through the torch tier (the searches' own tests:
  tests/formats/search/);
- ``--jobs``: plans, errors, GGUF bytes and the measurement cache are the
  same for 1 and 2 workers;
- on CUDA (skips without): convert ``--device cuda`` == the CPU path, plan,
  errors and GGUF sha256, on samples/ds4-tiny at the default effort.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.artifact import sha256_file
from ds4quant.codebooks import fit_optimized
from ds4quant.convert import convert
from ds4quant.errors import BadInputError
from ds4quant.formats import search
from ds4quant.formats.search import Backend, Tier
from ds4quant.plan import AdaptiveOptions, measure_matrix
from tests.plan.test_adaptive import IMATRIX, ROUTING, SAMPLE, _gguf

torch = pytest.importorskip("torch")
from tests.formats.search.test_torch_mix import DEVICES, _data  # noqa: E402

F = np.float32
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
def test_fitter_and_measure_matrix_through_torch_equal_the_host(dev, qtype):
    rng = np.random.default_rng(3)
    x = _data(rng, 96, 128, "t3")
    q = np.exp(1.5 * rng.standard_normal(128)).astype(F)
    q[rng.random(128) < 0.05] = 0
    for imp in (q, None):
        a = fit_optimized([x], qtype, imp, seed="blk.1/3", iterations=3, restarts=1, max_rows=40)
        b = fit_optimized([x], qtype, imp, seed="blk.1/3", iterations=3, restarts=1, max_rows=40,
                          backend=Backend(Tier.TORCH, dev))
        assert np.array_equal(a.books.view(np.uint32), b.books.view(np.uint32)) and a.mode == b.mode
        assert (a.error, a.reference_error, a.fixed_error, a.refined_error) == \
            (b.error, b.reference_error, b.fixed_error, b.refined_error)
        for mode in (0, 1):
            assert np.array_equal(search.encode_mix(qtype, x, imp, a.books, mode, Backend(Tier.TORCH, dev)),
                                  formats.encode(qtype, x, imp, a.books, mode=mode))
    opts = AdaptiveOptions(target_bpw=2.7, fit_iterations=2, fit_restarts=1, fit_max_rows=40)
    w = q.astype(np.float64)
    m0, b0 = measure_matrix(x, q, w, qtype, opts, seed="t/1")
    m1, b1 = measure_matrix(x, q, w, qtype, opts, seed="t/1", backend=Backend(Tier.TORCH, dev))
    assert m0 == m1 and np.array_equal(b0[0], b1[0]) and b0[1] == b1[1]


def test_bad_device_and_jobs_are_refused():
    with pytest.raises(BadInputError, match="--device"):
        AdaptiveOptions(target_bpw=2.7, device="tpu").validate()
    with pytest.raises(BadInputError, match="--jobs"):
        AdaptiveOptions(target_bpw=2.7, jobs=0).validate()
    with pytest.raises(BadInputError, match="--device"):
        AdaptiveOptions(target_bpw=2.7, device="cpu:1")
    if not CUDA:
        with pytest.raises(BadInputError, match="no CUDA device"):
            AdaptiveOptions(target_bpw=2.7, device="cuda").backend()
    assert AdaptiveOptions(target_bpw=2.7, device="cuda:1").device_name == "cuda:1"
    assert AdaptiveOptions(target_bpw=2.7, device="torch-cpu").backend() == Backend(Tier.TORCH, "cpu")


def _run(tmp, label, target, jobs, threads, device="cpu", effort=(2, 0, 64)):
    opts = AdaptiveOptions(target_bpw=target, routing=str(ROUTING), cache_dir=str(tmp / f"c-{label}"),
                           fit_iterations=effort[0], fit_restarts=effort[1], fit_max_rows=effort[2],
                           jobs=jobs, device=device)
    out = tmp / f"{label}-{target:.4f}"
    rep = convert(SAMPLE, out, "adaptive", imatrix=IMATRIX, threads=threads, adaptive=opts)
    return rep, sha256_file(_gguf(out))


def _cache_bytes(root):
    files = sorted(root.glob("measure-*.json"))
    assert len(files) == 1
    return files[0].read_bytes()


def test_plans_bytes_and_cache_do_not_depend_on_the_worker_count(tmp_path):
    runs = {}
    for label, jobs, threads in (("j1", 1, 1), ("j2", 2, 1), ("j3t2", 3, 2)):
        runs[label] = _run(tmp_path, label, 17 / 6, jobs, threads)
    shas = {k: v[1] for k, v in runs.items()}
    assert len(set(shas.values())) == 1, shas
    plans = {k: [(c.name, c.qtype) for c in v[0].plan] for k, v in runs.items()}
    assert plans["j1"] == plans["j2"] == plans["j3t2"]
    errs = {k: v[0].adaptive.predicted_weighted_error for k, v in runs.items()}
    assert len(set(errs.values())) == 1, errs
    caches = {k: _cache_bytes(tmp_path / f"c-{k}") for k in runs}
    assert caches["j1"] == caches["j2"] == caches["j3t2"]


def test_convert_through_the_torch_search_equals_the_cpu_path(tmp_path, monkeypatch):
    """--device torch-cpu end to end (the plumbing CUDA uses), on one adaptive tensor:
    the measure stage's searches and the encode's run on the torch tier, the same bytes."""
    from ds4quant.convert import encode as encode_stage

    host = set()  # qtypes the encode stage encoded on the host
    real = encode_stage.encode
    monkeypatch.setattr(encode_stage, "encode", lambda q, *a, **k: (host.add(q), real(q, *a, **k))[1])
    expert_qtypes = {"rocmfp2", "rocmfp2_mix", "rocmfp3"}
    got = {}
    for device in ("cpu", "torch-cpu"):
        opts = AdaptiveOptions(target_bpw=2.5625, routing=str(ROUTING), cache_dir=str(tmp_path / f"c-{device}"),
                               candidates=("rocmfp2", "rocmfp2_mix", "rocmfp3"), fit_iterations=2, fit_restarts=0,
                               fit_max_rows=64, device=device, jobs=2)
        out = tmp_path / device
        rep = convert(SAMPLE, out, "adaptive", imatrix=IMATRIX, threads=1, adaptive=opts,
                      tensor_types=(r"blk\.[1-3]\..*exps=rocmfp2", r"blk\.0\.ffn_(up|down)_exps=rocmfp2"))
        got[device] = (sha256_file(_gguf(out)), _cache_bytes(tmp_path / f"c-{device}"),
                       rep.adaptive.predicted_weighted_error)
        assert any(c.qtype == "rocmfp2_mix" for c in rep.plan)  # the MIX path was measured and chosen
        # the encode stage ran the experts' searches on the device tier, and only there
        chosen = {c.qtype for c in rep.plan} & expert_qtypes
        assert chosen >= {"rocmfp2", "rocmfp2_mix"}
        assert (host & chosen) == (set() if device == "torch-cpu" else chosen), (device, host)
        host.clear()
    assert got["cpu"] == got["torch-cpu"]


@needs_cuda
@pytest.mark.gpu
def test_convert_on_cuda_equals_the_cpu_path(tmp_path, monkeypatch):
    """Default effort (6,1,512), both budgets: same plan, figures and GGUF bytes
    (every matrix on the device: the sample's are below DEVICE_MIN_WEIGHTS)."""
    from ds4quant.plan import job

    monkeypatch.setattr(job, "DEVICE_MIN_WEIGHTS", 0)
    for target in (17 / 6, 2.7):
        a = _run(tmp_path, "cpu", target, 2, None, "cpu", (6, 1, 512))
        b = _run(tmp_path, "cuda", target, 2, None, "cuda", (6, 1, 512))
        assert a[1] == b[1]
        assert [(c.name, c.qtype) for c in a[0].plan] == [(c.name, c.qtype) for c in b[0].plan]
        assert a[0].adaptive.predicted_weighted_error == b[0].adaptive.predicted_weighted_error
    assert _cache_bytes(tmp_path / "c-cpu") == _cache_bytes(tmp_path / "c-cuda")
