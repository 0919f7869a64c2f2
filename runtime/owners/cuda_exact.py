"""Exact mode of the CUDA owner through ``kernels.exact_triton`` and
``kernels.exact_planes`` (a mixin of ``CudaOwner``): a layer with one stack per
projection takes four launches a call — quantize, gate + up, SwiGLU +
quantize, down — captured once per (layer, slots) in a CUDA graph like fast
mode's decode step. rocmfp2 / rocmfp3 layers of the decode-step word layout
(``CudaOwner.gemv_set``) use ``exact_triton.gemv_exact`` (gate and up in one
launch); every other kernel qtype (MIX, rocmfp4/6/8, s40, affine, mxfp4) uses
``exact_planes.product`` on the plane layout (gate and up apart), with the
level tables as integers times a power of two (``exact_planes.integer_levels``;
a MIX book pair it refuses keeps the layer on the definition's path).
Prefill-sized calls (``exact_grouped_mean`` slots an expert or more, or past
``exact_max_slots``) take ``exact_grouped.product`` instead: the prefill's
device slot sort, each weight tile read once for all its slots, the same
exact sums (eager launches: a prefill's slot count varies call to call).

The bytes are the definition's (``owners/torch_exact``, the CPU owner's):
the kernels compute the same exact sums and the same one-operation-at-a-time
float64 SwiGLU. Where a (slot, row) sum falls outside the kernels' float64
bound the kernels count it; the call is then run again stage by stage
(eager, ``exact_patched``), each flagged output replaced by the definition's
integer-limb sum of that pair (``torch_exact._limb_linear``) before the next
stage reads it. A non-finite input or SwiGLU output sends the call through
``TorchOwner``'s exact path, which raises the definition's error.
``exact_stats`` counts the calls that took the kernels alone, the patched
ones and the reruns.
q8_0 / bf16 / f16 / f32, several stacks a projection and batches above
``exact_max_slots`` that the grouped kernels cannot take run ``TorchOwner``'s
exact path directly.
"""

from __future__ import annotations

import numpy as np

from ds4quant.runtime.owners.base import distinct


