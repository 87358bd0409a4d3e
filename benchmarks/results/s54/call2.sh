#!/usr/bin/env bash
# Issue 56, for the next device session (any card; the H200 is where the c = 32 goal is missed): does a slot-engine
# program call return before the device has run it? The served engine thread spent 51.6% of its wall inside program
# calls on an H100 (s53/call2) while py-spy saw it running ~20%: the calls wait, or spend host time updating CUDA graphs.
# Two candidates: (a) a while loop of unknown trip count left out of the CUDA graphs reads its predicate on the host and
# holds the calling thread until the device gets there (XLA puts a loop in a graph only if every op of it is a command;
# the served adaptive step, lowered for CUDA on the CPU host, has 6 loops, 5 holding Pallas-Triton kernels, none with
# --attention xla); (b) every step's outputs get new addresses while the pipeline holds the last step's, and XLA writes
# new addresses into every graph node that uses them before the graph runs (docs/perf-log.md, session 54).
# 1. scripts/probe_dispatch.py, Qwen3-8B shapes at the served setting (32 slots, capacity 1024, K = 2, tau 6.35): the
#    step call on an idle device (the last outputs freed, then held: (b)'s cost) and behind a running step ((a)'s
#    wait), the pipelined step, a prefill behind a step, and the
#    compiled step's while census (known trip count / graphed / host-read, with the custom calls inside the host-read
#    ones), for the adaptive step with Pallas attention (graphs on and off) and with XLA attention, and the block step.
# 2. With the time left: the fixed K = 2 server with --attention auto and xla at c = 1 and c = 32 (engine tables).
# Stage .clean with the serve wheels, then
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s54/call2.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
elapsed() { echo $(( $(date +%s) - T0 )); }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; } | tee "$OUT/device.txt"
timeout -k 10 ${PROBE_S:-330} python3 scripts/probe_dispatch.py --preset qwen3-8b --random-init --slots 32 --capacity 1024 \
  --prompt 128 --steps 2 --reps 10 --simulated-tau 6.35 --settings auto/on/auto,auto/on/xla,auto/off/auto,block/on/auto \
  --json "$OUT/probe.json" --dump-hlo "$OUT/hlo" 2>&1 | grep -v "$FILTER" | cut -c1-600 | tee "$OUT/probe.log" | tail -9
echo "[s54 call2] probe done at $(elapsed) s"
serve() {   # ATTENTION WAIT_S
  local a=$1 wait=$2 t=$(date +%s) up=
  python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention $a --slots 32 \
    --capacity 1024 --engine-steps 2 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 \
    --port 8101 > "$OUT/server_$a.log" 2>&1 &
  local pid=$!
  while [ $(( $(date +%s) - t )) -lt $wait ]; do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
    sleep 2
  done
  echo "[s54 call2] --attention $a up after ${up:-never} s (at $(elapsed) s)"
  [ -n "$up" ] && timeout -k 5 60 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
    --requests 384 --requests-at-1 8 --concurrency 1,32x384 --rates "" --json "$OUT/load_$a.json" 2>&1 \
    | tee "$OUT/load_$a.log" | grep "^| conc\|^| load\|engine thread"
  kill $pid; wait $pid 2>/dev/null
}
for a in auto xla; do
  left=$(( ${BUDGET:-570} - $(elapsed) )); [ $left -ge 90 ] && serve $a $(( left - 40 ))
done
echo "[s54 call2] done at $(elapsed) s"
# the device returns at most 8 files: everything in one archive, the tables beside it
(cd "$OUT" && tar -czf raw.tgz --exclude raw.tgz . && rm -rf hlo server_*.log load_*.json)
