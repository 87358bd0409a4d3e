#!/usr/bin/env bash
# Session 32, H200 host call 2: the embedded pair on the host's 16 CPU cores (issue 37's 1.3x goal)
# with the CPU width set (0, 3, 7, 15) and the capacity-sized KV chunk (128 keys here), with fixed
# widths 3 and 7 beside plain, W = 0, the whole block and auto.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call2 $(( $(date +%s) - START ))s] $*"; }
nproc
say "cpu pair, 16 cores"
JAX_PLATFORMS=cpu timeout 420 python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 7 --cpu-widths 3,7 \
  --budget-s 400 --out "$OUT" --json cpu16.json 2>&1 | grep -v Warning | tee "$OUT/cpu16.log" | tail -20
say done
