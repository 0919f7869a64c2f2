"""The tensor-core prefill kernels and the plane-layout exact kernels on a real
device (skipped without CUDA/HIP), at DS4 sizes (hidden 4096, expert 2048):

* prefill: every kernel qtype against a float64 product of the decoded
  weights on the device (bf16-rounded activations), with an expert that gets
  no slot and one that gets many; the call takes the prefill path; a CUDA
  graph of ``prefill_device`` replays another routing of the same slot count
  to the eager result;
* exact: the CUDA owner's bytes for every plane-layout qtype equal the
  definition's (``TorchOwner`` on the device, and ``torch-cpu`` at batch 1)
  at 1 and 64 tokens and at 512 tokens through the per-slot kernels, and at
  64 and 2,048 tokens through the grouped kernels (every kernel qtype). With ``DS4Q_GPU_RECORD=path`` the
  hashes are appended there as JSON lines."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")]

from ds4quant import formats  # noqa: E402
from ds4quant.codebooks import CodebookEntry  # noqa: E402
from ds4quant.runtime.kernels import layout  # noqa: E402
from ds4quant.runtime.owners.base import ExpertStack  # noqa: E402

from ._synth import record_gpu, sha32  # noqa: E402

DEV = "hip:0" if getattr(torch.version, "hip", None) else "cuda:0"
H, I, N_EXP, TOPK = 4096, 2048, 32, 6
PLANE_QTYPES = tuple(q for q in layout.KERNEL_QTYPES if q not in layout.LINEAR_QTYPES)


def _scale_span(q):
    bb = formats.QTYPES[q].block_bytes
    if q == "mxfp4":
        return 0, 1, 118, 127
    n = 1 if q in ("rocmfp4_fast", "rocmfp8") else 2
    return bb - n, n, 0x18, 0x38


def strictly_increasing_books(rng, n: int, L: int):
    """float32 (n, 2, L) bf16 books, each strictly increasing (redrawn until rounding keeps them so)."""
    from ds4quant import formats

    out = np.empty((n, 2, L), np.float32)
    for e in range(n):
        while True:
            b = formats.bf16_round(np.sort(rng.uniform(-1, 1, (2, L)), axis=-1).astype(np.float32))
            if np.all(np.diff(b, axis=-1) > 0):
                out[e] = b
                break
    return out


def _layer(q, seed=1):
    r = np.random.default_rng(seed)
    stacks, entries = {}, {}
    for proj, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
        qt = formats.QTYPES[q]
        d = r.integers(0, 256, (N_EXP, rows, cols // 32, qt.block_bytes), dtype=np.uint8)
        first, cnt, lo, hi = _scale_span(q)
        sc = r.integers(lo, hi + 1, (N_EXP, rows, cols // 32, cnt)).astype(np.uint8)
        if qt.is_mix:
            sc |= (r.integers(0, 2, sc.shape) << 7).astype(np.uint8)
        d[..., first:first + cnt] = sc
        name = f"blk.0.ffn_{proj}_exps.weight"
        stacks[proj] = ExpertStack(name, 0, proj, q, rows, cols, tuple(range(N_EXP)), d.reshape(N_EXP, rows, -1))
        if qt.is_mix:
            L = qt.codebook_levels
            books = strictly_increasing_books(r, N_EXP, L)
            entries[name] = CodebookEntry(name, q, (np.arange(N_EXP) % 3 != 2).astype(np.uint8), books)
    return stacks, entries


def _owner(cls, stacks, entries, device, **kw):
    o = cls(device, identity=device if device != "cpu" else "torch-cpu:0", **kw)
    for st in stacks.values():
        o.add_stack(st)
    for t, ent in entries.items():
        o.register_books(t, tuple(range(N_EXP)), ent)
    return o


def _ids(tokens, seed):
    r = np.random.default_rng(seed)
    ids = np.stack([r.choice(N_EXP - 1, TOPK, replace=False) for _ in range(tokens)]).reshape(-1)
    ids[: tokens * TOPK // 3] = 5  # one busy expert; expert N_EXP - 1 gets no slot
    return ids


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
def test_prefill_matches_float64_at_ds4_sizes(qtype):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    stacks, entries = _layer(qtype)
    o = _owner(CudaOwner, stacks, entries, DEV)
    ids = _ids(256, 2)
    assert o.grouped_plan(0, ids) is None and o.prefill_set(0) is not None
    x = np.random.default_rng(3).standard_normal((ids.shape[0], H)).astype(np.float32)
    y = o.run_slots(0, x, ids, "fast")
    xb = torch.from_numpy(x).to(DEV).to(torch.bfloat16).double()
    err = 0.0
    for e in np.unique(ids):
        rows = np.flatnonzero(ids == e)
        W = {p: o._decode(0, p, int(e)).to(DEV).double() for p in stacks}
        xe = xb[torch.from_numpy(rows).to(DEV)]
        g = torch.clamp(xe @ W["gate"].T, max=10.0)
        h = (g / (1 + torch.exp(-g)) * torch.clamp(xe @ W["up"].T, -10.0, 10.0)).float().bfloat16().double()
        ref = (h @ W["down"].T).cpu().numpy()
        err = max(err, float(np.abs(y[rows] - ref).max() / np.abs(ref).max()))
    assert err < 1e-2, f"{qtype}: {err}"
    record_gpu(test="prefill_ds4", qtype=qtype, rel_err=err)
    o.close()


def test_prefill_replays_from_a_cuda_graph():
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    stacks, entries = _layer("rocmfp4")
    o = _owner(CudaOwner, stacks, entries, DEV)
    ids0, ids1 = _ids(128, 4), _ids(128, 5)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((ids0.shape[0], H)).astype(np.float32)).to(DEV)
    di = torch.from_numpy(ids0).to(DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o.prefill_device(0, x, di)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = o.prefill_device(0, x, di)
    di.copy_(torch.from_numpy(ids1).to(DEV))
    g.replay()
    torch.cuda.synchronize()
    want = o.prefill_device(0, x, torch.from_numpy(ids1).to(DEV))
    assert torch.equal(y, want)
    o.close()


@pytest.mark.parametrize("qtype", PLANE_QTYPES)
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_exact_planes_give_the_definitions_bytes(qtype, tokens):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    stacks, entries = _layer(qtype, seed=7)
    o = _owner(CudaOwner, stacks, entries, DEV)
    o.exact_max_slots = 4096  # 512 tokens (3,072 slots) through the kernels too
    o.exact_grouped_mean = 10 ** 9  # the per-slot kernels (the grouped ones: the next test)
    ids = _ids(tokens, 8)
    assert o.exact_set(0, ids) is not None and o.exact_set(0, ids)[0] == "planes"
    x = np.random.default_rng(9).standard_normal((ids.shape[0], H)).astype(np.float32)
    y = o.run_slots(0, x, ids, "exact")
    assert o.exact_stats["rerun"] == 0
    ref = _owner(TorchOwner, stacks, entries, DEV)
    want = ref.run_slots(0, x, ids, "exact")
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), qtype
    if tokens == 1:
        cpu = _owner(TorchOwner, stacks, entries, "cpu")
        assert np.array_equal(y.view(np.uint32), cpu.run_slots(0, x, ids, "exact").view(np.uint32))
        cpu.close()
    record_gpu(test="exact_planes_ds4", qtype=qtype, tokens=tokens, sha256=sha32(y), stats=dict(o.exact_stats))
    o.close()
    ref.close()


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
@pytest.mark.parametrize("tokens", [64, 2048])
def test_exact_grouped_gives_the_definitions_bytes(qtype, tokens):
    """Prefill-sized exact calls (exact_grouped: bf16 integer dots on the tensor cores, float64
    group terms): the definition's bytes, on the owner's default routing at 2,048 tokens."""
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    stacks, entries = _layer(qtype, seed=8)
    o = _owner(CudaOwner, stacks, entries, DEV)
    if tokens < 512:
        o.exact_grouped_mean = 1
    ids = _ids(tokens, 8)
    assert o.exact_set(0, ids)[0] == "grouped"
    x = np.random.default_rng(10).standard_normal((ids.shape[0], H)).astype(np.float32)
    y = o.run_slots(0, x, ids, "exact")
    assert o.exact_stats["rerun"] == 0
    ref = _owner(TorchOwner, stacks, entries, DEV)
    want = ref.run_slots(0, x, ids, "exact")
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), qtype
    record_gpu(test="exact_grouped_ds4", qtype=qtype, tokens=tokens, sha256=sha32(y), stats=dict(o.exact_stats))
    o.close()
    ref.close()


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_device_layer_replays_from_one_graph(tokens):
    """Routing + routed experts + combine + shared expert as one CUDA graph: a replay on new
    inputs gives the eager call's bytes."""
    from ds4quant.runtime.device_layer import DeviceLayer
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    stacks, entries = _layer("rocmfp2")
    o = _owner(CudaOwner, stacks, entries, DEV)
    r = np.random.default_rng(10)
    gate = torch.from_numpy((r.standard_normal((N_EXP, H)) * 0.02).astype(np.float32))
    shared = tuple(torch.from_numpy((r.standard_normal(s) * 0.02).astype(np.float32)) for s in ((I, H), (I, H), (H, I)))
    dl = DeviceLayer(o, 0, gate, torch.zeros(N_EXP), top_k=TOPK, shared=shared)
    hid = torch.from_numpy(r.standard_normal((tokens, H)).astype(np.float32)).to(DEV)
    g, out = dl.graph(hid)
    new = torch.from_numpy(r.standard_normal((tokens, H)).astype(np.float32)).to(DEV)
    hid.copy_(new)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dl(new))
    o.close()