class ExactKernelsMixin:
    """Exact mode on the word-layout kernels; needs CudaOwner's residency and buffers."""

    def _exact_init(self, enabled: bool) -> None:
        self.exact_kernels = bool(enabled)
        # (rows per program, words per step, warps, prefetch) of the gate + up and the down launch
        self.exact_tile: dict[str, tuple] = {"gu": (8, 64, 4, True), "down": (16, 64, 8, True)}
        # slots a call may have for the kernels (each slot reads its expert's weights: no grouping)
        self.exact_max_slots = 1024
        self.exact_stats = {"kernel": 0, "patched": 0, "rerun": 0}
        # (rows per program, columns per step, warps) of the plane-layout product
        self.exact_planes_tile = (16, 64, 4)
        # slots per routed expert from which an exact call takes the grouped kernels
        # (exact_grouped: each weight tile read once for all its slots); calls past
        # exact_max_slots take them whatever the mean
        self.exact_grouped_mean = 8
        # (rows per program, warps, pipeline stages) of the grouped launches
        self.exact_grouped_tile = (64, 4, 2)

    def exact_set(self, layer: int, ids: np.ndarray):
        """``("words", gemv_set(layer))``, ``("planes", (gate, up, down planes, loc device,
        loc host, local experts))`` or ``("grouped", the same planes)`` when this call can
        take the exact kernels, else None."""
        n = ids.shape[0]
        if not self.exact_kernels or n == 0:
            return None
        try:
            from ds4quant.runtime.kernels import exact_triton  # noqa: F401
        except ImportError:  # exact mode stays usable without triton (the definition's path)
            return None
        if n > self.exact_max_slots or n >= self.exact_grouped_mean * distinct(ids):
            ps = self._exact_planes_set(layer)
            if ps is not None and self._grouped_levels(ps) and self._all_resident(ps[4], ids):
                return ("grouped", ps)
            if n > self.exact_max_slots:
                return None
        gem = self.gemv_set(layer)
        got = ("words", gem) if gem is not None else None
        if got is None:
            ps = self._exact_planes_set(layer)
            got = ("planes", ps) if ps is not None else None
        if got is None or not self._all_resident(got[1][4], ids):
            return None  # the definition's path names the expert that is not resident
        return got

    def _exact_planes_set(self, layer: int):
        """The plane-layout stacks of ``layer`` with their integer level tables on the device
        (``exact_planes.integer_levels``), or None."""
        import torch
        from ds4quant.runtime.kernels import exact_planes as xp

        pf = self.single_stacks(layer)
        if pf is None:
            return None
        for p in pf[:3]:
            if p["fmt"].mix:
                self._mix_levels(p)  # raises when the books are not registered
            key = id(p["books"]) if p["fmt"].mix else 0
            if p.get("ilut_key") != key or "ilut" not in p:
                got = xp.integer_levels(p["llut"].cpu().numpy(), p["fmt"].group)
                if got is None:
                    p["ilut"] = None
                else:
                    p["ilut"] = torch.from_numpy(got[0]).to(self.device)
                    p["ishift"] = torch.from_numpy(got[1]).to(self.device)
                    p["wide"] = got[2]
                p["ilut_key"] = key
                p["finite"] = self._finite_weights(p)
            if p["ilut"] is None or not p["finite"]:
                return None
        return pf

    def _grouped_levels(self, ps) -> bool:
        """Whether every stack of a plane set has integer levels the grouped kernels take,
        their bf16 slices (``exact_grouped.level_parts``) on the device in ``gparts`` /
        ``gbits`` (made once per stack and books)."""
        import torch
        from ds4quant.runtime.kernels import exact_grouped as xg

        for p in ps[:3]:
            if p.get("gparts_key", -1) != p["ilut_key"]:
                got = xg.level_parts(p["ilut"].cpu().numpy(), p["fmt"].group)
                p["gparts"] = None if got is None else torch.from_numpy(got[0]).contiguous().to(self.device)
                p["gbits"] = None if got is None else got[1]
                p["gtop"] = None if got is None else torch.from_numpy(
                    xg.parts_top(got[0], p["fmt"].group, p["fmt"].affine)).to(self.device)
                p["gparts_key"] = p["ilut_key"]
            if p["gparts"] is None:
                return False
        return True

    @staticmethod
    def _finite_weights(p) -> bool:
        """Whether every decoded weight of the stack is finite: a scale byte whose value times
        the largest level overflows float32 (mxfp4's top E8M0 bytes) makes the definition raise,
        so such a stack keeps the definition's path (checked once per stack and books)."""
        import torch
        from ds4quant.runtime.kernels import layout

        top = np.float32(np.abs(p["llut"].cpu().numpy()).max())
        with np.errstate(over="ignore"):
            over = np.flatnonzero(~np.isfinite(layout.scale_lut(p["stack"].qtype) * top))
        if over.size == 0:
            return True
        return not bool(torch.isin(p["s"], torch.from_numpy(over).to(p["s"].device, torch.uint8)).any())

    def exact_device(self, layer: int, x, ids, kind: str | None = None):
        """The exact kernels on device tensors: x float32 (n, H), ids int64 (n,) global
        experts -> (y float32 (n, H), bad int32 (1,)); y holds the definition's bits when
        bad is 0. kind: ``exact_set``'s first item (default: the layer's per-slot kernels)."""
        import torch
        from ds4quant.runtime.kernels import exact_triton as ek

        kind = kind or self._exact_kind(layer)
        if kind != "words":
            return self._planes_device(layer, x, ids, grouped=kind == "grouped")
        lg, lu, ld, loc, _ = self._gemv[layer]
        bad = torch.zeros((1,), dtype=torch.int32, device=x.device)
        qx, sx = ek.quantize(x, bad)
        bn, bw, nw, pre = self.exact_tile["gu"]
        g, u = ek.gemv_exact(lg, qx, sx, ids, loc, bad, lp2=lu, bn=bn, bw=bw, num_warps=nw, pre=pre)
        qh, sh = ek.swiglu_quantize(g, u, self.swiglu_limit, bad)
        bn, bw, nw, pre = self.exact_tile["down"]
        y = ek.gemv_exact(ld, qh, sh, ids, loc, bad, bn=bn, bw=bw, num_warps=nw, pre=pre)
        return y, bad

    def exact_patched(self, layer: int, x, ids, kind: str | None = None):
        """Exact mode stage by stage, every flagged pair patched through the definition's limbs:
        x float32 (n, H), ids int64 (n,) device tensors -> y float32 (n, H), or None when an
        input or a SwiGLU output is not finite (the definition's path raises)."""
        import torch
        from ds4quant.runtime.kernels import exact_triton as ek

        kind = kind or self._exact_kind(layer)
        if kind != "words":
            return self._planes_device(layer, x, ids, patch=True, grouped=kind == "grouped")
        lg, lu, ld, loc, _ = self._gemv[layer]
        host_ids = ids.cpu().numpy()
        bad = torch.zeros((1,), dtype=torch.int32, device=x.device)
        qx, sx = ek.quantize(x, bad)
        if int(bad[0]):
            return None
        bn, bw, nw, pre = self.exact_tile["gu"]
        g, u, fg, fu = ek.gemv_exact(lg, qx, sx, ids, loc, bad, lp2=lu, bn=bn, bw=bw, num_warps=nw, pre=pre,
                                     flags=True)
        self._patch(layer, "gate", g, fg, host_ids, x)
        self._patch(layer, "up", u, fu, host_ids, x)
        bad.zero_()
        h = torch.empty_like(g)
        qh, sh = ek.swiglu_quantize(g, u, self.swiglu_limit, bad, h=h)
        if int(bad[0]):
            return None
        bn, bw, nw, pre = self.exact_tile["down"]
        y, fy = ek.gemv_exact(ld, qh, sh, ids, loc, bad, bn=bn, bw=bw, num_warps=nw, pre=pre, flags=True)
        self._patch(layer, "down", y, fy, host_ids, h)
        return y

    def _patch(self, layer: int, proj: str, out, flags, ids: np.ndarray, inp) -> None:
        """out[slot, row] = the definition's limb sum for every flagged pair (inp: that stage's input)."""
        import torch
        from ds4quant.runtime.owners import torch_exact as te

        pairs = flags.nonzero().cpu().numpy()
        for slot in np.unique(pairs[:, 0]):
            rows = torch.from_numpy(pairs[pairs[:, 0] == slot, 1]).to(out.device)
            w = self._decode(layer, proj, int(ids[slot])).to(out.device).index_select(0, rows)
            q, s = te.quantize_blocks(inp[slot:slot + 1])
            out[slot, rows] = te._limb_linear(*te._split_weights(w), q, s)[0]

    def _exact_graph(self, layer: int, n: int, H: int):
        """(graph, x, ids, y, bad): the exact decode step of ``n`` slots captured once."""
        import torch

        key = (layer, n, "exact")
        if key in self._graph_cache:
            return self._graph_cache[key]
        xs = torch.zeros((n, H), dtype=torch.float32, device=self.device)
        loc = self._gemv[layer][4] if self._exact_kind(layer) == "words" else self._exact_planes_set(layer)[4]
        ids = torch.full((n,), int(loc.argmax()), dtype=torch.int64, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles the kernels outside the capture
            self.exact_device(layer, xs, ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            y, bad = self.exact_device(layer, xs, ids)
        self._graph_cache[key] = (graph, xs, ids, y, bad)
        return self._graph_cache[key]

    def _exact_cuda(self, layer: int, x: np.ndarray, ids: np.ndarray, ready, kind: str):
        """The exact kernels through the pinned buffers and the owner's two streams; ready.fire()
        once the input copy is enqueued. None: the call needs the definition's path. Grouped
        calls (prefill: any slot count) run eager, the per-slot kernels from a graph."""
        import torch

        n, H = x.shape
        pin_x = self._pin("x", n * H, torch.float32).view(n, H)
        self._stage_in(pin_x, x)
        pin_i = self._pin("ids", n, torch.int64)
        pin_i.numpy()[...] = ids
        copy, comp = self._stream_pair()
        graph = None
        if self.graphs and kind != "grouped":
            graph, dx, di, gy, gbad = self._exact_graph(layer, n, H)
        else:
            dx = torch.empty((n, H), dtype=torch.float32, device=self.device)
            di = torch.empty((n,), dtype=torch.int64, device=self.device)
        copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy):
            dx.copy_(pin_x, non_blocking=True)
            di.copy_(pin_i, non_blocking=True)
            staged = torch.cuda.Event()
            staged.record(copy)
        ready.fire()
        with torch.cuda.stream(comp):
            comp.wait_event(staged)
            if graph is not None:
                graph.replay()
                y, bad = gy, gbad
            else:
                y, bad = self.exact_device(layer, dx, di, kind)
            pin_y = self._pin("y", n * H, torch.float32).view(n, H)
            pin_y.copy_(y, non_blocking=True)
            pin_b = self._pin("bad", 1, torch.int32)
            pin_b.copy_(bad, non_blocking=True)
            done = torch.cuda.Event()
            done.record(comp)
        done.synchronize()  # this owner's work only
        if not int(pin_b.numpy()[0]):
            self.exact_stats["kernel"] += 1
            return self._stage_out(pin_y)
        with torch.cuda.stream(comp):  # some pairs need the limbs (or a value is not finite)
            y = self.exact_patched(layer, dx, di, kind)
            if y is None:
                return None
            pin_y.copy_(y, non_blocking=True)
            done = torch.cuda.Event()
            done.record(comp)
        done.synchronize()
        self.exact_stats["patched"] += 1
        return self._stage_out(pin_y)

    def exact_kernels_call(self, layer: int, x, ids: np.ndarray, ready):
        """float32 (n, H) host rows through the exact kernels on a CUDA device (staged through
        the pinned buffers), or None (the caller takes the definition's path: a layer or batch
        the kernels do not cover, or a rerun). Device rows: ``run_slots_device``."""
        import torch

        got = self.exact_set(layer, ids)
        if got is None:
            return None
        xn = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
        xn = np.ascontiguousarray(xn, dtype=np.float32)
        if xn.ndim != 2 or xn.shape[0] != ids.shape[0]:
            return None  # the definition's path raises the shape error
        with self._lock:
            y = self._exact_cuda(layer, xn, ids, ready, got[0])
        if y is None:
            self.exact_stats["rerun"] += 1
        return y

    def _exact_kind(self, layer: int) -> str:
        return "words" if self.gemv_set(layer) is not None else "planes"

    def _planes_device(self, layer: int, x, ids, patch: bool = False, grouped: bool = False):
        """Exact mode on the plane layout: x float32 (n, H), ids int64 (n,) device tensors ->
        (y, bad) like ``exact_device``, or with ``patch`` y with every flagged pair replaced by
        the definition's limbs (None when an input or a SwiGLU output is not finite).
        ``grouped``: the products of ``exact_grouped`` over the device slot sort, else
        ``exact_planes``'s per slot; the same bytes either way."""
        import torch
        from ds4quant.runtime.kernels import exact_planes as xp
        from ds4quant.runtime.kernels import exact_triton as ek

        pg, pu, pd, loc, _, E = self._exact_planes_set(layer)
        bad = torch.zeros((1,), dtype=torch.int32, device=x.device)
        if grouped:
            from ds4quant.runtime.kernels import exact_grouped as xg
            from ds4quant.runtime.kernels import prefill_triton as pk

            plan = pk.sort_slots(ids, loc, E, x.shape[0], bm=self.prefill_bm)
            bn, nw, ns = self.exact_grouped_tile
            kw = dict(flags=patch, native=not pk.INTERPRETED, bn=bn, num_warps=nw, num_stages=ns)

            def prod(p, q, s):
                return xg.product(p["fmt"], p, q, s, plan, bad, **kw)
        else:
            bn, bk, nw = self.exact_planes_tile
            kw = dict(flags=patch, bn=bn, bk=bk, num_warps=nw)

            def prod(p, q, s):
                return xp.product(p["fmt"], p, q, s, ids, loc, bad, **kw)
        qx, sx = ek.quantize(x, bad)
        if patch and int(bad[0]):
            return None
        q = xp.plain(qx)
        g = prod(pg, q, sx)
        u = prod(pu, q, sx)
        host_ids = ids.cpu().numpy() if patch else None
        if patch:
            (g, fg), (u, fu) = g, u
            self._patch(layer, "gate", g, fg, host_ids, x)
            self._patch(layer, "up", u, fu, host_ids, x)
            bad.zero_()
        h = torch.empty_like(g) if patch else None
        qh, sh = ek.swiglu_quantize(g, u, self.swiglu_limit, bad, h=h)
        if patch and int(bad[0]):
            return None
        y = prod(pd, xp.plain(qh), sh)
        if patch:
            y, fy = y
            self._patch(layer, "down", y, fy, host_ids, h)
            return y
        return y, bad
