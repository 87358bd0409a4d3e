#!/usr/bin/env bash
# Session 38, call 1 (issue 61): everything the issue left unmeasured on a GPU, current code, one
# machine, in order of value, each section with its own time budget (a slow one cannot eat the call):
#   A. adaptive width, Qwen3-8B shapes, simulated tau 6.54 and 4.24: plain (W = 0 of the program),
#      every fixed width of the program (3, 15), auto, and true plain (no draft) at B = 32, 8, 1
#      (then 64 if its program compiles in the budget): the issue's B = 32 case first;
#   B. MoE Qwen3-Coder-30B-A3B shapes (12 layers), bf16: B = 1, 8, 32 plain step and DFlash iteration
#      against the touched-expert floors at THIS machine's copy bandwidth (env.log measures it);
#   C. hybrid Qwen3.5-9B shapes: B = 1 and 32 plain step and DFlash iteration (the rollback's share),
#      floors at 4.23 TB/s in the JSON (floor_bytes: rescale by env.log's copy figure).
#   (The served run at simulated tau 6.35 is not here: its server's start alone took 179 s in session 30
#   and the image has no fastapi / uvicorn; it does not fit beside A-C in one 600 s call.)
# Run from the repo root: run(command="bash benchmarks/results/s38/call1.sh", timeout_s=600).
# SMOKE=1: tiny shapes on CPU (checks the command lines here). Files back: env.log, ad.log, ad.json,
# moe.log, bench_moe.json, hybrid.log, hybrid.jsonl.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[call1 $(( $(date +%s) - START ))s] $*"; }
left() { echo $(( ${TOTAL_S:-575} - ($(date +%s) - START) )); }
PY=${PY:-python3}
if [ -n "$SMOKE" ]; then
  A_ARGS="--smoke --batches 2 --reps 1"; B_ARGS="--smoke --batches 1"; C_ARGS="--smoke"; FLOOR=4.23
else
  A_ARGS="--batches 32,8,1,64"; B_ARGS="--batches 1,8,32"; C_ARGS="--batches 1,32"
fi

say "env: GPU, copy bandwidth, bf16 matmul rate"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1
  git log --oneline -1 2>/dev/null
  timeout 60 $PY - <<'EOF'
import time, jax, jax.numpy as jnp
from jax import lax
print("jax", jax.__version__, jax.devices())
small = jax.default_backend() == "cpu"
n = (1 << 22) if small else (1 << 30)                       # bf16 elements: 2 GiB a buffer on GPU
x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
K = 20
f = jax.jit(lambda x: lax.fori_loop(0, K, lambda i, y: y * 1.0001, x))
f(x).block_until_ready()
ts = []
for _ in range(5):
    t = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t)
bw = 2 * 2 * n * K / min(ts)
m = 1024 if small else 8192
a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
g = jax.jit(lambda a, b: lax.fori_loop(0, 10, lambda i, c: (c @ b) * 0.01, a))
g(a, b).block_until_ready()
ts = []
for _ in range(5):
    t = time.perf_counter(); g(a, b).block_until_ready(); ts.append(time.perf_counter() - t)
print(f"COPY_TBPS {bw / 1e12:.3f}  (read + write, {K} x {2 * n / 2**30:.0f} GiB in one program, best of 5)")
print(f"BF16_TFLOPS {10 * 2 * m ** 3 / min(ts) / 1e12:.1f}  ({m}^3 products x 10, random data, best of 5)")
EOF
} 2>&1 | tee "$OUT/env.log"
[ -z "$SMOKE" ] && FLOOR=$(awk '/^COPY_TBPS/ {print $2}' "$OUT/env.log")
FLOOR=${FLOOR:-4.23}
say "floors at $FLOOR TB/s"

# A. adaptive width (budget 220 s: compiles one at a time in the background, B = 32 first)
say "A: bench_adaptive ($(left)s left)"
timeout -k 10 235 $PY scripts/bench_adaptive.py $A_ARGS --taus 6.54,4.24 --fixed-widths 3,15 \
  --true-plain-batches 32,1 --out "$OUT" --json ad.json --budget-s 220 2>&1 | grep -v "Warning\|^W0000\|^E0000" \
  | tee "$OUT/ad.log" | grep -v "^\[ *[0-9.]*s\]   B"
say "A rc=$?"

# B. MoE loop rows (budget 135 s)
say "B: bench_moe loop ($(left)s left)"
timeout -k 10 150 $PY scripts/bench_moe.py --sections loop $B_ARGS --moe-gmms pallas_gpu --floor-tbs "$FLOOR" \
  --budget-s 135 --out "$OUT" 2>&1 | grep -v "Warning\|^W0000\|^E0000" | cut -c1-300 | tee "$OUT/moe.log" | grep "loop\|#"
say "B rc=$?"

# C. hybrid 9B (what is left, at least 60 s)
REM=$(left)
say "C: bench_hybrid 9b (${REM}s left)"
if [ "$REM" -gt 60 ]; then
  timeout -k 10 $(( REM - 5 )) $PY scripts/bench_hybrid.py $C_ARGS --paths kernel-bv32 --models 9b \
    --budget-s $(( REM - 20 )) --out "$OUT/hybrid.jsonl" 2>&1 | grep -v "Warning\|^W0000\|^E0000" \
    | tee "$OUT/hybrid.log" | grep -o '"batch": [0-9]*\|"block": [0-9]*\|"ms_per_iteration": [0-9.]*\|"x_floor": [0-9.]*\|"fold_share": [0-9.]*\|"skipped": true\|Error.*' | paste -sd' ' | sed 's/"batch"/\n"batch"/g'
  say "C rc=$?"
fi
say done
ls -la "$OUT"
