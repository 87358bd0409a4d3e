"""Draft-training step: time, tokens/s, peak memory and MFU on this machine's accelerator, and (with
--tpu-aot) the step compiled ahead of time for a TPU v6e:2x2 (data parallel over its 4 chips) on a
CPU host: per-chip memory from memory_analysis(), flops from cost_analysis().

    python scripts/bench_train.py                       # H200: Qwen3-8B target + z-lab draft, random bf16
    python scripts/bench_train.py --quick               # CPU, tiny shapes, seconds
    JAX_PLATFORMS=cpu python scripts/bench_train.py --tpu-aot [--presets qwen3-4b,qwen3-8b]

MFU = model FLOPs (target forward + draft forward and backward, the LM head over the block slots
included) / step time / the chip's bf16 dense peak (H200: 989 TFLOP/s). Model FLOPs count matmuls
only: 2·params·tokens for projections, the causal target attention at T²/2, the draft's context
attention at the anchors' mean position, backward = 2× forward for the draft, 1× for the frozen LM
head (input gradient only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tpu-aot" in sys.argv:  # before jax starts: libtpu must not probe for TPU workers
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compiles on this host may hold libtpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_jax.config import PRESETS, DraftConfig, TargetConfig  # noqa: E402
from dflash_jax.modeling.draft import DFlashDraft  # noqa: E402
from dflash_jax.modeling.qwen3 import Qwen3  # noqa: E402
from dflash_jax.train.step import (StepConfig, Trainer, build_step, init_state, make_mesh,  # noqa: E402
                                   split_draft, step_shardings)

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "v6e": 918e12, "cpu": None}
QWEN3_MASK = 151669


def model_flops(tc: TargetConfig, dc: DraftConfig, B: int, T: int, N: int, mean_anchor: float) -> dict:
    H, Hq, Hkv, D, I = tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size
    per_layer = H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * I              # matmul params of a layer
    tgt = 2 * per_layer * tc.num_layers * B * T + 2 * 2 * tc.num_layers * B * Hq * D * T * T / 2
    S = dc.block_size
    Q = B * N * S                                                             # block tokens
    dl = dc.num_layers
    d_proj = 2 * per_layer * dl * Q                                           # block rows through the layers
    d_ctx = 2 * (len(dc.target_layer_ids) * H * H) * B * T + 2 * (H * 2 * Hkv * D) * dl * B * T
    d_att = 2 * 2 * dl * B * N * S * Hq * D * (mean_anchor + S)
    head = 2 * H * tc.vocab_size * B * N * (S - 1)
    draft = 3 * (d_proj + d_ctx + d_att) + 2 * head
    return dict(target_fwd=tgt, draft_fwd_bwd=draft, total=tgt + draft)


def batch_data(B: int, T: int, seed: int = 0, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    lm = np.ones((B, T), np.int32)
    lm[:, : T // 10] = 0                                                      # a prompt, then the response
    return tokens, lm


def _peak_bytes():
    try:
        return jax.devices()[0].memory_stats().get("peak_bytes_in_use")
    except Exception:
        return None


def measure(tc, dc, cfg, B, T, steps, warmup=2):
    target = Qwen3(tc, jnp.bfloat16, rngs=nnx.Rngs(0))
    draft = DFlashDraft(dc, jnp.float32, rngs=nnx.Rngs(1))
    gd, params = split_draft(draft, cfg.compute_dtype)
    del draft
    tr = Trainer(target, gd, cfg, make_mesh())
    del target
    state = tr.place_state(init_state(params, cfg))
    tokens, lm = batch_data(B, T)
    ids = np.arange(B)
    t0 = time.perf_counter()
    state, m = tr.step(state, tokens, lm, ids, 0)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        state, m = tr.step(state, tokens, lm, ids, 0)
    jax.block_until_ready(m["loss"])
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = tr.step(state, tokens, lm, ids, 0)
    jax.block_until_ready(m["loss"])
    dt = (time.perf_counter() - t0) / steps
    return dict(step_s=dt, compile_s=compile_s, peak_bytes=_peak_bytes(), loss=float(m["loss"]))


def gpu_table(args):
    if args.quick:
        tc = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=1e6)
        dc = DraftConfig.for_target(tc, num_layers=2, block_size=8)
        T, N, batches, steps = 128, 16, [1, 2], 2
    else:
        tc = PRESETS[args.preset]
        dc = DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=QWEN3_MASK)
        T, N, steps = args.seq, args.anchors, args.steps
        batches = [int(b) for b in args.batches.split(",")]
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)
    print(f"# device {kind}; target {args.preset if not args.quick else 'tiny'}, draft {dc.num_layers} layers, "
          f"S {dc.block_size}, T {T}, N {N}; jax {jax.__version__}", flush=True)
    print("| batch | step (ms) | tokens/s | block tokens/s | peak mem (GiB) | model TFLOP/step | MFU | compile (s) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for B in batches:
        cfg = StepConfig(block_size=dc.block_size, mask_token_id=dc.mask_token_id,
                         target_layer_ids=dc.target_layer_ids, num_anchors=N, total_steps=1000,
                         attention_impl=args.attention, chunk_blocks=args.chunk_blocks, head_chunk=args.head_chunk)
        try:
            r = measure(tc, dc, cfg, B, T, steps)
        except Exception as e:  # the first batch that does not fit ends the sweep
            msg = " ".join(str(e).split())[:160]
            print(f"| {B} | does not run: {type(e).__name__}: {msg} |")
            break
        fl = model_flops(tc, dc, B, T, min(N, int(0.9 * T) - 1), mean_anchor=0.55 * T)
        mfu = fl["total"] / r["step_s"] / peak if peak else float("nan")
        pk = r["peak_bytes"] / 2**30 if r["peak_bytes"] else float("nan")
        print(f"| {B} | {r['step_s'] * 1e3:.1f} | {B * T / r['step_s']:.0f} | {B * N * dc.block_size / r['step_s']:.0f} "
              f"| {pk:.1f} | {fl['total'] / 1e12:.1f} | {mfu:.1%} | {r['compile_s']:.1f} |", flush=True)
        rows.append(dict(batch=B, **r, **fl, mfu=mfu))
    return rows


def tpu_aot(args):
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2")
    devs = topo.devices
    mesh = make_mesh(devs)
    ins, outs = step_shardings(mesh)
    print(f"# TPU v6e:2x2 ({len(devs)} chips, {devs[0].device_kind}), data parallel, T {args.seq}, N {args.anchors}, "
          f"per-chip batch {args.tpu_batch}; compiled ahead of time on a CPU host")
    print("| target | per-chip args (GiB) | temp (GiB) | total per chip (GiB) | fits 32 GB HBM (90%) | compiler TFLOP/step/chip | model TFLOP/step |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for preset in args.presets.split(","):
        tc = PRESETS[preset]
        dc = DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=QWEN3_MASK)
        B = args.tpu_batch * len(devs)
        cfg = StepConfig(block_size=16, mask_token_id=QWEN3_MASK, target_layer_ids=dc.target_layer_ids,
                         num_anchors=args.anchors, total_steps=1000, attention_impl=args.tpu_attention,
                         chunk_blocks=args.chunk_blocks, head_chunk=args.head_chunk)
        tshell = nnx.eval_shape(lambda: Qwen3(tc, jnp.bfloat16, rngs=nnx.Rngs(0)))
        dshell = nnx.eval_shape(lambda: DFlashDraft(dc, jnp.bfloat16, rngs=nnx.Rngs(0)))
        tdef, tstate = nnx.split(tshell)
        ddef, dparams = nnx.split(dshell, nnx.Param)
        dparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), dparams)
        state = jax.eval_shape(lambda p: init_state(p, cfg), dparams)
        put = lambda tree, sh: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)
        a_state, a_target = put(state, ins[0]), put(tstate, ins[1])
        a_tok = jax.ShapeDtypeStruct((B, args.seq), jnp.int32, sharding=ins[2])
        a_ids = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=ins[4])
        a_ep = jax.ShapeDtypeStruct((), jnp.int32, sharding=ins[5])
        t0 = time.perf_counter()
        comp = jax.jit(build_step(tdef, ddef, cfg), in_shardings=ins, out_shardings=outs,
                       donate_argnums=(0,)).trace(a_state, a_target, a_tok, a_tok, a_ids, a_ep).lower().compile()
        ma = comp.memory_analysis()
        ca = comp.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        arg, tmp = ma.argument_size_in_bytes, ma.temp_size_in_bytes
        out_b, alias = ma.output_size_in_bytes, ma.alias_size_in_bytes
        total = arg + tmp + out_b - alias
        fl = model_flops(tc, dc, B, args.seq, args.anchors, 0.55 * args.seq)
        print(f"| {preset} | {arg / 2**30:.1f} | {tmp / 2**30:.1f} | {total / 2**30:.1f} | "
              f"{'yes' if total < 0.9 * 32e9 else 'marginal' if total < 32e9 else 'no'} | {ca.get('flops', float('nan')) / 1e12:.1f} | "
              f"{fl['total'] / 1e12:.1f} | (compile {time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(dict(preset=preset, argument_bytes=arg, temp_bytes=tmp, output_bytes=out_b, alias_bytes=alias,
                         total_bytes=total, compiler_flops=ca.get("flops"), model_flops=fl["total"]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes on whatever device (CPU: seconds)")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--batches", default="1,2,4,8,16", help="tried in order until one does not fit")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attention", default="auto", help="the target's attention (auto: Pallas/cuDNN)")
    p.add_argument("--chunk-blocks", type=int, default=32)
    p.add_argument("--head-chunk", type=int, default=2048)
    p.add_argument("--tpu-aot", action="store_true")
    p.add_argument("--presets", default="qwen3-4b,qwen3-8b")
    p.add_argument("--tpu-batch", type=int, default=1, help="sequences per chip for --tpu-aot")
    p.add_argument("--tpu-attention", default="xla", help="the target's attention in the TPU program")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    rows = tpu_aot(args) if args.tpu_aot else gpu_table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)


if __name__ == "__main__":
    main()
