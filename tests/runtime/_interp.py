"""Triton's interpreter (TRITON_INTERPRET=1) for the kernel tests on the CPU.

``kernels(module)`` sets the variable before the kernel module is imported
(triton.jit reads it when it decorates) and applies ``patch_interpreter``:
triton 3.6's interpreter turns scalar kernel arguments (held as one-element
arrays) into Python ints with ``int(array)``, which numpy >= 2.3 refuses for
arrays of one dimension. The benchmarks' CPU smoke runs apply the same patch."""

from __future__ import annotations

import importlib
import os
import sys


def patch_interpreter() -> None:
    """Give the interpreter's tensors an ``__index__`` that reads their one element (idempotent)."""
    from triton.runtime import interpreter as ti

    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is not None and not getattr(orig, "_ds4q", False):
        def patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._ds4q = True
        ti._patch_lang_tensor = patched


def kernels(module: str):
    import pytest

    if not os.environ.get("TRITON_INTERPRET"):
        if module in sys.modules:
            pytest.skip(f"{module} already imported without TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    patch_interpreter()
    return importlib.import_module(module)


def device_kernels(module: str):
    """A kernel module as the tests run it: compiled where CUDA is present,
    under the interpreter elsewhere."""
    import pytest

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        return importlib.import_module(module)
    return kernels(module)
