#!/usr/bin/env bash
# Issue 56, for the next device session (s52/call1's trace was cut off: each engine's programs compiled for ~80 s on
# the H200 host, and the call ran out at the paged row). (1) The device host's own HTTP ceiling and host CPU per
# token (scripts/bench_http.py: the server's app over a null engine, no GPU): s52/call2 served fewer tokens/s on the
# H200 than s51 on the H100 (c = 32 4,598-4,997 against 5,335-6,207; TPOT 4.75-5.02 against 3.91-4.34 ms) while
# offline the H200 was 10% faster, so the served path looks host-bound there; this row puts a number on the host.
# (2) The paged and fixed engines offline at the server's K = 2, traced, with the whole call for it.
# Stage .clean with the serve wheels, then
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s52/call3.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
JAX_PLATFORMS=cpu timeout -k 5 90 python3 scripts/bench_http.py --http h11 --loop asyncio --concurrency 32,48 \
  --requests 384 2>&1 | grep -v "$FILTER" | tee "$OUT/bench_http.txt" | tail -5
left=$(( 575 - $(elapsed) ))
echo "[s52 call3] engines at K = 2, traced, with $left s left"
timeout -k 5 $left python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 96 --slots 32 --steps 2 --insert-width 8 --step-buckets off --refill-min 1 --refill-ahead off \
  --max-prompt 128 --min-new 64 --max-new 128 --simulated-tau 6.35 --verify-width auto --page-size 16 \
  --kv-pages off,auto --trace /tmp/trace_k2 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/engine_k2_trace.txt" | tail -60
ls -la "$OUT"
