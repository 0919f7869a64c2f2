# Sourced by scripts/test.sh and scripts/demo.sh: make (or reuse) a virtual
# environment in .venv and install ds4quant with everything it needs.
# torch is pinned to 2.13.0 first: that CPU wheel is on this kind of machine's
# disk, and a bare `torch` requirement would pull a multi-GB CUDA build.
# A first set-up says what it installs and how big it is (the sizes are
# docs/performance.md#first-run's), then each step's seconds, on stderr; a
# later run that finds the environment current says nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
_say() { echo "[setup] $*" >&2; }
_step() {  # _step WHAT CMD...: one line before, one with the seconds after
  local what=$1 t0=$SECONDS
  shift
  _say "$what ..."
  "$@"
  _say "$what: done in $((SECONDS - t0)) s"
}
if [ ! -x .venv/bin/python ]; then
  _say "first run: making .venv (about 2.1 GB once installed: PyTorch CPU 754 MB, Triton 641 MB, llvmlite 173 MB, transformers 129 MB)"
  _step "python -m venv .venv" "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.ds4quant-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  _say "installing into .venv (minutes on a first run, mostly download)"
  # pip's download bar for the one big wheel on a terminal; quiet otherwise
  bar=-q
  if [ -t 2 ]; then bar=--progress-bar=on; fi
  _step "pip: upgrade pip" python -m pip install -q --upgrade pip
  _step "pip: torch 2.13.0 (the CPU wheel, 754 MB)" python -m pip install "$bar" "torch==2.13.0"
  _step "pip: ds4quant[dev], editable (numba, transformers, triton for the kernel tests, pytest)" \
    python -m pip install -q -e ".[dev]"
  touch "$stamp"
  _say "done; 'source .venv/bin/activate' puts ds4quant on your PATH"
fi
