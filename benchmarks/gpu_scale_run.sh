#!/usr/bin/env bash
# benchmarks/scale.py on a lent CUDA GPU (one H200, 16 cores), from the checkout root, with the gguf
# wheel in .whl (the device image lacks it):
#   OUT=... LAYERS="2 4" SEQS=64 TOKENS=2048 MAXMEM=32G bash benchmarks/gpu_scale_run.sh
# For each N in LAYERS: generate a DS4 Flash slice of N layers (real dimensions, random weights) on the
# local disk, then the streamed reference pass, calibrate itself, uniform
# convert, adaptive convert --device cuda with calibrate's files and the streamed candidate pass on a
# cuda:0 owner, each in its own child:
# seconds per layer, peak host RSS, peak GPU memory, and the projection to 43 layers.
# SKIP=adaptive (steps to skip: reference,calibrate,uniform,adaptive,candidate), RECIPE=mxfp4 (the uniform
# recipe), CANDIDATE_OF=uniform (the candidate pass over the uniform artifact, before the adaptive convert),
# SENS=N (calibrate's sensitivity sequences), BATCH=N (calibrate's --batch-size and the streamed passes' batch), PROJECT_SEQS=N (calibrate projected at N sequences, default 128), PROFILE=1 (torch.profiler's top operators of the reference step),
# TESTS="file::test ..." (GPU tests run first, T_TESTS seconds at most), EXPERTS=N (fewer routed experts), RATIO_OFFSET=K (the slice starts at DS4 Flash's layer K: 2 gives a CSA and an HCA layer), SOURCE=DIR (an existing slice), KEEP=1 (keep
# /tmp/scaleN for a next call on the same warm machine).
# Everything that comes back is under $OUT (one JSON and one text file per N, device.txt).
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip.log 2>&1 || { echo "editable install failed"; tail -5 /tmp/pip.log; }
for p in formats codebooks runtime; do [ -e "ds4quant/$p" ] || ln -s "../$p" "ds4quant/$p"; done
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, sys, os; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'cores', os.cpu_count())"
  grep -m1 "model name" /proc/cpuinfo; git log -1 --format=%h 2>/dev/null; df -h /tmp | tail -1; free -g | head -2; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
if [ -n "${TESTS:-}" ]; then  # GPU tests first, after the install above (a bare checkout cannot import them)
  timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; tail -15 "$OUT/gpu_tests.txt"
fi
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -E 'H100|H200|MI300X' | tr A-Z a-z)}
for N in ${LAYERS:-2 4}; do
  t0=$(date +%s)
  timeout "${T_EACH:-3000}" python3 benchmarks/scale.py --layers "$N" --seqs "${SEQS:-64}" --tokens "${TOKENS:-2048}" \
      --device "${DEVICE:-cuda}" --max-memory "${MAXMEM:-32G}" --adaptive-candidates "${CANDIDATES:-default}" \
      ${SKIP:+--skip "$SKIP"} ${RECIPE:+--recipe "$RECIPE"} ${CANDIDATE_OF:+--candidate-of "$CANDIDATE_OF"} \
      ${SENS:+--sensitivity-seqs "$SENS"} ${BATCH:+--batch-size "$BATCH"} ${PROFILE:+--profile "$OUT/profile_flash${N}.txt"} \
      --project-seqs "${PROJECT_SEQS:-128}" ${EXPERTS:+--experts "$EXPERTS"} ${RATIO_OFFSET:+--ratio-offset "$RATIO_OFFSET"} ${SOURCE:+--source "$SOURCE"} \
      --work "/tmp/scale$N" --json-out "$OUT/scale_flash${N}_${CARD:-gpu}.json" > "$OUT/scale_flash${N}_${CARD:-gpu}.txt" 2>&1
  echo "N=$N rc=$? $(( $(date +%s) - t0 )) s"; tail -40 "$OUT/scale_flash${N}_${CARD:-gpu}.txt"
  # a SOURCE inside the work folder (a slice an earlier step kept) stays for the next step
  if [ "${KEEP:-0}" != 1 ]; then
    case "${SOURCE:-}" in "/tmp/scale$N"/*) find "/tmp/scale$N" -mindepth 1 -maxdepth 1 ! -path "${SOURCE%/}" -exec rm -rf {} + ;;
                          *) rm -rf "/tmp/scale$N" ;; esac
  fi
done
