#!/usr/bin/env bash
# The engine interop check: llama.cpp (through llama-cpp-python) loads and runs our artifacts.
#
# llama-cpp-python has no CPU wheel on the package index for this platform: pip builds its
# vendored llama.cpp (about 4 minutes on a quiet 2-core box, far longer under load). It is installed once into .venv
# (the default CI never needs it; the interop tests skip cleanly without it) and reused after.
# Extra arguments go to pytest, e.g. `bash scripts/interop.sh -k q8_0`.
#
#   bash scripts/interop.sh                  # install if needed, then tests/interop
#   LLAMA_CPP_JOBS=8 bash scripts/interop.sh  # more build jobs on a bigger machine
source "$(dirname "$0")/_env.sh"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"  # vendors ggml-org/llama.cpp 0c1e57098 (LLM_ARCH_DEEPSEEK4)
if ! python -c "import llama_cpp" 2>/dev/null; then
  echo "interop: building $LLAMA_CPP_PYTHON (CPU only; minutes; cached in .venv afterwards)" >&2
  # CPU build without host-specific instructions, so the same .venv works on the CI box
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_HIP=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="${LLAMA_CPP_JOBS:-2}" \
    python -m pip install -v "$LLAMA_CPP_PYTHON"
fi
python -c "import llama_cpp; print('interop: llama-cpp-python', llama_cpp.__version__)"
DS4QUANT_INTEROP_REPORT="${DS4QUANT_INTEROP_REPORT:-interop-figures.json}" python -m pytest -q -s tests/interop "$@"
