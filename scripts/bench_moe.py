#!/usr/bin/env python
"""MoE target benchmark (issue 36): Qwen3-Coder-30B-A3B shapes, random bf16 weights, one GPU.

    python scripts/bench_moe.py                         # every section (H200: see docs/moe.md)
    python scripts/bench_moe.py --sections widths       # one section
    python scripts/bench_moe.py --smoke                 # tiny shapes on CPU: proves every section runs
    python scripts/bench_moe.py --out DIR               # bench_moe.json goes to DIR (default: $OUT)

Sections:
  bw       device copy bandwidth (bytes read + written of a 1 GiB bf16 x * 2): the floors' divisor.
  touched  distinct experts per MoE layer (mean over layers) of a plain step (B tokens) and of a
           16-token verify (B x 16 tokens), counted from the routing of the random model on random
           tokens, next to the independent-routing expectation E (1 - (1 - k/E)^T).
  loop     plain ms per step and DFlash ms per iteration at B = 1, 8, 32 (prompt 512), each against
           its floor: (bytes of the non-expert weights + experts touched x bytes of one expert x
           layers [+ the draft + the LM head once more for the draft's slots]) / copy bandwidth.
           A loop iteration's time is a difference: the same compiled program runs max_new_tokens
           N1 and N2 and ms/iter = (t2 - t1) / (iterations2 - iterations1) (bench_gpu.py's method).
  widths   the verify-width cost curve: the target's forward + LM head over w tokens per row, w in
           1, 2, 4, 8, 16, at B = 1 and 8, context 512 (a fixed-trip loop of `--inner` forwards
           per dispatch), with the experts touched and the floor of each width. The adaptive
           verify width reads this curve.

KernelConfig: the library defaults (`--moe-gmm` picks the grouped matmul: xla = ragged_dot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SECTIONS = ("bw", "touched", "loop", "widths")


def log(*a):
    print(*a, flush=True)


def expected_distinct(E: int, k: int, T: int) -> float:
    """Distinct experts per layer when T tokens each pick k of E independently and uniformly."""
    return E * (1 - (1 - k / E) ** T)


def param_bytes(module) -> int:
    import jax
    from flax import nnx
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


class MoeBench:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp
        from dflash_jax import KernelConfig
        from dflash_jax.config import PRESETS, DraftConfig, Qwen3MoeConfig
        from dflash_jax.weights import init_draft, init_target
        self.args = args
        if args.smoke:
            self.tcfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                                       num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16,
                                       num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True)
        else:
            self.tcfg = PRESETS[args.preset]
        self.dtype = "float32" if args.smoke else "bfloat16"
        t0 = time.perf_counter()
        self.target = init_target(self.tcfg, seed=0, dtype=self.dtype)
        self.dcfg = DraftConfig.for_target(self.tcfg, num_layers=args.draft_layers, block_size=args.block)
        self.draft = init_draft(self.dcfg, seed=1, dtype=self.dtype)
        jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(self.target)))
        log(f"# models built in {time.perf_counter() - t0:.1f}s: target {param_bytes(self.target) / 1e9:.2f} GB, "
            f"draft {param_bytes(self.draft) / 1e9:.2f} GB")
        self.kernels = KernelConfig(moe_gmm=args.moe_gmm)
        c = self.tcfg
        item = jnp.dtype(self.dtype).itemsize
        self.expert_bytes = 3 * c.hidden_size * c.moe_intermediate_size * item
        self.sparse_layers = sum(c.is_sparse(i) for i in range(c.num_layers))
        expert_total = self.expert_bytes * c.num_experts * self.sparse_layers
        self.embed_bytes = c.vocab_size * c.hidden_size * item
        self.lm_head_bytes = self.embed_bytes
        # what every forward reads whatever the routing: attention, norms, routers, dense MLPs, LM head
        self.dense_bytes = param_bytes(self.target) - expert_total - self.embed_bytes
        self.draft_bytes = param_bytes(self.draft)
        self.bw = None
        self._touched: dict[tuple[int, int], float] = {}
        self.results = {"preset": "smoke" if args.smoke else args.preset, "moe_gmm": args.moe_gmm,
                        "expert_bytes": self.expert_bytes, "dense_bytes": self.dense_bytes,
                        "draft_bytes": self.draft_bytes}

    # ---------------------------------------------------------------------------------- sections

    def bw_section(self):
        import jax
        import jax.numpy as jnp
        n = (1 << 20) if self.args.smoke else (1 << 29)          # bf16 elements: 2 MiB / 1 GiB
        x = jnp.ones((n,), jnp.bfloat16)
        f = jax.jit(lambda x: x * 2)
        f(x).block_until_ready()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        self.bw = 2 * n * 2 / min(ts)
        self.results["copy_bytes_per_s"] = self.bw
        log(f"bw        copy {self.bw / 1e12:.2f} TB/s (read + write)")

    def _bandwidth(self):
        if self.bw is None:
            self.bw_section()
        return self.bw

    def touched(self, B: int, T: int) -> float:
        """Mean over MoE layers of the distinct experts B x T random tokens at positions
        [512, 512 + T) route to (a forward over a fresh cache; the routing of a token depends on
        its context only through attention, random weights route ~uniformly anyway)."""
        if (B, T) in self._touched:
            return self._touched[(B, T)]
        import jax
        import jax.numpy as jnp
        from dflash_jax.models import moe
        tgt, E = self.target, self.tcfg.num_experts
        C = 512 + T + 16

        from flax import nnx
        graph, state = nnx.split(tgt)     # weights as arguments: a closure would bake them in as constants

        @jax.jit
        def count(state, tokens):
            model = nnx.merge(graph, state)
            pos = jnp.broadcast_to(jnp.arange(512, 512 + T, dtype=jnp.int32), (B, T))
            with moe.recording() as rec:
                model(tokens, pos, model.new_cache(B, C), pos + 1)
            return jnp.stack([moe.distinct_experts(idx, E) for idx in rec])

        tokens = jax.random.randint(jax.random.key(B * 100 + T), (B, T), 0, self.tcfg.vocab_size)
        self._touched[(B, T)] = float(jnp.mean(count(state, tokens)))
        return self._touched[(B, T)]

    def touched_section(self):
        c = self.tcfg
        rows = []
        for B in self.args.batches:
            for what, T in (("step", 1), ("verify", self.args.block)):
                got = self.touched(B, T)
                want = expected_distinct(c.num_experts, c.num_experts_per_tok, B * T)
                rows.append(dict(batch=B, kind=what, tokens=B * T, distinct=got, independent=want))
                log(f"touched   B={B:<3} {what:<6} {B * T:>5} tokens: {got:6.1f} experts/layer "
                    f"(independent routing {want:6.1f}, of {c.num_experts})")
        self.results["touched"] = rows

    def _floor_s(self, experts_per_layer: float, dflash: bool) -> float:
        b = self.dense_bytes + experts_per_layer * self.expert_bytes * self.sparse_layers
        if dflash:
            b += self.draft_bytes + self.lm_head_bytes        # the draft and its LM head pass
        return b / self._bandwidth()

    def _time_generate(self, draft, B: int) -> float:
        """ms per loop iteration by the N1/N2 difference (same program: fixed capacity)."""
        import numpy as np
        from dflash_jax import generate
        a = self.args
        rng = np.random.RandomState(B)
        prompts = [rng.randint(0, self.tcfg.vocab_size, a.prompt).tolist() for _ in range(B)]
        C = a.prompt + a.n2 + 2 * a.block + 64
        kw = dict(block_size=a.block if draft is not None else None, capacity=C, kernels=self.kernels)

        def run(n):
            ts, iters = [], None
            for _ in range(a.repeats):
                t = time.perf_counter()
                r = generate(self.target, draft, prompts, max_new_tokens=n, **kw)
                ts.append(time.perf_counter() - t)
                iters = max(len(x) for x in r.acceptance_lengths)
            return statistics.median(ts), iters

        run(a.n1)                                              # compile
        t1, i1 = run(a.n1)
        t2, i2 = run(a.n2)
        return 1e3 * (t2 - t1) / max(1, i2 - i1)

    def loop_section(self):
        c, S = self.tcfg, self.args.block
        rows = []
        for B in self.args.batches:
            for kind in ("plain", "dflash"):
                ms = self._time_generate(self.draft if kind == "dflash" else None, B)
                T = S if kind == "dflash" else 1
                got = self.touched(B, T)
                want = expected_distinct(c.num_experts, c.num_experts_per_tok, B * T)
                floor = 1e3 * self._floor_s(got, kind == "dflash")
                floor_ind = 1e3 * self._floor_s(want, kind == "dflash")
                rows.append(dict(batch=B, kind=kind, ms=ms, distinct=got, floor_ms=floor,
                                 independent=want, floor_independent_ms=floor_ind))
                log(f"loop      B={B:<3} {kind:<6} {ms:8.3f} ms/iter   floor {floor:7.3f} ms "
                    f"({got:5.1f} experts/layer; {ms / floor:5.2f}x)   independent-routing floor "
                    f"{floor_ind:7.3f} ms ({want:5.1f})")
        self.results["loop"] = rows

    def widths_section(self):
        import jax
        import jax.numpy as jnp
        from dflash_jax import sharding
        c, a, tgt = self.tcfg, self.args, self.target
        rows = []
        ctx = a.prompt
        for B in a.width_batches:
            for w in a.widths:
                C = ctx + w + 16
                cache = tgt.new_cache(B, C)
                pos = jnp.broadcast_to(jnp.arange(ctx, ctx + w, dtype=jnp.int32), (B, w))
                tokens = jax.random.randint(jax.random.key(w), (B, w), 0, c.vocab_size)
                kernels = self.kernels.resolve()

                from flax import nnx
                graph, state = nnx.split(tgt)   # weights as arguments, not captured constants

                @jax.jit
                def many(state, tokens, cache):
                    model = nnx.merge(graph, state)

                    def body(i, carry):
                        cache, acc = carry
                        h, _, cache = model(tokens, pos, cache, pos + 1, kernels=kernels)
                        return cache, acc + jnp.sum(sharding.argmax(model.logits(h)))
                    return jax.lax.fori_loop(0, a.inner, body, (cache, jnp.int32(0)))

                jax.block_until_ready(many(state, tokens, cache))
                ts = []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    jax.block_until_ready(many(state, tokens, cache))
                    ts.append(time.perf_counter() - t)
                ms = 1e3 * statistics.median(ts) / a.inner
                got = self.touched(B, w)
                floor = 1e3 * self._floor_s(got, False)
                rows.append(dict(batch=B, width=w, ms=ms, distinct=got, floor_ms=floor,
                                 independent=expected_distinct(c.num_experts, c.num_experts_per_tok, B * w)))
                log(f"widths    B={B:<3} w={w:<3} {ms:8.3f} ms   floor {floor:7.3f} ms ({got:5.1f} experts/layer)")
        self.results["widths"] = rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): prove every section runs")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--preset", default="qwen3-coder-30b-a3b")
    ap.add_argument("--moe-gmm", default="auto", help="KernelConfig.moe_gmm: auto, xla, pallas, pallas_tpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--width-batches", default="1,8")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--n1", type=int, default=8, help="max_new_tokens of the short run")
    ap.add_argument("--n2", type=int, default=40, help="max_new_tokens of the long run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inner", type=int, default=10, help="forwards per dispatch in the widths section")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--json", default="bench_moe.json")
    args = ap.parse_args()
    if args.smoke:
        args.prompt, args.n1, args.n2, args.repeats, args.inner, args.block = 16, 4, 8, 1, 2, 4
        args.batches, args.widths, args.width_batches = "1", "1,4", "1"
    args.batches = [int(x) for x in args.batches.split(",")]
    args.widths = [int(x) for x in args.widths.split(",")]
    args.width_batches = [int(x) for x in args.width_batches.split(",")]
    sections = [s for s in args.sections.split(",") if s]
    bad = set(sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; known: {', '.join(SECTIONS)}")
    import jax
    log(f"# bench_moe on {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    b = MoeBench(args)
    failed = []
    for s in sections:
        t = time.perf_counter()
        try:
            getattr(b, f"{s}_section")()
        except Exception as e:  # noqa: BLE001 - report and go on with the other sections
            traceback.print_exc()
            failed.append(s)
            log(f"{s}: FAILED {type(e).__name__}: {e}")
        log(f"# {s} took {time.perf_counter() - t:.1f}s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.json), "w") as f:
            json.dump(b.results, f, indent=1)
    if failed:
        sys.exit(f"failed sections: {', '.join(failed)}")


if __name__ == "__main__":
    main()
