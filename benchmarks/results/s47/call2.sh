#!/usr/bin/env bash
# Prepared in session 46 for the next device session (issue 56, not yet run): where the paged server's c = 32 loss
# goes (session 46, one H100: paged 0.928x the fixed server's tok/s at c = 32, TTFT p50 +23%, TPOT p50 +2%), and the
# offline B = 32 figure on the same card for the "c = 32 >= 0.9x offline" goal. One process, no HTTP:
# static batches of 32 (the offline program), the fixed-slot engine and the paged engine (a pool of the same
# positions, the server's full table widths), Qwen3-8B shapes, simulated tau 6.35, GSM8K prompts up to 128 tokens,
# 64-128 new tokens, then each traced (--trace: device busy / idle between programs / per program).
# Step buckets off and one insert width keep each engine's warm-up to a few programs (a server's ten took 4.5-5 min).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s47/call2.sh", timeout_s=590, carry=[".clean"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout -k 10 560 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 --prompts 128 \
  --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages off,auto --trace /tmp/engine_trace 2>&1 \
  | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-400 | tee "$OUT/engine_paged.txt" | tail -60
ls -la "$OUT"
