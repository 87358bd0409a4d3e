#!/usr/bin/env bash
# Session 34, H200 call 3: call 2 again with the routing kernel rewritten (call 2's took 4.4 us a
# B = 1 layer, one 4-warp program over all rows, and made the 35B-A3B DFlash iteration 3.8% slower:
# now a one-warp program per row, k argmax reductions, the picks' values reloaded from their
# logits, a sorting network for the ascending order). The MoE routing kernel (KernelConfig.moe_route: softmax, top-k,
# renormalisation and the choices' ascending order in one Triton launch; the one-token path's x
# shared and its raw buffers chained, no metadata, pad or sort). A/B on / off in one call:
# per-kernel profile of a B = 1 Coder-30B-A3B plain step, the user's program (time-only) at B = 1
# and 8 for Coder-30B-A3B (12 layers) and the Qwen3.5-35B-A3B hybrid (40 layers), then bench_moe's
# loop (the BENCHMARKS table).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
for r in off on; do
  say "coder 12 layers B=1 plain profile, moe_route $r"
  timeout 120 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --kinds plain \
    --top 24 --moe-route $r --out "$OUT" 2>&1 | grep -v Warning | cut -c1-200 | tee -a "$OUT/profile.log" | head -30
done
for r in off on; do
  for b in 1 8; do
    say "coder 12 layers B=$b time-only, moe_route $r"
    timeout 150 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch $b --kinds plain,dflash \
      --time-only on --moe-route $r 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee -a "$OUT/time.log"
  done
done
for r in off on; do
  say "35b-a3b 40 layers B=1 time-only, moe_route $r"
  timeout 200 python scripts/profile_step.py --preset qwen3.5-35b-a3b --layers 0 --batch 1 --kinds plain,dflash \
    --time-only on --moe-route $r 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee -a "$OUT/time.log"
done
say "9b 32 layers B=1 time-only (call 1's 6.181 ms again)"
timeout 150 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 \
  --kinds plain,dflash --time-only on 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee -a "$OUT/time.log"
say "bench_moe loop B=1,8 (default program)"
timeout 260 python scripts/bench_moe.py --sections loop --batches 1,8 --moe-gmms pallas_gpu --budget-s 240 \
  --out "$OUT" 2>&1 | grep -v Warning | grep "loop\|#" | cut -c1-250 | tee "$OUT/bench_moe.log"
say done
