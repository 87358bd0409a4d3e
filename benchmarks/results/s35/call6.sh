#!/usr/bin/env bash
# Session 35, H200 call 6: the MoE grouping by comparison (models/moe.group_rows: ranks from an
# [R, R] compare-and-count for R <= 1,024 rows instead of argsort + bincount + the inverse's scatter;
# gpu.group_list's non-empty groups by a compare-and-count instead of a sort of G keys) against the
# previous files (old_*.py.txt, swapped in for the "old" runs), the user's program, Coder-30B-A3B
# 12 layers: B = 8 plain and DFlash, then B = 1 DFlash (its 16 verify rows x 8 choices).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call6 $(( $(date +%s) - START ))s] $*"; }
keep=$(mktemp -d); cp dflash_jax/models/moe.py "$keep/new_moe.py"; cp pallas_kernels/moe/gpu.py "$keep/new_gpu.py"
use() { if [ "$1" = old ]; then cp benchmarks/results/s35/old_moe.py.txt dflash_jax/models/moe.py; cp benchmarks/results/s35/old_moe_gpu.py.txt pallas_kernels/moe/gpu.py;
        else cp "$keep/new_moe.py" dflash_jax/models/moe.py; cp "$keep/new_gpu.py" pallas_kernels/moe/gpu.py; fi; }
for spec in "new 8 plain,dflash" "old 8 plain,dflash" "new 1 dflash" "old 1 dflash"; do
  set -- $spec
  left=$(( 320 - ($(date +%s) - START) )); [ $left -lt 40 ] && { say "skip $spec"; continue; }
  use $1; say "$1 B=$2 $3"
  timeout $left python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch $2 --kinds $3 \
    --time-only on 2>&1 | grep -v Warning | grep "ms/step\|rror" | sed "s/^/$1 /" | tee -a "$OUT/time.log"
done
use new
say done
