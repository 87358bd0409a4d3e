#!/usr/bin/env bash
# Session 32, H200 call 5 (issue 37, the served anchor at concurrency 1): the engine's bucket-1 step
# against generate's loop at one row, Qwen3-8B shapes, random bf16, the full width forced (what
# auto picks at one row), K = 4 iterations a step; session 29 inferred ~7.4 ms an iteration served
# against the loop's 5.5, and session 30's host-path fix was measured only on the 2-core CPU.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call5 $(( $(date +%s) - START ))s] $*"; }
say "engine breakdown, bucket 1"
timeout 440 python scripts/bench_engine.py --preset qwen3-8b --random-init --breakdown --breakdown-rows 1 \
  --slots 32 --steps 4 --verify-width 15 --step-buckets 1/32 2>&1 | grep -v Warning | tee "$OUT/engine_b1.log" | tail -25
say done
