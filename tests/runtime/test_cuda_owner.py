"""The CUDA owner on a real device (skipped without CUDA/HIP).

Exact mode: the CUDA owner's bytes equal the CPU owners' for every expert
qtype (synthetic stacks, mode-0 and mode-1 MIX experts), and MoE output
sha256 of CUDA-only, mixed CPU+CUDA and CPU-only placements agree on
artifacts ``ds4quant convert`` writes (rocmfp2-strix, rocmfp3, rocmfp4,
mxfp4, an adaptive MIX artifact). Fast mode: the Triton kernels against a
float64 product of the decoded weights. With ``DS4Q_GPU_RECORD=path`` every
hash is appended there as JSON lines (the closing note's record).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")]

from ds4quant import runtime  # noqa: E402
from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._synth import sha32, record_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
E = 16
LAYER = 1
EXPERTS = (3, 7, 8, 20)
DEV = "hip:0" if getattr(torch.version, "hip", None) else "cuda:0"
HAVE_CPU = importlib.util.find_spec("ds4quant.runtime.owners.cpu") is not None


def _load(owner, qtype):
    return S.hold_layer(owner, qtype, LAYER, EXPERTS)


def _cuda_owner():
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    return CudaOwner("cuda:0", identity=DEV)


@pytest.mark.parametrize("qtype", S.EXACT_QTYPES)
def test_exact_slots_equal_the_cpu_owners_bytes(qtype):
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    ids = np.array([20, 3, 3, 8, 7, 20, 7, 7])
    x = S.tokens(len(ids), seed=4)
    x[2, :32] = 0.0  # an all-zero activation block
    cuda = _cuda_owner()
    _load(cuda, qtype)
    got = cuda.run_slots(LAYER, x, ids, "exact")
    ref_owners = [TorchOwner("cpu", identity="torch-cpu:0")]
    if HAVE_CPU:
        from ds4quant.runtime.owners.cpu import CpuOwner

        ref_owners.append(CpuOwner(identity="cpu:0"))
    for o in ref_owners:
        _load(o, qtype)
        want = o.run_slots(LAYER, x, ids, "exact")
        assert sha32(got) == sha32(want), f"{qtype}: {cuda.identity} vs {o.identity}"
        o.close()
    record_gpu(test="exact_slots", qtype=qtype, owners=[cuda.identity] + [o.identity for o in ref_owners],
            sha256=sha32(got))
    cuda.close()


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
@pytest.mark.parametrize("ids", [[20, 3, 8], [7, 3, 7, 20, 7, 3, 8, 8, 8]], ids=["gemv", "grouped"])
def test_fast_kernels_match_float64(qtype, ids):
    pytest.importorskip("triton")
    ids = np.array(ids)
    o = _cuda_owner()
    stacks = _load(o, qtype)
    assert o.plan(LAYER, ids) is not None
    x = S.tokens(len(ids), seed=5)
    y = o.run_slots(LAYER, x, ids, "fast")
    ref = S.moe_ref64(stacks, x, ids)
    worst = max(float(np.abs(y[r] - ref[r]).max() / np.abs(ref[r]).max()) for r in range(len(ids)))
    path = o.fast_path(LAYER, ids)[0]
    record_gpu(test="fast_vs_f64", qtype=qtype, slots=len(ids), path=path, max_rel=worst)
    if path == "prefill":  # bf16 activations (docs/gpu.md#prefill): held as the interpreter test holds them
        S.assert_rows_close(y, S.moe_ref64(stacks, x, ids, bf16=True), ids, 1e-2, f"{qtype} (bf16 inputs)")
        S.assert_rows_close(y, ref, ids, 3e-2, qtype)
    else:
        assert worst < 1e-4, f"{qtype} ({path}): {worst}"
    o.close()


# --------------------------------------------------------------------------
# placements on converted artifacts

RECIPES = ("rocmfp2-strix", "rocmfp3", "rocmfp4", "mxfp4", "adaptive")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return {}


def _artifact(artifacts, tmp_path_factory, recipe):
    if recipe in artifacts:
        return artifacts[recipe]
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("gpu") / recipe
    if recipe == "adaptive":
        from ds4quant.plan import AdaptiveOptions

        calib = ROOT / "samples" / "ds4-tiny-calib"
        opts = AdaptiveOptions(routing=str(calib / "routing.csv"), cache_dir=str(out.parent / "cache"),
                               fit_iterations=2, fit_restarts=0, fit_max_rows=64, target_bpw=2.7,
                               granularity="expert")
        convert(SAMPLE, out, "adaptive", imatrix=calib / "imatrix.gguf", adaptive=opts)
    else:
        convert(SAMPLE, out, recipe, threads=4)
    artifacts[recipe] = out
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_placements_give_identical_moe_bytes(artifacts, tmp_path_factory, recipe):
    from ds4quant import formats

    art = _artifact(artifacts, tmp_path_factory, recipe)
    g = torch.Generator().manual_seed(11)
    x = torch.randn((7, 256), generator=g) * 2
    x[3, :32] = 0.0
    x[4, 40] = 300.0
    tok = torch.tensor([5, 17, 100, 3, 511, 0, 42])
    cpu = "cpu:0" if HAVE_CPU else "torch-cpu:0"
    plcs = {
        "cpu only": {L: {cpu: tuple(range(E))} for L in range(4)},
        "cuda only": {L: {DEV: tuple(range(E))} for L in range(4)},
        "cpu + cuda": {L: {cpu: tuple(range(0, E, 2)), DEV: tuple(range(1, E, 2))} for L in range(4)},
        "torch-cpu + cuda blocks": {L: {"torch-cpu:1": tuple(range(5)), DEV: tuple(range(5, E))} for L in range(4)},
    }
    hashes = {}
    for name, plc in plcs.items():
        owners = {DEV: _cuda_owner()} if DEV in plc[0] else None
        with runtime.load(art, placement=plc, mode="exact", owners=owners) as rt:
            if recipe == "adaptive":
                assert any(formats.QTYPES[s.qtype].is_mix for s in rt.view.stacks)
            hashes[name] = [sha32(rt.moe(L, x, tok)) for L in (0, 2)]
            qts = sorted({s.qtype for s in rt.view.stacks})
            if owners:  # fast mode on the same owner: the kernels, close to exact
                rt.mode = "fast"
                z = rt.moe(2, x, tok)
                rt.mode = "exact"
                ze = rt.moe(2, x, tok)
                rel = float((z - ze).norm() / ze.norm())
                assert rel < 6e-2, f"{name}: fast vs exact {rel}"
    record_gpu(test="placements", recipe=recipe, qtypes=qts, layers=[0, 2], sha256=hashes)
    first = next(iter(hashes.values()))
    for name, h in hashes.items():
        assert h == first, f"{recipe}: {name} differs from cpu only"
