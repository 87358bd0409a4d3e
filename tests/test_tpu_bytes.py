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


# The slot step's shape: its iterations inside a conditional (run when some row is busy), the
# weights and caches named as decode.lower_slot_step's arguments (tstate[...], slots.loop.*).
COND_HLO = """HloModule c, is_scheduled=true

%fused_dus (param_0.1: bf16[4,4,16,128], param_1.1: bf16[1,4,16,128], param_2: s32[]) -> bf16[4,4,16,128] {
  %param_0.1 = bf16[4,4,16,128]{3,2,1,0} parameter(0)
  %param_1.1 = bf16[1,4,16,128]{3,2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dynamic-update-slice = bf16[4,4,16,128]{3,2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %c, %c, %c)
}

%busy (p: (bf16[256,64], bf16[4,4,16,128], bf16[1,4,16,128], s32[])) -> (bf16[4,4,16,128]) {
  %p = (bf16[256,64]{1,0}, bf16[4,4,16,128]{3,2,1,0}, bf16[1,4,16,128]{3,2,1,0}, s32[]) parameter(0)
  %w = bf16[256,64]{1,0} get-tuple-element(%p), index=0
  %pool = bf16[4,4,16,128]{3,2,1,0} get-tuple-element(%p), index=1
  %new = bf16[1,4,16,128]{3,2,1,0} get-tuple-element(%p), index=2
  %at = s32[] get-tuple-element(%p), index=3
  %neg = bf16[256,64]{1,0} negate(%w), metadata={op_name="jit(f)/cond/verify/target_layer0/neg"}
  %fusion = bf16[4,4,16,128]{3,2,1,0} fusion(%pool, %new, %at), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/cond/verify/target_layer0/dynamic_update_slice"}
  ROOT %t = (bf16[4,4,16,128]{3,2,1,0}) tuple(%fusion)
}

%idle (q: (bf16[4,4,16,128])) -> (bf16[4,4,16,128]) {
  %q = (bf16[4,4,16,128]{3,2,1,0}) parameter(0)
  %pool.1 = bf16[4,4,16,128]{3,2,1,0} get-tuple-element(%q), index=0
  ROOT %t.1 = (bf16[4,4,16,128]{3,2,1,0}) tuple(%pool.1)
}

ENTRY %main (w: bf16[256,64], pool: bf16[4,4,16,128], new: bf16[1,4,16,128], at: s32[], go: s32[]) -> (bf16[4,4,16,128]) {
  %w = bf16[256,64]{1,0} parameter(0), metadata={op_name="tstate['layers'][0]['o'].value"}
  %pool = bf16[4,4,16,128]{3,2,1,0} parameter(1), metadata={op_name="slots.loop.target_cache.k[0]"}
  %new = bf16[1,4,16,128]{3,2,1,0} parameter(2)
  %at = s32[] parameter(3)
  %go = s32[] parameter(4)
  %ops.0 = (bf16[4,4,16,128]{3,2,1,0}) tuple(%pool)
  %ops.1 = (bf16[256,64]{1,0}, bf16[4,4,16,128]{3,2,1,0}, bf16[1,4,16,128]{3,2,1,0}, s32[]) tuple(%w, %pool, %new, %at)
  ROOT %cond = (bf16[4,4,16,128]{3,2,1,0}) conditional(%go, %ops.0, %ops.1), branch_computations={%idle, %busy}
}
"""


