#!/usr/bin/env bash
# Prepared in session 49 for the next device session (issue 56, not yet run): the paged engine's page size. Served,
# the paged server runs ~7% under the fixed one at c = 32 (s49/call3, call5: 0.93x), offline its step costs 14% more
# busy time (s47). With pages of 16 and the GPU attention's 64-key tiles (D 128), every KV tile spans four pages and
# loads each key's page id and row (a gather load, pallas_kernels/attention/gpu.py); pages of 64 make each tile one
# page, read as a contiguous slice. Offline, one process each: static B = 32 and the fixed engine (baseline), the
# paged engine with pages of 16, then with pages of 64 (same positions in the pool).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s49/call8.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
run() {   # NAME PAGE_SIZE KV_PAGES
  timeout -k 10 250 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 --prompts 288 \
    --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
    --simulated-tau 6.35 --verify-width auto --page-size $2 --kv-pages $3 2>&1 | grep -v "$FILTER" | cut -c1-400 \
    | tee "$OUT/engine_$1.txt" | tail -6
}
run p16 16 off,auto
run p64 64 auto
ls -la "$OUT"
