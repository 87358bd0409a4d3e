#!/usr/bin/env bash
# Session 31, H200 call 2: the GDN kernel's new tiling (gdn_block_v 16; a verify block's warps by
# gated_delta.gpu.warps_for) against block_v 32 under the same rule, B = 1 and 32 (call 1: bv 32
# with the old 4 warps, 6.588 ms at B = 1).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call2 $(( $(date +%s) - START ))s] $*"; }
say "gdn kernel, default warps"
timeout 90 python scripts/bench_gdn_kernel.py --block-v 16,32 --warps 0 --out "$OUT/gdn_kernel.jsonl" \
  2>&1 | grep -v Warning | tee "$OUT/gdn_kernel.log"
say "hybrid"
timeout $(( 585 - ($(date +%s) - START) )) python scripts/bench_hybrid.py --paths kernel-bv16,kernel-bv32 \
  --models 9b --batches 1,32 --out "$OUT/hybrid.jsonl" --budget-s $(( 560 - ($(date +%s) - START) )) 2>&1 | tee "$OUT/hybrid.log"
say done
