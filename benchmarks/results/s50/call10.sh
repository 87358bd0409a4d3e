#!/usr/bin/env bash
# Issue 56 (session 50): the GPU page-write kernel (pallas_kernels/attention/gpu_cache_write.py: one Triton kernel per
# layer storing the block's K/V rows into their pages) against XLA's page-wise write (gather the touched pages, update,
# scatter back, for K and for V: s47 counted 53% more kernels and 14% more busy time in the paged step than the fixed
# one). Offline bench_engine as s49/call5 and s47/call2 (288 prompts of 128, 64-128 new, 32 slots, K = 4, tau 6.35
# simulated), one process per tree, each with its own static B = 32 row: NEW (this tree: fixed rows, then paged with
# the kernel), OLD (old/: the tree before the kernel, paged with XLA's write), then NEW with pages of 64 if time is left.
# Stage: .clean as usual, plus .clean/old_files/{attention,cache}.py from the commit before the kernel (895ac4a~1; the
# old tree is that copy of .clean: the device's carry limit), then
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s50/call10.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
rm -rf old && mkdir old && cp -r dflash_jax pallas_kernels scripts old/ && cp old_files/attention.py old_files/cache.py \
  old/dflash_jax/ && rm old/pallas_kernels/attention/gpu_cache_write.py || exit 1
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {   # NAME TREE PAGE_SIZE KV_PAGES
  local left=$(( 575 - $(elapsed) ))
  [ $left -lt 100 ] && { echo "[s50 call10] $1 skipped ($left s left)"; return; }
  echo "[s50 call10] $1 at $(elapsed) s"
  (cd "$2" && PYTHONPATH=$PWD timeout -k 5 $left python3 scripts/bench_engine.py --preset qwen3-8b --random-init \
    --dtype bfloat16 --prompts 288 --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 \
    --min-new 64 --max-new 128 --simulated-tau 6.35 --verify-width auto --page-size $3 --kv-pages $4) 2>&1 \
    | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_$1.txt" | tail -4
}
run new_p16 . 16 off,auto
run old_p16 old 16 auto
run new_p64 . 64 auto
ls -la "$OUT"
