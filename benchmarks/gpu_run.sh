#!/usr/bin/env bash
# The CUDA owner on a lent GPU: the benchmark, then the CUDA tests + identity hashes
# (one pytest process, so numba compiles once). From the staged checkout root:
#   OUT=... T_BENCH=130 T_TESTS=190 bash benchmarks/gpu_run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || { echo "editable install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/device.txt" 2>&1
python3 -c "import torch, triton, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numba', numba.__version__, torch.cuda.get_device_name(0))" >> "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
if [ "${T_BENCH:-130}" != 0 ]; then
  timeout "${T_BENCH:-130}" python3 benchmarks/runtime_gpu.py --out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"; tail -32 "$OUT/bench.txt"
fi
if [ "${T_TESTS:-190}" != 0 ]; then
  DS4Q_GPU_RECORD="$OUT/hashes.jsonl" timeout "${T_TESTS:-190}" python3 -m pytest -v -p no:cacheprovider -rfEs \
    --timeout 90 -k "${TESTS_K:-exact_slots or fast_kernels or placements or device_owner}" \
    tests/runtime/test_cuda_owner.py tests/runtime/test_identity.py > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" "$OUT/tests.txt" | tail -45
fi
