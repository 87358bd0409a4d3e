"""Qwen3.5 hybrid target (issue 38): a plain decode step and a DFlash iteration of the compiled
loop, random bf16 weights, against the HBM floor (weights + attention KV + recurrent state bytes),
and the rollback's (commit's) share of an iteration.

    python scripts/bench_hybrid.py                       # Qwen3.5-9B shapes, B = 1 and 32, S = 16
    python scripts/bench_hybrid.py --smoke               # tiny shapes on CPU (checks the script runs)
    python scripts/bench_hybrid.py --model 35b-a3b       # Qwen3.5-35B-A3B shapes (MoE, bf16 ~70 GB)

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
from dflash_jax.models.qwen3_5 import Qwen35Config, record_bytes, state_bytes  # noqa: E402
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
    layers' K/V of the context, the GDN state read and written once per request."""
    w = nbytes(nnx.state(target, nnx.Param)) - (0 if c.tie_word_embeddings else nbytes(target.embed.get_value()))
    tot, one = expert_bytes(target)
    if tot:   # MoE: at most the experts B*S*k choices can touch (an upper bound on the floor's weights)
        w = w - tot + one * min(c.num_experts, B * S * c.num_experts_per_tok)
    kv = B * ctx * len(c.full_layers) * 2 * c.num_kv_heads * c.head_dim * target.dtype.itemsize
    st = 2 * B * state_bytes(c, target.dtype)
    d = 0 if draft is None else nbytes(nnx.state(draft, nnx.Param))
    dkv = 0 if draft is None else B * ctx * draft.config.num_layers * 2 * draft.config.num_kv_heads * \
        draft.config.head_dim * target.dtype.itemsize
    return dict(weights=w, kv=kv, state=st, draft=d, draft_kv=dkv, total=w + kv + st + d + dkv)


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


