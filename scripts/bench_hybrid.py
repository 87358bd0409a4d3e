"""Qwen3.5 hybrid target (issue 38): a plain decode step and a DFlash iteration of the compiled
loop, random bf16 weights, against the HBM floor (weights + attention KV + recurrent state bytes),
and the rollback's (commit's) share of an iteration.

    python scripts/bench_hybrid.py                       # Qwen3.5-9B shapes, B = 1 and 32, S = 16
    python scripts/bench_hybrid.py --smoke               # tiny shapes on CPU (checks the script runs)
    python scripts/bench_hybrid.py --model 35b-a3b       # Qwen3.5-35B-A3B shapes (MoE, bf16 ~70 GB)
    python scripts/bench_hybrid.py --paths xla-chunk,kernel --models 9b,35b-a3b --budget-s 330   # A/B

--paths names how the GDN layers run their short blocks (decode, verify): xla-chunk / xla-recurrent
(models/gated_delta.py's forms) or kernel / kernel-bvN (pallas_kernels/gated_delta, the whole head
per program or N value dims per program; KernelConfig.gdn="pallas"). --layer-counts first prints
the launch-level op counts of ONE GDN layer's block forward + fold per path (on GPU: the real
fusions and kernels; on CPU the kernel is a stand-in custom call). --budget-s skips the rows that
would not finish in time (each row is estimated from the slowest row so far).

Each figure is the median per-iteration time of K iterations of `loop.iterate` run inside one
jitted fori_loop (as the while loop runs them), the loop state donated. The draft is a random
5-layer DFlash draft of the target's width (drafts are rejected: every iteration does the same
work whatever is accepted; the fold runs over the whole block regardless). The rollback's share is
measured twice: the same loop with the fold left out (ms_without_fold, fold_share) and the commit
timed alone as its own program (commit_ms, commit_share: includes one dispatch). Prints one JSON
object per configuration and writes them to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "--tpu-aot" in sys.argv:     # libtpu must not probe the host for TPU workers (tests/tpu_aot.py)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dflash_jax import DraftConfig, decode, init_draft, loop  # noqa: E402
from dflash_jax import init_target  # noqa: E402
from dflash_jax.models.qwen3_5 import Qwen35Config, record_bytes, state_bytes, with_verify_form  # noqa: E402
from dflash_jax.models.qwen3_5_moe import PRESET_35B_A3B, Qwen35MoeConfig  # noqa: E402

# Qwen3.5-9B text model (transformers' Qwen3_5TextConfig defaults are these shapes): 32 layers,
# every 4th full attention (8 full, 24 GDN).
QWEN35_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32, num_heads=16,
                 num_kv_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, rope_theta=1e7)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)
COPY_TBPS = 4.23e12      # H200 copy bandwidth measured here (DESIGN.md reference numbers)


# the MoE smoke shapes: 8 experts top-2 plus the shared expert
TINY_MOE = dict(TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)


def config(shapes: dict, verify_form: str, moe: bool = False) -> Qwen35Config:
    if moe and shapes is None:
        return dataclasses.replace(PRESET_35B_A3B, verify_form=verify_form)
    L = shapes["num_layers"]
    types = tuple("linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L))
    return (Qwen35MoeConfig if moe else Qwen35Config)(layer_types=types, verify_form=verify_form, **shapes)


def expert_bytes(target) -> tuple[int, int]:
    """(bytes of all routed-expert weights, of one expert across the layers); (0, 0) when dense."""
    tot = one = 0
    for layer in target.layers:
        e = getattr(layer.mlp, "experts", None)
        if e is not None:
            b = nbytes((e.experts_gate_up.get_value(), e.experts_down.get_value()))
            tot, one = tot + b, one + b // e.num_experts
    return tot, one


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def floor_bytes(target, draft, c: Qwen35Config, B: int, ctx: int, S: int) -> dict:
    """What one step must move at least: the weights read (embedding is a gather), the full
    layers' K/V of the context, the GDN state read and written once per request; with a draft, its
    layers and the LM head once more (the draft's logits over the block read the target's head,
    as bench_gpu's and bench_moe's floors count it)."""
    w = nbytes(nnx.state(target, nnx.Param)) - (0 if c.tie_word_embeddings else nbytes(target.embed.get_value()))
    tot, one = expert_bytes(target)
    if tot:   # MoE: at most the experts B*S*k choices can touch (an upper bound on the floor's weights)
        w = w - tot + one * min(c.num_experts, B * S * c.num_experts_per_tok)
    kv = B * ctx * len(c.full_layers) * 2 * c.num_kv_heads * c.head_dim * target.dtype.itemsize
    st = 2 * B * state_bytes(c, target.dtype)
    d = 0 if draft is None else nbytes(nnx.state(draft, nnx.Param))
    head = target.lm_head if target.lm_head is not None else target.embed
    dh = 0 if draft is None else nbytes(head.get_value())
    dkv = 0 if draft is None else B * ctx * draft.config.num_layers * 2 * draft.config.num_kv_heads * \
        draft.config.head_dim * target.dtype.itemsize
    return dict(weights=w, kv=kv, state=st, draft=d, draft_head=dh, draft_kv=dkv, total=w + kv + st + d + dh + dkv)


def _time(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def hlo_stats(compiled_text: str) -> dict:
    """Launch-level op counts of an optimised HLO module (fusions, custom calls, unfused dots and
    copies, while loops): at B = 1 an iteration's time above its byte floor is mostly per-kernel
    overhead, and these counts say how many kernels each verify form issues."""
    import re
    count = lambda op: len(re.findall(rf"= [^=]*? {op}\(", compiled_text))
    return dict(fusion=count("fusion"), custom_call=count("custom-call"), dot=count("dot"),
                copy=count("copy"), while_loops=count("while"))


PATHS = {"xla-chunk": ("chunk", "xla", 0), "xla-recurrent": ("recurrent", "xla", 0), "kernel": ("chunk", "pallas", 0)}


def path_spec(name: str) -> tuple:
    """(verify_form, KernelConfig.gdn, gdn_block_v) of a --paths entry (kernel-bvN: N value dims)."""
    if name in PATHS:
        return PATHS[name]
    if name.startswith("kernel-bv") and name[9:].isdigit():
        return ("chunk", "pallas", int(name[9:]))
    raise SystemExit(f"--paths: unknown path {name!r}; expected {sorted(PATHS)} or kernel-bvN")


def path_kernels(name: str):
    from dflash_jax.kernel_config import KernelConfig
    _, gdn, bv = path_spec(name)
    return KernelConfig(gdn=gdn, gdn_block_v=bv)


def entry_ops(compiled_text: str) -> dict:
    """Op counts of the ENTRY computation of an optimised HLO module (what a GPU launches: each
    fusion, custom call (a Pallas kernel, a cuBLAS gemm), unfused op), free ops left out."""
    import re
    body = compiled_text[compiled_text.index("ENTRY"):]
    body = body[:body.index("\n}")]
    free = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    ops = re.findall(r"= (?:\([^)]*\)|\S+) ([a-z][a-z0-9-]*)\(", body)
    counts: dict = {}
    for op in ops:
        if op not in free:
            counts[op] = counts.get(op, 0) + 1
    return dict(launches=sum(counts.values()), **dict(sorted(counts.items())))


def layer_counts(c: Qwen35Config, paths: list, dtype, batches=(1,), blocks=(16, 1)) -> list:
    """Launch-level op counts of ONE GDN layer (9B widths: projections, conv, gates, the rule, the
    output norm, out projection) over a block, then its commit (the fold and the conv window), per
    --paths entry, B and T. Compiled for this backend from abstract weights (no memory). On a
    backend without the Triton kernel (CPU) the kernel is replaced by a stand-in custom call of
    its shapes (one launch; the fold kernel likewise), so the counts around them are the compiler's own."""
    from dflash_jax.models.qwen3_5 import GatedDeltaNet
    import pallas_kernels.gated_delta.gpu as kgpu
    gdef, abstract = nnx.split(nnx.eval_shape(lambda: GatedDeltaNet(c, jnp.dtype(dtype), nnx.Rngs(0))))
    on_gpu = jax.default_backend() == "gpu"
    real, real_fold = kgpu.gdn_block, kgpu.fold_deltas
    rows = []
    for name in paths:
        form, _, _ = path_spec(name)
        kc = path_kernels(name).resolve()
        if not on_gpu and kc.gdn != "xla":      # the stand-in: the kernel's outputs from one host call
            import dataclasses as dc
            kc = dc.replace(kc, gdn="pallas_gpu_interpret")

            def stand_in(p, window, conv_w, A_log, dt_bias, norm_w, state, **kw):
                B, T = p.shape[:2]
                HV, dk, dv = state.shape[1], state.shape[2], state.shape[3]
                bv = kw.get("block_v") or dv
                o = jax.ShapeDtypeStruct((B, T, HV * dv), p.dtype) if bv == dv else \
                    jax.ShapeDtypeStruct((B, T, HV, dv), jnp.float32)
                outs = (o, jax.ShapeDtypeStruct((B, HV, T, dk), jnp.float32),
                        jax.ShapeDtypeStruct((B, HV, T), jnp.float32), jax.ShapeDtypeStruct((B, HV, T, dv), jnp.float32))
                res = jax.pure_callback(lambda *a: tuple(np.zeros(x.shape, x.dtype) for x in outs), outs,
                                        p, window, conv_w, A_log, dt_bias, norm_w, state)
                return res[0], tuple(res[1:])

            def fold_stand_in(k, G, delta, state, n, **kw):
                out = jax.ShapeDtypeStruct(state.shape, jnp.float32)
                return jax.pure_callback(lambda *a: np.zeros(out.shape, out.dtype), out, k, G, delta, state, n)
            kgpu_fn, fold_fn = stand_in, fold_stand_in
        else:
            kgpu_fn, fold_fn = real, real_fold
        for B in batches:
            for T in blocks:
                def fn(st, h, state, window, n):
                    m = nnx.merge(gdef, st)
                    m.verify_form = form
                    out, rec = m(h, state, window, False, kc)
                    new_state, new_window = m.advance(state, rec, n)
                    return out, new_state, new_window
                args = (abstract, jax.ShapeDtypeStruct((B, T, c.hidden_size), jnp.dtype(dtype)),
                        jax.ShapeDtypeStruct((B, c.linear_num_value_heads, c.linear_key_head_dim,
                                              c.linear_value_head_dim), jnp.float32),
                        jax.ShapeDtypeStruct((B, c.linear_conv_kernel_dim - 1, c.conv_dim), jnp.dtype(dtype)),
                        jax.ShapeDtypeStruct((B,), jnp.int32))
                import pallas_kernels.gated_delta as pkg
                pkg.gdn_block, pkg.fold_deltas = kgpu_fn, fold_fn       # read while tracing only
                try:
                    text = jax.jit(fn).lower(*args).compile().as_text()
                finally:
                    pkg.gdn_block, pkg.fold_deltas = real, real_fold
                r = dict(kind="gdn layer counts", path=name, batch=B, block=T, backend=jax.default_backend(),
                         kernel_stand_in=not on_gpu and kc.gdn != "xla", **entry_ops(text))
                print(json.dumps(r), flush=True)
                rows.append(r)
    return rows