def test_a_conditional_is_charged_as_its_costliest_branch_with_slot_step_names():
    """scripts/tpu_bytes.py reads the slot step (scripts/tpu_paged_step.py --top): a conditional
    is its busiest branch, traced through the branch's operand tuple to the entry's weights
    (tstate[...]) and caches (slots.loop.target_cache...), not the whole state in and out."""
    s = tpu_bytes.breakdown(COND_HLO)
    rec = {r["name"]: r for r in s["records"]}
    w = 256 * 64 * 2
    assert set(rec) == {"cond/neg", "cond/fusion"}
    assert s["kinds_hbm"]["weights"] == w and rec["cond/neg"]["group"] == "target_layer0"
    # the page written in place: its rows, the pool neither read nor copied
    assert s["kinds_hbm"]["kv_write"] == 4 * 16 * 128 * 2 and s["kinds_hbm"].get("kv_read", 0) == 0
    assert s["hbm_total"] == 2 * w + 2 * 4 * 16 * 128 * 2 + 4     # neg in + out, the rows in + out, the offset


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
    the fused weight given to the kernel twice is charged once, and no q relayout copy is left.
    (One compile, with the kernel: the program without it moved 0.375 GB of activations, this one
    0.237, and its compile was 12-17 s of CI; the bound below sits between them.)"""
    from dflash_jax import DraftConfig, KernelConfig, TargetConfig, decode
    tc = dataclasses.replace(TargetConfig.preset("qwen3-8b"), num_layers=2)
    dc = DraftConfig.for_target(tc, num_layers=1, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=(0, 1))
    comp = decode.lower_iteration(tc, dc, batch=32, prompt_len=512, capacity=1024,
                                  kernels=KernelConfig(attention="pallas_tpu", tpu_mlp=True),
                                  device=tpu_aot.tpu_device("v5p:2x2x1")).compile()
    s = tpu_bytes.breakdown(comp)
    ideal = tpu_bytes.ideal_bytes(tc, dc, draft=True, batch=32, capacity=1024)
    assert abs(s["model_total"] / s["compiler_bytes_accessed"] - 1) < 0.05
    assert s["kinds_hbm"]["weights"] <= 1.02 * (ideal["target_layers"] + ideal["draft"])
    # three layers' MLP blocks: without the kernel >= 3 x 40 MB more of [512, 2I] intermediates and
    # normed rows (0.375 GB in all)
    assert s["kinds_hbm"]["activations"] < 0.375e9 - 0.12e9
    assert s["kinds_hbm"]["copies"] < 0.02e9


def _pallas_probe_kernel():
    """A Pallas kernel whose traffic is known by hand: grid (2, 3, 2); x [64, 384] f32 in blocks
    (32, 128) at (i, j) (each block once, re-used over k); w [256, 256] bf16 in blocks (128, 128) at
    (k, 0) (re-fetched whenever k changes: every step); e [16, 128] f32 at (0, 0) once; a KV-like
    c [4, 512, 128] f32 in blocks (1, 128, 128) at (i, min(k, last)) with last from a scalar-prefetch
    value (the clamp: every block up to k's range); o [64, 384] f32 out like x."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(n_ref, x_ref, w_ref, e_ref, c_ref, o_ref):
        o_ref[...] = x_ref[...] + e_ref[0:1, :] + c_ref[0, 0:1, :] + w_ref[0:1, 0:128].astype(jnp.float32)

    def c_map(i, j, k, n_ref):
        last = jnp.maximum(pl.cdiv(n_ref[i], 128) - 1, 0)
        return (i, jnp.minimum(k, last), 0)

    def f(n, x, w, e, c):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(2, 3, 2),
                in_specs=[pl.BlockSpec((32, 128), lambda i, j, k, n: (i, j)),
                          pl.BlockSpec((128, 128), lambda i, j, k, n: (k, 0)),
                          pl.BlockSpec((16, 128), lambda i, j, k, n: (0, 0)),
                          pl.BlockSpec((1, 128, 128), c_map)],
                out_specs=pl.BlockSpec((32, 128), lambda i, j, k, n: (i, j))),
            name="traffic_probe")(n, x, w, e, c)
    shapes = [((2,), jnp.int32), ((64, 384), jnp.float32), ((256, 256), jnp.bfloat16),
              ((16, 128), jnp.float32), ((4, 512, 128), jnp.float32)]
    return f, shapes


@tpu_aot.requires_libtpu
def test_pallas_kernel_charged_by_its_blockspecs_not_whole_operands():
    """The tool reads a Pallas kernel's grid and index maps out of its Mosaic module and charges
    each operand what the pipeline moves; checked against the bytes counted by hand."""
    import jax
    f, shapes = _pallas_probe_kernel()
    dev = tpu_aot.tpu_device("v6e:2x2")
    comp = tpu_aot.compile_for_tpu(f, *(tpu_aot.abstract(s, d, dev) for s, d in shapes))
    prog = tpu_bytes.Program(comp.as_text())
    cc = [i for i in prog.instrs if i.op == "custom-call" and i.attr("custom_call_target") == "tpu_custom_call"]
    assert len(cc) == 1
    t = tpu_bytes.pallas_traffic(cc[0])
    steps = 2 * 3 * 2
    x_b = 64 * 384 * 4                         # 6 blocks of (32, 128), each fetched once
    w_b = steps * 128 * 128 * 2                # k changes on every step: a (128, 128) block each
    e_b = 16 * 128 * 4                         # one block, never re-fetched
    c_b = 2 * 3 * 2 * 128 * 128 * 4            # rows i of c; blocks 0, 1 for each (i, j): 12 fetches
    assert t["inputs"] == [2 * 4, x_b, w_b, e_b, c_b]
    assert t["outputs"] == [x_b]
    # the record: HBM bytes by the BlockSpecs, the whole-operand figure kept next to it
    rec = next(r for r in tpu_bytes.charges(prog) if r["op"] == "tpu_custom_call")
    assert rec["hbm"] == 2 * 4 + x_b + w_b + e_b + c_b + x_b
    assert rec["hbm_whole"] == 2 * 4 + x_b + 256 * 256 * 2 + e_b + 4 * 512 * 128 * 4 + x_b
