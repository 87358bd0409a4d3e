#!/usr/bin/env bash
# Session 35, H200 call 2: where the time goes now, for the next steps of issues 38 and 36: every
# kernel family of the Qwen3.5-9B B = 1 DFlash iteration in the user's program (session 31's
# breakdown came from bench_hybrid's old loop), and of a Coder-30B-A3B B = 8 plain step (the sorted
# expert path's bookkeeping, 1.37x its floor).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call2 $(( $(date +%s) - START ))s] $*"; }
say "9b 32 layers B=1 dflash, every kernel"
timeout 240 python scripts/profile_step.py --preset qwen3.5-9b --layers 0 --draft-layers 5 --batch 1 --kinds dflash \
  --top 45 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230 | tee "$OUT/profile_9b.log" | head -80
say "coder 12 layers B=8 plain, every kernel"
timeout 200 python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 8 --kinds plain \
  --top 45 --out "$OUT" 2>&1 | grep -v Warning | cut -c1-230 | tee "$OUT/profile_coder_b8.log" | head -70
say done
