#!/usr/bin/env bash
# Session 39 (issue 57): int8 weight-only targets against bf16 on one GPU, in ONE call, each section
# with its own time budget (a slow one cannot eat the call):
#   env. nvidia-smi, jax / torch versions, the copy bandwidth two ways before anything else holds the GPU:
#        torch's device-to-device copy (cudaMemcpy, 4 GiB) in its own process, then bench_gpu.copy_probe
#        (4 GiB into a new buffer, one dispatch a pass: x + 1 bf16 / uint32, jnp.copy; a read-only sum
#        beside). FLOOR = the fastest plausible copy figure (<= 6 TB/s): both scripts' floors use it.
#        (Session 38's probe ran 20 passes in one fori_loop, which XLA fused: 53.9 TB/s, bogus.)
#   A. Qwen3-8B shapes, random weights: plain step and DFlash iteration (5-layer draft, block 16,
#      prompt 512) at B = 1, 8, 32, bf16 target and the same target int8 (init_target(quantize="int8"):
#      its layers' linears), same draft, same process; table of both, ratios, x byte floor.
#   B. Qwen3-Coder-30B-A3B shapes (12-layer cut), pallas_gpu grouped matmuls: the same rows. Whether the
#      int8 target's experts are quantized is read from its bytes (the log says "experts NOT quantized"
#      when dflash_jax.quantize leaves them bf16).
# Run from the repo root: run(command="bash benchmarks/results/s39/quant_call.sh", timeout_s=480).
# SMOKE=1: tiny shapes on CPU (checks the command lines here). TOTAL_S: the call's budget (420 s).
# Files back: env.log, gpu_quant.log, bench_gpu_quant.json, moe_quant.log, bench_moe_quant.json.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s); say() { echo "[quant $(( $(date +%s) - START ))s] $*"; }
left() { echo $(( ${TOTAL_S:-420} - ($(date +%s) - START) )); }
PY=${PY:-python3}
QUANT=${QUANT:-int8,fp8@1}
FILTER="Warning\|^W0000\|^E0000\|^I0000"
if [ -n "$SMOKE" ]; then
  export JAX_PLATFORMS=cpu
  A_ARGS="--smoke --quant-batches 1,2 --compile-workers 2"; B_ARGS="--smoke --batches 1 --precompile-workers 2"
  PROBE_BYTES=$((1 << 24)); A_BUDGET=400; A_TIMEOUT=600
else
  A_ARGS="--quant-batches 1,8,32 --loop-n 32,160 --reps 3 --compile-workers 6"
  B_ARGS="--batches 1,8,32 --layers 12 --precompile-workers 6"
  PROBE_BYTES=$((1 << 32)); A_BUDGET=225; A_TIMEOUT=245
fi

say "env: GPU, versions, copy bandwidth (torch memcpy, then JAX)"
{
  nvidia-smi 2>&1 | head -20
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1
  git log --oneline -1 2>/dev/null
  echo "quantize.py / moe.py commits:"; git log --oneline -3 -- dflash_jax/quantize.py dflash_jax/models/moe.py 2>/dev/null
  PROBE_BYTES=$PROBE_BYTES timeout 60 $PY - <<'PYEOF'
import os, time
try:
    import torch
    print("torch", torch.__version__)
    if torch.cuda.is_available():
        n = int(os.environ["PROBE_BYTES"]) // 2
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")   # random data, not zeros
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                y.copy_(x)
            b.record(); torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3 / 10)
        ts.sort()
        print(f"TORCH_COPY_TBPS {2 * x.nbytes / ts[len(ts) // 2] / 1e12:.3f}  (y.copy_(x), {x.nbytes / 2**30:.0f} GiB "
              f"read + written, median of 5 x 10, CUDA events; {torch.cuda.get_device_name(0)})")
except Exception as e:
    print("torch copy probe failed:", type(e).__name__, e)
PYEOF
  PROBE_BYTES=$PROBE_BYTES timeout 90 $PY - <<'PYEOF'
import os, sys
sys.path.insert(0, "scripts")
import jax
print("jax", jax.__version__, jax.devices(), jax.devices()[0].device_kind)
try:
    import flax; print("flax", flax.__version__)
except Exception:
    pass
from bench_gpu import copy_probe
p = copy_probe(int(os.environ["PROBE_BYTES"]))
print("JAX copy probe (TB/s, bytes read + written; read_sum: read only):",
      ", ".join(f"{k} {v:.3f}" for k, v in p["TBps"].items()), "| implausible:", p["implausible"] or "none",
      "| errors:", p.get("errors", "none"))
print(f"JAX_COPY_TBPS {p['copy_TBps']:.3f}  ({p['copy_from']}, {p['bytes'] / 2**30:.0f} GiB into a new buffer, "
      "one dispatch a pass)")
PYEOF
} 2>&1 | grep -v "$FILTER" | tee "$OUT/env.log"
FLOOR=$(awk '/^(TORCH|JAX)_COPY_TBPS/ && $2 + 0 > 0 && $2 + 0 <= 6 {if ($2 > m) m = $2} END {if (m) print m}' "$OUT/env.log")
[ -n "$SMOKE" ] && FLOOR=${FLOOR:-0.05}
FLOOR=${FLOOR:-4.23}
say "floors at $FLOOR TB/s (the fastest plausible copy figure of env.log)" | tee -a "$OUT/env.log"

# A. Qwen3-8B shapes (budget A_BUDGET s)
say "A: bench_gpu quant, Qwen3-8B shapes ($(left)s left)"
timeout -k 10 $A_TIMEOUT $PY scripts/bench_gpu.py --sections quant --quantize "$QUANT" $A_ARGS --floor-tbs "$FLOOR" \
  --budget-s $A_BUDGET --out "$OUT" --json bench_gpu_quant.json 2>&1 | grep -v "$FILTER" | cut -c1-400 \
  | tee "$OUT/gpu_quant.log" | grep -v "^\[ *[0-9.]*s\]   \(plain\|dflash\)_b[0-9]*\(_[a-z0-9]*\)\?: [0-9.]* ms/iter"
say "A rc=$?"

# B. MoE Qwen3-Coder-30B-A3B shapes (what is left, at least 60 s)
REM=$(left)
say "B: bench_moe loop + quant, Coder-30B-A3B shapes (${REM}s left)"
if [ "$REM" -gt 60 ] || [ -n "$SMOKE" ]; then
  [ -n "$SMOKE" ] && REM=600
  timeout -k 10 $(( REM - 5 )) $PY scripts/bench_moe.py --sections loop --quantize "$QUANT" $B_ARGS \
    --moe-gmms pallas_gpu --floor-tbs "$FLOOR" --budget-s $(( REM - 25 )) --out "$OUT" --json bench_moe_quant.json \
    2>&1 | grep -v "$FILTER" | cut -c1-400 | tee "$OUT/moe_quant.log" | grep -v "^precompile B=\|^touched \|^skipped   touched"
  say "B rc=$?"
fi
say done
ls -la "$OUT"
