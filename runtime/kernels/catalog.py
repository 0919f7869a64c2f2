"""Every Triton kernel the runtime and the measure stage launch, with the
specialisations they launch (qtypes, tiles, constexprs): the list the
ahead-of-time compile check (``runtime/kernels/aot.py``, ``tests/aot``) compiles
for the HIP and CUDA targets users run.

The specialisations are not written out by hand: each catalogue entry names
scenarios that call the public launch wrappers (``moe_triton.linear``,
``gemv_triton.gemv``, ``exact_triton.quantize``, ``triton_scale.search``, ...)
with the settings the owners and the measure stage use, on small CPU tensors of
the right dtypes. ``capture`` runs them with Triton's launcher replaced by a
recorder, so a launch's signature and constexprs are exactly what the wrapper
passes. A wrapper that gains a constexpr or a tile therefore changes the
compiled set by itself. ``tests/aot`` fails when a ``@triton.jit`` function of
the package is neither a catalogued kernel nor called by one.

``Rules`` marks the kernels that promise the CPU's bits: their generated code
is inspected (``asm_rules``) for contracted multiply-adds and approximate
division, square root or exponential where their definition forbids them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

#: (backend, arch, warp size) of every target the check compiles for: the AMD GPUs users
#: run (Strix Halo, RX 7900, R9700, MI300) and NVIDIA sm_86 / sm_89 / sm_90
TARGETS = (("hip", "gfx1151", 32), ("hip", "gfx1100", 32), ("hip", "gfx1201", 32), ("hip", "gfx942", 64),
           ("cuda", 86, 32), ("cuda", 89, 32), ("cuda", 90, 32))


def target_name(t) -> str:
    return f"{t[0]}:{t[1]}"


@dataclass(frozen=True)
class Rules:
    """What a kernel's generated code may not contain (``asm_rules``)."""

    no_fma: bool = False  # no contracted multiply-add on floats
    no_approx: bool = False  # no approximate division / square root / exponential


FAST = Rules()
BITS = Rules(no_fma=True, no_approx=True)  # one IEEE operation at a time
NO_APPROX = Rules(no_approx=True)  # exact sums that any fusing keeps exact; no approximations


@dataclass(frozen=True)
class Spec:
    """One launch specialisation: what ``triton.compile`` needs besides the target."""

    module: str
    kernel: str
    signature: tuple  # ((argument, Triton type or "constexpr"), ...)
    constexprs: tuple  # ((argument, value), ...)
    options: tuple  # ((launch option, value), ...): num_warps, enable_fp_fusion, ...
    rules: Rules
    scenario: str
    backends: tuple = ("cuda", "hip")  # the targets a launch with these settings is made for

    @property
    def key(self) -> tuple:
        return (self.module, self.kernel, self.signature, self.constexprs, self.options)

    @property
    def label(self) -> str:
        c = ",".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}[{c}]"


@dataclass(frozen=True)
class Entry:
    module: str
    kernel: str
    rules: Rules
    scenarios: tuple = field(default=())  # names of scenario functions below


_TORCH_TYPES = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "uint8": "u8",
                "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1"}


