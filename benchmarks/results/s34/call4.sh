#!/usr/bin/env bash
# Session 34, H200 call 4: bench_moe's loop (the BENCHMARKS table's rows, with their counted-expert
# floors) at B = 1, 8, 32 with the final routing kernel; call 3's ran out of time before it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
timeout 330 python scripts/bench_moe.py --sections loop --batches 1,8,32 --moe-gmms pallas_gpu --budget-s 300 \
  --out "$OUT" 2>&1 | grep -v Warning | grep "loop\|#" | cut -c1-250 | tee "$OUT/bench_moe.log"
