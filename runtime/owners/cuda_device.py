"""Device-resident calls of the CUDA owner (a mixin of ``CudaOwner``):
``run_slots_device`` takes the slot rows as a tensor already on the owner's
device and returns the outputs there, with ``run_slots``' bytes.

``run_slots`` takes host arrays: on a CUDA device it stages the rows through
pinned buffers (at 2,048 tokens, 201 MB of float32 slot rows each way), which
costs several times the prefill kernels themselves. A caller whose hidden
states already live on the device (a layer of the streamed model on a GPU,
``runtime.execute.run_layer`` with device hidden states) hands the rows over
as they are: the only host work left is the routing ids (n int64), which the
owner reads on the host to pick a path and to check residency, as
``run_slots`` does. Every path is the one ``run_slots`` takes for the same
call (decode step from its CUDA graph, grouped matrix-vector kernels,
tensor-core prefill, the tl.dot kernels, the exact kernels and their patch,
the definition's torch path), so the bytes are the same (docs/gpu.md#device).

On the CPU device (the interpreter tests) ``run_slots`` itself goes through
here and copies the result to a host array.
"""

from __future__ import annotations

import numpy as np

from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.torch_owner import device_rows


class PinnedIds:
    """A captured graph's expert ids from the host without blocking it: a pinned buffer of
    its own (a pageable copy holds the host for the whole transfer, a large share of a
    batch-1 call) that is written again only after the event recorded behind its last
    copy, so a copy still in flight never reads the next call's ids."""

    def __init__(self, n: int):
        import torch

        self.host = torch.empty((n,), dtype=torch.int64, pin_memory=True)
        self.copied = torch.cuda.Event()  # recorded behind each copy out of ``host``
        self.pending = False

    def put(self, dst, ids: np.ndarray) -> None:
        """``dst[:] = ids`` on the current stream of ``dst``'s device."""
        import torch

        if self.pending:
            self.copied.synchronize()
        self.host.numpy()[...] = ids
        dst.copy_(self.host, non_blocking=True)
        self.copied.record(torch.cuda.current_stream(dst.device))
        self.pending = True


class DeviceSlotsMixin:
    """run_slots on device tensors; needs CudaOwner's kernels, graphs and lock."""

    def run_slots_device(self, layer: int, x, expert_ids, mode: Mode):
        """Per-slot outputs on the device: x float32 (n, H) torch tensor on this owner's
        device, expert_ids int64 (n,) (host array or tensor) -> float32 (n, H) tensor on the
        device, the bytes ``run_slots`` returns for the same rows."""
        import torch

        mode = Mode.parse(mode, where=self.identity)
        x, ids = device_rows(self, x, expert_ids)
        if ids.shape[0] == 0:
            return torch.zeros_like(x)
        if mode is Mode.EXACT:
            y = self._exact_on_device(layer, x, ids)
        else:
            with self._lock:
                y = self._fast_on_device(layer, x, ids)
        if y is None:  # the definition's path (exact) or the torch fallback (fast)
            y = self.torch_slots(layer, x, ids, mode)
        return y

    def _fast_on_device(self, layer: int, x, ids: np.ndarray):
        """Fast mode's kernels on ``fast_path``'s choice, or None (the fallback)."""
        import torch

        n, H = x.shape
        kind, got = self.fast_path(layer, ids)
        if kind == "step":
            xT = x.view(n, H // 16, 16).transpose(1, 2)  # group-transposed (``group_t``)
            if self.graphs and self.device.type == "cuda":
                graph, dx, di, gy, stage = self._step_graph(layer, n, H)
                dx.copy_(xT)
                stage.put(di, ids)
                graph.replay()
                return gy.clone()  # the graph's output buffer is reused by the next replay
            return self.gemv_device(layer, xT.contiguous(), torch.from_numpy(ids).to(self.device))
        if kind == "grouped":
            order, groups = got
            do = torch.from_numpy(order).to(self.device)
            xT = x.index_select(0, do).view(n, H // 16, 16).transpose(1, 2).contiguous()
            ys = self.grouped_device(layer, xT, torch.from_numpy(groups).to(self.device))
            y = torch.empty_like(ys)
            y.index_copy_(0, do, ys)
            return y
        if kind == "prefill":
            y = self.prefill_device(layer, x, torch.from_numpy(ids).to(self.device))
            if y is not None:
                return y
        return self.fast_device(layer, x, ids)

    def _exact_on_device(self, layer: int, x, ids: np.ndarray):
        """The exact kernels eagerly on device rows (patched where they flag a pair), or
        None: the call takes the definition's path."""
        import torch

        got = self.exact_set(layer, ids)
        if got is None:
            return None
        kind = got[0]
        it = torch.from_numpy(ids).to(self.device)
        with self._lock:
            if self.graphs and self.device.type == "cuda" and kind != "grouped":  # ``_exact_cuda``'s graph
                graph, dx, di, gy, gbad = self._exact_graph(layer, x.shape[0], x.shape[1])
                dx.copy_(x)
                di.copy_(it)
                graph.replay()
                y, bad = gy.clone(), gbad
            else:
                y, bad = self.exact_device(layer, x, it, kind)
            if int(bad[0]):
                y = self.exact_patched(layer, x, it, kind)
                if y is not None:
                    self.exact_stats["patched"] += 1
            else:
                self.exact_stats["kernel"] += 1
        if y is None:
            self.exact_stats["rerun"] += 1
        return y
