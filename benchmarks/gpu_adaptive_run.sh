#!/usr/bin/env bash
# The lent-GPU run of issue 14 (adaptive measure stage on CUDA), from the staged checkout root:
#   OUT=... WHL=../whl T_TESTS=150 T_TINY=120 T_DS4=150 bash benchmarks/gpu_adaptive_run.sh
# In parallel (the first compile of the numba kernels is each process's own):
# 1. the CUDA identity tests: torch search / batched search / fitter / windowed mode 0 == numba, and
#    convert --device cuda == the CPU path on samples/ds4-tiny at the default effort (plan, errors,
#    GGUF sha256, measurement cache); the pairwise sum == this machine's np.sum;
# 2. benchmarks/adaptive.py --cost-only on samples/ds4-tiny: all cores vs --device cuda (plans, errors,
#    GGUF sha256 compared);
# 3. then --ds4-shape (DS4 Flash-shaped experts): --device cuda first, then all cores (digests compared).
# Everything that comes back is under $OUT (at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHL:-../whl}"/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip.log 2>&1 || { echo "editable install failed"; tail -5 /tmp/pip.log; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, numba, numpy, sys, os; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(0), 'cores', os.cpu_count())"
  grep -m1 "model name" /proc/cpuinfo; uptime; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
t0=$(date +%s)
( timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -rfEs \
    -k "cuda or batched or windowed or pairwise" tests/test_adaptive_device.py tests/test_adaptive_speed.py \
    > "$OUT/tests.txt" 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/tests.txt" ) &
S="--source samples/ds4-tiny --imatrix samples/ds4-tiny-calib/imatrix.gguf --routing samples/ds4-tiny-calib/routing.csv"
timeout "${T_TINY:-120}" python3 benchmarks/adaptive.py $S --cost-only --skip-anchor --skip-one-core --device cuda \
  --json --out /tmp/b-tiny > /tmp/b-tiny.json 2> "$OUT/tiny.err"
echo "tiny rc=$? $(( $(date +%s) - t0 )) s"
cp /tmp/b-tiny/cost-partial.json "$OUT/tiny_cost.json" 2>/dev/null
timeout "${T_DS4:-150}" python3 benchmarks/adaptive.py $S --cost-only --ds4-only --ds4-shape "${DS4_EXPERTS:-2}" \
  --skip-one-core --device cuda --device-first --json --out /tmp/b-ds4 > /tmp/b-ds4.json 2> "$OUT/ds4.err"
echo "ds4 rc=$? $(( $(date +%s) - t0 )) s"
cp /tmp/b-ds4/ds4shape-partial.json "$OUT/ds4_cost.json" 2>/dev/null
wait
tail -c 3000 "$OUT/tests.txt"; tail -c 1500 "$OUT/tiny.err"; tail -c 1500 "$OUT/ds4.err"
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in ("tiny_cost.json", "ds4_cost.json"):
    p = o / f
    if p.exists():
        d = json.loads(p.read_text())
        for k, v in d["paths"].items():
            print(f, k, {x: v.get(x) for x in ("measure_s", "s", "s_per_gb", "cpu_s_per_gb", "error_2.8333", "error_2.7", "gguf_sha256_2.8333", "digest")})
        print(f, "same_plans_and_bytes", d.get("same_plans_and_bytes"), "identical", d.get("identical"))
EOF
