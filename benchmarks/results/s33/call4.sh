#!/usr/bin/env bash
# Session 33, H200 call 4: one-row projections as two-row dots (models/layers.linear), A/B in one
# call. XLA:GPU had rewritten each [K] x [K, N] dot under 10M elements as a multiply writing the
# [K, N] product + a reduce (call 3's HLO): the MoE targets' o-projection at B = 1, 28 us a layer.
# profile_step's --small-dot 0 is the old program (every one-row dot as written).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call4 $(( $(date +%s) - START ))s] $*"; }
for sd in 0 default; do
  x=$([ $sd = default ] && echo "" || echo "--small-dot $sd")
  say "coder B=1 plain, small-dot $sd"
  timeout 150 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --kinds plain \
    --top 12 $x --out "$OUT" 2>&1 | grep -v Warning | cut -c1-200
  say "35b-a3b 8 layers B=1 plain, small-dot $sd"
  timeout 150 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 8 --batch 1 --kinds plain \
    --top 12 $x --out "$OUT" 2>&1 | grep -v Warning | cut -c1-200
done
say "bench_moe loop B=1 (default program, while graphs)"
timeout 200 python scripts/bench_moe.py --sections loop --batches 1 --moe-gmms pallas_gpu --budget-s 180 \
  --out "$OUT" 2>&1 | grep -v Warning | grep "loop\|#" | cut -c1-250
say "bench_hybrid 35b-a3b B=1 (40 layers)"
timeout 240 python scripts/bench_hybrid.py --paths kernel-bv32 --models 35b-a3b --batches 1 --moe-batches 1 \
  --no-fold-share --budget-s 220 --out "$OUT/hybrid_35b.jsonl" 2>&1 | grep -v Warning | cut -c1-300
say done
