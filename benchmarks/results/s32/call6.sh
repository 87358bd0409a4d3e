#!/usr/bin/env bash
# Session 32, H200 host call 6: call 3 repeated without its W = 7 column (4 GSM8K + 4 HumanEval
# prompts, 9 interleaved rounds): a third sample of the 16-core ratio (plain moved 380-410 tok/s
# between calls 1 and 2).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call6 $(( $(date +%s) - START ))s] $*"; }
say "cpu pair, 16 cores, 8 prompts"
JAX_PLATFORMS=cpu timeout 300 python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 9 --cpu-prompts 4 \
  --budget-s 280 --out "$OUT" --json cpu16.json 2>&1 | grep -v Warning | tee "$OUT/cpu16.log" | tail -12
say done
