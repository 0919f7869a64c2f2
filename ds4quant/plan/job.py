"""One expert matrix resident on the measure stage's device (issue 14).

Each expert matrix is measured as six or so candidates, and each used to
upload the matrix again (pageable copies), bring its decoded values back and
sum the errors on the host: at full width that host traffic and its page
faults, not the GPU, bounded the stage. ``Resident`` uploads the matrix,
its importance and its error weights once (through pinned memory, on the
worker's stream) and gives every candidate what it needs there: the halves
view for the MIX searches, the importance's row energies for the scale
search, and the error sums of a decoded matrix (``metrics_device``, the
host's figures bit for bit, with Triton; elsewhere, as on torch's CPU
device, the host's ``error_sums`` of a copy).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ds4quant.metrics import Sums, error_sums

_HALF = 16


def _upload(a: np.ndarray, dtype, device):
    """``a`` as a tensor on ``device``: on CUDA through a pinned buffer and a
    copy queued on the current stream (the buffer is handed back, to be kept
    until the copy ran)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a, dtype))
    if device.type != "cuda":
        return t.to(device), None
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True), pinned


class Resident:
    """``x`` float32 (rows, cols), its importance (cols,) or None and the
    error weights float64 (cols,) on ``device``, for all of one expert's
    candidates. Build it inside the worker's stream (``worker_stream``)."""

    def __init__(self, x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, device) -> None:
        self.x = np.ascontiguousarray(x, np.float32)
        self.imp = imp
        self.err_w = np.ascontiguousarray(err_w, np.float64)
        self.device = device
        self._keep = []  # pinned sources of queued copies
        self.X = self._up(self.x, np.float32)
        self.Q = None if imp is None else self._up(imp, np.float32)
        self.E = self._up(self.err_w, np.float64)
        self._sigma2 = None

    def _up(self, a, dtype):
        t, pinned = _upload(a, dtype, self.device)
        if pinned is not None:
            self._keep.append(pinned)
        return t

    def halves(self):
        """(X (rows, cols/16, 16), W (1, cols/16, 16) or None): ``_mix_search_torch.to_device``'s layout."""
        rows, cols = self.x.shape
        W = None if self.Q is None else self.Q.reshape(1, cols // _HALF, _HALF)
        return self.X.reshape(rows, cols // _HALF, _HALF), W

    def sigma2(self):
        """The rows' energies of the importance weights (``_scale_search_torch.row_energies``), once per matrix."""
        if self._sigma2 is None:
            from ds4quant.formats.search.torch_scale import row_energies

            self._sigma2 = self._up(row_energies(self.x), np.float32)
        return self._sigma2

    def sums(self, Y) -> Sums:
        """``error_sums(x, y, err_w)`` of decoded values Y (a tensor of x's size on the device)."""
        from ds4quant.formats.search import torch_batch as mb

        Y = Y.reshape(self.x.shape)
        if mb.triton_for(self.device):
            from ds4quant.formats.search.triton_sums import error_sums_device

            return error_sums_device(self.X, Y, self.E)
        from ds4quant.formats.search.torch_scale import to_host

        return error_sums(self.x, to_host(Y), self.err_w)
