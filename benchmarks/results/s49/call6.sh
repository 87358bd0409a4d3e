#!/usr/bin/env bash
# Issue 57, B >= 8 (the DFlash verify of 128-512 rows, where every 8-bit form loses to bf16: the checkpoint's
# K blocks need a scale inside the K loop, which cuBLASLt's fp8 GEMM on Hopper does not take): the weight
# requantized to one scale per output channel and x to one per row (gpu_w8a8.matmul_channel: one fp8 dot,
# scaled after it), per matmul (top kernels: is it cuBLAS's fp8 GEMM?) and chained over 36 layers.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s49/call6.sh", timeout_s=300, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 5 110 python3 scripts/bench_w8a8_chain.py --rows 1,16,128,512 --tbs $TBS \
  --forms "bf16,w8a8 model,w8a8 channel" 2>&1 | grep -v "$FILTER" | tee "$OUT/chain_channel.txt"
timeout -k 5 120 python3 scripts/bench_fp8_w8a8.py --rows 1,128,512,2048 --shapes qkv,o,gate_up,down --tbs $TBS \
  --variants "bf16 xla,w8a8 channel,w8a8 dequant" --json "$OUT/channel.json" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/channel.txt" | tail -52
ls -la "$OUT"
