"""Suite-wide settings.

Hypothesis runs derandomized (examples derived from each test's source), with
no example database, so a run never depends on an earlier run or on luck:
the same checkout gives the same examples on every machine.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ds4quant",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ds4quant")

# Without a GPU, Triton kernels can only run in Triton's interpreter. The variable
# must be set before any module defining kernels is imported (triton.jit reads it
# when it decorates), and collection imports the runtime early (test modules that
# build a CUDA owner import the kernel modules), so it is set here, before every
# test module. With a GPU the kernels compile, and the interpreter tests skip.
import importlib.util  # noqa: E402
import os  # noqa: E402

if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch  # noqa: E402

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
