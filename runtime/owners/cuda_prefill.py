"""Prefill of the CUDA owner through ``kernels.prefill_triton`` (a mixin of
``CudaOwner``): calls whose experts see many slots each (past the decode-step
and grouped matrix-vector kernels) on a layer with one stack per projection
take two tensor-core launches, gate + up with SwiGLU fused, then down, after
the slot sort on the device. No host planning and no read-back: the host
only checks that every routed expert is resident here (it holds the ids
already) and picks the row tile from the slot count.

Stacks whose decoded weights ``prefill_triton.bf16_terms`` cannot prove exact
in one or two bf16 parts (and layers with several stacks a projection) keep
the float32 ``tl.dot`` kernels of ``moe_triton`` (``CudaOwner.fast_device``).
"""

from __future__ import annotations


class PrefillMixin:
    """Tensor-core prefill on the plane layout; needs CudaOwner's residency."""

    def _prefill_init(self, enabled: bool) -> None:
        self.prefill = bool(enabled)
        # (weight rows per program, columns per step, warps, pipeline stages, swap) of the two launches
        # (``prefill_triton.tile_kw``; swap: the product transposed, weights as the tensor cores'
        # A operand). The fastest of benchmarks/runtime_gpu_prefill.py's sweep on an H100 at
        # 2,048 tokens with the launch order and input cast below (docs/gpu.md#prefill-tiles):
        # rocmfp2 / rocmfp3 layers (``prefill_tile_linear``) 7.22 ms swapped with 128-column
        # steps against 7.66 for the 128-row tile before; the other qtypes keep 64 x 64 unswapped
        # (MIX 19.96 ms against 20.69 swapped; rocmfp4 10.30 against 10.11, within 2%)
        self.prefill_tile: dict[str, tuple] = {"gu": (64, 64, 4, 3, False), "down": (64, 64, 4, 3, False)}
        self.prefill_tile_linear: dict[str, tuple] = {"gu": (64, 128, 4, 3, True), "down": (64, 128, 4, 3, True)}
        # slots of one expert per program; 0: ``prefill_triton.pick_bm`` by the slot count
        self.prefill_bm = 0
        # ``prefill_triton.grouped``'s n_first (launch order: column blocks first, the same bytes;
        # 2.6% faster at 2,048 tokens) and the gate/up input cast to bf16 once before the launch
        # (the kernel rounds it so anyway: the same bytes, half the bytes each column block
        # reads; a further 5.8% on the same card)
        self.prefill_n_first = True
        self.prefill_x16 = True
        self._prefill: dict[int, object] = {}

    def _prefill_reset(self, layer: int) -> None:
        self._prefill.pop(layer, None)

    def prefill_set(self, layer: int):
        """``single_stacks(layer)`` when prefill is on, else None."""
        return self.single_stacks(layer) if self.prefill else None

    def single_stacks(self, layer: int):
        """(gate, up, down planes, loc int64 device, loc host, local experts) when ``layer``
        has one kernel-layout stack per projection over the same experts, else None (the
        prefill kernels' and the plane-layout exact kernels' condition)."""
        if layer in self._prefill:
            return self._prefill[layer]
        import torch

        got = None
        one = self.one_stack_each(layer)
        if one is not None:
            pg, pu, pd, ids, loc = one
            got = (pg, pu, pd, torch.from_numpy(loc).to(self.device), loc, len(ids))
        self._prefill[layer] = got
        return got

    def _bf16_split(self, p):
        """SPLIT for a stack's planes (True: two bf16 parts), or None when the decoded weights
        are not exact in two parts; MIX: from the registered books (raises when unregistered)."""
        from ds4quant.runtime.kernels import prefill_triton as pk

        if p["fmt"].mix:
            self._mix_levels(p)
            key = id(p["books"])
            if p.get("terms_key") != key:
                books, modes = self.registry.lookup(self.identity, p["stack"].tensor)
                p["terms"] = pk.qtype_terms(p["stack"].qtype, books, modes)
                p["terms_key"] = key
        elif "terms" not in p:
            p["terms"] = pk.qtype_terms(p["stack"].qtype)
        t = p["terms"]
        return None if t == 0 else (t == 2)

    def prefill_device(self, layer: int, x, ids):
        """The prefill kernels on device tensors: x float32 (n, H) in slot order, ids int64
        (n,) global experts (all resident) -> float32 (n, H) in slot order, or None when the
        layer has no single stack per projection or a stack's weights have no exact bf16 form."""
        import torch

        from ds4quant.runtime.kernels import layout
        from ds4quant.runtime.kernels import prefill_triton as pk
        from ds4quant.runtime.swiglu import swiglu_fast

        got = self.single_stacks(layer)  # cached: a CUDA graph captures no host-to-device copy of it
        if got is None:
            return None
        pg, pu, pd, loc, _, E = got
        splits = [self._bf16_split(p) for p in (pg, pu, pd)]
        if any(s is None for s in splits):
            return None
        n = x.shape[0]
        plan = pk.sort_slots(ids, loc, E, n, bm=self.prefill_bm)
        L = self.swiglu_limit
        linear = all(p["stack"].qtype in layout.LINEAR_QTYPES for p in (pg, pu, pd))
        tiles = self.prefill_tile_linear if linear else self.prefill_tile
        kw = dict(pk.tile_kw(tiles["gu"]), n_first=self.prefill_n_first)
        if self.prefill_x16 and x.dtype == torch.float32:
            x = x.to(torch.bfloat16)
        if pg["fmt"].key == pu["fmt"].key and splits[0] == splits[1]:
            h = pk.grouped(pg["fmt"], x, plan, pg, w2=pu, limit=L, split=splits[0], out_dtype=torch.bfloat16,
                           **kw)
        else:
            g = pk.grouped(pg["fmt"], x, plan, pg, split=splits[0], **kw)
            u = pk.grouped(pu["fmt"], x, plan, pu, split=splits[1], **kw)
            h = swiglu_fast(g, u, L)
        y = torch.empty((n, pd["stack"].rows), dtype=torch.float32, device=x.device)
        pk.grouped(pd["fmt"], h, plan, pd, scatter=True, split=splits[2], out=y, n_first=self.prefill_n_first,
                   **pk.tile_kw(tiles["down"]))
        return y
