#!/usr/bin/env bash
# Train several seeds of the copy sample side by side on one GPU and pack each checkpoint
# (with its log) into one tar: the lent GPU machine returns at most 8 files a call, and a
# seed's checkpoint is 8. On CUDA train_ds4_copy.py runs deterministic kernels, so a seed
# trained here is the seed a later run reproduces; then pick one on the CPU with
#   python samples/measure_ds4_copy.py --source DIR --work W --copy-sets 5
#
#   OUT=/path SEEDS="5 6 7 8" bash samples/train_seeds.sh            # engine shape, CUDA
#   OUT=/path SEEDS="5 6" ENGINE=0 bash samples/train_seeds.sh       # ds4-copy's shape
#   OUT=/path SEEDS="1 2" DEVICE=cpu EXTRA=--smoke bash samples/train_seeds.sh   # a smoke run
# Five runs shared an H100 at about 0.35 s a step each (1,025 steps: ~6 minutes); MAX_S stops
# a run early (its report records the steps done) so the call ends inside its limit.
set -u
: "${OUT:?set OUT to a results folder}" "${SEEDS:?set SEEDS to the seeds to train}"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
shape=$([ "${ENGINE:-1}" = 1 ] && echo --engine-shape)
mkdir -p "$OUT"
for s in $SEEDS; do
  python3 "$here/train_ds4_copy.py" --device "${DEVICE:-cuda}" $shape --seed "$s" --threads "${THREADS:-3}" \
    --max-seconds "${MAX_S:-470}" --log-every 100 --out "$work/seed$s" ${EXTRA:-} > "$work/train$s.log" 2>&1 &
done
wait
for s in $SEEDS; do
  if [ -d "$work/seed$s" ]; then
    cp "$work/train$s.log" "$work/seed$s/"
    tar -C "$work" -cf "$OUT/seed$s.tar" "seed$s"
  fi
  echo "seed $s: $(grep -v Warn "$work/train$s.log" | tail -1)"
done
rm -rf "$work"
