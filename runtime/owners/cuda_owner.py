"""CudaOwner: routed experts on one CUDA (or ROCm) device, fast mode through
the Triton kernels of ``runtime.kernels``.

* exact mode gives the CPU owner's bytes: on layers the decode-step kernels
  cover (below) through ``kernels.exact_triton`` (``owners/cuda_exact``: the
  definition's exact sums and float64 SwiGLU in four launches, a CUDA graph
  per (layer, slots)); elsewhere, and for a call those kernels flag, it is
  ``TorchOwner``'s: ``formats.decode_torch`` of the artifact bytes, then
  ``torch_exact`` (docs/exact-mode.md's definition in integer /
  single-rounding torch ops).
* fast mode repacks every resident stack once at load
  (``kernels.layout.repack``: code planes + scale bytes, and offset bytes
  for rocmfp2_affine, the runtime's own layout; the artifact bytes stay
  resident for exact mode and ``held_bytes``) for every qtype of
  ``kernels.layout.KERNEL_QTYPES`` (every ROCmFPX qtype, rocmfp6 and
  rocmfp2_affine included, MIX 105/106 and mxfp4) and runs two launches
  per call and layer: gate + up of all the selected experts with SwiGLU
  fused, then down; slots sorted by expert, up to ``bt`` tokens of one
  expert per program (``tl.dot``) when experts have several slots each,
  a matrix-vector tile for up to ``moe_triton.MV_TOKENS`` slots of one
  expert when they have few (at most that many on average).
* prefill (experts with more than ``group_max_mean`` slots each on average,
  or any expert with several slots on a layer without word-layout kernels;
  one stack per projection: ``prefill_wanted``): the
  tensor-core grouped GEMMs of ``kernels.prefill_triton`` (``owners/cuda_prefill``):
  bf16 weight tiles decoded in registers, the slot sort on the device, no
  host planning; other layers keep the float32 ``tl.dot`` kernels.
* MIX (105/106) stacks decode with the books registered in this owner's
  registry, copied to the device on first use (and again after a
  re-registration); an unregistered tensor raises ``UnregisteredTableError``.
* decode steps (at most ``gemv_max_slots`` slots, one stack per projection,
  rocmfp2 / rocmfp3: ``layout.LINEAR_QTYPES``) run ``kernels.gemv_triton``
  instead: no sort and no host planning, the slot -> local expert lookup on
  the device, both launches captured once per (layer, slots) in a CUDA graph
  and replayed (``graphs=False``: eager launches).
* larger batches on such a layer whose experts see few tokens each (at most
  ``group_max_mean`` on average) run gemv_triton's grouped form: slots
  sorted by expert on the host, one program decodes an expert's weight tile
  once for up to ``group_tb`` of its tokens (a grouped matrix-vector
  product); a token's arithmetic is the decode step's, so its bits do not
  depend on the batch. Busier experts (prefill) take the tl.dot kernels.
* inputs and outputs go through pinned host buffers; the input copy runs on
  a copy stream, the compute stream waits for it on a CUDA event, the caller
  waits on the output's event (never a device-wide synchronize).
  ``run_slots_staged`` fires the overlap readiness signal as soon as that copy
  is enqueued (runtime/overlap.py). Rows already on the device take
  ``run_slots_device`` (``owners/cuda_device``): the same paths, no staging.
* qtypes outside ``kernels.layout.KERNEL_QTYPES`` (q8_0, bf16, f16, f32),
  or a call whose experts need them, run TorchOwner's fast path
  (decode_torch + matmul) for the whole call.

    o = CudaOwner("cuda:0")
    rt = runtime.load(art, placement={L: {"cuda:0": ids}}, owners={"cuda:0": o}, mode="fast")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ds4quant.errors import BadInputError, MissingDependencyError, ShapeError
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.base import ExpertStack, distinct
from ds4quant.runtime.owners.cuda_device import DeviceSlotsMixin, PinnedIds
from ds4quant.runtime.owners.cuda_exact import ExactKernelsMixin
from ds4quant.runtime.owners.cuda_prefill import PrefillMixin
from ds4quant.runtime.owners.torch_owner import DEFAULT_SWIGLU_LIMIT, TorchOwner
from ds4quant.runtime.swiglu import swiglu_fast

PROJS = ("gate", "up", "down")


def owner_for(name, *, identity: str, **options) -> "CudaOwner":
    """The owner of a ``cuda:N`` or ``hip:N`` name (``owners/kinds.py``'s registry):
    device N (torch names a ROCm device ``cuda`` too)."""
    return CudaOwner(f"cuda:{name.index or 0}", identity=identity, **options)


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """One call's launches, ready to replay (CUDA graphs): per combination of
    (gate, up, down) stacks, the group tables of each stage.

    order: int64 device tensor, sorted slot -> original slot; stages: tuple of
    (fmt_gu, planes_gate, planes_up, groups_gu, fmt_d, planes_down, groups_d, first, count, dual)."""

    order: object
    n: int
    bt: int
    stages: tuple


def group_t(x: np.ndarray) -> np.ndarray:
    """float32 (n, H) -> (n, 16, H / 16) with [s, c, j] = x[s, 16 j + c] (the decode-step layout)."""
    n, H = x.shape
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(n, H // 16, 16).transpose(0, 2, 1))


def _need_triton():
    try:
        from ds4quant.runtime.kernels import moe_triton
    except ImportError as exc:  # the owner is usable for exact mode without it
        raise MissingDependencyError("the CUDA owner's fast path needs triton (pip install triton)") from exc
    return moe_triton


class CudaOwner(DeviceSlotsMixin, ExactKernelsMixin, PrefillMixin, TorchOwner):
    """Owner protocol on a CUDA/ROCm device; see the module docstring."""

    def __init__(self, device: str = "cuda:0", identity: Optional[str] = None,
                 swiglu_limit: float = DEFAULT_SWIGLU_LIMIT, bt: int = 16, prec: Optional[str] = None,
                 graphs: bool = True, gemv_max_slots: int = 16, exact_kernels: bool = True,
                 prefill: bool = True):
        super().__init__(device, identity=identity, swiglu_limit=swiglu_limit)
        self._exact_init(exact_kernels)
        self._prefill_init(prefill)
        self.graphs = bool(graphs)
        self.gemv_max_slots = int(gemv_max_slots)
        # decode-step kernel tiles: stage ("gu" / "down") -> (rows per program, words per step,
        # warps, pipeline stages, prefetch, scales computed rather than gathered)
        # (measured on an H200: docs/performance.md#runtime-gpu-step)
        self.gemv_tile: dict[str, tuple] = {"gu": (8, 64, 4, 1, True, True), "down": (16, 64, 8, 1, True, True)}
        # the grouped form's tiles (same fields) and tokens per program (batch 64 on the H200:
        # tb 2 at (8, 32, 2) with computed scales, 1.68 ms; tb 4 lost at 64 and led at 2048 tokens)
        self.group_tile: dict[str, tuple] = {"gu": (8, 32, 2, 1, True, True), "down": (8, 32, 2, 1, True, True)}
        self.group_tb = 2
        self.group_max_mean = 8.0
        self._gemv: dict[int, object] = {}  # layer -> (gate, up, down planes, loc) or None
        self._graph_cache: dict[tuple[int, int], tuple] = {}
        self._pinned: dict[str, object] = {}
        self._streams = None
        if bt not in (16, 32, 64):
            raise BadInputError(f"bt (tokens of one expert per program) must be 16, 32 or 64, got {bt}")
        self.bt = int(bt)
        # the tl.dot tiles' input precision: the backend's (layout.DOT_PREC) unless given
        self.prec = prec or self._dot_prec()
        # launch shape (rows, warps, columns per step) per tokens-per-program
        # (1: matrix-vector tile, bt: tl.dot); 0 = the kernel default
        self.tile: dict[int, tuple[int, int, int]] = {}
        self._planes: dict[str, dict] = {}  # tensor -> planes of that stack

    def _dot_prec(self) -> str:
        from ds4quant.runtime.kernels import layout

        return layout.dot_prec() if self.device.type == "cuda" else layout.DOT_PREC["cuda"]

    # -- residency -------------------------------------------------------
    def add_stack(self, stack: ExpertStack) -> None:
        import torch
        from ds4quant.runtime.kernels import layout

        super().add_stack(stack)
        fmt = layout.kernel_format(stack.qtype)
        if fmt is None:
            return
        if self.device.type == "cpu":  # the CPU device (tests): the planes need a tensor of the bytes
            dev = torch.from_numpy(np.ascontiguousarray(stack.data))
        else:
            dev = self._where[(stack.layer, str(stack.proj))][stack.expert_ids[0]][2]
        a, b, s, off = layout.repack(stack.qtype, dev, stack.cols)
        p = dict(fmt=fmt, stack=stack, a=a, b=b, s=s, o=off,
                 slut=torch.from_numpy(layout.scale_lut(stack.qtype)).to(self.device),
                 llut=None, tab=torch.zeros(1, dtype=torch.int32, device=self.device), books=None)
        if stack.qtype in layout.LINEAR_QTYPES:
            p["lin"] = layout.linear_planes(stack.qtype, a, b, s, p["slut"])
        self._gemv.pop(stack.layer, None)
        self._prefill_reset(stack.layer)
        self._graph_cache = {k: v for k, v in self._graph_cache.items() if k[0] != stack.layer}
        if not fmt.mix:
            p["llut"] = torch.from_numpy(layout.level_lut(stack.qtype)).to(self.device)
        else:
            p["tab"] = torch.arange(0, 2 * stack.n_experts, 2, dtype=torch.int32, device=self.device)
        self._planes[stack.tensor] = p

    def resident_bytes(self) -> int:
        extra = sum(int(p["a"].nbytes + p["s"].nbytes + sum(p[k].nbytes for k in "bo" if p[k] is not None))
                    for p in self._planes.values())
        extra += sum(int(p["lin"].a.nbytes + p["lin"].a2.nbytes) for p in self._planes.values()
                     if "lin" in p and p["lin"].a2 is not None)
        return super().resident_bytes() + extra

    def close(self) -> None:
        super().close()
        self._planes.clear()
        self._gemv.clear()
        self._prefill.clear()
        self._graph_cache.clear()
        self._pinned.clear()

    def _mix_levels(self, p) -> None:
        """The stack's registered books on the device (raises when unregistered)."""
        import torch
        from ds4quant.runtime.kernels import layout

        st = p["stack"]
        books, modes = self.registry.lookup(self.identity, st.tensor)
        if p["books"] is not books:  # first use or re-registered
            p["llut"] = torch.from_numpy(layout.level_lut(st.qtype, books, modes)).to(self.device)
            p["books"] = books

    # -- planning --------------------------------------------------------
    def plan(self, layer: int, expert_ids) -> Optional[LaunchPlan]:
        """The launches for slots routed to ``expert_ids`` (int64 (n,)), or None
        when some selected expert's stack has no kernel layout (fallback)."""
        import torch

        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        n = int(ids.shape[0])
        uniq = np.unique(ids)
        combos: dict[tuple, int] = {}
        combo_of = {}
        for e in uniq:
            try:
                key = tuple(self._where[(layer, p)][int(e)][0].tensor for p in PROJS)
            except KeyError:
                raise BadInputError(f"expert {int(e)} of layer {layer} is not resident on {self.identity}") from None
            if any(t not in self._planes for t in key):
                return None
            combo_of[int(e)] = combos.setdefault(key, len(combos))
        cslot = np.array([combo_of[int(e)] for e in ids], dtype=np.int64)
        order = np.lexsort((ids, cslot))
        sids = ids[order]
        starts = np.flatnonzero(np.r_[True, sids[1:] != sids[:-1]]) if n else np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, n])
        if n == 0 or counts.max() == 1:
            bt = 1
        elif n / len(uniq) <= (mv := _need_triton().MV_TOKENS):  # few slots an expert: matrix-vector groups
            bt = mv
        else:
            bt = self.bt
        stages = []
        for key, ci in combos.items():
            pg, pu, pd = (self._planes[t] for t in key)
            for p in (pg, pu, pd):
                if p["fmt"].mix:
                    self._mix_levels(p)
            loc = {t: {e: i for i, e in enumerate(self._planes[t]["stack"].expert_ids)} for t in key}
            rows = []  # (expert, first slot, count)
            for s0, c in zip(starts, counts):
                e = int(sids[s0])
                if combo_of[e] != ci:
                    continue
                for off in range(0, int(c), bt):
                    rows.append((e, int(s0) + off, min(bt, int(c) - off)))
            first = rows[0][1] if rows else 0
            count = sum(r[2] for r in rows)

            def table(t):
                g = np.array([(loc[t][e], s, c) for e, s, c in rows], dtype=np.int32).reshape(-1, 3)
                return torch.from_numpy(g).to(self.device)

            dual = (pg["fmt"].key == pu["fmt"].key and pg["stack"].expert_ids == pu["stack"].expert_ids)
            stages.append((pg["fmt"], pg, pu, table(key[0]), table(key[1]), pd["fmt"], pd, table(key[2]),
                           first, count, dual))
        return LaunchPlan(torch.from_numpy(order).to(self.device), n, bt, tuple(stages))

    def launch(self, plan: LaunchPlan, xs, h, y) -> None:
        """Run ``plan`` on sorted inputs xs (n, H) into h (n, I) and y (n, H) (device tensors)."""
        import torch

        k = _need_triton()
        L = self.swiglu_limit
        bn, nw, bk = self.tile.get(plan.bt, (0, 0, 0))
        kw = dict(bt=plan.bt, prec=self.prec, bn=bn, num_warps=nw, bk=bk)
        for fg, pg, pu, gg, gu, fd, pd, gd, first, count, dual in plan.stages:
            if dual:
                k.linear(fg, xs, gg, pg, h, w2=pu, limit=L, **kw)
            else:
                g = torch.empty_like(h)
                u = torch.empty_like(h)
                k.linear(fg, xs, gg, pg, g, **kw)
                k.linear(pu["fmt"], xs, gu, pu, u, **kw)
                sl = slice(first, first + count)  # this combo's sorted slots
                h[sl] = swiglu_fast(g[sl], u[sl], L)
            k.linear(fd, h, gd, pd, y, **kw)

    def fast_device(self, layer: int, xt, expert_ids):
        """Fast mode on device tensors: float32 (n, H) device -> float32 (n, H) device,
        or None when the call needs the fallback."""
        import torch

        plan = self.plan(layer, expert_ids)
        if plan is None:
            return None
        if plan.n == 0:
            return torch.zeros_like(xt)
        inter = next(iter(plan.stages))[1]["stack"].rows
        xs = xt.index_select(0, plan.order).contiguous()
        h = torch.empty((plan.n, inter), dtype=torch.float32, device=self.device)
        y = torch.empty_like(xs)
        self.launch(plan, xs, h, y)
        out = torch.empty_like(y)
        out.index_copy_(0, plan.order, y)
        return out

    # -- decode steps (gemv_triton) --------------------------------------
    def one_stack_each(self, layer: int):
        """(gate, up, down planes, expert ids, loc host int64 (max id + 1,)) when every
        projection of ``layer`` has one kernel-layout stack here, all over the same
        experts (loc: the stack row of each expert id, -1 where absent), else None:
        the condition of the decode-step, prefill and plane-layout exact kernels."""
        stacks = []
        for proj in PROJS:
            owners = {v[0].tensor for v in self._where.get((layer, proj), {}).values()}
            if len(owners) != 1 or next(iter(owners)) not in self._planes:
                return None
            stacks.append(self._planes[next(iter(owners))])
        pg, pu, pd = stacks
        ids = pg["stack"].expert_ids
        if pu["stack"].expert_ids != ids or pd["stack"].expert_ids != ids:
            return None
        loc = np.full(max(ids) + 1, -1, np.int64)
        loc[list(ids)] = np.arange(len(ids))
        return pg, pu, pd, ids, loc

    def gemv_set(self, layer: int):
        """(gate, up, down linear planes, loc int64 device (max id + 1,), loc host)
        when ``layer`` can run the decode-step kernels, else None."""
        if layer in self._gemv:
            return self._gemv[layer]
        import torch

        got = None
        one = self.one_stack_each(layer)
        if one is not None:
            pg, pu, pd, ids, loc = one
            if "lin" in pg and "lin" in pu and "lin" in pd and pg["stack"].qtype == pu["stack"].qtype:
                got = (pg["lin"], pu["lin"], pd["lin"], torch.from_numpy(loc).to(self.device), loc)
        self._gemv[layer] = got
        return got

    def prefill_wanted(self, layer: int, ids: np.ndarray) -> bool:
        """Whether a fast call takes the tensor-core prefill kernels (when the layer has them):
        its experts see more than ``group_max_mean`` slots each on average, or the layer has
        no word-layout kernels (its qtypes are not rocmfp2 / rocmfp3) and some expert has
        several slots. Measured on an H100 at batch 64 (docs/performance.md): rocmfp4 and MIX
        layers ran 4x faster on the prefill kernels than on the matrix-vector tiles, while
        rocmfp2 / rocmfp3 layers keep the grouped matrix-vector kernels below that mean."""
        n = ids.shape[0]
        if n == 0:
            return False
        uniq = distinct(ids)
        if n / uniq > self.group_max_mean:
            return True
        return n > uniq and self.gemv_set(layer) is None

    def fast_path(self, layer: int, ids: np.ndarray):
        """Fast mode's path for a call of ``ids`` (int64 (n,), n > 0), as (kind, what it needs):
        ("step", ``gemv_set``), ("grouped", ``grouped_plan``), ("prefill", ``prefill_set``) or
        ("tiles", None: ``fast_device``, which plans on the host and names an expert that is
        not resident). A decode step naming an expert not resident here is refused."""
        gem = self.gemv_set(layer) if ids.shape[0] <= self.gemv_max_slots else None
        if gem is not None:
            loc = gem[4]
            if not self._all_resident(loc, ids):
                bad = sorted({int(e) for e in ids if e < 0 or e >= loc.shape[0] or loc[e] < 0})
                raise BadInputError(f"experts {bad} of layer {layer} are not resident on {self.identity}")
            return "step", gem
        gp = self.grouped_plan(layer, ids)
        if gp is not None:
            return "grouped", gp
        pf = self.prefill_set(layer) if self.prefill_wanted(layer, ids) else None
        if pf is not None and self._all_resident(pf[4], ids):
            return "prefill", pf
        return "tiles", None

    @staticmethod
    def _all_resident(loc: np.ndarray, ids: np.ndarray) -> bool:
        """Whether every id of a non-empty ``ids`` has a slot in ``gemv_set``'s host
        ``loc`` (-1: not resident here)."""
        return bool(ids.min() >= 0 and ids.max() < loc.shape[0] and (loc[ids] >= 0).all())

    def gemv_device(self, layer: int, xT, ids):
        """The decode-step kernels on device tensors: xT float32 (n, 16, H / 16)
        group-transposed (``group_t``), ids int64 (n,) global experts -> float32
        (n, H). Exactly two launches, no host work."""
        import torch
        from ds4quant.runtime.kernels import gemv_triton as gk

        lg, lu, ld, loc, _ = self._gemv[layer]
        n = xT.shape[0]
        inter = lg.a.shape[1]
        hT = torch.empty((n, 16, inter // 16), dtype=torch.float32, device=xT.device)
        y = torch.empty((n, ld.a.shape[1]), dtype=torch.float32, device=xT.device)
        bn, bw, nw, ns, pre, sd = self.gemv_tile["gu"]
        gk.gemv(lg, xT, ids, loc, hT, lp2=lu, limit=self.swiglu_limit, out_t=True, bn=bn, bw=bw, num_warps=nw,
                num_stages=ns, pre=pre, sdec=sd)
        bn, bw, nw, ns, pre, sd = self.gemv_tile["down"]
        gk.gemv(ld, hT, ids, loc, y, bn=bn, bw=bw, num_warps=nw, num_stages=ns, pre=pre, sdec=sd)
        return y

    def grouped_plan(self, layer: int, ids: np.ndarray):
        """(order, groups) for the grouped kernels, or None when the layer has no
        word layout or its experts see too many tokens each (the tl.dot path)."""
        from ds4quant.runtime.kernels import gemv_triton as gk

        gem = self.gemv_set(layer)
        if gem is None or ids.shape[0] == 0:
            return None
        loc = gem[4]
        if not self._all_resident(loc, ids):
            return None
        if ids.shape[0] / distinct(ids) > self.group_max_mean:
            return None
        return gk.groups_for(ids, loc, self.group_tb)

    def grouped_device(self, layer: int, xT, groups):
        """The grouped kernels on device tensors: xT float32 (n, 16, H / 16) sorted by
        expert and group-transposed, groups int32 (g, 3) device -> float32 (n, H) sorted."""
        import torch
        from ds4quant.runtime.kernels import gemv_triton as gk

        lg, lu, ld, loc, _ = self._gemv[layer]
        n = xT.shape[0]
        hT = torch.empty((n, 16, lg.a.shape[1] // 16), dtype=torch.float32, device=xT.device)
        y = torch.empty((n, ld.a.shape[1]), dtype=torch.float32, device=xT.device)
        tb = self.group_tb
        bn, bw, nw, ns, pre, sd = self.group_tile["gu"]
        gk.gemv(lg, xT, loc, loc, hT, lp2=lu, limit=self.swiglu_limit, out_t=True, groups=groups, tb=tb, bn=bn,
                bw=bw, num_warps=nw, num_stages=ns, pre=pre, sdec=sd)
        bn, bw, nw, ns, pre, sd = self.group_tile["down"]
        gk.gemv(ld, hT, loc, loc, y, groups=groups, tb=tb, bn=bn, bw=bw, num_warps=nw, num_stages=ns, pre=pre, sdec=sd)
        return y

    def _step_graph(self, layer: int, n: int, H: int):
        """(graph, xT, ids, y, stage): the decode step of ``n`` slots captured once; stage: the
        graph's own ``PinnedIds`` for device-row calls (``run_slots_device``)."""
        import torch

        key = (layer, n)
        if key in self._graph_cache:
            return self._graph_cache[key]
        xs = torch.zeros((n, 16, H // 16), dtype=torch.float32, device=self.device)
        ids = torch.zeros((n,), dtype=torch.int64, device=self.device)
        ids.fill_(int(self._gemv[layer][4].argmax()))  # a resident expert (loc >= 0) for the warm-up
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles the kernels outside the capture
            self.gemv_device(layer, xs, ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another owner's thread may be launching work meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            y = self.gemv_device(layer, xs, ids)
        self._graph_cache[key] = (graph, xs, ids, y, PinnedIds(n))
        return self._graph_cache[key]

    @staticmethod
    def _stage_in(pin, arr) -> None:
        """``arr`` into the pinned buffer ``pin`` (same element count) with torch's copy,
        which splits a large copy over the intra-op threads (numpy's assignment runs on
        one; at 2,048 tokens a prefill call stages 201 MB each way)."""
        import torch

        pin.copy_(torch.from_numpy(np.ascontiguousarray(arr)).view(pin.shape))

    @staticmethod
    def _stage_out(pin) -> np.ndarray:
        """A new host array holding the pinned buffer ``pin`` (the buffer is reused)."""
        import torch

        out = torch.empty(pin.shape, dtype=pin.dtype)
        out.copy_(pin)
        return out.numpy()

    def _pin(self, name: str, n: int, dtype):
        import torch

        buf = self._pinned.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1 << max(0, n - 1).bit_length()), dtype=dtype, pin_memory=True)
            self._pinned[name] = buf
        return buf[:n]

    def _stream_pair(self):
        import torch

        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def _fast_cuda(self, layer: int, x: np.ndarray, ids: np.ndarray, ready):
        """Fast mode on a CUDA device through pinned buffers and two streams;
        ready.fire() once the input copy is enqueued. None: needs the fallback."""
        import torch

        n, H = x.shape
        kind, got = self.fast_path(layer, ids)
        if kind == "grouped":
            return self._grouped_cuda(layer, x, got, ready)
        gem = got if kind == "step" else None
        pf = got if kind == "prefill" else None
        pin_i = self._pin("ids", n, torch.int64)
        pin_i.numpy()[...] = ids
        if gem is not None:  # the kernels read x group-transposed: done here, on the host
            pin_x = self._pin("x", n * H, torch.float32).view(n, 16, H // 16)
            self._stage_in(pin_x, group_t(x))
        else:
            pin_x = self._pin("x", n * H, torch.float32).view(n, H)
            self._stage_in(pin_x, x)
        copy, comp = self._stream_pair()
        graph = None
        if gem is not None and self.graphs:
            graph, dx, di, gy, _ = self._step_graph(layer, n, H)
        else:
            dx = torch.empty(tuple(pin_x.shape), dtype=torch.float32, device=self.device)
            di = torch.empty((n,), dtype=torch.int64, device=self.device)
        copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy):
            dx.copy_(pin_x, non_blocking=True)
            di.copy_(pin_i, non_blocking=True)
            staged = torch.cuda.Event()
            staged.record(copy)
        ready.fire()
        with torch.cuda.stream(comp):
            comp.wait_event(staged)  # the copy dependency, on the device
            if graph is not None:
                graph.replay()
                y = gy
            elif gem is not None:
                y = self.gemv_device(layer, dx, di)
            else:
                y = self.prefill_device(layer, dx, di) if pf is not None else None
                if y is None:
                    y = self.fast_device(layer, dx, ids)
                if y is None:
                    return None
            pin_y = self._pin("y", n * H, torch.float32).view(n, H)
            pin_y.copy_(y, non_blocking=True)
            done = torch.cuda.Event()
            done.record(comp)
        done.synchronize()  # this owner's work only
        return self._stage_out(pin_y)

    def _grouped_cuda(self, layer: int, x: np.ndarray, gp, ready):
        """The grouped kernels through the pinned buffers (eager launches: the group count
        varies); the sort by expert and the group transposition run on the device."""
        import torch

        order, groups = gp
        n, H = x.shape
        pin_x = self._pin("x", n * H, torch.float32).view(n, H)
        self._stage_in(pin_x, x)
        pin_o = self._pin("order", n, torch.int64)
        pin_o.numpy()[...] = order
        pin_g = self._pin("groups", groups.size, torch.int32).view(-1, 3)
        pin_g.numpy()[...] = groups
        copy, comp = self._stream_pair()
        copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy):
            dx = pin_x.to(self.device, non_blocking=True)
            do = pin_o.to(self.device, non_blocking=True)
            dg = pin_g.to(self.device, non_blocking=True)
            staged = torch.cuda.Event()
            staged.record(copy)
        ready.fire()
        with torch.cuda.stream(comp):
            comp.wait_event(staged)
            for t in (dx, do, dg):
                t.record_stream(comp)
            xT = dx.index_select(0, do).view(n, H // 16, 16).transpose(1, 2).contiguous()
            ys = self.grouped_device(layer, xT, dg)
            y = torch.empty_like(ys)
            y.index_copy_(0, do, ys)
            pin_y = self._pin("y", n * H, torch.float32).view(n, H)
            pin_y.copy_(y, non_blocking=True)
            done = torch.cuda.Event()
            done.record(comp)
        done.synchronize()
        return self._stage_out(pin_y)

    # -- compute ---------------------------------------------------------
    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: Mode) -> np.ndarray:
        from ds4quant.runtime.overlap import Readiness

        return self.run_slots_staged(layer, x, expert_ids, mode, Readiness())

    def run_slots_staged(self, layer: int, x, expert_ids, mode: Mode, ready) -> np.ndarray:
        """run_slots, firing ``ready`` once the input copy is enqueued (runtime/overlap.py)."""
        import torch

        mode = Mode.parse(mode, where=self.identity)
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        if self.device.type != "cuda":  # the CPU device (interpreter tests): nothing to stage
            ready.fire()
            xt = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            return self.run_slots_device(layer, xt.to(device=self.device, dtype=torch.float32), ids,
                                         mode).numpy()
        if mode is Mode.EXACT:
            y = self.exact_kernels_call(layer, x, ids, ready)
            if y is not None:
                return y
            ready.fire()  # the definition's path: its input copy is inside torch_exact
            return super().run_slots(layer, x, expert_ids, mode)
        xn = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
        if xn.ndim != 2 or xn.shape[0] != ids.shape[0]:
            raise ShapeError(f"run_slots: x {tuple(xn.shape)} and {ids.shape[0]} expert ids disagree")
        if ids.shape[0] == 0:
            ready.fire()
            return np.zeros(xn.shape, np.float32)
        with self._lock:
            y = self._fast_cuda(layer, xn, ids, ready)
        if y is None:
            return super().run_slots(layer, x, expert_ids, mode)
        return y
