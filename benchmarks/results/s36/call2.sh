#!/usr/bin/env bash
# Session 36, H200 call 2: (1) issue 37: where the retired W = 0 step still trails true plain at
# B = 128 (call 1: W = 0 0.986x, auto 0.99x), per kernel (profile_width0.py; forced W = 0 now
# retires at once, so "w0" is the retired step); (2) issue 36: a tile sweep of the grouped matmul's
# two launches at a B = 8 step (64 rows) and a B = 8 verify (1,024 rows) against the default tiles.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call2 $(( $(date +%s) - START ))s] $*"; }
say "profile_width0 B=128"
timeout 230 python scripts/profile_width0.py --batch 128 --top 25 --out "$OUT" 2>&1 | grep -v Warning \
  | tee "$OUT/pw0.log" | tail -32
say "sweep_moe_tiles"
timeout $(( 575 - ($(date +%s) - START) )) python scripts/sweep_moe_tiles.py --tokens 8,128 \
  --budget-s $(( 545 - ($(date +%s) - START) )) --out "$OUT" 2>&1 | grep -v Warning > "$OUT/sweep.log"
grep -A8 "best per" "$OUT/sweep.log"; grep -c "us " "$OUT/sweep.log"
say done
