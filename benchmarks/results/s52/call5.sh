#!/usr/bin/env bash
# Issue 56, for the next device session: the paged and fixed engines offline at the server's K = 2 (one-row refills,
# as the server does them), traced (bench_engine --trace: device busy and idle per program), the whole call for it
# (s52/call1 ran out of time compiling before its paged row).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s52/call5.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout -k 5 570 python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 96 --slots 32 --steps 2 --insert-width 8 --step-buckets off --refill-min 1 --refill-ahead off \
  --max-prompt 128 --min-new 64 --max-new 128 --simulated-tau 6.35 --verify-width auto --page-size 16 \
  --kv-pages off,auto --trace /tmp/trace_k2 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_k2_trace.txt" | tail -60
ls -la "$OUT"
