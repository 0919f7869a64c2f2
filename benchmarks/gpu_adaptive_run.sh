#!/usr/bin/env bash
# The adaptive measure stage on a lent CUDA GPU, from the checkout root, with
# the gguf wheel in .whl (the device image lacks it):
#   OUT=... T_TESTS=240 T_PROF=100 T_DS4=330 DS4_EXPERTS=16 bash benchmarks/gpu_adaptive_run.sh
# 1. the CUDA identity tests, which also fill numba's cache before anything is timed: the Triton MIX
#    and scale searches == numba at DS4 sizes, the torch searches == numba, and convert --device cuda
#    == the CPU path on samples/ds4-tiny (plan, errors, GGUF sha256, measurement cache);
# 2. --ds4-shape N (DS4 Flash-shaped experts) at full width: all cores on the CPU, --device cuda
#    (the Triton kernels) and --device cuda with every search as torch operations (the anchor),
#    one digest expected for all rows.
# 3. with T_PROF: one worker's per-candidate breakdown of the three paths and its profiles;
#    with T_WIDTH: the phases per matrix at widths WIDTHS (default 1 and every core) and a GIL probe.
# Everything that comes back is under $OUT (at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/pip.log 2>&1 || { echo "editable install failed"; tail -5 /tmp/pip.log; }
# pytest puts the checkout root first on sys.path: let ./ds4quant hold the mapped packages too
for p in formats codebooks runtime; do [ -e "ds4quant/$p" ] || ln -s "../$p" "ds4quant/$p"; done
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, numba, numpy, sys, os; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(0), 'cores', os.cpu_count())"
  grep -m1 "model name" /proc/cpuinfo; git log -1 --format=%h 2>/dev/null; uptime; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
t0=$(date +%s)
if [ "${T_TESTS:-240}" != 0 ]; then
  timeout "${T_TESTS:-240}" python3 -m pytest -q -p no:cacheprovider -rfEs ${TESTS:-tests/formats/search tests/plan/test_device.py} \
      -k "${TESTS_K:-not torch_cpu}" \
      > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests.txt"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -20
fi
if [ "${T_PROF:-0}" != 0 ]; then  # one worker's breakdown (benchmarks/adaptive_profile.py)
  timeout "$T_PROF" python3 benchmarks/adaptive_profile.py --device cuda > "$OUT/profile.txt" 2>&1
  echo "profile rc=$? $(( $(date +%s) - t0 )) s"; head -24 "$OUT/profile.txt"
fi
if [ "${T_WIDTH:-0}" != 0 ]; then  # phases per matrix at each width (benchmarks/adaptive_width.py)
  timeout "$T_WIDTH" python3 benchmarks/adaptive_width.py --device cuda --experts "${DS4_EXPERTS:-16}" \
    --widths "${WIDTHS:-1,$(nproc)}" --json "$OUT/width.json" > "$OUT/width.txt" 2>&1
  echo "width rc=$? $(( $(date +%s) - t0 )) s"; grep -v Warning "$OUT/width.txt" | tail -60
fi
if [ "${T_DS4:-330}" != 0 ]; then
  timeout "${T_DS4:-330}" python3 benchmarks/adaptive.py --cost-only --ds4-only --ds4-shape "${DS4_EXPERTS:-16}" \
    --threads "$(nproc)" --skip-one-core --skip-anchor --device cuda --device-first ${BENCH_ARGS:---device-anchor} \
    --json --out /tmp/b-ds4 > /tmp/b-ds4.json 2> "$OUT/ds4.err"
  echo "ds4 rc=$? $(( $(date +%s) - t0 )) s"
  cp /tmp/b-ds4/ds4shape-partial.json "$OUT/ds4_cost.json" 2>/dev/null
  tail -c 1500 "$OUT/ds4.err"
  python3 - "$OUT" <<'PY'
import json, sys, pathlib
p = pathlib.Path(sys.argv[1]) / "ds4_cost.json"
if p.exists():
    d = json.loads(p.read_text())
    for k, v in d["paths"].items():
        print(k, {x: (round(v[x], 2) if isinstance(v.get(x), float) else v.get(x)) for x in ("s", "s_per_gb", "cpu_s_per_gb", "load_average")}, v["digest"][:16])
    print("fp4_gb", d.get("fp4_gb"), "identical", d.get("identical"))
PY
fi
