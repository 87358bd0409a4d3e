#!/usr/bin/env bash
# Issue 56: the fixed K = 2 server at c = 32 under py-spy --nonblocking (s52/call3's blocking py-spy halved the
# served tok/s, 6,000 -> 3,270 on an H100: the server is host-sensitive), once without py-spy in the same call as the
# baseline; the raw stacks come back as one tarball (the device returns at most 8 files).
# run(command="cd .clean && OUT=$OUT bash benchmarks/results/s53/call1.sh", timeout_s=590, carry=[".clean"])
T0=$(date +%s); export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; W=/tmp/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; } | tee "$OUT/device.txt"
elapsed() { echo $(( $(date +%s) - T0 )); }
python3 scripts/serve_simulated.py --tau 6.35 --random-init qwen3-8b --dtype bfloat16 --attention auto --slots 32 \
  --capacity 1024 --engine-steps 2 --step-buckets none --max-queue 256 --warmup-prompt-len 65:128 \
  --port 8101 > $W/server_fixed.log 2>&1 &
pid=$!; t=$(date +%s); up=
while [ $(( $(date +%s) - t )) -lt 200 ]; do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8101/health', timeout=2)" 2>/dev/null && { up=$(( $(date +%s) - t )); break; }
  sleep 2
done
echo "[s53 call1] up after ${up:-never} s (at $(elapsed) s)"
load() {  # NAME
  timeout -k 5 100 python3 scripts/load_test.py --url "http://127.0.0.1:8101" --preset qwen3-8b \
    --requests 384 --requests-at-1 1 --concurrency 32x384 --rates "" --json "$W/load_$1.json" 2>&1 \
    | tee "$W/load_$1.log" | grep "^| conc"
}
if [ -n "$up" ]; then
  load plain
  /tmp/site/bin/py-spy record -p $pid -d 12 -r 100 --nonblocking --threads -f raw -o "$W/spy_nb.txt" > "$W/spy_nb.log" 2>&1 &
  spy=$!; load spy_nb; wait $spy; tail -1 "$W/spy_nb.log"
  /tmp/site/bin/py-spy dump -p $pid > "$W/dump.txt" 2>&1
  load plain2
fi
kill $pid; wait $pid 2>/dev/null
tar -czf "$OUT/call1.tgz" -C $W .
echo "[s53 call1] done at $(elapsed) s"; ls -la $W
