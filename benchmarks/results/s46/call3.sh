#!/usr/bin/env bash
# Session 46: s45/call1.sh with the fixed-slot server alone (the paged one ran in call1.sh, on the same warm H100,
# minutes before). Raw output: call3/.
# run(command="cd .clean && END_S=420 OUT=$OUT bash benchmarks/results/s46/call3.sh", timeout_s=440, carry=[".clean"])
# Session 45 (issue 56): both engines' served tok/s in ONE call, the paged engine FIRST (it was never measured),
# then the fixed-slot engine if the time left is at least 1.3x the paged warm-up + 60 s. The paged server runs
# with --prefix-cache off: the load test's prompts are random (no prefix is shared, so nothing would hit) and with
# the cache on the warm-up compiles every prompt bucket 16-128 instead of 128 alone (session 44), which with the
# fixed server's warm-up does not fit one 590 s call. Qwen3-8B shapes, simulated tau 6.35, c = 1 and 32.
# Then, with what is left of the call (>= 180 s), the B = 1 FP8 W8A8 step of s44/call1.sh.
# Ran once in session 45 with END_S=255 (the budget's last 280 s): the paged warm-up on the H200 took more than its
# 175 s (raw: call1/). Give it a full call: END_S=560, timeout_s=590.
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s45/call1.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client; print('serve deps ok')" || exit 1
python3 scripts/load_test.py --help > /dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
serve() {   # ENGINE WAIT_S -> sets UP (seconds to come up, or empty)
  local eng=$1 wait=$2 extra=(); [ "$eng" = paged ] && extra=(--kv-pages 2049 --prefix-cache off)
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
serve fixed $(( ${END_S:-560} - 80 )); exit 0
left=$(( ${END_S:-560} - $(elapsed) ))
if [ -n "$PAGED_UP" ] && [ $left -ge $(( PAGED_UP * 13 / 10 + 60 )) ]; then serve fixed $(( left - 50 )); else echo "[call3] fixed skipped ($left s left)"; fi
# the rest of the call (if >= 180 s): issue 57's FP8 W8A8 whole step at B = 1 against bf16 (s44/call1.sh, B = 1 only)
left=$(( ${END_S:-560} + 25 - $(elapsed) ))
if [ $left -ge 180 ]; then
  TBS=3.043; grep -q H200 "$OUT/device.txt" && TBS=4.3
  echo "[s45] W8A8 at B = 1 with $left s left"
  timeout -k 10 $(( left - 10 )) python3 scripts/bench_gpu.py --sections quant --quantize "fp8-w8a8,fp8-w8a8+head@1,fp8@1" \
    --quant-batches 1 --loop-n 32,160 --reps 3 --compile-workers 6 --floor-tbs $TBS --budget-s $(( left - 30 )) \
    --out "$OUT" --json bench_gpu_w8a8.json 2>&1 | grep -v "Warning\|^W0000\|^E0000\|^I0000" | cut -c1-400 \
    | tee "$OUT/gpu_w8a8.log" | tail -30
fi
ls -la "$OUT"
