#!/usr/bin/env bash
# Issue 57 (session 51): W8A8 per output channel (--w8a8 channel) in the whole B = 1 step against bf16, in one
# process (s50/call13.sh measured B = 8: DFlash 0.804x bf16). The rest of the session's device budget (~460 s).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s51/call4.sh", timeout_s=420, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 380 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8-channel" --quant-batches 1 \
  --loop-n 32,160 --reps 3 --compile-workers 8 --floor-tbs $TBS --budget-s 340 --out "$OUT" --json bench_gpu_channel_b1.json \
  2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_channel_b1.log" | tail -14
ls -la "$OUT"
