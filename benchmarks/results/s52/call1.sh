#!/usr/bin/env bash
# Issue 56: where the paged server's extra ~10% per step goes at K = 2 (s51/call2: served c = 32, paged 0.86-0.89x
# fixed, TPOT 4.3 against 3.9 ms, while offline at K = 4 the paged engine was 1.03-1.08x fixed). Here both engines
# offline as the server drives them (K = 2, refill as soon as one slot frees, no refill ahead), traced
# (bench_engine --trace: device busy and idle per program, side by side in one process). Then issue 57: W8A8 per
# output channel at B = 32 against bf16 in one process (the last unmeasured row of its table).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s52/call1.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
elapsed() { echo $(( $(date +%s) - T0 )); }
timeout -k 5 270 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 160 --slots 32 --steps 2 --insert-width 8 --step-buckets off --refill-min 1 --refill-ahead off \
  --max-prompt 128 --min-new 64 --max-new 128 --simulated-tau 6.35 --verify-width auto --page-size 16 \
  --kv-pages off,auto --trace /tmp/trace_k2 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_k2_trace.txt" | tail -60
left=$(( 570 - $(elapsed) ))
echo "[s52 call1] W8A8 per channel at B = 32 with $left s left"
[ $left -ge 150 ] && timeout -k 10 $(( left - 10 )) python3 scripts/bench_gpu.py --sections quant \
  --quantize "fp8-w8a8-channel" --quant-batches 32 --loop-n 32,160 --reps 3 --compile-workers 8 \
  --floor-tbs $TBS --budget-s $(( left - 30 )) --out "$OUT" --json bench_gpu_channel_b32.json 2>&1 | grep -v "$FILTER" \
  | cut -c1-400 | tee "$OUT/gpu_channel_b32.log" | tail -16
ls -la "$OUT"
