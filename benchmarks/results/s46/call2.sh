#!/usr/bin/env bash
# Session 46 (issue 57): session 45's prepared call3.sh plus a profile of the W8A8 B = 1 DFlash loop.
# (0) scripts/bench_w8a8_chain.py: 36 layers' four 8-bit matmuls chained, each form's wall time and kernels per
#     layer at 1 and 16 rows (does the one-kernel Pallas form win at one row once launch gaps count?);
# (1) scripts/bench_w8a8_rows.py at 512 and 2048 rows (fp8 dots vs the dequantized operands' one dot vs bf16):
#     the many-row form's first GPU timing;
# (2) the whole step at B = 1 and 32, FP8 W8A8 and weight-only FP8 against bf16 in one process, then the
#     profile section on the W8A8 target (--profile-quantize: device time per iteration by kernel, and the
#     idle/launch gaps against the measured iteration): where the 1.7x-over-the-floor goes.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s46/call2.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
timeout -k 10 130 python3 scripts/bench_w8a8_chain.py --rows 1,16 --tbs $TBS 2>&1 | grep -v "$FILTER" | tee "$OUT/w8a8_chain.txt"
timeout -k 10 60 python3 scripts/bench_w8a8_rows.py --shapes qkv,gate_up,down --rows 512,2048 --reps 5 --tpu "" 2>&1 \
  | grep -v "$FILTER" | tee "$OUT/w8a8_rows.txt"
timeout -k 10 ${B_S:-370} python3 scripts/bench_gpu.py --sections quant,profile --quantize "fp8-w8a8,fp8" \
  --profile-quantize fp8-w8a8 --quant-batches 1,32 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-370} - 60 )) \
  --out "$OUT" --json bench_gpu_w8a8_b32.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_w8a8_b32.log" | tail -80
ls -la "$OUT"
