#!/usr/bin/env bash
# (Ran at commit bf11076: scripts/bench_skinny.py and the kernel it times were removed after this call.)
# Session 35, H200 call 1: (1) the 16-row matmuls, XLA's GEMM against a Pallas skinny kernel
# (pallas_kernels/skinny/gpu.py) at the Qwen3.5-9B projection shapes, device time per matmul vs the
# bytes floor, with a tile sweep at 16 rows (session 31: the 9B iteration's matmuls take 1.19x their
# weights' bytes at 16 rows, 1.05x at one row); (2) issue 38's B = 32 fold share of the 9B hybrid
# with the fold kernel (last measured with the XLA fold: 10.7%).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
say "bench_skinny rows 16,1 with the sweep at 16"
timeout 330 python scripts/bench_skinny.py --rows 16,1 --sweep --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/skinny.log"
say "bench_hybrid 9b B=32 (fold share)"
timeout 200 python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 32 \
  --out "$OUT/hybrid_b32.jsonl" 2>&1 | grep -v Warning | cut -c1-400 | tee "$OUT/hybrid.log" | tail -8
say done
