#!/usr/bin/env bash
# Session 31, H200 call 5: the hybrid MoE target issue 38 names, Qwen3.5-35B-A3B shapes (random bf16,
# 40 layers, 10 full-attention, 256 experts top-8 + shared), B = 1 and 8: plain step and DFlash
# iteration against their floors, the fold's share, a trace of each row. Never measured before.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call5 $(( $(date +%s) - START ))s] $*"; }
say "hybrid 35B-A3B"
timeout 440 python scripts/bench_hybrid.py --paths kernel-bv32 --models 35b-a3b --batches 1 --moe-batches 1,8 \
  --trace "${TMPDIR:-/tmp}/htrace" --out "$OUT/hybrid_35b.jsonl" --budget-s 420 2>&1 | cut -c1-400 | tee "$OUT/hybrid_35b.log"
say done
