#!/usr/bin/env bash
# Session 31, H200 call 1: the GDN block kernel's tiling (value dims per program x warps) alone at
# Qwen3.5-9B widths, then the B = 1 hybrid iteration at block_v 8 / 16 / 32 (issue 38: 1.58x floor).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$OUT/env.log"
say "gdn kernel sweep"
timeout 200 python scripts/bench_gdn_kernel.py --block-v 8,16,32,64,128 --warps 1,2,4,8 --out "$OUT/gdn_kernel.jsonl" \
  2>&1 | grep -v Warning | tee "$OUT/gdn_kernel.log"
say "hybrid B = 1"
timeout $(( 585 - ($(date +%s) - START) )) python scripts/bench_hybrid.py --paths kernel-bv32,kernel-bv16,kernel-bv8 \
  --models 9b --batches 1 --out "$OUT/hybrid.jsonl" --budget-s $(( 560 - ($(date +%s) - START) )) 2>&1 | tee "$OUT/hybrid.log"
say done
