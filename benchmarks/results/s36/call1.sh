#!/usr/bin/env bash
# Session 36, H200 call 1: issue 37's retirement (a one-shot "auto" loop settled on W = 0 decodes
# plainly to the end: no draft context, no width choice). (1) B = 128 at simulated tau 4.24 / 6.54
# against true plain (s30: auto 0.98x, W = 0 0.986x); (2) in parallel on 2 pinned host cores, the
# embedded pair on CPU (s32 on the dev host: auto 0.97x plain); (3) bench_moe's loop after s35's
# grouping change (issue 36: B = 8 1.37x / 1.35x before it).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
say "cpu pair on cores 0,1 (background)"
( JAX_PLATFORMS=cpu taskset -c 0,1 timeout 420 python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 5 \
    --out "$OUT" --json cpu2.json > "$OUT/cpu2.log" 2>&1 ) &
say "adaptive B=128"
taskset -c 2-15 timeout 330 python scripts/bench_adaptive.py --taus 4.24,6.54 --batches 128 --true-plain-batches 128 \
  --n2 256 --reps 3 --out "$OUT" --json ad128.json --budget-s 300 2>&1 | grep -v Warning | tee "$OUT/ad128.log" | tail -12
say "bench_moe loop"
taskset -c 2-15 timeout $(( 570 - ($(date +%s) - START) )) python scripts/bench_moe.py --sections loop --batches 1,8,32 \
  --moe-gmms pallas_gpu --budget-s $(( 540 - ($(date +%s) - START) )) --out "$OUT" 2>&1 | grep -v Warning \
  | grep "loop\|#" | cut -c1-250 | tee "$OUT/bench_moe.log"
wait
grep -v "WARNING\|E0000\|===\|learning/" "$OUT/cpu2.log" | tail -9
say done
