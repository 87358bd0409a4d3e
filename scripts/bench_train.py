"""Draft-training step: time, tokens/s, peak memory and MFU on this machine's accelerator, and (with
--tpu-aot) the step compiled ahead of time for a TPU v6e:2x2 (data parallel over its 4 chips) on a
CPU host: per-chip memory from memory_analysis(), flops from cost_analysis().

    python scripts/bench_train.py                       # H200: Qwen3-8B target + z-lab draft, random bf16
    python scripts/bench_train.py --quick               # CPU, tiny shapes, seconds
    python scripts/bench_train.py --breakdown 4 --steps 3 [--profile DIR]   # where a B=4 step's time goes
    python scripts/bench_train.py --breakdown 4 --steps 3 --train-attention xla,pallas_gpu   # both, side by side
    JAX_PLATFORMS=cpu python scripts/bench_train.py --tpu-aot [--presets qwen3-4b,qwen3-8b]

MFU = model FLOPs (target forward + draft forward and backward, the LM head over the block slots
included) / step time / the chip's bf16 dense peak (H200: 989 TFLOP/s). Model FLOPs count matmuls
only: 2·params·tokens for projections, the causal target attention at T²/2, the draft's context
attention at the anchors' mean position, backward = 2× forward for the draft, 1× for the frozen LM
head (input gradient only).

--breakdown B times, for one batch, the full step and its parts, each its own jitted function run
alone with a device sync (median over --steps): (a) the frozen target's forward giving the taps,
(b) the draft's forward + backward + AdamW update given those taps, (b1) the packed draft layers with
the split attention, forward + backward to the parameters under a fixed cotangent, (b2) the chunked LM
head + loss over the block slots, forward + backward to the hidden states. --profile DIR also wraps
two full steps in jax.profiler.trace(DIR) (TensorBoard xplane + a Perfetto trace.json.gz).
"""

from __future__ import annotations

import argparse
import functools
import gc
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
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_jax.config import PRESETS, DraftConfig, TargetConfig  # noqa: E402
from dflash_jax.drafts.dflash import DFlashDraft  # noqa: E402
from dflash_jax.models.qwen3 import Qwen3  # noqa: E402
from dflash_jax.train.anchors import anchor_key, sample_anchors  # noqa: E402
from dflash_jax.train.loss import block_labels, block_loss_sums  # noqa: E402
from dflash_jax.train.packed import TRAIN_ATTENTION, block_tokens, draft_forward, resolve_train_attention  # noqa: E402
from dflash_jax.train.step import (StepConfig, Trainer, build_step, init_state, loss_and_metrics,  # noqa: E402
                                   lr_schedule, make_mesh, make_optimizer, split_draft, step_shardings,
                                   target_features)

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
    return dict(target_fwd=tgt, draft_fwd_bwd=draft, total=tgt + draft,
                draft_layers_fwd_bwd=3 * (d_proj + d_ctx + d_att), lm_head_fwd_bwd=2 * head)


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


def _profile(call, profile_dir, n=2):
    """Run `call` n times under jax.profiler.trace (xplane for TensorBoard + a Perfetto trace)."""
    try:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(n):
                jax.block_until_ready(call())
        print(f"# profile of {n} steps written under {profile_dir}", flush=True)
    except Exception as e:  # a missing profiler backend (CUPTI) must not lose the timings
        print(f"# profile failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}", flush=True)


def measure(tc, dc, cfg, B, T, steps, warmup=2, profile_dir=None):
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
    loss = float(m["loss"])
    if profile_dir:
        box = [state]

        def call():
            box[0], mm = tr.step(box[0], tokens, lm, ids, 0)
            return mm["loss"]
        _profile(call, os.path.join(profile_dir, f"b{B}"))
    return dict(step_s=dt, compile_s=compile_s, peak_bytes=_peak_bytes(), loss=loss)


def _shapes(args):
    """(target config, draft config, T, N) of the run: tiny under --quick, else the preset."""
    if args.quick:
        tc = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=1e6)
        dc = DraftConfig.for_target(tc, num_layers=2, block_size=8)
        return tc, dc, 128, 16
    tc = PRESETS[args.preset]
    dc = DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=QWEN3_MASK)
    return tc, dc, args.seq, args.anchors


def _step_cfg(args, dc, N, train_attention="xla"):
    return StepConfig(block_size=dc.block_size, mask_token_id=dc.mask_token_id,
                      target_layer_ids=dc.target_layer_ids, num_anchors=N, total_steps=1000,
                      attention_impl=args.attention, train_attention=train_attention,
                      chunk_blocks=args.chunk_blocks, head_chunk=args.head_chunk)