def _arg_type(v) -> str:
    if hasattr(v, "dtype") and hasattr(v, "data_ptr"):
        return "*" + _TORCH_TYPES[str(v.dtype).replace("torch.", "")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(1 << 31) <= v < (1 << 31) else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for a kernel argument {type(v).__name__}")


_BACKENDS = [("cuda", "hip")]  # the backends the launches being recorded are made for


@contextmanager
def _only(*backends: str):
    """Launches inside are made for these backends only (settings that differ per backend)."""
    _BACKENDS.append(tuple(backends))
    try:
        yield
    finally:
        _BACKENDS.pop()


@contextmanager
def _recording(out: list):
    """Triton's launcher replaced by a recorder of (kernel, arguments, options)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("capture needs compiled kernels: run without TRITON_INTERPRET")
    from triton.runtime.jit import JITFunction

    orig = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        out.append((self, args, kwargs, _BACKENDS[-1]))
        return None

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = orig


def _spec(fn, args, kwargs, rules: Rules, scenario: str, backends: tuple) -> Spec:
    names = list(fn.arg_names)
    const_names = {p.name for p in fn.params if p.is_constexpr}
    values = dict(zip(names, args))
    options = {}
    for k, v in kwargs.items():
        if k in names:
            values[k] = v
        else:
            options[k] = v
    sig, const = [], []
    for n in names:
        if n in const_names:
            sig.append((n, "constexpr"))
            const.append((n, values[n]))
        else:
            sig.append((n, _arg_type(values[n])))
    return Spec(fn.__module__, fn.__name__, tuple(sig), tuple(const), tuple(sorted(options.items())), rules,
                scenario, backends)


# -- scenarios: the launches the owners and the measure stage make -----------

def _torch():
    import torch

    return torch


def _fake_planes(fmt, E: int, N: int, K: int):
    """A stack's kernel planes (moe_triton / prefill_triton / exact_planes) of the right dtypes."""
    torch = _torch()
    u8 = torch.uint8
    return dict(a=torch.zeros((E, N, K * fmt.abits // 8), dtype=u8),
                b=torch.zeros((E, N, K * fmt.bbits // 8), dtype=u8) if fmt.has_b else None,
                s=torch.zeros((E, N, K // fmt.group), dtype=u8),
                o=torch.zeros((E, N, K // fmt.group), dtype=u8) if fmt.affine else None,
                slut=torch.zeros(256, dtype=torch.float32), llut=torch.zeros((2 * E, fmt.nlev), dtype=torch.float32),
                tab=torch.arange(0, 2 * E, 2, dtype=torch.int32), fmt=fmt)


def _fake_exact(fmt, E: int, N: int, K: int, n: int):
    """(planes with integer level tables, q, s): an exact kernel's stack and quantized input."""
    torch = _torch()
    p = _fake_planes(fmt, E, N, K)
    p["ilut"] = torch.zeros((2 * E, fmt.nlev), dtype=torch.float32)
    p["ishift"] = torch.zeros(2 * E, dtype=torch.int32)
    return p, torch.zeros((n, K)), torch.zeros((n, K // 32), dtype=torch.int32)


def _owner_defaults():
    """A CUDA owner's settings (tiles, tokens per program) as constructed, on the CPU device."""
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    return CudaOwner("cpu", identity="torch-cpu:0")


def scenario_moe_linear():
    """``CudaOwner.launch``: gate + up fused (and apart, when two formats differ) and down,
    at the matrix-vector tile (bt 1 and ``MV_TOKENS`` slots a group) and the tl.dot tile (the owner's bt)."""
    torch = _torch()
    from ds4quant.runtime.kernels import layout, moe_triton

    o = _owner_defaults()
    E, H, inter, n = 2, 512, 256, 4
    for q in layout.KERNEL_QTYPES:
        f = layout.kernel_format(q)
        gu, d = _fake_planes(f, E, inter, H), _fake_planes(f, E, H, inter)
        x = torch.zeros((n, H))
        h = torch.zeros((n, inter))
        y = torch.zeros((n, H))
        g = torch.zeros((1, 3), dtype=torch.int32)
        for bt in (1, moe_triton.MV_TOKENS, o.bt):
            bn, nw, bk = o.tile.get(bt, (0, 0, 0))
            for backend, prec in layout.DOT_PREC.items():  # the owner's precision on each backend
                kw = dict(bt=bt, prec=prec, bn=bn, num_warps=nw, bk=bk)
                with _only(backend):
                    moe_triton.linear(f, x, g, gu, h, w2=gu, limit=10.0, **kw)
                    moe_triton.linear(f, x, g, gu, h, **kw)
                    moe_triton.linear(f, h, g, d, y, **kw)


def _linear_planes(qtype: str, E: int, N: int, K: int):
    torch = _torch()
    from ds4quant.runtime.kernels import layout

    f = layout.kernel_format(qtype)
    p = _fake_planes(f, E, N, K)
    slut = torch.from_numpy(layout.scale_lut(qtype))
    return layout.linear_planes(qtype, p["a"], p["b"], p["s"], slut)


def scenario_gemv():
    """``CudaOwner.gemv_device`` (decode step) and ``grouped_device`` at the owner's tiles."""
    torch = _torch()
    from ds4quant.runtime.kernels import gemv_triton as gk
    from ds4quant.runtime.kernels import layout

    o = _owner_defaults()
    gemv_tile, group_tile = o.gemv_tile, o.group_tile
    E, H, inter, n = 2, 512, 256, 2
    for q in layout.LINEAR_QTYPES:
        lg, ld = _linear_planes(q, E, inter, H), _linear_planes(q, E, H, inter)
        xT = torch.zeros((n, 16, H // 16))
        hT = torch.zeros((n, 16, inter // 16))
        y = torch.zeros((n, H))
        ids = torch.zeros(n, dtype=torch.int64)
        groups = torch.zeros((1, 3), dtype=torch.int32)
        for tiles, grouped in ((gemv_tile, False), (group_tile, True)):
            kw = dict(groups=groups, tb=o.group_tb) if grouped else {}
            bn, bw, nw, ns, pre, sd = tiles["gu"]
            gk.gemv(lg, xT, ids, ids, hT, lp2=lg, limit=10.0, out_t=True, bn=bn, bw=bw, num_warps=nw,
                    num_stages=ns, pre=pre, sdec=sd, **kw)
            bn, bw, nw, ns, pre, sd = tiles["down"]
            gk.gemv(ld, hT, ids, ids, y, bn=bn, bw=bw, num_warps=nw, num_stages=ns, pre=pre, sdec=sd, **kw)


def scenario_exact_words():
    """``ExactKernelsMixin.exact_device`` / ``exact_patched`` on the word layout."""
    torch = _torch()
    from ds4quant.runtime.kernels import exact_triton as ek
    from ds4quant.runtime.kernels import layout

    tile = _owner_defaults().exact_tile
    E, H, inter, n = 2, 512, 256, 2
    x = torch.zeros((n, H))
    bad = torch.zeros(1, dtype=torch.int32)
    ids = torch.zeros(n, dtype=torch.int64)
    ek.quantize(x, bad)
    g = torch.zeros((n, inter))
    ek.swiglu_quantize(g, g, 10.0, bad)
    ek.swiglu_quantize(g, g, 10.0, bad, h=g)
    for q in layout.LINEAR_QTYPES:
        lg, ld = _linear_planes(q, E, inter, H), _linear_planes(q, E, H, inter)
        qx = torch.zeros((n, 16, H // 16))
        sx = torch.zeros((n, H // 32), dtype=torch.int32)
        qh = torch.zeros((n, 16, inter // 16))
        sh = torch.zeros((n, inter // 32), dtype=torch.int32)
        for flags in (False, True):
            bn, bw, nw, pre = tile["gu"]
            ek.gemv_exact(lg, qx, sx, ids, ids, bad, lp2=lg, bn=bn, bw=bw, num_warps=nw, pre=pre, flags=flags)
            bn, bw, nw, pre = tile["down"]
            ek.gemv_exact(ld, qh, sh, ids, ids, bad, bn=bn, bw=bw, num_warps=nw, pre=pre, flags=flags)


def scenario_prefill():
    """``CudaOwner.prefill_device``: the tensor-core grouped GEMM, gate + up fused and apart, and down."""
    torch = _torch()
    from ds4quant.runtime.kernels import layout, prefill_triton as pk

    o = _owner_defaults()
    E, H, inter, n = 2, 512, 256, 8
    for q in layout.KERNEL_QTYPES:
        f = layout.kernel_format(q)
        gu, d = _fake_planes(f, E, inter, H), _fake_planes(f, E, H, inter)
        ids = torch.zeros(n, dtype=torch.int64)
        x = torch.zeros((n, H))
        # the row tile DS4's 2048-token prefill picks (pick_bm: 48 slots an expert -> 64) for every
        # qtype, the others for one
        # the owner's tiles: rocmfp2 / rocmfp3 layers take prefill_tile_linear
        tiles = o.prefill_tile_linear if q in layout.LINEAR_QTYPES else o.prefill_tile
        for bm in pk.BM_CHOICES if q == "rocmfp2" else (64,):
            plan = pk.sort_slots(ids, ids, E, n, bm=bm)
            for split in pk.split_variants(q):
                kw = pk.tile_kw(tiles["gu"])
                h = pk.grouped(f, x, plan, gu, w2=gu, limit=10.0, split=split, out_dtype=torch.bfloat16, **kw)
                pk.grouped(f, x, plan, gu, split=split, **kw)
                pk.grouped(f, h, plan, d, scatter=True, split=split, **pk.tile_kw(tiles["down"]))


def scenario_exact_planes():
    """``ExactKernelsMixin`` on the plane layout (every kernel qtype)."""
    torch = _torch()
    from ds4quant.runtime.kernels import exact_planes as xp
    from ds4quant.runtime.kernels import layout

    E, H, inter, n = 2, 512, 256, 2
    bad = torch.zeros(1, dtype=torch.int32)
    ids = torch.zeros(n, dtype=torch.int64)
    for q in layout.KERNEL_QTYPES:
        f = layout.kernel_format(q)
        p, qx, sx = _fake_exact(f, E, inter, H, n)
        tile = _owner_defaults().exact_planes_tile
        for wide in ((False, True) if f.mix else (False,)):
            p["wide"] = wide
            for flags in (False, True):
                xp.product(f, p, qx, sx, ids, ids, bad, flags=flags, bn=tile[0], bk=tile[1], num_warps=tile[2])


def scenario_exact_grouped():
    """``ExactKernelsMixin`` on prefill-sized calls (every kernel qtype, the owner's tile)."""
    torch = _torch()
    from ds4quant.runtime.kernels import exact_grouped as xg
    from ds4quant.runtime.kernels import layout, prefill_triton as pk

    E, H, inter, n = 2, 512, 256, 8
    bad = torch.zeros(1, dtype=torch.int32)
    ids = torch.zeros(n, dtype=torch.int64)
    bn, nw, ns = _owner_defaults().exact_grouped_tile
    for q in layout.KERNEL_QTYPES:
        f = layout.kernel_format(q)
        p, qx, sx = _fake_exact(f, E, inter, H, n)
        p["gbits"] = xg.part_bits(f.group)
        p["gtop"] = torch.zeros(2 * E, dtype=torch.int32)
        # the row tile of DS4's 2048-token prefill (48 slots an expert -> 64) for every qtype;
        # MIX books that span many octaves take two or three level slices
        for bm in pk.BM_CHOICES if q == "rocmfp2" else (64,):
            plan = pk.sort_slots(ids, ids, E, n, bm=bm)
            for splits in range(1, xg.MAX_SPLITS + 1) if f.mix else (1,):
                p["gparts"] = torch.zeros((splits, 2 * E, f.nlev), dtype=torch.float32)
                for flags in (False, True):
                    xg.product(f, p, qx, sx, plan, bad, flags=flags, bn=bn, num_warps=nw, num_stages=ns)


def scenario_search_scale():
    """The measure stage's scale search (``formats.search.search_scale`` / ``measure_scale``)."""
    torch = _torch()
    from ds4quant.formats.search import triton_scale
    from ds4quant.formats.search.tables import FP2, FP3, FP4

    x = torch.zeros((2, 64))
    q = torch.ones(64)
    s2 = torch.ones(2)
    for fmt, group in ((FP2, 16), (FP3, 16), (FP4, 16), (FP4, 32)):
        for qq in (None, q):
            triton_scale.search(fmt, group, x, qq, s2)
            triton_scale.search(fmt, group, x, qq, s2, codes=False, decode=True)


def scenario_search_mix():
    """The MIX searches, the fitter's error terms (``formats.search.choose_mix`` / ``mix_error_on_device``)."""
    import numpy as np

    torch = _torch()
    from ds4quant.formats.search import triton_mix

    X = torch.zeros((2, 4, 16))
    W = torch.ones((1, 4, 16))
    for bits in (2, 3):
        L = 4 if bits == 2 else 8
        books = np.tile(np.arange(L, dtype=np.float32) - L // 2, (2, 1))
        for mode in (0, 1):
            for w in (None, W):
                ch = triton_mix.search_device(X, w, books, mode, bits)
                triton_mix.terms_device(X, w, books, mode, bits, ch)


def scenario_sums():
    """The measure stage's float64 sums (``error_sums_on_device``, ``pairwise_total``) and
    calibrate's column sums of squares (``column_square_sums``)."""
    torch = _torch()
    from ds4quant.formats.search import triton_sums

    x = torch.zeros((4, 64))
    part = torch.zeros((4, 8), dtype=torch.float64)
    w = torch.ones(64, dtype=torch.float64)
    for ww in (None, w):
        triton_sums._launch(triton_sums._row_sums_kernel, (1,), x, x, ww if ww is not None else part, part, 4, 64,
                            HAS_W=ww is not None, BLOCK=triton_sums.ROWS_PER_PROGRAM)
    t = torch.zeros(1024, dtype=torch.float64)
    lo = torch.zeros(8, dtype=torch.int64)
    out = torch.zeros(8, dtype=torch.float64)
    triton_sums._launch(triton_sums._leaves_kernel, (1,), t, lo, lo, out, 8, BLOCK=triton_sums.LEAVES_PER_PROGRAM)
    triton_sums._launch(triton_sums._column_sq_kernel, (1,), x, t, 4, 64, BLOCK=triton_sums.COLUMNS_PER_PROGRAM)


SCENARIOS: dict[str, Callable[[], None]] = {
    "moe_linear": scenario_moe_linear,
    "gemv": scenario_gemv,
    "exact_words": scenario_exact_words,
    "prefill": scenario_prefill,
    "exact_planes": scenario_exact_planes,
    "exact_grouped": scenario_exact_grouped,
    "search_scale": scenario_search_scale,
    "search_mix": scenario_search_mix,
    "sums": scenario_sums,
}

_R = "ds4quant.runtime.kernels."
_S = "ds4quant.formats.search."

#: every launched kernel: (module, kernel, rules, the scenarios that launch it)
CATALOG = (
    Entry(_R + "moe_triton", "_moe_linear_kernel", FAST, ("moe_linear",)),
    Entry(_R + "gemv_triton", "_gemv_kernel", FAST, ("gemv",)),
    Entry(_R + "exact_triton", "_gemv_exact_kernel", NO_APPROX, ("exact_words",)),
    Entry(_R + "exact_triton", "_quant_kernel", BITS, ("exact_words",)),
    Entry(_R + "exact_triton", "_swiglu_quant_kernel", BITS, ("exact_words",)),
    Entry(_R + "prefill_triton", "_prefill_kernel", FAST, ("prefill",)),
    Entry(_R + "exact_planes", "_planes_exact_kernel", NO_APPROX, ("exact_planes",)),
    Entry(_R + "exact_grouped", "_grouped_exact_kernel", NO_APPROX, ("exact_grouped",)),
    Entry(_S + "triton_scale", "_search_kernel", BITS, ("search_scale",)),
    Entry(_S + "triton_mix", "_books_kernel", BITS, ("search_mix",)),
    Entry(_S + "triton_mix", "_fixed_kernel", BITS, ("search_mix",)),
    Entry(_S + "triton_mix", "_terms_kernel", BITS, ("search_mix",)),
    Entry(_S + "triton_sums", "_row_sums_kernel", BITS, ("sums",)),
    Entry(_S + "triton_sums", "_leaves_kernel", BITS, ("sums",)),
    Entry(_S + "triton_sums", "_column_sq_kernel", BITS, ("sums",)),
)


def capture(scenarios=None) -> list:
    """The specialisations the scenarios launch (deduplicated, in launch order).
    Raises when a scenario launches a kernel the catalogue does not list."""
    rules = {(e.module, e.kernel): e.rules for e in CATALOG}
    names = list(SCENARIOS) if scenarios is None else list(scenarios)
    specs: dict = {}
    for name in names:
        calls: list = []
        with _recording(calls):
            SCENARIOS[name]()
        for fn, args, kwargs, backends in calls:
            key = (fn.__module__, fn.__name__)
            if key not in rules:
                raise LookupError(f"scenario {name} launches {key[0]}.{key[1]}, which the catalogue does not list")
            sp = _spec(fn, args, kwargs, rules[key], name, backends)
            if sp.key in specs:  # the same launch made for more backends
                old = specs[sp.key]
                sp = replace(old, backends=tuple(dict.fromkeys(old.backends + backends)))
            specs[sp.key] = sp
    return list(specs.values())
