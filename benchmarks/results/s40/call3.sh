#!/usr/bin/env bash
# Session 40 device call 2: (A) issue 57's int8 rows alone, Qwen3-8B shapes at B = 1 and 8 (call 1's six
# variants spent its budget compiling: benchmarks/results/s40/gpu_quant.log), then (B) issue 59's
# structured-output cost on the embedded pair (scripts/bench_structured.py).
# run(command="bash benchmarks/results/s40/call3.sh", timeout_s=590)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
FILTER="Warning\|^W0000\|^E0000\|^I0000"
pip install -q --no-deps .whl/llguidance-*.whl 2>&1 | tail -1    # the wheel is carried: run(..., carry=[".whl"])
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
echo "[call3] A: int8 vs bf16, Qwen3-8B shapes"
timeout -k 10 ${A_S:-340} python3 scripts/bench_gpu.py --sections quant --quantize int8 --quant-batches 1,8 \
  --loop-n 32,160 --reps 3 --compile-workers 4 --floor-tbs ${FLOOR:-3.043} --budget-s $(( ${A_S:-340} - 20 )) \
  --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/gpu_quant.log" | tail -40
echo "[call3] B: structured output, embedded pair"
for g in regex json; do
  timeout ${B_S:-90} python3 scripts/bench_structured.py --grammar $g --dtype bfloat16 --slots 4 --prompts 16 --new 128 \
    --json "$OUT/structured_$g.json" 2>&1 | grep -v "$FILTER" | tee "$OUT/structured_$g.log" | tail -12
done
ls -la "$OUT"
