#!/usr/bin/env bash
# Session 40 device call 3: (B) issue 59's structured-output cost on the embedded pair (call 2's runs
# could not import llguidance: pip there is another interpreter's), then (A) issue 57's int8+head and
# fp8 rows at B = 1 (call 2 measured int8 at B = 1, 8).
# run(command="bash benchmarks/results/s40/call4.sh", timeout_s=560, carry=[".whl"])
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import llguidance; print('llguidance', llguidance.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
echo "[call4] B: structured output, embedded pair"
for g in regex json; do
  timeout ${B_S:-120} python3 scripts/bench_structured.py --grammar $g --dtype bfloat16 --slots 4 --prompts 16 --new 128 \
    --json "$OUT/structured_$g.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/structured_$g.log" | tail -12
done
echo "[call4] A: int8+head and fp8 vs bf16 at B = 1, Qwen3-8B shapes"
timeout -k 10 ${A_S:-280} python3 scripts/bench_gpu.py --sections quant --quantize "int8+head,fp8" --quant-batches 1 \
  --loop-n 32,160 --reps 3 --compile-workers 4 --floor-tbs ${FLOOR:-3.043} --budget-s $(( ${A_S:-280} - 20 )) \
  --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant.log" | tail -30
ls -la "$OUT"
