#!/usr/bin/env bash
# Session 31, H200 call 4: the hybrid B = 1 iteration's 16-row matmuls (5.06 ms, 1.19x their bytes,
# call 3): XLA's Triton GEMMs (default) against cuBLAS (--xla_gpu_enable_triton_gemm=false), same call.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call4 $(( $(date +%s) - START ))s] $*"; }
for flags in "" "--xla_gpu_enable_triton_gemm=false"; do
  tag=${flags:+cublas}; tag=${tag:-default}
  say "hybrid B = 1, XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 240 python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 1 \
    --no-fold-share --trace "${TMPDIR:-/tmp}/htrace_$tag" --out "$OUT/hybrid_$tag.jsonl" 2>&1 | cut -c1-300 | tee "$OUT/hybrid_$tag.log"
done
say done
