#!/usr/bin/env bash
# Issue 57, for the next device session: the B = 32 DFlash iteration, W8A8 per output channel against bf16 in one
# process, the one row of the B = 1/8/32 table still missing. s52/call4 (run in session 53 on an H100) timed both
# plain steps (bf16 7.098, per channel 5.447 ms: 0.767x) and DFlash bf16 (17.210 ms), but its four programs' precompile
# took 494 s (445-467 s each, three in parallel; plain bf16 alone 27 s) and left no time for the per-channel DFlash
# row. Here only the DFlash rows (--quant-kinds dflash), compiled two at a time.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s53/call3.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; } | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 575 python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8-channel" --quant-batches 32 \
  --quant-kinds dflash --loop-n 32,160 --reps 3 --compile-workers 2 --floor-tbs $TBS --budget-s 560 --out "$OUT" \
  --json bench_gpu_channel_b32_dflash.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu.log" | tail -16
