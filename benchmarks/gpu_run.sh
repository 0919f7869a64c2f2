#!/usr/bin/env bash
# Everything the GPU owner needs a GPU for, in one call of under ten minutes on a lent GPU.
# From the staged checkout root:
#   OUT=/path/to/results bash benchmarks/gpu_run.sh
# Steps (each under its own timeout; a step's failure is reported and the next one runs):
#   1. device and versions                                   -> $OUT/device.txt
#   2. every GPU test file, one pytest process (numba compiles once), hashes recorded
#                                                            -> $OUT/tests.txt, $OUT/hashes.jsonl
#   3. the one-table benchmark (benchmarks/runtime_gpu_table.py): batches 1/64/512/2048,
#      four recipes, ours fast/exact vs bf16 grouped_mm and dense bf16, copy rate
#                                                            -> $OUT/table.json, $OUT/table.txt
#   4. the ahead-of-time compile check on all seven targets (no GPU needed: the host's cores):
#      one specialisation per kernel and scenario, or with AOT_FULL=1 every one (~1,000
#      compiles: minutes on 16 cores)                        -> $OUT/aot.json, $OUT/aot.txt
# Budgets (seconds): T_TESTS (default 300), T_TABLE (220), T_AOT (45; 0 skips): about 9.5 minutes
# with the install. None of it has run yet (written while no GPU was lent). T_BENCH=N also
# runs the older two-batch benchmark (benchmarks/runtime_gpu.py) for N seconds; T_SWEEP=N the
# prefill-sized kernels' tile sweep (benchmarks/runtime_gpu_prefill.py, SWEEP_ARGS) -> $OUT/prefill.json.
set -u
: "${OUT:?set OUT to a results folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 || { echo "editable install failed"; tail -5 "$OUT/pip.log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || rocm-smi 2>/dev/null
  python3 -c "import torch, triton, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', getattr(torch.version, 'hip', None), 'triton', triton.__version__, 'numba', numba.__version__, torch.cuda.get_device_name(0))"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# newest first: a budget that runs out cuts the long-established files
GPU_TESTS="tests/runtime/test_prefill_exact_cuda.py tests/runtime/test_exact_cuda.py tests/runtime/test_gemv_cuda.py
  tests/formats/test_fp4_torch.py tests/runtime/stream/test_forward.py::test_a_gpu_layer_decodes_its_experts_there_to_the_same_bits
  tests/calibrate/test_streamed.py::test_calibrate_on_cuda_writes_the_files tests/samples/test_train_smoke.py::test_same_seed_gives_identical_bytes_on_the_gpu tests/runtime/test_cuda_owner.py tests/runtime/test_identity.py tests/runtime/test_worker_cuda.py
  tests/runtime/test_execute.py tests/formats/test_torch_cuda.py tests/formats/search/test_triton_scale.py
  tests/formats/search/test_triton_mix.py tests/formats/search/test_triton_sums.py tests/plan/test_device.py"
GPU_TESTS=${TESTS:-$GPU_TESTS}  # TESTS="file[::test] ...": run these instead
if [ "${T_TESTS:-300}" != 0 ]; then
  # -v: a step cut by its budget still names every test that finished, and failures show as they happen
  DS4Q_GPU_RECORD="$OUT/hashes.jsonl" timeout "${T_TESTS:-300}" python3 -m pytest -v --tb=short -p no:cacheprovider \
    -rfEs ${TESTS_K:+-k "$TESTS_K"} $GPU_TESTS > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "FAIL|ERROR|passed|failed|skipped" "$OUT/tests.txt" | tail -30
fi
if [ "${T_TABLE:-220}" != 0 ]; then
  timeout "${T_TABLE:-220}" python3 benchmarks/runtime_gpu_table.py --out "$OUT/table.json" \
    --budget $(( ${T_TABLE:-220} - 40 )) ${TABLE_ARGS:-} > "$OUT/table.txt" 2>&1
  echo "table rc=$?"; tail -60 "$OUT/table.txt"
fi
if [ "${T_SWEEP:-0}" != 0 ]; then
  timeout "${T_SWEEP}" python3 benchmarks/runtime_gpu_prefill.py --out "$OUT/prefill.json" \
    --budget $(( ${T_SWEEP} - 30 )) ${SWEEP_ARGS:-} > "$OUT/prefill.txt" 2>&1
  echo "prefill sweep rc=$?"; grep -v Warn "$OUT/prefill.txt" | tail -40
fi
if [ "${T_BENCH:-0}" != 0 ]; then
  timeout "${T_BENCH}" python3 benchmarks/runtime_gpu.py --out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"; tail -32 "$OUT/bench.txt"
fi
if [ "${T_AOT:-45}" != 0 ]; then
  env -u TRITON_INTERPRET TRITON_CACHE_DIR="$(mktemp -d)" timeout "${T_AOT:-45}" python3 tests/aot/compile_all.py \
    $([ "${AOT_FULL:-0}" = 1 ] || echo --first) --jobs "$(nproc)" --json "$OUT/aot.json" > "$OUT/aot.txt" 2>&1
  echo "aot rc=$?"; tail -5 "$OUT/aot.txt"
fi
