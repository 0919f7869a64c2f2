# Sourced by scripts/test.sh and scripts/demo.sh: make (or reuse) a virtual
# environment in .venv and install ds4quant with everything it needs.
# torch is pinned to 2.13.0 first: that CPU wheel is on this kind of machine's
# disk, and a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.ds4quant-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
