#!/usr/bin/env bash
# s49/call7 as run in session 50 (issue 57): W8A8 per output channel
# (--w8a8 channel, quantize.Fp8ChannelWeight) in the whole step, against bf16 and the block scheme in the same
# process. The chain (call6) says per channel should take the B = 8 DFlash iteration below bf16 (its 128-row
# verify's matmuls 4.98 against bf16's 6.41 ms, the block scheme's 10.94). B = 8 first (the decisive row),
# alone (32 and 1 left out: the last 290 s of the device budget); one bench_gpu process per batch so a timeout keeps what ran.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s50/call11.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
for B in 8; do
  left=$(( 270 - $(date +%s) + T0 ))
  [ $left -lt 120 ] && { echo "[s50 call11] B = $B skipped ($left s left)"; continue; }
  budget=$(( left > 260 ? 230 : left - 30 ))
  timeout -k 10 $(( budget + 20 )) python3 scripts/bench_gpu.py --sections quant \
    --quantize "fp8-w8a8-channel,fp8-w8a8" --quant-batches $B --loop-n 32,160 --reps 3 --compile-workers 8 \
    --floor-tbs $TBS --budget-s $budget --out "$OUT" --json bench_gpu_channel_b$B.json 2>&1 | grep -v "$FILTER" \
    | cut -c1-400 | tee "$OUT/gpu_channel_b$B.log" | tail -16
done
ls -la "$OUT"
