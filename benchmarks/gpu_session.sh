#!/usr/bin/env bash
# One lent-GPU call that re-measures what changed since the last full runs, in order of value:
#   1. the streamed reference over a full-width 2-layer DS4 Flash slice (benchmarks/gpu_scale_run.sh)
#   2. the GPU tests named in FIRST_TESTS and TESTS (benchmarks/gpu_run.sh's test step)
#   3. the one-table benchmark for TABLE_ARGS (benchmarks/gpu_run.sh's table step)
# OUT=dir bash benchmarks/gpu_session.sh; budgets T_SCALE, T_TESTS, T_TABLE (seconds).
set -u
: "${OUT:?set OUT to a results folder}"
mkdir -p "$OUT/scale" "$OUT/run"
OUT="$OUT/scale" LAYERS=2 SEQS=${SEQS:-8} TOKENS=2048 MAXMEM=32G SKIP=${SKIP:-uniform,candidate,adaptive} \
  T_EACH=${T_SCALE:-330} bash benchmarks/gpu_scale_run.sh 2>&1 | tail -25
# the newest kernels' GPU tests first (FIRST_TESTS="" leaves them out)
FIRST_TESTS=${FIRST_TESTS-tests/runtime/test_prefill_exact_cuda.py::test_exact_grouped_gives_the_definitions_bytes}
[ -n "${TESTS:-}" ] && TESTS="$FIRST_TESTS $TESTS"
export TESTS
OUT="$OUT/run" T_AOT=0 T_TESTS=${T_TESTS:-90} T_TABLE=${T_TABLE:-100} bash benchmarks/gpu_run.sh > "$OUT/run/log.txt" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/run/tests.txt" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150 | tail -30
grep -A25 "^___" "$OUT/run/tests.txt" | head -40
grep -v Warn "$OUT/run/table.txt" | tail -14
