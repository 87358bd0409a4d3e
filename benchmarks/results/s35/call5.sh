#!/usr/bin/env bash
# (Ran at commit 6aa41d4: --gdn-form and the chunked form were removed after this call.)
# Session 35, H200 call 5: the chunked GDN kernel with tensor-core float32 products (call 4: its
# IEEE dots took 110 us a 9B layer, one TF32 pass 12 us, the walk 21): (1) precision x warps alone,
# with the difference from the walk; (2) the user's program at B = 1, walk then chunk (tf32x3, the
# default now); (3) B = 32 with the chunk (call 1's walk: 24.188 ms, fold 4.7%).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call5 $(( $(date +%s) - START ))s] $*"; }
say "precision x warps"
timeout 150 python benchmarks/results/s35/gdn_prec.py 2>&1 | grep -v Warning | tee "$OUT/gdn_prec.log"
for f in walk auto; do
  say "9b B=1 time-only gdn_form $f"
  timeout 170 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 \
    --kinds plain,dflash --time-only on --gdn-form $f 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee -a "$OUT/time.log"
done
say "bench_hybrid 9b B=32 (chunk)"
timeout $(( 560 - ($(date +%s) - START) )) python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 32 \
  --out "$OUT/hybrid_b32_chunk.jsonl" 2>&1 | grep -v Warning | cut -c1-300 | tee "$OUT/hybrid.log" | tail -3
say done
