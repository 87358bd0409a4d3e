#!/usr/bin/env bash
# Issue 56: the fixed K = 2 server (c = 1, c = 32) and the offline static B = 32 program in one call, on the code of
# session 52's prefill change (s53/call1 served 6,363-6,487 tok/s at c = 32 on an H100 without a static row in that
# call). load_test now prints the engine thread's table (dflash_engine_* metrics: ms a step, rows a step, the
# thread's shares in dispatch / read wait / idle), which tells a host-bound server from a device-bound one.
# LIMIT (default 400 s) bounds the offline row.
# run(command="cd .clean && OUT=$OUT LIMIT=400 bash benchmarks/results/s53/call2.sh", timeout_s=420, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; } | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
  --capacity 1024 --engine-steps 2 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 \
  --port 8101 > "$OUT/server_fixed.log" 2>&1 &
pid=$!; t=$(date +%s); up=
while [ $(( $(date +%s) - t )) -lt 150 ]; do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
  sleep 2
done
echo "[s53 call2] up after ${up:-never} s (at $(elapsed) s)"
[ -n "$up" ] && timeout -k 5 60 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
  --requests 384 --requests-at-1 8 --concurrency 1,32x384 --rates "" --json "$OUT/load_fixed.json" 2>&1 \
  | tee "$OUT/load_fixed.log" | grep "^| conc\|^| load\|engine thread"
kill $pid; wait $pid 2>/dev/null
left=$(( ${LIMIT:-400} - $(elapsed) )); echo "[s53 call2] offline with $left s left"
[ $left -ge 60 ] && timeout -k 5 $left python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 288 --slots 32 --steps 2 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages off 2>&1 | grep -v "$FILTER" | cut -c1-400 \
  | tee "$OUT/engine_offline.txt" | tail -8
echo "[s53 call2] done at $(elapsed) s"