def _peak():
    kind = jax.devices()[0].device_kind
    return kind, next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)


def gpu_table(args, train_attention="xla"):
    tc, dc, T, N = _shapes(args)
    if args.quick:
        batches, steps = [1, 2], 2
    else:
        steps = args.steps
        batches = [int(b) for b in args.batches.split(",")]
    kind, peak = _peak()
    print(f"# device {kind}; target {args.preset if not args.quick else 'tiny'}, draft {dc.num_layers} layers, "
          f"S {dc.block_size}, T {T}, N {N}; draft attention {train_attention}; jax {jax.__version__}", flush=True)
    print("| batch | step (ms) | tokens/s | block tokens/s | peak mem (GiB) | model TFLOP/step | MFU | compile (s) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for B in batches:
        cfg = _step_cfg(args, dc, N, train_attention)
        try:
            r = measure(tc, dc, cfg, B, T, steps, profile_dir=args.profile if B == batches[0] else None)
        except Exception as e:  # the first batch that does not fit ends the sweep
            msg = " ".join(str(e).split())[:160]
            print(f"| {B} | does not run: {type(e).__name__}: {msg} |")
            break
        fl = model_flops(tc, dc, B, T, min(N, int(0.9 * T) - 1), mean_anchor=0.55 * T)
        mfu = fl["total"] / r["step_s"] / peak if peak else float("nan")
        pk = r["peak_bytes"] / 2**30 if r["peak_bytes"] else float("nan")
        print(f"| {B} | {r['step_s'] * 1e3:.1f} | {B * T / r['step_s']:.0f} | {B * N * dc.block_size / r['step_s']:.0f} "
              f"| {pk:.1f} | {fl['total'] / 1e12:.1f} | {mfu:.1%} | {r['compile_s']:.1f} |", flush=True)
        rows.append(dict(batch=B, train_attention=train_attention, **r, **fl, mfu=mfu))
    return rows


def _median_time(call, steps):
    """(compile + first run s, median s of `steps` synced runs after one warm-up) of call()."""
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - t0
    jax.block_until_ready(call())
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return first, float(np.median(ts))


def breakdown(args, train_attention="xla"):
    """The full step and its parts (a), (b), (b1), (b2) for one batch, each jitted alone, on one device."""
    tc, dc, T, N = _shapes(args)
    B = args.breakdown
    steps = 2 if args.quick else args.steps
    cfg = _step_cfg(args, dc, N, train_attention)
    kind, peak = _peak()
    dt = jnp.dtype(cfg.compute_dtype)
    target = Qwen3(tc, jnp.bfloat16, rngs=nnx.Rngs(0))
    draft = DFlashDraft(dc, jnp.float32, rngs=nnx.Rngs(1))
    gd, params = split_draft(draft, cfg.compute_dtype)
    del draft
    tr = Trainer(target, gd, cfg, make_mesh(jax.devices()[:1]))
    del target
    tdef, tstate = tr.target_def, tr.target_state
    box = [tr.place_state(init_state(params, cfg))]                            # donated by (full) and (b)
    del params
    tokens_np, lm_np = batch_data(B, T)
    tokens, lm = jnp.asarray(tokens_np), jnp.asarray(lm_np)
    ids, epoch = jnp.arange(B, dtype=jnp.int32), jnp.zeros((), jnp.int32)
    opt, sched = make_optimizer(cfg), lr_schedule(cfg)

    @jax.jit
    def part_a(tstate, tokens):
        return target_features(nnx.merge(tdef, tstate), tokens, cfg)             # [B, T, n·H]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def part_b(state, tstate, feats, tokens, lm, ids, epoch):
        target = nnx.merge(tdef, tstate)
        (loss, _), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            state.params, gd, target, tokens, lm, ids, epoch, cfg, feats=feats)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        new = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                            step=state.step + 1)
        return new, loss, sched(state.step)

    @jax.jit
    def prep(tstate, tokens, lm, ids, epoch):
        """What (b1) and (b2) take as given: anchors, block embeddings, labels, weights."""
        target = nnx.merge(tdef, tstate)
        anchors, keep = sample_anchors(anchor_key(cfg.anchor_seed, epoch, ids), lm, cfg.num_anchors)   # [B, N]
        embeds = target.embed_tokens(block_tokens(tokens, anchors, cfg.block_size, cfg.mask_token_id))  # [B, N·S, H]
        return anchors, embeds, block_labels(tokens, lm, anchors, keep, cfg.block_size, cfg.gamma_value)

    @jax.jit
    def part_b1(params, embeds, feats, anchors, cot):
        def f(p):
            d = nnx.merge(gd, jax.tree.map(lambda x: x.astype(dt), p))
            h = draft_forward(d, embeds, feats, anchors, chunk_blocks=cfg.chunk_blocks,
                              attention=cfg.train_attention)
            return jnp.sum(h.astype(jnp.float32) * cot)
        return jax.grad(f)(params)

    @jax.jit
    def part_b2(tstate, hidden, labels, weights, valid):
        target = nnx.merge(tdef, tstate)

        def f(h):
            sums = block_loss_sums(target, h, labels, weights, valid, head_chunk=cfg.head_chunk)
            return sums["loss_sum"] / jnp.maximum(sums["weight_sum"], 1e-9)
        return jax.value_and_grad(f)(hidden)

    def full():
        box[0], m = tr.step(box[0], tokens, lm, ids, epoch)
        return m["loss"]

    feats = part_a(tstate, tokens)
    anchors, embeds, (labels, weights, valid) = prep(tstate, tokens, lm, ids, epoch)
    key = jax.random.key(2)
    cot = jax.random.normal(key, embeds.shape, dt)                             # [B, N·S, H]
    hidden = jax.random.normal(jax.random.fold_in(key, 1), embeds.shape, dt)   # [B, N·S, H]

    def call_b():
        box[0], loss, _ = part_b(box[0], tstate, feats, tokens, lm, ids, epoch)
        return loss

    fl = model_flops(tc, dc, B, T, min(N, int(0.9 * T) - 1), mean_anchor=0.55 * T)
    parts = [("full step (a + b in one program)", full, fl["total"]),
             ("(a) target forward → taps", lambda: part_a(tstate, tokens), fl["target_fwd"]),
             ("(b) draft fwd + bwd + AdamW, given taps", call_b, fl["draft_fwd_bwd"]),
             ("(b1) draft layers + split attention, fwd + bwd", lambda: part_b1(box[0].params, embeds, feats, anchors, cot),
              fl["draft_layers_fwd_bwd"]),
             ("(b2) LM head + CE over block slots, fwd + bwd", lambda: part_b2(tstate, hidden, labels, weights, valid),
              fl["lm_head_fwd_bwd"])]
    print(f"# device {kind}; target {args.preset if not args.quick else 'tiny'}, draft {dc.num_layers} layers, "
          f"S {dc.block_size}, T {T}, N {N}, batch {B}; draft attention {train_attention}; median of {steps} "
          f"synced runs per part; jax {jax.__version__}",
          flush=True)
    print("| part | ms | share of step | model TFLOP | MFU | compile + first run (s) |")
    print("|---|---|---|---|---|---|", flush=True)
    rows, times = [], {}
    for name, call, flops in parts:   # each row as soon as it is measured: a cut-short run keeps the rest
        first, t = times[name] = _median_time(call, steps)
        step_s = times[parts[0][0]][1]
        mfu = flops / t / peak if peak else float("nan")
        print(f"| {name} | {t * 1e3:.1f} | {t / step_s:.1%} | {flops / 1e12:.3g} | {mfu:.1%} | {first:.1f} |",
              flush=True)
        rows.append(dict(part=name, train_attention=train_attention, ms=t * 1e3, share=t / step_s,
                         model_flops=flops, mfu=mfu, first_s=first))
    a, b = times[parts[1][0]][1], times[parts[2][0]][1]
    b1, b2 = times[parts[3][0]][1], times[parts[4][0]][1]
    rest = b - b1 - b2
    print(f"| (b) − (b1) − (b2): anchors, embeds, AdamW, grad norm | {rest * 1e3:.1f} | {rest / step_s:.1%} | | | |")
    print(f"| step − (a) − (b): gained (−) or lost (+) by one program | {(step_s - a - b) * 1e3:.1f} | "
          f"{(step_s - a - b) / step_s:.1%} | | | |", flush=True)
    print(f"# peak memory {(_peak_bytes() or float('nan')) / 2**30:.1f} GiB", flush=True)
    if args.profile:
        _profile(full, os.path.join(args.profile, f"b{B}-{train_attention}"))
    return rows


