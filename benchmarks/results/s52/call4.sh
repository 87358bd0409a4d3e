#!/usr/bin/env bash
# Issue 57, for the next device session: W8A8 per output channel at B = 32 against bf16 in one process, the call to
# itself (s52/call1 gave it 270 s: its precompile had built one program of four when the call ended).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s52/call4.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 570 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8-channel" --quant-batches 32 \
  --loop-n 32,160 --reps 3 --compile-workers 8 --floor-tbs $TBS --budget-s 540 --out "$OUT" \
  --json bench_gpu_channel_b32.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_channel_b32.log" | tail -16
ls -la "$OUT"
