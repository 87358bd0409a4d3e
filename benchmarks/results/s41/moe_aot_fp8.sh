#!/bin/bash
# Session 41 (issue 57): Qwen3-Coder-30B-A3B-FP8 (float8 experts and linears, 128 x 128 block scales)
# per chip on v5e-4 and v6e-1 ahead of time, FP8 experts in the TPU grouped-matmul kernel vs XLA's
# dequantize + ragged_dot; one MoE layer's bytes beside bf16 and int8. Wrap in
# `flock /tmp/dflash_libtpu.lock` where another process may hold libtpu.
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv-test/bin/python}
OUT=benchmarks/results/s41
F="^WARNING\|^I0000\|^E0000"
$PY scripts/tpu_moe_aot.py --layer --layer-chip v5e-4 --json $OUT/moe_layer_fp8_v5e.json 2>&1 | grep -v "$F" > $OUT/moe_layer_fp8_v5e.log
$PY scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash,plain --quantize fp8 \
    --json $OUT/tpu_moe_aot_fp8_b1.json 2>&1 | grep -v "$F" > $OUT/tpu_moe_aot_fp8_b1.log
$PY scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash --quantize fp8 --moe-gmm xla \
    --json $OUT/tpu_moe_aot_fp8_xla_b1.json 2>&1 | grep -v "$F" > $OUT/tpu_moe_aot_fp8_xla_b1.log
# the whole 48 layers on v6e-1 (does the compiler agree with the extrapolation?)
$PY scripts/tpu_moe_aot.py --chips v6e-1 --programs dflash --quantize fp8 --layers 47,48 \
    --json $OUT/tpu_moe_aot_fp8_v6e1_full.json 2>&1 | grep -v "$F" > $OUT/tpu_moe_aot_fp8_v6e1_full.log