def check_attention(impl, B=2, T=3072, N=128, S=16, Hq=32, Hkv=8, D=128, seed=0):
    """`impl`'s split attention against the XLA one on this device at Qwen3-8B heads (bf16, sorted
    anchors, a padded tail in row 1): the largest error of o and of dq, dkc, dvc, dkb, dvb relative to
    the largest XLA value. A kernel that compiles but computes garbage shows here before any timing."""
    from dflash_jax.train.packed import split_attention
    ks = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(ks[0], (B, N * S, Hq, D), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (B, T, Hkv, D), jnp.bfloat16) for k in ks[1:3])
    kb, vb = (jax.random.normal(k, (B, N * S, Hkv, D), jnp.bfloat16) for k in ks[3:5])
    anchors = jnp.sort(jax.random.randint(ks[5], (B, N), 0, T - 1), axis=1).at[1, N // 2:].set(0)
    anchors = anchors.at[0, 0].set(0)                                         # an empty context
    ct = jax.random.normal(ks[6], q.shape, jnp.bfloat16)

    def run(attention):
        f = lambda *x: split_attention(*x, anchors, S, attention=attention)
        g = jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * ct), argnums=range(5))
        return jax.jit(lambda *x: (f(*x), *g(*x)))(q, kc, vc, kb, vb)

    got, ref = run(impl), run("xla")
    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                  max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)) for a, b in zip(got, ref)]
    finite = all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in got)
    print(f"# check {impl} vs xla (B {B}, T {T}, N {N}, bf16): max |err| / max |xla| of o, dq, dkc, dvc, dkb, dvb = "
          + ", ".join(f"{e:.2e}" for e in errs) + f"; all finite: {finite}"
          + ("" if finite and max(errs) < 5e-2 else "  <-- MISMATCH"), flush=True)


