#!/usr/bin/env bash
# Issue 56 (session 50): call5 again with the paged server on pages of PAGE positions (default 64: one GPU attention tile
# per page, no gather load; s49/call8 compares 16 and 64 offline), the pool the same 32k positions (--kv-pages
# 32784 / PAGE + 1); fixed server, paged server, then the static B = 32 program offline, as call5.
# Stage .clean with the serve wheels (as s48/call3.sh), then:
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s50/call9.sh", timeout_s=590, carry=[".clean"])
PAGE=${PAGE:-64}; T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000\|^W1"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
serve() {   # ENGINE WAIT_S
  local eng=$1 wait=$2 extra=(); [ "$eng" = paged ] && extra=(--kv-pages $(( 32784 / PAGE + 1 )) --page-size $PAGE --prefix-cache off)
  local t=$(date +%s)
  python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
    --capacity 1024 --engine-steps 4 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 "${extra[@]}" \
    --port 8101 > "$OUT/server_$eng.log" 2>&1 &
  local pid=$! up=
  while [ $(( $(date +%s) - t )) -lt $wait ]; do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
    sleep 2
  done
  echo "[s50 call9] $eng up after ${up:-(not within $wait)} s (at $(elapsed) s)"; grep -h "warm-up done" "$OUT/server_$eng.log"
  if [ -n "$up" ]; then
    timeout -k 5 120 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
      --requests 384 --requests-at-1 8 --concurrency 1,32x384,48x384 --rates "" --json "$OUT/load_$eng.json" 2>&1 \
      | tee "$OUT/load_$eng.log" | grep -v "Warning" | tail -8
  fi
  kill $pid; wait $pid 2>/dev/null
}
serve fixed 200
serve paged $(( 400 - $(elapsed) ))
left=$(( 575 - $(elapsed) ))
pages="off"
echo "[s50 call9] offline with $left s left (--kv-pages $pages)"
[ $left -ge 90 ] && timeout -k 5 $left python3 scripts/bench_engine.py --preset qwen3-8b --random-init --dtype bfloat16 \
  --prompts 288 --slots 32 --steps 4 --insert-width 8 --step-buckets off --max-prompt 128 --min-new 64 --max-new 128 \
  --simulated-tau 6.35 --verify-width auto --kv-pages $pages 2>&1 | grep -v "$FILTER" | cut -c1-400 \
  | tee "$OUT/engine_offline.txt" | tail -8
ls -la "$OUT"
