#!/usr/bin/env bash
# Issue 56 (s53/call4.sh plus a third server; best on an H200, where the c = 32 goal is missed): the fixed K = 2 server
# with the slot engine's loops as CUDA-graph while loops (--while-graphs on, the default), as XLA's host-read loops
# (off), and with no command buffers at all (off + XLA_FLAGS=--xla_gpu_enable_command_buffer=, "none": a step's graph
# is never re-recorded for the next step's buffers), each at c = 1 and c = 32 with load_test's engine-thread table (ms a step, rows a step, insert / step dispatch,
# read wait, host rest), then the offline static B = 32 program and the fixed engine at K = 2 (bench_engine prints its
# thread's table too), all in one call. On an
# H100 (s53/call2) the c = 32 server's thread spent 51.6% of the wall inside dispatch calls and 43.8% in reads: a
# dispatch that blocks that long leaves the host's bookkeeping on the device's critical path, which a slower host
# (the H200's: TTFT at c = 1 doubled) pays per step. Stage .clean with the serve wheels, then
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s54/call1.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; } | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
serve() {   # GRAPHS WAIT_S (GRAPHS none: off, and no command buffers)
  local g=$1 wait=$2 t=$(date +%s) up= flag=$1 xf=
  [ "$g" = none ] && { flag=off; xf="--xla_gpu_enable_command_buffer="; }
  XLA_FLAGS="$xf" python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
    --capacity 1024 --engine-steps 2 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 \
    --while-graphs $flag --port 8101 > "$OUT/server_graphs_$g.log" 2>&1 &
  local pid=$!
  while [ $(( $(date +%s) - t )) -lt $wait ]; do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
    sleep 2
  done
  echo "[s54 call1] --while-graphs $g up after ${up:-never} s (at $(elapsed) s)"
  [ -n "$up" ] && timeout -k 5 60 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
    --requests 384 --requests-at-1 8 --concurrency 1,32x384 --rates "" --json "$OUT/load_graphs_$g.json" 2>&1 \
    | tee "$OUT/load_graphs_$g.log" | grep "^| conc\|^| load\|engine thread"
  kill $pid; wait $pid 2>/dev/null
}
for g in ${SERVERS:-on off none}; do serve $g 150; done   # SERVERS="on none" BUDGET=500: a shorter call
left=$(( ${BUDGET:-570} - $(elapsed) )); echo "[s54 call1] offline with $left s left"
[ $left -ge 60 ] && timeout -k 5 $left python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 288 --slots 32 --steps 2 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages off 2>&1 | grep -v "$FILTER" | cut -c1-400 \
  | tee "$OUT/engine_offline.txt" | tail -6
echo "[s54 call1] done at $(elapsed) s"
# the device returns at most 8 files: everything in one archive, the tables beside it
(cd "$OUT" && tar -czf raw.tgz --exclude raw.tgz . && rm -f server_graphs_*.log load_graphs_*.json)
