#!/usr/bin/env bash
# Issue 56, for the next device session: where serving's ~17% goes on the H200 host. s52/call2 served fewer tokens/s
# on the H200 than s51 did on the H100 (c = 32 4,598-4,997 against 5,335-6,207; TPOT 4.75-5.02 against 3.91-4.34 ms)
# while offline the H200 is 10% faster: the served path looks host-bound there. (1) The host's HTTP ceiling and CPU
# per token (scripts/bench_http.py: the server's app over a null engine, no GPU), against this project's CPU host's
# 56-92 k tok/s. (2) Each server at K = 2 under the c = 32 load with py-spy attached (the py_spy wheel in whl/):
# every Python thread's samples while active (raw collapsed stacks: engine thread, event loop, the rest), so the
# engine thread's host time per step and its waits are read, not guessed. Stage .clean with the serve wheels and
# py_spy (pip download py-spy), then
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s52/call3.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
nproc | tee "$OUT/nproc.txt"; grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/nproc.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
JAX_PLATFORMS=cpu timeout -k 5 90 python3 scripts/bench_http.py --http h11 --loop asyncio,uvloop --concurrency 32 \
  --requests 384 2>&1 | grep -v "$FILTER" | tee "$OUT/bench_http.txt" | tail -5
serve() {   # ENGINE WAIT_S
  local eng=$1 wait=$2 extra=(); [ "$eng" = paged ] && extra=(--kv-pages 2050 --page-size 16 --prefix-cache off)
  local t=$(date +%s)
  python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
    --capacity 1024 --engine-steps 2 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 "${extra[@]}" \
    --port 8101 > "$OUT/server_$eng.log" 2>&1 &
  local pid=$! up=
  while [ $(( $(date +%s) - t )) -lt $wait ]; do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
    sleep 2
  done
  echo "[s52 call3] $eng up after ${up:-(not within $wait)} s (at $(elapsed) s)"
  if [ -n "$up" ]; then
    /tmp/site/bin/py-spy record -p $pid -d 15 -r 250 --threads -f raw -o "$OUT/spy_$eng.txt" > "$OUT/spy_$eng.log" 2>&1 &
    local spy=$!
    timeout -k 5 100 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
      --requests 384 --requests-at-1 1 --concurrency 32x384 --rates "" --json "$OUT/load_$eng.json" 2>&1 \
      | tee "$OUT/load_$eng.log" | grep -v "Warning" | tail -4
    wait $spy; tail -2 "$OUT/spy_$eng.log"
  fi
  kill $pid; wait $pid 2>/dev/null
}
serve fixed 200
left=$(( 560 - $(elapsed) ))
[ $left -ge 200 ] && serve paged $(( left - 80 ))
ls -la "$OUT"