def trace_breakdown(step, iters: int, trace_dir: str, top: int = 30) -> dict:
    """One more run of `step` (iters iterations) under jax.profiler: device time per iteration by
    kernel family and by named scope (bench_gpu's trace readers), the busy and idle share."""
    from bench_gpu import _device_events, _family, _find_trace, summarize_trace, trace_timeline
    jax.block_until_ready(step())
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(step())
    loaded = _device_events(_find_trace(trace_dir))
    sm, tl = summarize_trace(None, loaded), trace_timeline(None, loaded=loaded)
    fam: dict = {}
    for name, (t, n) in sm["by_name"].items():
        f = fam.setdefault(_family(name), [0.0, 0])
        f[0] += t
        f[1] += n
    per = lambda us: round(us / iters, 1)                                                   # noqa: E731
    families = sorted(fam.items(), key=lambda kv: -kv[1][0])[:top]
    scopes = sorted(sm["by_scope"].items(), key=lambda kv: -kv[1])[:top]
    return dict(trace_busy_ms_per_iteration=round(sm["busy_ms"] / iters, 3),
                trace_span_ms_per_iteration=round(tl["span_ms"] / iters, 3),
                trace_idle_ms_per_iteration=round(tl["idle_ms"] / iters, 3),
                trace_kernels_per_iteration=round(sm["n_events"] / iters, 1),
                trace_top_families_us=[(k, per(t), round(n / iters, 1)) for k, (t, n) in families],
                trace_top_scopes_us=[(k, per(t)) for k, t in scopes])


