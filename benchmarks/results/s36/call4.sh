#!/usr/bin/env bash
# Session 36, H200 call 4: issue 37's CPU rows with the host otherwise idle (calls 1 and 3 ran the
# 2-core pair beside GPU compiles: plain moved 226-368 tok/s between rounds): the embedded pair,
# real acceptance, on 2 pinned cores, then on all 16.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAX_PLATFORMS=cpu
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call4 $(( $(date +%s) - START ))s] $*"; }
say "2 cores"
taskset -c 0,1 timeout 250 python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 9 --out "$OUT" --json cpu2.json \
  > "$OUT/cpu2.log" 2>&1
grep -v "WARNING\|E0000\|===\|learning/" "$OUT/cpu2.log" | tail -8
say "16 cores"
timeout $(( 480 - ($(date +%s) - START) )) python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 7 --out "$OUT" \
  --json cpu16.json > "$OUT/cpu16.log" 2>&1
grep -v "WARNING\|E0000\|===\|learning/" "$OUT/cpu16.log" | tail -8
say done
