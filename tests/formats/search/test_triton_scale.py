"""The Triton tier's scale search (``formats.search.triton_scale``) gives the
numba encoder's bytes for rocmfp2 / rocmfp3 / rocmfp4 / rocmfp4_fast, through
Triton's interpreter on the CPU (a ``Backend(Tier.TRITON, "cpu")``) and
through the compiled kernel on CUDA where present.

- rows of edge values side by side (rows are independent: sigma^2 is per row):
  every distribution of the codec tests at tiny to large scales, exact ties,
  zero and -0 groups, outliers up to 3e38 and FLT_MAX, subnormals, NaN/Inf and
  all-NaN/all-Inf groups, the search rules' rows (all candidates inf, FP2's
  collapsing distances), FP4-grid rows; with no importance, importance with
  zeros, an overflowing and a subnormal weight, and all-zero importance;
- random matrices and importances from the codec tests' generators;
- ``search.measure_scale``'s (nbytes, y): the bits of ``decode(encode(x))``;
- the tier choice: Triton on CUDA (compiled) only by default; ``stats`` only on the torch tier;
- on CUDA, a DS4-like 512 x 2048 matrix per qtype (a fresh process: the
  interpreter tests set TRITON_INTERPRET for this one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.errors import BadInputError
from ds4quant.formats import search
from ds4quant.formats.search import Backend, DeviceKind, Tier
from tests.formats.test_scale_codecs import SETTINGS, importances, matrices

torch = pytest.importorskip("torch")
from ds4quant.formats.search import torch_scale as sst  # noqa: E402
from tests.formats.search.test_torch_scale import _fp4_grid, _numba, measured  # noqa: E402
from tests.runtime._interp import kernels  # noqa: E402

# the interpreter runs the kernel's float32 ops in numpy, which warns where IEEE overflows to inf
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
F = np.float32
NAMES = list(search.SCALE_SEARCHES)
TRITON_CPU = Backend(Tier.TRITON, DeviceKind.CPU)  # the kernel under Triton's interpreter


@pytest.fixture(scope="module")
def tr():
    if torch.cuda.is_available():
        # these run the kernel on torch's CPU device through the interpreter (CI); on a GPU host
        # the compiled kernel is what runs, and test_cuda_ds4_shape_equals_numba checks it
        pytest.skip("interpreter tests: a CPU-only host's (the compiled kernel is tested on CUDA)")
    return kernels("ds4quant.formats.search.triton_scale")


@pytest.fixture
def forced(tr):
    with _forced():
        yield tr


@contextmanager
def _forced():
    """The Triton tier on torch's CPU device (the interpreter)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sst, "search", _never)  # a call that slips through to the torch search fails loudly
        yield


def _never(*a, **k):
    raise AssertionError("the torch search ran instead of the Triton kernel")




