"""Fast mode's clamped SwiGLU, the one copy every fast path calls.

    h = silu(min(g, limit)) * clamp(u, -limit, limit)       # DS4's experts (transformers' math)

Exact mode defines the same function bit for bit with basic operations only
(``runtime/exact.py``'s ``swiglu`` on the CPU, ``owners/torch_exact.py``'s
``swiglu_exact`` in torch ops: the same bits on every device). Fast mode
takes each array library's own exp: numpy's for the CPU owner's float32
arrays, torch's ``silu`` for torch tensors (torch owners, the device owner's
unfused stage, the home's shared expert). Fast mode's distance from exact is
measured, never assumed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["swiglu_fast"]


def swiglu_fast(g, u, limit: float):
    """float32 clamped SwiGLU of gate ``g`` and up ``u`` (same shape): numpy
    arrays give a numpy array (numpy's exp), torch tensors a tensor (``silu``)."""
    if isinstance(g, np.ndarray):
        L = np.float32(limit)
        gc = np.minimum(g, L)
        uc = np.clip(u, -L, L)
        with np.errstate(over="ignore"):
            return (gc / (np.float32(1.0) + np.exp(-gc)) * uc).astype(np.float32)
    import torch

    return torch.nn.functional.silu(torch.clamp(g, max=limit)) * torch.clamp(u, min=-limit, max=limit)
