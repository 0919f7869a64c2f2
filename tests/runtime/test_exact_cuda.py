"""Exact mode's Triton kernels on a real device (skipped without CUDA/HIP): the
CUDA owner's exact bytes through ``kernels/exact_triton`` (graph and eager)
equal the CPU owners' at DS4 sizes (hidden 4096, expert 2048: rocmfp2,
rocmfp3, the rocmfp2-strix mix) and at batch 64; a call with flagged pairs
is patched through the definition's limbs to the same bytes; the float64 SwiGLU gives the
definition's bits over a million values, and its compiled code divides with
IEEE float64 division and has no fused multiply-add. With
``DS4Q_GPU_RECORD=path`` the hashes are appended there as JSON lines."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")]

from ds4quant import formats  # noqa: E402
from ds4quant.runtime.owners import torch_exact as te  # noqa: E402
from ds4quant.runtime.owners.base import ExpertStack  # noqa: E402

from . import _synth as S  # noqa: E402
from ._synth import sha32, record_gpu  # noqa: E402

DEV = "hip:0" if getattr(torch.version, "hip", None) else "cuda:0"
HAVE_CPU = importlib.util.find_spec("numba") is not None
STRIX = ("rocmfp2", "rocmfp2", "rocmfp3")
DS4 = (4096, 2048)  # hidden, expert width


def _stacks(qtypes, n_exp, H, I, seed=1):
    """Seeded random valid bytes (codes uniform, scale bytes 2^-8 .. 0.5 of either sign)."""
    r = np.random.default_rng(seed)
    out = {}
    for proj, q, rows, cols in (("gate", qtypes[0], I, H), ("up", qtypes[1], I, H), ("down", qtypes[2], H, I)):
        bb = formats.QTYPES[q].block_bytes
        d = r.integers(0, 256, (n_exp, rows, cols // 32, bb), dtype=np.uint8)
        d[..., -2:] = r.integers(0x18, 0x39, (n_exp, rows, cols // 32, 2)) | (r.integers(0, 2, (
            n_exp, rows, cols // 32, 2)) << 7)
        out[proj] = ExpertStack(f"blk.0.ffn_{proj}_exps.weight", 0, proj, q, rows, cols, tuple(range(n_exp)),
                                d.reshape(n_exp, rows, -1))
    return out


def _owners(stacks, cpu=True):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    cuda = CudaOwner(DEV, identity=DEV)
    refs = [TorchOwner("cpu", identity="torch-cpu:0")]
    if cpu and HAVE_CPU:
        from ds4quant.runtime.owners.cpu import CpuOwner

        refs.append(CpuOwner(identity="cpu:0"))
    for o in [cuda] + refs:
        for st in stacks.values():
            o.add_stack(st)
    return cuda, refs


@pytest.mark.parametrize("qtypes", [("rocmfp2",) * 3, ("rocmfp3",) * 3, STRIX], ids=["rocmfp2", "rocmfp3", "strix"])
def test_exact_kernels_give_the_cpu_bytes_at_ds4_sizes(qtypes):
    stacks = _stacks(qtypes, 8, *DS4)
    cuda, refs = _owners(stacks)
    ids = np.array([5, 0, 7, 3, 5, 1])
    x = S.tokens(len(ids), seed=31, hidden=DS4[0])
    x[1, :32] = 0.0
    got = cuda.run_slots(0, x, ids, "exact")
    assert cuda.exact_stats == {"kernel": 1, "patched": 0, "rerun": 0}
    cuda.graphs = False
    eager = cuda.run_slots(0, x, ids, "exact")
    hashes = {cuda.identity: sha32(got), f"{cuda.identity} eager": sha32(eager)}
    for o in refs:
        hashes[o.identity] = sha32(o.run_slots(0, x, ids, "exact"))
        o.close()
    record_gpu(test="exact_kernels_ds4", qtypes=list(qtypes), sha256=hashes)
    assert len(set(hashes.values())) == 1, hashes
    cuda.close()


def test_exact_kernels_at_batch_64_give_the_cpu_bytes():
    stacks = _stacks(STRIX, 32, 1024, 512, seed=2)
    cuda, refs = _owners(stacks, cpu=False)
    r = np.random.default_rng(5)
    ids = np.stack([r.choice(32, 6, replace=False) for _ in range(64)]).reshape(-1)
    x = S.tokens(len(ids), seed=32, hidden=1024)
    got = cuda.run_slots(0, x, ids, "exact")
    assert cuda.exact_stats == {"kernel": 1, "patched": 0, "rerun": 0}
    want = refs[0].run_slots(0, x, ids, "exact")
    record_gpu(test="exact_kernels_b64", qtypes=list(STRIX), sha256=sha32(got))
    assert sha32(got) == sha32(want)
    cuda.close()
    refs[0].close()


def test_a_flagged_call_is_patched_to_the_cpu_bytes():
    stacks = _stacks(STRIX, 4, 1024, 512, seed=3)
    cuda, refs = _owners(stacks)
    ids = np.array([1, 3, 1])
    x = S.tokens(3, seed=33, hidden=1024)
    x[2, :32] *= 1e30  # a token whose blocks span 2^200: outside the kernels' float64 bound
    x[2, 64:96] *= 1e-30
    got = cuda.run_slots(0, x, ids, "exact")
    assert cuda.exact_stats == {"kernel": 0, "patched": 1, "rerun": 0}
    for o in refs:
        assert sha32(o.run_slots(0, x, ids, "exact")) == sha32(got), o.identity
        o.close()
    cuda.close()


def test_device_swiglu_and_quantize_give_the_definitions_bits():
    from ds4quant.runtime.kernels import exact_triton as ek

    g0 = torch.Generator().manual_seed(9)
    n, K = 512, 2048
    g = torch.randn((n, K), generator=g0) * torch.exp(torch.randn((n, 1), generator=g0) * 2)
    u = torch.randn((n, K), generator=g0) * 4
    g[0, :6] = torch.tensor([-800.0, -709.5, -709.0, 709.0, float("inf"), -0.0])
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    h = torch.empty((n, K), dtype=torch.float32, device=DEV)
    qt, s = ek.swiglu_quantize(g.to(DEV), u.to(DEV), 10.0, bad, h=h)
    want = te.swiglu_exact(g, u, 10.0)
    assert int(bad[0]) == 0
    assert np.array_equal(h.cpu().numpy().view(np.uint32), want.numpy().view(np.uint32))
    q0, s0 = te.quantize_blocks(want)
    assert torch.equal(qt.cpu().permute(0, 2, 1).reshape(n, K).to(torch.int64), q0)
    assert torch.equal(s.cpu().to(torch.int64), s0)
    x = g.clone()
    x[0, 4] = 3e38  # finite: exact mode refuses an infinite input
    qx, sx = ek.quantize(x.to(DEV), bad)
    q1, s1 = te.quantize_blocks(x)
    assert torch.equal(qx.cpu().permute(0, 2, 1).reshape(n, K).to(torch.int64), q1)
    assert torch.equal(sx.cpu().to(torch.int64), s1)


@pytest.mark.skipif(bool(getattr(torch.version, "hip", None)), reason="reads NVIDIA PTX")
def test_swiglu_kernel_divides_in_ieee_float64_without_fma():
    from ds4quant.runtime.kernels import exact_triton as ek

    n, K = 2, 64
    g = torch.randn((n, K), device=DEV)
    qt = torch.empty((n, 16, K // 16), device=DEV)
    s = torch.empty((n, K // 32), dtype=torch.int32, device=DEV)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    ck = ek._swiglu_quant_kernel[(n, 1)](g, g, K, ek.swiglu_constants(g.device, 10.0), qt, s, bad, qt, K, K // 16,
                                         K // 32, NB=2, H_OUT=False, num_warps=2, enable_fp_fusion=False)
    ptx = ck.asm["ptx"]
    record_gpu(test="swiglu_ptx", div_rn_f64=ptx.count("div.rn.f64"), fma_f64=ptx.count("fma.rn.f64"))
    assert "div.rn.f64" in ptx and "fma.rn.f64" not in ptx and "div.approx" not in ptx