def edge_rows(cols=128, seed=0):
    """float32 (rows, cols): one edge case or distribution a row (see the module docstring)."""
    rng = np.random.default_rng(seed)
    dists = [
        lambda: rng.standard_normal(cols), lambda: rng.laplace(size=cols), lambda: rng.standard_t(3, cols),
        lambda: rng.uniform(-1, 1, cols), lambda: rng.integers(-16, 17, cols) / 4.0,  # exact ties
        lambda: rng.standard_normal(cols) * (rng.random(cols) < 0.2), lambda: -np.abs(rng.standard_normal(cols)) ** 2,
    ]
    rows = [d() * 2.0 ** p for d in dists for p in (-30, -3, 10)]
    r = rng.standard_normal(cols)
    r[:16], r[32:48] = 0.0, -0.0  # zero groups
    rows.append(r)
    r = rng.standard_normal(cols)
    r[rng.choice(cols, 12, replace=False)] = [50, -300, 1e6, -1e20, 3e38, 1e-40, 3e38, -3e38, 1e20, 5e37, -1e30, 7]
    rows.append(r)
    rows.append(np.where(rng.random(cols) < 0.5, -1, 1) * F(3.4028235e38) * rng.random(cols))  # near FLT_MAX
    rows.append(np.where(rng.random(cols) < 0.5, -1, 1) * rng.integers(1, 1 << 20, cols) * 2.0 ** -149)  # subnormal
    r = rng.standard_normal(cols) * 1e-38
    r[::3] = 1e-45
    rows.append(r)  # subnormals among small normals
    r = rng.standard_normal(cols)
    r[rng.choice(cols, 6, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, np.inf, -np.inf]
    r[16:32], r[64:80] = np.nan, np.inf  # an all-NaN and an all-Inf group
    rows.append(r)
    r = np.zeros(cols)
    r[3] = 1e20  # every weighted candidate overflows: inf ties -> 1; FP4 never >= FLT_MAX -> 0
    r[40], r[41] = 1e20, 0.5  # FP2: |x/S| >= 2^24, the distances tie
    rows.append(r)
    x = np.stack(rows).astype(F)
    return np.concatenate([x, _fp4_grid(rng, 2, cols)])


def edge_importances(cols=128, seed=1):
    rng = np.random.default_rng(seed)
    q = np.exp(1.5 * rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.1] = 0
    q[5], q[6], q[7] = F(3e38), F(1e-42), 0  # overflowing weights -> FLT_MAX; a subnormal q
    return [None, q, np.zeros(cols, F)]


@pytest.mark.parametrize("name", NAMES)
def test_edge_rows_equal_numba(forced, name):
    x = edge_rows()
    for imp in edge_importances():
        got = search.encode_scale(name, x, imp, TRITON_CPU, nonfinite="reference")
        want = _numba(name, x, imp)
        bad = np.argwhere(np.any(got != want, axis=1)).ravel()
        assert not bad.size, (name, imp is None, "rows", bad)


@pytest.mark.parametrize("name", NAMES)
@settings(SETTINGS, max_examples=4)
@given(data=st.data())
def test_random_matrices_equal_numba(tr, name, data):
    x = data.draw(matrices(nonfinite=True))
    imp = data.draw(importances(x.shape[1]))
    with _forced():
        got = search.encode_scale(name, x, imp, TRITON_CPU, nonfinite="reference")
    assert np.array_equal(got, _numba(name, x, imp))


@pytest.mark.parametrize("name", NAMES)
def test_measure_scale_gives_the_decoded_bits(forced, name):
    rng = np.random.default_rng(2)
    x = np.concatenate([(0.05 * rng.standard_t(3, (6, 64))).astype(F), _fp4_grid(rng, 2, 64)])
    x[0, 5], x[1, :16] = 3e38, 0.0
    q = np.exp(rng.standard_normal(64)).astype(F)
    for imp in (q, None):
        data = formats.encode(name, x, imp)
        nbytes, y = measured(name, x, imp, TRITON_CPU)
        assert nbytes == data.nbytes
        assert np.array_equal(y.view(np.uint32), formats.decode(name, data, 64).view(np.uint32))


def test_the_tier_choice(tr):
    assert Backend.for_device("cpu").tier is Tier.TORCH
    # the interpreter never on a GPU by default (these tests run under it)
    assert Backend.for_device("cuda").tier is (Tier.TORCH if tr.INTERPRETED else Tier.TRITON)
    with pytest.raises(BadInputError, match="torch tier"):  # the window proofs' counts are the torch search's
        search.encode_scale("rocmfp2", np.ones((1, 64), F), None, TRITON_CPU, stats={})
    x = np.ones((1, 32), F)
    assert search.encode_scale("rocmfp4_fast", x, None, TRITON_CPU).tobytes() == \
        formats.encode("rocmfp4_fast", x).tobytes()
    assert search.encode_scale("rocmfp2", np.zeros((0, 64), F), None, TRITON_CPU).shape == (0, 20)


# --------------------------------------------------------------------------
# the compiled kernel (a fresh process without TRITON_INTERPRET)


def _fresh(code, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=timeout)


def test_sm90_ptx_has_only_ieee_float32_ops(tr):
    """Triton's real code generator for sm_90, no GPU needed: no fused multiply-add,
    no flush-to-zero, no approximate op; the square root is sqrt.rn."""
    r = _fresh("from tests.formats.search.test_triton_scale import ptx_ops; ptx_ops()", 600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for line in r.stdout.split("\n")[-3:-1]:
        variant, ops = line.split(":")
        ops = set(ops.split())
        assert not {o for o in ops if "fma" in o or "ftz" in o or "approx" in o}, (variant, ops)
        assert {"mul.rn.f32", "add.rn.f32", "sub.rn.f32", "sqrt.rn.f32"} <= ops, (variant, ops)


def ptx_ops():
    """Print the float32 / conversion / math ops of the sm_90 PTX of FP2 per 16 and FP4 per 32
    with importance, as the launch compiles them (``LAUNCH``)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from ds4quant.formats.search import triton_scale as tr

    assert not tr.INTERPRETED
    names = list(tr._search_kernel.arg_names)
    for fmt, g in ((0, 16), (4, 32)):
        const = dict(FMT=fmt, G=g, HAS_Q=True, INIT_BITS=0x7F800000, INIT_BYTE=127, CODES=True, DECODE=True,
                     BLOCK=tr.BLOCK)
        sig = {n: "constexpr" if n in const else
               {"e_ptr": "*i32", "c_ptr": "*u8"}.get(n, "*fp32") if n.endswith("_ptr") else "i32" for n in names}
        src = ASTSource(fn=tr._search_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
        k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tr.NUM_WARPS, **tr.LAUNCH))
        ops = set(re.findall(r"\b(?:fma|mul|add|sub|sqrt|div|rcp|rsqrt|abs|max|min|neg|ex2|lg2|cvt)[.a-z0-9]*",
                             k.asm["ptx"]))
        print(f"fmt{fmt}/{g}: " + " ".join(sorted(o for o in ops if "f32" in o or "ftz" in o or "approx" in o)))


# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_ds4_shape_equals_numba():
    r = _fresh("from tests.formats.search.test_triton_scale import cuda_main; cuda_main()", 900)
    sys.stdout.write(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def cuda_main(rows=512, cols=2048):
    """Every qtype at a DS4-like shape on the GPU against numba; prints the kernel's time."""
    import time

    from ds4quant.formats.search import triton_scale as tr

    cuda = Backend.for_device("cuda")
    assert not tr.INTERPRETED and cuda.tier is Tier.TRITON
    rng = np.random.default_rng(7)
    x = _fp4_grid(rng, rows, cols)
    x[: rows // 4] = (0.02 * rng.standard_t(3, (rows // 4, cols))).astype(F)
    e = edge_rows(cols, seed=3)
    x[rows // 4: rows // 4 + e.shape[0]] = e
    q = np.exp(rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.05] = 0
    q[11] = F(3e38)
    for name in NAMES:
        for imp in (q, None):
            want = _numba(name, x, imp)
            got = search.encode_scale(name, x, imp, cuda, nonfinite="reference")
            bad = np.argwhere(np.any(got != want, axis=1)).ravel()
            assert not bad.size, (name, imp is None, "rows", bad[:20])
            xf = np.where(np.isfinite(x), x, 0).astype(F)
            nbytes, y = measured(name, xf, imp, cuda)
            ref = formats.decode(name, formats.encode(name, xf, imp), cols)
            assert nbytes == want.nbytes and np.array_equal(y.view(np.uint32), ref.view(np.uint32)), name
            fmt, group = search.SCALE_SEARCHES[name]
            X = torch.from_numpy(xf).cuda()
            Q = torch.from_numpy(imp).cuda() if imp is not None else None
            s2 = torch.from_numpy(search.row_energies(xf)).cuda()
            tr.search(fmt, group, X, Q, s2, codes=False, decode=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                tr.search(fmt, group, X, Q, s2, codes=False, decode=True)
            torch.cuda.synchronize()
            print(f"{name} imp={imp is not None}: {(time.perf_counter() - t) / 10 * 1e3:.3f} ms per {rows}x{cols}")
