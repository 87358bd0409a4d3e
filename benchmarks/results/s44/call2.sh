#!/usr/bin/env bash
# Session 44 (prepared, not run: no device time): both engines' served tok/s in ONE call (issue 56), as s43/call3.sh:
# the fixed-slot server comes up (up to 480 s), is measured and stopped; the paged server then runs if the time
# left is at least 2.2x the fixed warm-up + 60 s (its prefix cache warms prompt buckets 16-128, the fixed one 128
# alone; session 42: paged 420 s against fixed 265 s serially). Qwen3-8B shapes, simulated tau 6.35, c = 1 and 32.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s44/call2.sh", timeout_s=590, carry=[".clean"])
# If the paged server is skipped, a second call: run(command="cd .clean && ENGINE=paged OUT=$OUT bash benchmarks/results/s42/call2c.sh", ...).
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')" || exit 1
python3 scripts/load_test.py --help > /dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
serve() {   # ENGINE WAIT_S -> sets UP (seconds to come up, or empty)
  local eng=$1 wait=$2 extra=(); [ "$eng" = paged ] && extra=(--kv-pages 2049)
  local t=$(date +%s)
  python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
    --capacity 1024 --engine-steps auto --max-queue 256 --warmup-prompt-len 65:128 "${extra[@]}" --port 8101 \
    > "$OUT/server_$eng.log" 2>&1 &
  PID=$!; UP=
  while [ $(( $(date +%s) - t )) -lt $wait ]; do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { UP=$(( $(date +%s) - t )); break; }
    sleep 2
  done
  echo "[call3] $eng up after ${UP:-(not within $wait)} s (at $(elapsed) s)"; grep -h "warm-up done\|compiling" "$OUT/server_$eng.log"
  if [ -n "$UP" ]; then
    timeout -k 5 60 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
      --requests 128 --requests-at-1 8 --concurrency 1,32x128 --rates "" --json "$OUT/load_$eng.json" 2>&1 \
      | tee "$OUT/load_$eng.log" | grep -v "Warning" | tail -14
  fi
  kill $PID; wait $PID 2>/dev/null
}
serve fixed $(( ${END_S:-560} - 80 )); FIXED_UP=$UP
left=$(( ${END_S:-560} - $(elapsed) ))
if [ -n "$FIXED_UP" ] && [ $left -ge $(( FIXED_UP * 22 / 10 + 60 )) ]; then serve paged $(( left - 50 )); else echo "[call3] paged skipped ($left s left)"; fi
ls -la "$OUT"
