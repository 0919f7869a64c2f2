#!/usr/bin/env bash
# The lent-GPU run of issue 14 (adaptive measure stage on CUDA), from the staged checkout root:
#   OUT=... T_TESTS=60 T_BENCH=80 bash benchmarks/gpu_adaptive_run.sh
# 1. (in the background) the CUDA identity unit tests (torch search, fitter, windowed mode 0 == numba / legacy);
# 2. benchmarks/adaptive.py --cost-only on samples/ds4-tiny: all cores vs --device cuda (plans, errors,
#    GGUF sha256 compared: the convert identity check) and --ds4-shape 1 (one DS4 Flash-shaped expert).
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || { echo "editable install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt" 2>&1
python3 -c "import torch, numba, sys, os; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, torch.cuda.get_device_name(0), 'cores', os.cpu_count())" >> "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
t0=$(date +%s)
# the unit tests beside the benchmark (one or two of the 16 cores; saves a minute of device time)
( timeout "${T_TESTS:-60}" python3 -m pytest -q -p no:cacheprovider -rfEs -k "(cuda or windowed) and not convert_on_cuda" \
  tests/test_adaptive_device.py > "$OUT/tests.txt" 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/tests.txt" ) &
timeout "${T_BENCH:-80}" python3 benchmarks/adaptive.py --source samples/ds4-tiny \
  --imatrix samples/ds4-tiny-calib/imatrix.gguf --routing samples/ds4-tiny-calib/routing.csv \
  --cost-only --skip-anchor --skip-one-core --device cuda --ds4-shape 1 --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"; tail -30 "$OUT/bench.txt"
wait; tail -8 "$OUT/tests.txt"
