"""scripts/tpu_bytes.py names the bytes of a compiled TPU iteration.

The fast test checks the charging rules on a hand-written optimized-HLO module (an async weight slice
into VMEM, its ConcatBitcast, a matmul fusion reading the VMEM copy, an in-place cache update). The
slow one compiles a 2-layer Qwen3-8B-wide DFlash iteration for v6e with the real TPU compiler and
checks the tool's sum against the compiler's cost_analysis and the HBM traffic against the ideal.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from tests import tpu_aot  # noqa: F401  (first: sets libtpu's env before JAX initialises its backends)

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tpu_bytes", REPO / "scripts" / "tpu_bytes.py")
tpu_bytes = importlib.util.module_from_spec(_spec)
sys.modules["tpu_bytes"] = tpu_bytes
_spec.loader.exec_module(tpu_bytes)

HLO = """HloModule m, is_scheduled=true, input_output_alias={ {0}: (2, {}, may-alias) }

%fused_dot (param_0: bf16[16,8], param_1: bf16[8,256]) -> bf16[16,256] {
  %param_0 = bf16[16,8]{1,0} parameter(0)
  %param_1 = bf16[8,256]{1,0:S(1)} parameter(1)
  ROOT %convolution = bf16[16,256]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%fused_dus (param_0.1: bf16[1,4,64,128], param_1.1: bf16[1,4,1,128], param_2: s32[]) -> bf16[1,4,64,128] {
  %param_0.1 = bf16[1,4,64,128]{3,2,1,0} parameter(0)
  %param_1.1 = bf16[1,4,1,128]{3,2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dynamic-update-slice = bf16[1,4,64,128]{3,2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %c, %c, %param_2, %c)
}

ENTRY %main (w: bf16[8,256], x: bf16[16,8], kv: bf16[1,4,64,128], new: bf16[1,4,1,128], at: s32[]) -> (bf16[16,256], bf16[1,4,64,128]) {
  %w = bf16[8,256]{1,0} parameter(0), metadata={op_name="ts['layers'][0]['o'].value"}
  %x = bf16[16,8]{1,0} parameter(1)
  %kv = bf16[1,4,64,128]{3,2,1,0} parameter(2), metadata={op_name="s.target_cache.k[0]"}
  %new = bf16[1,4,1,128]{3,2,1,0} parameter(3)
  %at = s32[] parameter(4)
  %bitcast.1 = s8[4096]{0} bitcast(%w)
  %slice-start = ((s8[4096]{0}), s8[2048]{0:S(1)}, s32[]{:S(2)}) slice-start(%bitcast.1), slice={[0:2048]}
  %slice-start.1 = ((s8[4096]{0}), s8[2048]{0:S(1)}, s32[]{:S(2)}) slice-start(%bitcast.1), slice={[2048:4096]}
  %slice-done = s8[2048]{0:S(1)} slice-done(%slice-start)
  %slice-done.1 = s8[2048]{0:S(1)} slice-done(%slice-start.1)
  %custom-call = bf16[8,256]{1,0:S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %fusion = bf16[16,256]{1,0} fusion(%x, %custom-call), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/verify/target_layer0/dot_general"}
  %fusion.1 = bf16[1,4,64,128]{3,2,1,0} fusion(%kv, %new, %at), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/verify/target_layer0/dynamic_update_slice"}
  ROOT %tuple = (bf16[16,256]{1,0}, bf16[1,4,64,128]{3,2,1,0}) tuple(%fusion, %fusion.1)
}
"""


def test_charges_name_prefetched_weights_and_in_place_cache_updates():
    s = tpu_bytes.breakdown(HLO)
    rec = {r["name"]: r for r in s["records"]}
    w = 8 * 256 * 2
    # the weight: read from HBM once (the two slices); the cost model charges it at the slices'
    # reads and writes, the ConcatBitcast and the matmul's read of the VMEM copy
    assert rec["slice-start"]["hbm"] + rec["slice-start.1"]["hbm"] == w
    assert rec["slice-start"]["group"] == "target_layer0"
    assert rec["custom-call"]["hbm"] == 0 and rec["custom-call"]["model"] == w
    assert s["kinds_model"]["weights"] == 4 * w and s["kinds_hbm"]["weights"] == w
    # the matmul: activations in and out from HBM, the weight operand from VMEM
    assert rec["fusion"]["hbm"] == 16 * 8 * 2 + 16 * 256 * 2 and rec["fusion"]["model"] == rec["fusion"]["hbm"] + w
    # the in-place cache update: the new row written, the buffer neither read nor copied
    assert s["kinds_hbm"]["kv_write"] == 4 * 128 * 2 and s["kinds_hbm"].get("kv_read", 0) == 0
    assert rec["fusion.1"]["group"] == "target_layer0"
    assert s["hbm_total"] == w + rec["fusion"]["hbm"] + rec["fusion.1"]["hbm"]
    assert s["model_total"] == sum(r["model"] for r in s["records"])


@pytest.mark.slow
@tpu_aot.requires_libtpu
def test_small_dflash_iteration_on_v6e_matches_the_compiler_and_the_ideal():
    from dflash_jax import DraftConfig, TargetConfig, decode
    tc = dataclasses.replace(TargetConfig.preset("qwen3-8b"), num_layers=2)
    dc = DraftConfig.for_target(tc, num_layers=1, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=(0, 1))
    comp = decode.lower_iteration(tc, dc, batch=1, prompt_len=512, capacity=1024, attention_impl="pallas_tpu",
                                  device=tpu_aot.tpu_device("v6e:2x2")).compile()
    s = tpu_bytes.breakdown(comp)
    ideal = tpu_bytes.ideal_bytes(tc, dc, draft=True, batch=1, capacity=1024)
    assert abs(s["model_total"] / s["compiler_bytes_accessed"] - 1) < 0.10, (s["model_total"], s["compiler_bytes_accessed"])
    assert s["hbm_total"] <= 1.10 * ideal["total"], (s["hbm_total"], ideal)
    # the LM head, read twice (the draft's logits and the verify's), is named as such
    assert abs(s["kinds_hbm"]["lm_head"] - ideal["lm_head"]) < 0.01 * ideal["lm_head"]
    groups = {r["group"] for r in s["records"]}
    assert {"target_layer0", "target_layer1", "draft_layer0", "draft_lm_head"} <= groups


def test_ideal_per_chip_is_a_quarter_of_the_weights_and_kv_plus_the_collectives():
    from dflash_jax import DraftConfig, TargetConfig
    tc = TargetConfig.preset("qwen3-8b")
    dc = DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=(1, 9, 17, 25, 33))
    full = tpu_bytes.ideal_bytes(tc, dc, draft=True, batch=4, capacity=1024)
    chip = tpu_bytes.ideal_per_chip(tc, dc, draft=True, batch=4, capacity=1024, dp=1, tp=4, collectives=123)
    for k in ("target_layers", "lm_head", "draft", "kv_read", "kv_write"):
        assert chip[k] == pytest.approx(full[k] / 4), k          # 8 kv heads: 2 per chip
    assert chip["collectives"] == 123
    assert chip["total"] == pytest.approx(full["total"] / 4 + 123)
    hlo = "%ar = bf16[1,16,4096]{2,1,0} all-reduce-start(%x), replica_groups={}\n"
    assert tpu_bytes.collective_bytes(hlo) == 2 * 16 * 4096 * 2


@pytest.mark.slow
@tpu_aot.requires_libtpu
def test_v5p_batched_iteration_fused_mlp_keeps_its_intermediates_off_hbm():
    """v5p, B=32 (512 rows a pass): KernelConfig(tpu_mlp=True) takes the MLP blocks' bytes off HBM,
    the fused weight given to the kernel twice is charged once, and no q relayout copy is left."""
    from dflash_jax import DraftConfig, KernelConfig, TargetConfig, decode
    tc = dataclasses.replace(TargetConfig.preset("qwen3-8b"), num_layers=2)
    dc = DraftConfig.for_target(tc, num_layers=1, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=(0, 1))
    out = {}
    for mlp in (False, True):
        comp = decode.lower_iteration(tc, dc, batch=32, prompt_len=512, capacity=1024,
                                      kernels=KernelConfig(attention="pallas_tpu", tpu_mlp=mlp),
                                      device=tpu_aot.tpu_device("v5p:2x2x1")).compile()
        out[mlp] = tpu_bytes.breakdown(comp)
    ideal = tpu_bytes.ideal_bytes(tc, dc, draft=True, batch=32, capacity=1024)
    s = out[True]
    assert abs(s["model_total"] / s["compiler_bytes_accessed"] - 1) < 0.05
    assert s["kinds_hbm"]["weights"] <= 1.02 * (ideal["target_layers"] + ideal["draft"])
    # three layers' MLP blocks: >= 3 x 40 MB of [512, 2I] intermediates and normed rows fewer
    assert s["kinds_hbm"]["activations"] < out[False]["kinds_hbm"]["activations"] - 0.12e9
    assert s["kinds_hbm"]["copies"] < 0.02e9