def side_by_side(rows, key, impls):
    """One table of ms and MFU per row `key` (a part, or a batch) for each draft attention."""
    print(f"# side by side: draft attention {' vs '.join(impls)}")
    print("| " + key + " | " + " | ".join(f"{i} ms | {i} MFU" for i in impls) + " |")
    print("|---|" + "---|---|" * len(impls))
    names = list(dict.fromkeys(r[key] for r in rows))
    for name in names:
        cells = []
        for i in impls:
            r = next((r for r in rows if r[key] == name and r["train_attention"] == i), None)
            ms = r["ms"] if r and "ms" in r else r["step_s"] * 1e3 if r else float("nan")
            cells.append(f"{ms:.1f} | {r['mfu']:.1%}" if r else "- | -")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


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
    p.add_argument("--train-attention", default="auto",
                   help="the draft's context attention in training, comma-separated to compare in one run: "
                        "xla, pallas_gpu (StepConfig.train_attention)")
    p.add_argument("--chunk-blocks", type=int, default=32)
    p.add_argument("--head-chunk", type=int, default=2048)
    p.add_argument("--tpu-aot", action="store_true")
    p.add_argument("--presets", default="qwen3-4b,qwen3-8b")
    p.add_argument("--tpu-batch", type=int, default=1, help="sequences per chip for --tpu-aot")
    p.add_argument("--tpu-attention", default="xla", help="the target's attention in the TPU program")
    p.add_argument("--breakdown", type=int, nargs="?", const=4, default=None, metavar="B",
                   help="time the step's parts for batch B (default 4) instead of the batch sweep")
    p.add_argument("--profile", metavar="DIR", help="also trace 2 full steps with jax.profiler into DIR")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if args.breakdown is not None and args.breakdown < 1:
        p.error(f"--breakdown needs a batch of at least 1, got {args.breakdown}")
    impls = list(dict.fromkeys(a.strip() for a in args.train_attention.split(",") if a.strip()))
    bad = [a for a in impls if a not in TRAIN_ATTENTION]
    if bad or not impls:
        p.error(f"--train-attention takes {', '.join(TRAIN_ATTENTION)} (comma-separated); got {args.train_attention!r}")
    impls = list(dict.fromkeys(resolve_train_attention(a) for a in impls))
    if args.tpu_aot:
        rows = tpu_aot(args)
    else:
        rows = []
        for impl in impls:
            if impl != "xla" and not args.quick:
                check_attention(impl)
            rows += breakdown(args, impl) if args.breakdown is not None else gpu_table(args, impl)
            gc.collect()
            jax.clear_caches()                       # the next program gets the memory back
        if len(impls) > 1:
            side_by_side(rows, "part" if args.breakdown is not None else "batch", impls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)


if __name__ == "__main__":
    main()
