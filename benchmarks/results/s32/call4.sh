#!/usr/bin/env bash
# Session 32, H200 call 4 (issue 38): the hybrid target's residual adds and zero-centred norms as the
# fused add + RMSNorm kernel (the MLP output deferred into the next layer's norm), A/B in one call:
# this tree, then the same with models/qwen3_5.py as before the change (qwen3_5_before.py.txt beside
# this script); Qwen3.5-9B shapes, B = 1, traced; then the 35B-A3B B = 1 rows with the change.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call4 $(( $(date +%s) - START ))s] $*"; }
here=benchmarks/results/s32
run9b() {
  timeout 200 python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 1 --no-fold-share \
    --trace "${TMPDIR:-/tmp}/htrace_$1" --out "$OUT/hybrid9b_$1.jsonl" 2>&1 | tee "$OUT/hybrid9b_$1.log" | cut -c1-300 | tail -4
}
say "9b, fused norms"; run9b fused
cp dflash_jax/models/qwen3_5.py "$OUT/qwen3_5_after.py.txt"
cp $here/qwen3_5_before.py.txt dflash_jax/models/qwen3_5.py
say "9b, before"; run9b before
cp "$OUT/qwen3_5_after.py.txt" dflash_jax/models/qwen3_5.py
say "9b, fused norms again"; run9b fused2
say "35b-a3b, fused norms"
timeout 240 python scripts/bench_hybrid.py --paths kernel-bv32 --models 35b-a3b --batches 1 --moe-batches 1 \
  --no-fold-share --out "$OUT/hybrid35b_fused.jsonl" --budget-s 220 2>&1 | tee "$OUT/hybrid35b_fused.log" | cut -c1-300 | tail -4
say done
