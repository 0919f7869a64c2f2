"""CudaOwner: routed experts on one CUDA (or ROCm) device, fast mode through
the Triton kernels of ``runtime.kernels``.

* exact mode is ``TorchOwner``'s: ``formats.decode_torch`` of the artifact
  bytes, then ``torch_exact`` (the session plan's definition in integer /
  single-rounding torch ops), so a CUDA owner gives the CPU owner's bytes.
* fast mode repacks every resident stack once at load
  (``kernels.layout.repack``: code planes + scale bytes, the runtime's own
  layout; the artifact bytes stay resident for exact mode and
  ``held_bytes``) and runs two launches per call and layer: gate + up of all
  the selected experts with SwiGLU fused, then down; slots sorted by expert,
  up to ``bt`` tokens of one expert per program (``tl.dot``) when an expert
  has several slots, a matrix-vector tile per slot otherwise.
* MIX (105/106) stacks decode with the books registered in this owner's
  registry, copied to the device on first use (and again after a
  re-registration); an unregistered tensor raises ``UnregisteredTableError``.
* qtypes outside ``kernels.layout.KERNEL_QTYPES`` (rocmfp6, rocmfp2_affine,
  q8_0, bf16, f16, f32), or a call whose experts need them, run
  TorchOwner's fast path (decode_torch + matmul) for the whole call.

    o = CudaOwner("cuda:0")
    rt = runtime.load(art, placement={L: {"cuda:0": ids}}, owners={"cuda:0": o}, mode="fast")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ds4quant.errors import BadInputError, MissingDependencyError, ShapeError
from ds4quant.runtime.owners.base import MODES, ExpertStack
from ds4quant.runtime.owners.torch_owner import DEFAULT_SWIGLU_LIMIT, TorchOwner

PROJS = ("gate", "up", "down")


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


def _need_triton():
    try:
        from ds4quant.runtime.kernels import moe_triton
    except ImportError as exc:  # the owner is usable for exact mode without it
        raise MissingDependencyError("the CUDA owner's fast path needs triton (pip install triton)") from exc
    return moe_triton


class CudaOwner(TorchOwner):
    """Owner protocol on a CUDA/ROCm device; see the module docstring."""

    def __init__(self, device: str = "cuda:0", identity: Optional[str] = None,
                 swiglu_limit: float = DEFAULT_SWIGLU_LIMIT, bt: int = 16, prec: str = "tf32x3"):
        super().__init__(device, identity=identity, swiglu_limit=swiglu_limit)
        if bt not in (16, 32, 64):
            raise BadInputError(f"bt (tokens of one expert per program) must be 16, 32 or 64, got {bt}")
        self.bt = int(bt)
        self.prec = prec
        # launch shape (rows, warps, columns per step) per tokens-per-program
        # (1: matrix-vector tile, bt: tl.dot); 0 = the kernel default
        self.tile: dict[int, tuple[int, int, int]] = {}
        self._planes: dict[str, dict] = {}  # tensor -> planes of that stack

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
        a, b, s = layout.repack(stack.qtype, dev, stack.cols)
        p = dict(fmt=fmt, stack=stack, a=a, b=b, s=s,
                 slut=torch.from_numpy(layout.scale_lut(stack.qtype)).to(self.device),
                 llut=None, tab=torch.zeros(1, dtype=torch.int32, device=self.device), books=None)
        if not fmt.mix:
            p["llut"] = torch.from_numpy(layout.level_lut(stack.qtype)).to(self.device)
        else:
            p["tab"] = torch.arange(0, 2 * stack.n_experts, 2, dtype=torch.int32, device=self.device)
        self._planes[stack.tensor] = p

    def resident_bytes(self) -> int:
        extra = sum(int(p["a"].nbytes + p["s"].nbytes + (p["b"].nbytes if p["b"] is not None else 0))
                    for p in self._planes.values())
        return super().resident_bytes() + extra

    def close(self) -> None:
        super().close()
        self._planes.clear()

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
        bt = 1 if n == 0 or counts.max() == 1 else self.bt
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
                gc = torch.clamp(g[sl], max=L)
                h[sl] = torch.nn.functional.silu(gc) * torch.clamp(u[sl], min=-L, max=L)
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

    # -- compute ---------------------------------------------------------
    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: str) -> np.ndarray:
        import torch

        if mode not in MODES:
            raise BadInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "exact":
            return super().run_slots(layer, x, expert_ids, mode)
        xt = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        xt = xt.to(device=self.device, dtype=torch.float32).contiguous()
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        if xt.ndim != 2 or xt.shape[0] != ids.shape[0]:
            raise ShapeError(f"run_slots: x {tuple(xt.shape)} and {ids.shape[0]} expert ids disagree")
        with self._lock:
            y = self.fast_device(layer, xt, ids)
        if y is None:
            return super().run_slots(layer, x, expert_ids, mode)
        return y.cpu().numpy()
