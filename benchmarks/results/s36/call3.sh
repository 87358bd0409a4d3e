#!/usr/bin/env bash
# Session 36, H200 call 3: issue 36, the grouped gmm's 128-column tiles (gpu.launch_tiles, from call
# 2's sweep) against the previous gpu.py (old_moe_gpu.py.txt swapped in for "old"), the user's
# program, Coder-30B-A3B 12 layers: B = 8 plain and DFlash, B = 1 DFlash; then bench_moe's loop
# (floors from the counted experts) at B = 8, 1, 32. In the background on 2 pinned host cores, the
# embedded pair on CPU again (issue 37, call 1 ran it beside compiles: plain moved 226-368 tok/s).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call3 $(( $(date +%s) - START ))s] $*"; }
( JAX_PLATFORMS=cpu taskset -c 0,1 timeout 500 python scripts/bench_adaptive.py --cpu-pair --cpu-rounds 9 \
    --out "$OUT" --json cpu2.json > "$OUT/cpu2.log" 2>&1 ) &
keep=$(mktemp -d); cp pallas_kernels/moe/gpu.py "$keep/new_gpu.py"
use() { if [ "$1" = old ]; then cp benchmarks/results/s36/old_moe_gpu.py.txt pallas_kernels/moe/gpu.py;
        else cp "$keep/new_gpu.py" pallas_kernels/moe/gpu.py; fi; }
for spec in "new 8 plain,dflash" "old 8 plain,dflash" "new 1 dflash" "old 1 dflash"; do
  set -- $spec
  left=$(( 330 - ($(date +%s) - START) )); [ $left -lt 40 ] && { say "skip $spec"; continue; }
  use $1; say "$1 B=$2 $3"
  taskset -c 2-15 timeout $left python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch $2 \
    --kinds $3 --time-only on 2>&1 | grep -v Warning | grep "ms/step\|rror" | sed "s/^/$1 /" | tee -a "$OUT/time.log"
done
use new
say "bench_moe loop"
taskset -c 2-15 timeout $(( 560 - ($(date +%s) - START) )) python scripts/bench_moe.py --sections loop --batches 8,1,32 \
  --moe-gmms pallas_gpu --budget-s $(( 530 - ($(date +%s) - START) )) --out "$OUT" 2>&1 | grep -v Warning \
  | grep "loop\|#" | cut -c1-250 | tee "$OUT/bench_moe.log"
wait
grep -v "WARNING\|E0000\|===\|learning/" "$OUT/cpu2.log" | tail -9
say done
