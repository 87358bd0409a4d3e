#!/usr/bin/env bash
# Session 44's prepared device call (issue 57; no device time was left in session 44 to run it): the
# whole B = 1 and 8 plain step and DFlash iteration of Qwen3-8B shapes with an FP8 checkpoint run
# W8A8 (--w8a8: quantize.to_w8a8; at B = 1 also with the LM head int8, --quantize int8+head) and weight-only
# (today's default, B = 1), each against bf16 in the same
# process, as session 41's call 3 timed int8 / fp8. The goal: W8A8 <= 0.6x bf16 at B = 1.
# Build .clean as in benchmarks/results/s43 (git archive of dflash_jax, pallas_kernels, scripts,
# pyproject.toml, benchmarks/results/s44), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s44/call1.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
echo "[s44] whole step: fp8 W8A8 at B = 1, 8; W8A8 with an int8 head and weight-only fp8 at B = 1; vs bf16"
timeout -k 10 ${B_S:-540} python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8,fp8-w8a8+head@1,fp8@1" --quant-batches 1,8 \
  --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( ${B_S:-540} - 20 )) \
  --out "$OUT" --json bench_gpu_w8a8.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_w8a8.log" | tail -40
ls -la "$OUT"
