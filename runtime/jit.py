"""How the CPU kernels (``fast.py``, ``exact.py``, ``exact_wide.py``) are called.

- ``jit_call``: call a numba kernel compiled, on first use for its argument
  types, with LLVM's SLP vectoriser on (numba leaves it off by default; it
  packs independent scalar operations and cannot change a bit);
- ``parallel``: whether a product is large enough for the kernels with a
  parallel region (numba's launch costs 0.1-2 ms on a busy host, more than a
  small product; the serial twins give the same bits: every output is
  computed alone either way);
- ``readonly``: one array signature for memmaps, copies and views alike.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

PARALLEL_MIN_WORK = 1 << 21  # weights x tokens from which the parallel kernels pay off


def parallel(work: int) -> bool:
    return work >= PARALLEL_MIN_WORK


def readonly(a: np.ndarray, dtype=None) -> np.ndarray:
    """A read-only C-contiguous view: one numba signature for memmaps, copies
    and views alike (each distinct signature costs a compile)."""
    v = np.ascontiguousarray(a, dtype=dtype).view()
    v.setflags(write=False)
    return v


_SLP_LOCK = threading.Lock()
_SLP_DONE: set = set()


def _arg_key(a):
    # what numba's typing of an argument depends on, without numba.typeof (whose
    # Python-level cost, ~100 us per array, would dominate a batch-1 call)
    if isinstance(a, np.ndarray):
        f = a.flags
        return (a.dtype.str, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
    return type(a)


def jit_call(fn, *args):
    """Call ``fn(*args)``, compiling it for these argument types with LLVM's
    SLP vectoriser on the first time (numba.core.config.SLP_VECTORIZE is read
    at each compilation; cache=True keeps the vectorised code)."""
    key = (fn, tuple(_arg_key(a) for a in args))
    if key not in _SLP_DONE:
        from numba.core import config

        with _SLP_LOCK:
            if key not in _SLP_DONE:
                old = config.SLP_VECTORIZE
                config.SLP_VECTORIZE = 1
                try:
                    fn.compile(tuple(numba.typeof(a) for a in args))
                finally:
                    config.SLP_VECTORIZE = old
                _SLP_DONE.add(key)
    return fn(*args)