def run_one(target, draft, B: int, ctx: int, S: int, iters: int, reps: int, stats: bool = False) -> dict:
    c = target.config
    prompts = [[int(x) for x in np.random.RandomState(b).randint(0, c.vocab_size, ctx)] for b in range(B)]
    d = draft if S > 1 else None
    st, tstate, dstate, p, _, _ = decode._static_and_params(
        target, d, prompts, stream=False, max_new_tokens=iters * S * (2 * reps + 4) + S,
        block_size=S if S > 1 else None)

    def models(ts, ds):
        return nnx.merge(st.target_def, ts), (None if st.draft_def is None else nnx.merge(st.draft_def, ds))

    prefill = jax.jit(lambda ts, ds, p: loop.prefill(st, *models(ts, ds), p))

    def k_iters_fn(commit):
        @functools.partial(jax.jit, donate_argnums=(3,))
        def k_iters(ts, ds, p, s):
            t, dr = models(ts, ds)
            saved = loop._commit
            loop._commit = commit         # read while tracing only
            try:
                return jax.lax.fori_loop(0, iters, lambda _, s: loop.iterate(st, t, dr, p, s)[0], s)
            finally:
                loop._commit = saved
        return k_iters

    s = prefill(tstate, dstate, p)
    jax.block_until_ready(s)
    holder = [s]

    def timed(k_iters):
        def step():
            holder[0] = k_iters(tstate, dstate, p, holder[0])
            return holder[0].lens
        return _time(step, reps) / iters

    k_main = k_iters_fn(loop._commit)
    extra = {}
    if stats:   # one iteration's program (a 1-iteration fori_loop is unrolled away: no loop op)
        one = jax.jit(lambda ts, ds, p, s: loop.iterate(st, *models(ts, ds), p, s)[0])
        extra["hlo_per_iteration"] = hlo_stats(one.lower(tstate, dstate, p, holder[0]).compile().as_text())
    per_iter = timed(k_main)
    # the same iterations with the fold left out (records dropped, states never advanced): the
    # difference is the rollback's cost inside the compiled loop
    no_fold = timed(k_iters_fn(lambda target, cache, n: cache.replace(records=None)))
    # the rollback alone: the commit of one block's records (a forward's cache), timed apart
    tgt = nnx.merge(st.target_def, tstate)
    pos = holder[0].lens[:, None] + jnp.arange(S, dtype=jnp.int32)
    block = jnp.zeros((st.batch, S), jnp.int32)
    fwd = jax.jit(lambda ts, c_, b, q: nnx.merge(st.target_def, ts)(b, q, c_, q + 1)[2])
    with_records = fwd(tstate, holder[0].target_cache, block, pos)
    n = jnp.full((st.batch,), S // 2, jnp.int32)
    commit = jax.jit(lambda ts, c_, n: nnx.merge(st.target_def, ts).commit(c_, n))
    t_commit = _time(lambda: commit(tstate, with_records, n).state, reps * 4)
    fl = floor_bytes(tgt, d, c, st.batch, ctx, S)
    floor_s = fl["total"] / COPY_TBPS
    return dict(batch=B, ctx=ctx, block=S, verify_form=c.verify_form, ms_per_iteration=per_iter * 1e3,
                floor_ms=floor_s * 1e3, x_floor=per_iter / floor_s, commit_ms=t_commit * 1e3,
                commit_share=t_commit / per_iter, ms_without_fold=no_fold * 1e3,
                fold_share=(per_iter - no_fold) / per_iter, floor_bytes=fl,
                state_bytes_per_request=state_bytes(c, tgt.dtype),
                record_bytes_per_request=record_bytes(c, S, tgt.dtype), device=str(jax.devices()[0].device_kind),
                **extra)


def tpu_aot(a, shapes, moe: bool) -> list:
    """Compile one DFlash iteration (and the plain step) for one chip of a TPU topology on this
    CPU host (libtpu, no TPU: docs/tpu-bytes.md) and compare the compiler's bytes accessed with
    the floor (weights + attention KV + the GDN state read and written). --layers cuts the stack
    (the first N layer types) to keep the compile short on a small host."""
    from jax.experimental import topologies
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
                r = dict(chip=a.tpu_aot, layers=c.num_layers, batch=B, block=S, verify_form=form,
                         capacity=a.capacity, bytes_accessed=float(cost.get("bytes accessed", 0)),
                         floor_bytes=fl, x_floor=float(cost.get("bytes accessed", 0)) / fl["total"],
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
    ap.add_argument("--forms", default="chunk,recurrent", help="verify forms of the GDN rule to compare")
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
    ap.add_argument("--out", default=None, help="JSON lines file")
    a = ap.parse_args()
    moe = a.model == "35b-a3b"
    shapes, dtype = ((TINY_MOE if moe else TINY), "float32") if a.smoke else \
        ((None if moe else QWEN35_9B), "bfloat16")
    if a.smoke:
        a.ctx, a.iters, a.reps, a.batches = min(a.ctx, 16), 2, 1, "1,2"
        a.capacity = min(a.capacity, 64)
    if a.tpu_aot:
        rows = tpu_aot(a, shapes, moe)
        if a.out:
            with open(a.out, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
        return
    rows = []
    for form in a.forms.split(","):
        c = config(shapes, form, moe)
        target = init_target(c, seed=0, dtype=dtype)
        draft = init_draft(DraftConfig.for_target(c, num_layers=5 if not a.smoke else 1, block_size=a.block),
                           seed=1, dtype=dtype)
        for B in (int(x) for x in a.batches.split(",")):
            for S in ((1, a.block) if form == a.forms.split(",")[0] else (a.block,)):
                r = run_one(target, draft, B, a.ctx, S, a.iters, a.reps, a.hlo_stats)
                r["kind"] = "plain step" if S == 1 else "dflash iteration"
                r["model"] = "smoke-" + a.model if a.smoke else "qwen3.5-" + a.model
                print(json.dumps(r), flush=True)
                rows.append(r)
        del target, draft
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
