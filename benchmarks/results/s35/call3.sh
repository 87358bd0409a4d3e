#!/usr/bin/env bash
# (Ran at commit c65305f: --gdn-form and the chunked form were removed after calls 3-5.)
# Session 35, H200 call 3: the GDN block kernel's chunked form (KernelConfig.gdn_form) against the
# walk: (1) equality and time of the kernel alone at 9B shapes, (2) the user's program at B = 1,
# walk then chunk (time-only), (3) the chunk's kernel time in the iteration's profile, (4) B = 32 with
# the chunk (call 1 had the walk: 24.188 ms, fold 4.7%).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
say "kernel alone"
timeout 120 python benchmarks/results/s35/gdn_check.py 2>&1 | grep -v Warning | tee "$OUT/gdn_check.log"
for f in walk auto; do
  say "9b B=1 time-only gdn_form $f"
  timeout 170 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 \
    --kinds plain,dflash --time-only on --gdn-form $f 2>&1 | grep -v Warning | grep "ms/step\|rror" | tee -a "$OUT/time.log"
done
say "9b B=1 dflash profile, chunk"
timeout 150 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 --kinds dflash \
  --top 14 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-200 | tee "$OUT/profile_9b_chunk.log" | tail -17
say "bench_hybrid 9b B=32 (chunk)"
timeout $(( 585 - ($(date +%s) - START) )) python scripts/bench_hybrid.py --paths kernel-bv32 --models 9b --batches 32 \
  --out "$OUT/hybrid_b32_chunk.jsonl" 2>&1 | grep -v Warning | cut -c1-300 | tee "$OUT/hybrid.log" | tail -3
say done