def run_one(target, draft, B: int, ctx: int, S: int, iters: int, reps: int, stats: bool = False,
            kernels=None, fold: bool = True, commit_alone: bool = True, trace_dir: str | None = None,
            compile_options: bool = True) -> dict:
    c = target.config
    prompts = [[int(x) for x in np.random.RandomState(b).randint(0, c.vocab_size, ctx)] for b in range(B)]
    d = draft if S > 1 else None
    st, tstate, dstate, p, _, _ = decode._static_and_params(
        target, d, prompts, stream=False, max_new_tokens=iters * S * (8 * (reps + 1) + 4) + S,
        block_size=S if S > 1 else None, kernels=kernels, verify_width="block")

    def models(ts, ds):
        return nnx.merge(st.target_def, ts), (None if st.draft_def is None else nnx.merge(st.draft_def, ds))

    prefill = jax.jit(lambda ts, ds, p: loop.prefill(st, *models(ts, ds), p))

    def k_iters_fn(commit):
        @functools.partial(jax.jit, donate_argnums=(3,))
        def k_iters(ts, ds, p, s, n):
            t, dr = models(ts, ds)
            saved = loop._commit
            loop._commit = commit         # read while tracing only
            try:
                return jax.lax.fori_loop(0, n, lambda _, s: loop.iterate(st, t, dr, p, s)[0], s)
            finally:
                loop._commit = saved
        return k_iters

    s = prefill(tstate, dstate, p)
    jax.block_until_ready(s)
    holder = [s]

    timing_kind = ["difference"]

    def timed(k_iters):
        """ms per iteration: runs of iters and 3 x iters iterations (one program, the trip count an
        argument), their difference over 2 x iters, so a call's own cost (its arguments: the
        models' thousands of arrays; on CUDA the command buffers' update) cancels."""
        def run(n):
            def step():
                holder[0] = k_iters(tstate, dstate, p, holder[0], n)
                return holder[0].lens
            return _time(step, reps)
        long_s, short_s = run(jnp.int32(3 * iters)), run(jnp.int32(iters))
        if long_s <= short_s:
            # noise above the work (a loaded host, a handful of iterations): the difference means
            # nothing, so the long run whole, its call's cost included (an upper bound), never a
            # negative time
            timing_kind[0] = "whole-call"
            return long_s / (3 * iters)
        return (long_s - short_s) / (2 * iters)

    def compiled(commit):
        # with the program's compile options, as generate() compiles it (on CUDA: the while loop
        # as a CUDA graph; without them the host reads the loop's predicate every iteration)
        opts = st.kernels.compiler_options() if compile_options else {}
        return k_iters_fn(commit).lower(tstate, dstate, p, holder[0], jnp.int32(iters)).compile(
            compiler_options=opts)

    k_main = compiled(loop._commit)
    extra = {"compile_options": sorted(st.kernels.compiler_options()) if compile_options else []}
    if stats:   # the K-iteration program's counts (the loop body is one iteration)
        extra["hlo_k_iterations"] = hlo_stats(k_main.as_text())
    per_iter = timed(k_main)
    if trace_dir:
        def once():
            holder[0] = k_main(tstate, dstate, p, holder[0], jnp.int32(iters))
            return holder[0].lens
        extra.update(trace_breakdown(once, iters, trace_dir))
    if fold:
        # the same iterations with the fold left out (records dropped, states never advanced): the
        # difference is the rollback's cost inside the compiled loop
        no_fold = timed(compiled(lambda target, cache, n: cache.replace(records=None)))
        extra.update(ms_without_fold=no_fold * 1e3, fold_share=(per_iter - no_fold) / per_iter)
    tgt = nnx.merge(st.target_def, tstate)
    if commit_alone:
        # the rollback alone: the commit of one block's records (a forward's cache), timed apart
        pos = holder[0].lens[:, None] + jnp.arange(S, dtype=jnp.int32)
        block = jnp.zeros((st.batch, S), jnp.int32)
        fwd = jax.jit(lambda ts, c_, b, q: nnx.merge(st.target_def, ts)(b, q, c_, q + 1, kernels=st.kernels)[2])
        with_records = fwd(tstate, holder[0].target_cache, block, pos)
        n = jnp.full((st.batch,), S // 2, jnp.int32)
        commit = jax.jit(lambda ts, c_, n: nnx.merge(st.target_def, ts).commit(c_, n))
        t_commit = _time(lambda: commit(tstate, with_records, n).state, reps * 4)
        extra.update(commit_ms=t_commit * 1e3, commit_share=t_commit / per_iter)
    fl = floor_bytes(tgt, d, c, st.batch, ctx, S)
    floor_s = fl["total"] / COPY_TBPS
    return dict(batch=B, ctx=ctx, block=S, verify_form=c.verify_form, ms_per_iteration=per_iter * 1e3,
                floor_ms=floor_s * 1e3, x_floor=per_iter / floor_s, floor_bytes=fl,
                gdn=str(st.kernels.gdn), gdn_block_v=int(st.kernels.gdn_block_v),
                state_bytes_per_request=state_bytes(c, tgt.dtype),
                record_bytes_per_request=record_bytes(c, S, tgt.dtype, kernel=st.kernels.gdn != "xla"), device=str(jax.devices()[0].device_kind),
                timing=timing_kind[0], **extra)


def tpu_aot(a, shapes, moe: bool) -> list:
    """Compile one DFlash iteration (and the plain step) for one chip of a TPU topology on this
    CPU host (libtpu, no TPU: docs/tpu-bytes.md) and compare the compiler's bytes accessed and
    the per-op HBM traffic (scripts/tpu_bytes.py's accounting: Pallas kernels by their BlockSpecs,
    VMEM operands free) with the floor (weights + attention KV + the GDN state read and written).
    --layers cuts the stack (the first N layer types) to keep the compile short on a small host."""
    from jax.experimental import topologies
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tpu_bytes
    from dflash_jax.kernel_config import KernelConfig
    topo = {"v6e": "v6e:2x2", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1"}[a.tpu_aot]
    dev = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
    rows = []
    for form in a.forms.split(","):
        c = config(shapes, form, moe)
        if a.layers:
            c = dataclasses.replace(c, num_layers=a.layers, layer_types=c.layer_types[:a.layers])
        dc = DraftConfig.for_target(c, num_layers=1 if a.smoke else 5, block_size=a.block,
                                    target_layer_ids=tuple(sorted({min(i, c.num_layers - 1) for i in (1, 3)})))
        target = nnx.eval_shape(lambda: init_target(c, seed=0, dtype="bfloat16"))
        draft = nnx.eval_shape(lambda: init_draft(dc, seed=1, dtype="bfloat16"))
        for B in (int(x) for x in a.batches.split(",")):
            for S in ((1, a.block) if form == a.forms.split(",")[0] else (a.block,)):
                t0 = time.perf_counter()
                low = decode.lower_iteration(c, dc if S > 1 else None, batch=B, prompt_len=a.ctx,
                                             capacity=a.capacity, kernels=KernelConfig(attention="pallas_tpu"),
                                             device=dev)
                comp = low.compile()
                cost = comp.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                fl = floor_bytes(target, draft if S > 1 else None, c, B, a.capacity, S)
                hbm = tpu_bytes.breakdown(comp)["hbm_total"]
                r = dict(chip=a.tpu_aot, layers=c.num_layers, batch=B, block=S, verify_form=form,
                         capacity=a.capacity, bytes_accessed=float(cost.get("bytes accessed", 0)),
                         floor_bytes=fl, x_floor=float(cost.get("bytes accessed", 0)) / fl["total"],
                         hbm_bytes=hbm, x_floor_hbm=hbm / fl["total"],
                         compile_s=time.perf_counter() - t0,
                         kind="plain step" if S == 1 else "dflash iteration",
                         hlo_per_iteration=hlo_stats(comp.as_text()))
                print(json.dumps(r), flush=True)
                rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CPU)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens before the timed iterations")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--forms", default="chunk,recurrent", help="verify forms of the GDN rule to compare "
                    "(the XLA paths; --paths supersedes it)")
    ap.add_argument("--paths", default=None,
                    help="GDN block paths to A/B: xla-chunk, xla-recurrent, kernel, kernel-bvN (default: --forms)")
    ap.add_argument("--models", default=None, help="comma list of --model values, run in order (one call)")
    ap.add_argument("--moe-batches", default=None, help="batches for the 35b-a3b model (default: --batches)")
    ap.add_argument("--layer-counts", action="store_true",
                    help="first: one GDN layer's launch-level op counts per path (9B widths, B = 1)")
    ap.add_argument("--only-layer-counts", action="store_true", help="--layer-counts, then stop (CPU: no model)")
    ap.add_argument("--no-fold-share", dest="fold_share", action="store_false",
                    help="skip the loop without the fold (one compile less per DFlash row)")
    ap.add_argument("--commit-alone", action="store_true", help="also time the commit as its own program")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="wall-clock budget: skip rows that would not finish in it (0: none)")
    ap.add_argument("--no-compile-options", dest="compile_options", action="store_false",
                    help="A/B only: compile the timed loop without the program's XLA options (KernelConfig."
                         "compiler_options: while graphs on CUDA), as this script did before session 33")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="9b", choices=("9b", "35b-a3b"),
                    help="Qwen3.5-9B (dense) or Qwen3.5-35B-A3B (MoE: 256 experts top-8 + shared) shapes")
    ap.add_argument("--hlo-stats", action="store_true",
                    help="also count the kernels (fusions, custom calls, dots) one compiled iteration issues")
    ap.add_argument("--tpu-aot", default=None, choices=("v6e", "v5e", "v5p"),
                    help="compile for one chip of this TPU (on a CPU host, libtpu) and report bytes vs floor")
    ap.add_argument("--layers", type=int, default=0, help="with --tpu-aot: the first N layers only (0: all)")
    ap.add_argument("--capacity", type=int, default=1024, help="with --tpu-aot: the KV capacity")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also profile each row's iterations once (jax.profiler, into DIR/<row>): device time "
                         "per iteration by kernel family and named scope, busy and idle")
    ap.add_argument("--out", default=None, help="JSON lines file")
    a = ap.parse_args()
    moe = a.model == "35b-a3b"
    shapes, dtype = ((TINY_MOE if moe else TINY), "float32") if a.smoke else \
        ((None if moe else QWEN35_9B), "bfloat16")
    if a.models:
        bad = set(a.models.split(",")) - {"9b", "35b-a3b"}
        if bad:
            raise SystemExit(f"--models: unknown {sorted(bad)}; expected 9b, 35b-a3b")
    if a.smoke:
        a.ctx, a.iters, a.reps, a.batches = min(a.ctx, 16), 2, 3, "1"
        a.moe_batches, a.fold_share = None, False
        a.capacity = min(a.capacity, 64)
    if a.tpu_aot:
        rows = tpu_aot(a, shapes, moe)
        if a.out:
            with open(a.out, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
        return
    rows = []
    out = open(a.out, "w") if a.out else None

    def emit(r):
        print(json.dumps(r), flush=True)
        rows.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    t_start, slowest = time.perf_counter(), 0.0
    paths = a.paths.split(",") if a.paths else ["xla-" + f for f in a.forms.split(",")]
    for name in paths:
        path_spec(name)
    if a.layer_counts or a.only_layer_counts:
        c9 = config(TINY if a.smoke else QWEN35_9B, "chunk")
        for r in layer_counts(c9, paths, dtype, blocks=(a.block, 1)):
            r["model"] = "smoke" if a.smoke else "qwen3.5-9b"
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
            rows.append(r)
    models = [] if a.only_layer_counts else a.models.split(",") if a.models else [a.model]
    for model in models:
        moe = model == "35b-a3b"
        shapes = (TINY_MOE if moe else TINY) if a.smoke else (None if moe else QWEN35_9B)
        batches = [int(x) for x in (a.moe_batches if moe and a.moe_batches else a.batches).split(",")]
        target = draft = tgt = None
        # rows in priority order: per batch, the DFlash iteration then the plain step, each path
        for B in batches:
            for S in (a.block, 1):
                for name in paths:
                    form = path_spec(name)[0]
                    left = a.budget_s - (time.perf_counter() - t_start)
                    if a.budget_s and left < max(slowest, 1.0) * 1.1:
                        print(json.dumps(dict(skipped=True, model=model, path=name, batch=B, block=S,
                                              budget_left_s=round(left, 1))), flush=True)
                        continue
                    t0 = time.perf_counter()
                    c = config(shapes, form, moe)
                    if target is None:
                        target = init_target(c, seed=0, dtype=dtype)
                        draft = init_draft(DraftConfig.for_target(c, num_layers=5 if not a.smoke else 1,
                                                                  block_size=a.block), seed=1, dtype=dtype)
                    tgt = with_verify_form(target, form)
                    r = run_one(tgt, draft, B, a.ctx, S, a.iters, a.reps, a.hlo_stats, kernels=path_kernels(name),
                                fold=a.fold_share and S > 1, commit_alone=a.commit_alone,
                                trace_dir=os.path.join(a.trace, f"{model}_{name}_b{B}_s{S}") if a.trace else None,
                                compile_options=a.compile_options)
                    r.update(kind="plain step" if S == 1 else "dflash iteration", path=name,
                             model="smoke-" + model if a.smoke else "qwen3.5-" + model,
                             row_s=round(time.perf_counter() - t0, 1))
                    emit(r)
                    slowest = max(slowest, time.perf_counter() - t0)
        target = draft = tgt = None     # the next model's weights need the memory
    if out:
        out.close()


if __name__ == "__main__":
    main()
