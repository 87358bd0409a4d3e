#!/usr/bin/env python
"""MoE target benchmark (issue 36): Qwen3-Coder-30B-A3B shapes, random bf16 weights, one GPU, each
measurement with every grouped matmul of `--moe-gmms` (xla = ragged_dot, pallas_gpu = the Pallas
GPU kernel over the touched experts only), ratios side by side.

    timeout 350 python scripts/bench_moe.py --sections loop,widths --batches 1,8,32 --width-batches 1,8 \
        --moe-gmms pallas_gpu,xla --budget-s 300 --out $OUT   # an H200 call (docs/moe.md, docs/perf-log.md)
    python scripts/bench_moe.py --sections layer            # one section
    python scripts/bench_moe.py --smoke                     # tiny shapes on CPU (the GPU kernel interpreted)

Sections (run in this order; each measurement is skipped, and listed as skipped, once the next one
would pass --budget-s by the time the slowest one of its kind took):
  bw       device copy bandwidth (bytes read + written of a 1 GiB bf16 x * 2). The floors divide
           by --floor-tbs (default 4.23 TB/s on GPU, the figure of BENCHMARKS.md's other rows) or,
           when 0, by this copy figure; the loop and width rows give the copy-figure floor too.
  layer    one expert layer (route given: the rows' sort, fused gate|up + SwiGLU, down, combine) at
           T = --layer-tokens tokens x top-8 with uniform random routing, in us, against the floor
           of the distinct experts those rows touch (experts x 3 H I x 2 B / bandwidth). Timed over
           --layer-copies distinct layers' weights per pass (so L2 holds no expert between passes).
  loop     plain ms per step and DFlash ms per iteration (z-lab Coder draft shape: 8 layers, block
           16) at B = 1, 8, 32 (prompt 512), against floors from the experts actually touched and
           from the independent-routing expectation: (non-expert weights + experts x bytes of one
           expert x layers [+ the draft + the LM head once more]) / bandwidth. ms/iter is a
           difference: the same program runs max_new_tokens N1 and N2 (bench_gpu.py's method).
  widths   the verify-width cost curve: the target's forward + LM head over w tokens per row, w in
           1, 2, 4, 8, 16, at B = 1 and 8, context 512 (a fixed-trip loop of `--inner` forwards per
           dispatch), with the experts touched and the floor of each width.
  touched  distinct experts per MoE layer (mean over layers) of a plain step (B tokens) and of a
           16-token verify (B x 16 tokens), counted from the random model's routing, next to the
           independent-routing expectation E (1 - (1 - k/E)^T) (mostly counted already by loop).

The loop and width rows run in priority order, not section order: the first --moe-gmms entry's
loop rows (B = 1 plain, DFlash, then B = 8, B = 32), its width curve, the distinct-expert counts of
the floors, then the next entry's loop and width rows; each row prints as measured (with the
independent-routing floor; the tables at the end use the counted experts) and the JSON is rewritten
after every row, so a run killed by its time limit keeps what it measured. KV capacities are rounded
up to multiples of 128 (the GPU attention kernel's tiles; others fell back to XLA attention).

--quantize int8[,...] adds, for every --moe-gmms entry, loop rows of the same random target quantized
at build (init_target(quantize=...): its layers' linears int8, and whatever else dflash_jax.quantize
quantizes, e.g. the stacked experts once they are), timed in the same process next to the bf16 rows,
with floors from each target's parameter bytes as stored; a table of bf16 against quantized follows.
--precompile-workers compiles every loop program ahead in threads (the rows then only time).

--layers cuts the target to its first L layers (every Coder layer is the same MoE layer): compiles
of the unrolled 48-layer loop take most of a 4-minute budget, so the default run measures a 12-layer
cut; its floors are of the same cut, so the ratios carry over (ms scale ~ by 48 / L). --layers 48
measures the whole model (give it --budget-s 540).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SECTIONS = ("bw", "layer", "loop", "widths", "touched")     # run in this order: the brief's priority


def log(*a):
    print(*a, flush=True)


def expected_distinct(E: int, k: int, T: int) -> float:
    """Distinct experts per layer when T tokens each pick k of E independently and uniformly."""
    return E * (1 - (1 - k / E) ** T)


def kv_capacity(n: int) -> int:
    """A KV capacity of at least n entries that the GPU attention kernel tiles (a multiple of 128 covers
    every block_k it picks; capacities that are not multiples of 16, 536 and 648, fell back to XLA
    attention in a measured run on the H200, as `generate`'s own default capacity, rounded to 1024,
    never does)."""
    return -(-n // 128) * 128


def param_bytes(module) -> int:
    import jax
    from flax import nnx
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def table(title: str, head: list[str], rows: list[list]):
    """One markdown table (the lead pastes it)."""
    log(f"\n### {title}")
    log("| " + " | ".join(head) + " |")
    log("|" + "---|" * len(head))
    for r in rows:
        log("| " + " | ".join(x if isinstance(x, str) else f"{x:.3f}" if isinstance(x, float) else str(x)
                              for x in r) + " |")
    log("")


class Budget:
    """Skip a measurement once it would pass the deadline by the slowest one of its kind so far."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.took: dict[str, float] = {}
        self.skipped: list[str] = []
        self.failed: list[str] = []

    def run(self, kind: str, what: str, fn, family: str | None = None):
        """fn() unless the time left is less than the slowest `kind` so far (or, before the first of
        its kind, the slowest of its `family`: a DFlash loop row is estimated by a plain one)."""
        left = self.deadline - time.perf_counter()
        need = self.took.get(kind, self.took.get(family, 0.0) if family else 0.0)
        if left < need:
            self.skipped.append(what)
            log(f"skipped   {what} (budget: {left:.0f}s left, it takes ~{need:.0f}s)")
            return None
        t = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - one failed row (a kernel that does not compile) spares the rest
            traceback.print_exc(limit=3)
            self.failed.append(what)
            log(f"FAILED    {what}: {type(e).__name__}: {str(e)[:300]}")
            return None
        took = time.perf_counter() - t
        self.took[kind] = max(self.took.get(kind, 0.0), took)
        if family:
            self.took[family] = max(self.took.get(family, 0.0), took)
        return out


class MoeBench:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp
        from dflash_jax.config import PRESETS, DraftConfig, Qwen3MoeConfig, default_target_layer_ids
        from dflash_jax.weights import init_draft, init_target
        self.args = args
        if args.smoke:
            self.tcfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                                       num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16,
                                       num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True)
        else:
            self.tcfg = PRESETS[args.preset]
            if args.layers:
                self.tcfg = dataclasses.replace(self.tcfg, num_layers=args.layers)
        self.dtype = "float32" if args.smoke else "bfloat16"
        self.budget = Budget(args.budget_s)
        t0 = time.perf_counter()
        self.target = init_target(self.tcfg, seed=0, dtype=self.dtype)
        # --quantize: the same random target (same seed) quantized at build, one copy per method
        from bench_gpu import quantized_target      # scripts/bench_gpu.py: fp8 as an FP8 checkpoint loads
        self.quant, self.quant_only = args.quantize
        self.qtargets = {q: quantized_target(init_target, self.tcfg, q, self.dtype) for q in self.quant}
        # the z-lab Coder-30B-A3B draft: 8 layers over 5 taps ([1, 12, 23, 34, 45] of 48 layers)
        taps = (default_target_layer_ids(self.tcfg.num_layers, args.draft_taps)
                if self.tcfg.num_layers >= 2 * args.draft_taps else None)   # tiny targets: for_target's taps
        self.dcfg = DraftConfig.for_target(self.tcfg, num_layers=args.draft_layers, block_size=args.block,
                                           target_layer_ids=taps)
        self.draft = init_draft(self.dcfg, seed=1, dtype=self.dtype)
        jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(self.target)))
        log(f"# models built in {time.perf_counter() - t0:.1f}s: target ({self.tcfg.num_layers} layers) "
            f"{param_bytes(self.target) / 1e9:.2f} GB, draft {param_bytes(self.draft) / 1e9:.2f} GB")
        on_cpu = jax.default_backend() == "cpu"
        # on CPU (smoke) the GPU kernel runs in the interpreter
        self.gmms = [g + "_interpret" if on_cpu and g == "pallas_gpu" else g for g in args.moe_gmms]
        c = self.tcfg
        item = jnp.dtype(self.dtype).itemsize
        self.sparse_layers = sum(c.is_sparse(i) for i in range(c.num_layers))
        self.embed_bytes = c.vocab_size * c.hidden_size * item
        self.lm_head_bytes = self.embed_bytes
        # per target (None: bf16; else the --quantize method): one expert's bytes as stored, and what
        # every forward reads whatever the routing (attention, norms, routers, dense MLPs, LM head)
        self.expert_bytes_of, self.dense_bytes_of = {}, {}
        for q, tgt in [(None, self.target)] + list(self.qtargets.items()):
            eb = expert_bytes(tgt, c.num_experts) or 3 * c.hidden_size * c.moe_intermediate_size * item
            self.expert_bytes_of[q] = eb
            self.dense_bytes_of[q] = param_bytes(tgt) - eb * c.num_experts * self.sparse_layers - self.embed_bytes
        self.expert_bytes, self.dense_bytes = self.expert_bytes_of[None], self.dense_bytes_of[None]
        for q in self.quant:
            log(f"# target {q}: {param_bytes(self.qtargets[q]) / 1e9:.2f} GB; one expert "
                f"{self.expert_bytes_of[q] / 1e6:.2f} MB (bf16 {self.expert_bytes / 1e6:.2f} MB"
                f"{': experts NOT quantized' if self.expert_bytes_of[q] >= self.expert_bytes else ''}), "
                f"non-expert bytes {self.dense_bytes_of[q] / 1e9:.3f} GB (bf16 {self.dense_bytes / 1e9:.3f} GB)")
        self.draft_bytes = param_bytes(self.draft)
        self.bw = None
        self.floor_bw = None if on_cpu or not args.floor_tbs else args.floor_tbs * 1e12
        self._touched: dict[tuple[int, int], float] = {}
        self.results = {"preset": "smoke" if args.smoke else args.preset, "layers": c.num_layers,
                        "moe_gmms": self.gmms, "expert_bytes": self.expert_bytes,
                        "dense_bytes": self.dense_bytes, "draft_bytes": self.draft_bytes,
                        "quantize": self.quant,
                        "expert_bytes_quantized": {q: self.expert_bytes_of[q] for q in self.quant},
                        "dense_bytes_quantized": {q: self.dense_bytes_of[q] for q in self.quant},
                        "draft_layers": args.draft_layers, "draft_taps": list(self.dcfg.target_layer_ids), "block": args.block}

    def kernels(self, gmm: str):
        from dflash_jax import KernelConfig
        return KernelConfig(moe_gmm=gmm).resolve()

    # ---------------------------------------------------------------------------------- sections

    def bw_section(self):
        from bench_gpu import copy_probe          # scripts/bench_gpu.py: one dispatch a pass
        probe = copy_probe((1 << 22) if self.args.smoke else (1 << 31))   # 2 GiB: the models hold the rest
        self.bw = probe["copy_TBps"] * 1e12
        self.results["copy_probe"] = probe
        self.results["copy_bytes_per_s"] = self.bw
        self.results["floor_bytes_per_s"] = self._bandwidth()
        log(f"bw        copy {self.bw / 1e12:.2f} TB/s (read + write; {probe['copy_from']}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in probe["TBps"].items())
            + f"); floors at {self._bandwidth() / 1e12:.2f} TB/s")

    def _bandwidth(self):
        if self.floor_bw is not None:
            return self.floor_bw
        if self.bw is None:
            self.bw_section()
        return self.bw

    def layer_section(self):
        """(a) one expert layer, route given, each grouped matmul, vs the touched-expert floor."""
        import jax
        import jax.numpy as jnp
        from dflash_jax.models import moe
        c, a = self.tcfg, self.args
        E, k, H, I = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        dt = jnp.dtype(self.dtype)
        keys = jax.random.split(jax.random.key(7), 2 * a.layer_copies)
        gate_up = [(jax.random.normal(keys[2 * i], (E, H, 2 * I), jnp.float32) * H ** -0.5).astype(dt)
                   for i in range(a.layer_copies)]
        down = [(jax.random.normal(keys[2 * i + 1], (E, I, H), jnp.float32) * I ** -0.5).astype(dt)
                for i in range(a.layer_copies)]
        rows = []
        for T in a.layer_tokens:
            kx, kr = jax.random.split(jax.random.key(T))
            x = jax.random.normal(kx, (T, H), jnp.float32).astype(dt)
            idx = jnp.argsort(jax.random.uniform(kr, (T, E)), axis=-1)[:, :k].astype(jnp.int32)  # k distinct
            w = jax.nn.softmax(jax.random.normal(kr, (T, k)), axis=-1).astype(dt)
            distinct = int(moe.distinct_experts(idx, E))
            floor_us = 1e6 * distinct * self.expert_bytes / self._bandwidth()
            row = dict(tokens=T, rows=T * k, distinct=distinct, floor_us=floor_us)
            for g in self.gmms:
                @jax.jit
                def many(x, w, idx, gate_up, down, impl=g):
                    def body(_, y):
                        for gu, dn in zip(gate_up, down):        # distinct weights each layer
                            y = y + moe.experts(y, w, idx, gu, dn, gmm_impl=impl) * 0.01
                        return y
                    return jax.lax.fori_loop(0, a.inner, body, x)

                def measure():
                    jax.block_until_ready(many(x, w, idx, gate_up, down))
                    return 1e6 * _median_time(lambda: jax.block_until_ready(many(x, w, idx, gate_up, down)),
                                              a.repeats) / (a.inner * a.layer_copies)
                us = self.budget.run(f"layer {g}", f"layer T={T} {g}", measure)
                self.save()
                row[g] = us
                if us is not None:
                    log(f"layer     T={T:<4} {g:<22} {us:9.1f} us   floor {floor_us:8.1f} us "
                        f"({distinct} experts; {us / floor_us:5.2f}x)")
            rows.append(row)
        self.results["layer"] = rows
        head = ["T", "rows", "experts touched", "floor us"] + [f"{g} us (x floor)" for g in self.gmms]
        table(f"(a) one expert layer ({E} experts, H {H}, I {I}, {self.dtype})", head, [
            [r["tokens"], r["rows"], r["distinct"], r["floor_us"]]
            + [_cell(r[g], r["floor_us"], 1) for g in self.gmms] for r in rows])

    def touched(self, B: int, T: int) -> float:
        """Mean over MoE layers of the distinct experts B x T random tokens at positions
        [512, 512 + T) route to (a forward over a fresh cache; random weights route ~uniformly).
        One forward of max(T, block) tokens per row counts every narrower width too: attention is
        causal, so the first w tokens of a wider forward route exactly as a w-token forward would
        (one compile per B instead of one per width)."""
        if (B, T) in self._touched:
            return self._touched[(B, T)]
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from dflash_jax.models import moe
        tgt, E = self.target, self.tcfg.num_experts
        W = max(T, self.args.block)
        widths = sorted({w for w in [T, W, 1, *self.args.widths] if w <= W})
        C = kv_capacity(512 + W + 16)
        graph, state = nnx.split(tgt)     # weights as arguments: a closure would bake them in as constants

        @jax.jit
        def count(state, tokens):
            model = nnx.merge(graph, state)
            pos = jnp.broadcast_to(jnp.arange(512, 512 + W, dtype=jnp.int32), (B, W))
            with moe.recording() as rec:
                model(tokens, pos, model.new_cache(B, C), pos + 1)
            return jnp.stack([jnp.stack([moe.distinct_experts(idx.reshape(B, W, -1)[:, :w], E) for idx in rec])
                              for w in widths])                                     # [widths, layers]

        tokens = jax.random.randint(jax.random.key(B * 100 + W), (B, W), 0, self.tcfg.vocab_size)
        got = jnp.mean(count(state, tokens).astype(jnp.float32), axis=1)
        for w, n in zip(widths, got.tolist()):
            self._touched.setdefault((B, w), float(n))
        return self._touched[(B, T)]

    def touched_section(self):
        c = self.tcfg
        rows = []
        for B in self.args.batches:
            for what, T in (("step", 1), ("verify", self.args.block)):
                got = self.budget.run("touched", f"touched B={B} {what}", lambda: self.touched(B, T))
                if got is None:
                    continue
                want = expected_distinct(c.num_experts, c.num_experts_per_tok, B * T)
                rows.append(dict(batch=B, kind=what, tokens=B * T, distinct=got, independent=want))
                log(f"touched   B={B:<3} {what:<6} {B * T:>5} tokens: {got:6.1f} experts/layer "
                    f"(independent routing {want:6.1f}, of {c.num_experts})")
        self.results["touched"] = rows

    def _floor_s(self, experts_per_layer: float, dflash: bool, bandwidth: float | None = None,
                 quant: str | None = None) -> float:
        b = self.dense_bytes_of[quant] + experts_per_layer * self.expert_bytes_of[quant] * self.sparse_layers
        if dflash:
            b += self.draft_bytes + self.lm_head_bytes        # the draft and its LM head pass
        return b / (bandwidth or self._bandwidth())

    def _floors(self, row: dict, experts: float, dflash: bool, suffix: str = ""):
        """floor_ms{suffix} at --floor-tbs and copy_floor_ms{suffix} at the measured copy figure."""
        for q in [None] + self.quant:
            tag = suffix + (f"@{q}" if q else "")
            row["floor_ms" + tag] = 1e3 * self._floor_s(experts, dflash, quant=q)
            if self.bw is not None:
                row["copy_floor_ms" + tag] = 1e3 * self._floor_s(experts, dflash, self.bw, quant=q)

    def _generate_args(self, draft, B: int, gmm: str, quant: str | None = None):
        """(target, prompts, generate keywords) of a loop row: the same for its precompile."""
        import numpy as np
        a = self.args
        rng = np.random.RandomState(B)
        prompts = [rng.randint(0, self.tcfg.vocab_size, a.prompt).tolist() for _ in range(B)]
        C = kv_capacity(a.prompt + a.n2 + 2 * a.block + 64)
        kw = dict(block_size=a.block if draft is not None else None, capacity=C, kernels=self.kernels(gmm),
                  verify_width="block")
        return (self.qtargets[quant] if quant else self.target), prompts, kw

    def precompile_loop(self):
        """Compile every loop program (each grouped matmul x target x B x kind) ahead, in
        --precompile-workers threads (XLA compiles release the GIL); the rows then only time."""
        import concurrent.futures as cf
        from dflash_jax import decode
        a = self.args
        items = [(g, q, B, kind) for g in self.gmms for B in a.batches for kind in ("plain", "dflash")
                 for q in self.quants(B)]

        def one(item):
            g, q, B, kind = item
            tgt, prompts, kw = self._generate_args(self.draft if kind == "dflash" else None, B, g, q)
            return decode.precompile(tgt, self.draft if kind == "dflash" else None, prompts,
                                     max_new_tokens=a.n2, **kw)

        t0 = time.perf_counter()
        done = 0
        with cf.ThreadPoolExecutor(max_workers=a.precompile_workers) as ex:
            futs = {ex.submit(one, it): it for it in items}
            for f in cf.as_completed(futs):
                g, q, B, kind = futs[f]
                try:
                    dt = f.result()
                    done += 1
                    log(f"precompile B={B:<3} {kind:<6} {self.column(g, q):<22} {dt:6.1f}s "
                        f"(at {time.perf_counter() - t0:.0f}s)")
                except Exception as e:  # noqa: BLE001 - the row compiles (and fails) again when timed
                    log(f"precompile B={B} {kind} {self.column(g, q)} FAILED {type(e).__name__}: {str(e)[:200]}")
        self.results["precompile_s"] = time.perf_counter() - t0
        log(f"# precompiled {done} of {len(items)} loop programs in {time.perf_counter() - t0:.1f}s "
            f"({a.precompile_workers} threads)")

    def quants(self, B: int) -> list:
        """None (bf16) and the --quantize methods timed at batch B (NAME@1/8 limits one)."""
        return [None] + [q for q in self.quant if B in self.quant_only.get(q, (B,))]

    @staticmethod
    def column(g: str, q: str | None) -> str:
        """A loop row's column: the grouped matmul, + the quantization of a --quantize target."""
        return g if not q else f"{g}+{q}"

    def _time_generate(self, draft, B: int, gmm: str, quant: str | None = None) -> float:
        """ms per loop iteration by the N1/N2 difference (same program: fixed capacity)."""
        from dflash_jax import generate
        a = self.args
        target, prompts, kw = self._generate_args(draft, B, gmm, quant)

        def run(n):
            ts, iters = [], None
            for _ in range(a.repeats):
                t = time.perf_counter()
                r = generate(target, draft, prompts, max_new_tokens=n, **kw)
                ts.append(time.perf_counter() - t)
                iters = max(len(x) for x in r.acceptance_lengths)
            return statistics.median(ts), iters

        run(a.n1)                                              # compile
        t1, i1 = run(a.n1)
        t2, i2 = run(a.n2)
        return 1e3 * (t2 - t1) / max(1, i2 - i1)

    # The loop and widths rows are measured in priority order: the first
    # grouped matmul's loop rows (B = 1 plain and DFlash, then B = 8, B = 32), its width curve, the
    # distinct-expert counts of the floors, then the next grouped matmul's loop and widths. Each row
    # prints as it is measured with its independent-routing floor; the counted floor follows.

    def _loop_row(self, B: int, kind: str) -> dict:
        c = self.tcfg
        rows = self.results.setdefault("loop", [])
        for r in rows:
            if r["batch"] == B and r["kind"] == kind:
                return r
        T = self.args.block if kind == "dflash" else 1
        want = expected_distinct(c.num_experts, c.num_experts_per_tok, B * T)
        row = dict(batch=B, kind=kind, tokens=B * T, independent=want)
        self._floors(row, want, kind == "dflash", "_independent")
        rows.append(row)
        return row

    def loop_rows(self, g: str):
        for B in self.args.batches:
            for kind in ("plain", "dflash"):
                for q in self.quants(B):
                    col, tag = self.column(g, q), (f"@{q}" if q else "")
                    row = self._loop_row(B, kind)
                    ms = self.budget.run(f"loop {kind} {col}", f"loop B={B} {kind} {col}",
                                         lambda: self._time_generate(self.draft if kind == "dflash" else None, B, g, q),
                                         family="loop")
                    if ms is None:
                        continue
                    row[col] = ms
                    f = row["floor_ms_independent" + tag]
                    cf = row.get("copy_floor_ms_independent" + tag, f)
                    log(f"loop      B={B:<3} {kind:<6} {col:<22} {ms:8.3f} ms/iter   independent-routing floor "
                        f"{f:7.3f} ms ({ms / f:5.2f}x) at {self._bandwidth() / 1e12:.2f} TB/s, "
                        f"{cf:7.3f} ms ({ms / cf:5.2f}x) at the copy figure ({row['independent']:.1f} experts/layer)")
                    self.save()

    def _width_row(self, B: int, w: int) -> dict:
        c = self.tcfg
        rows = self.results.setdefault("widths", [])
        for r in rows:
            if r["batch"] == B and r["width"] == w:
                return r
        want = expected_distinct(c.num_experts, c.num_experts_per_tok, B * w)
        row = dict(batch=B, width=w, tokens=B * w, independent=want)
        self._floors(row, want, False, "_independent")
        rows.append(row)
        return row

    def width_rows(self, g: str):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from dflash_jax import sharding
        c, a, tgt = self.tcfg, self.args, self.target
        ctx = a.prompt
        graph, state = nnx.split(tgt)   # weights as arguments, not captured constants
        kernels = self.kernels(g)
        for B in a.width_batches:
            for w in a.widths:
                row = self._width_row(B, w)
                C = kv_capacity(ctx + w + 16)
                pos = jnp.broadcast_to(jnp.arange(ctx, ctx + w, dtype=jnp.int32), (B, w))
                tokens = jax.random.randint(jax.random.key(w), (B, w), 0, c.vocab_size)

                @jax.jit
                def many(state, tokens, cache, pos=pos):
                    model = nnx.merge(graph, state)

                    def body(i, carry):
                        cache, acc = carry
                        h, _, cache = model(tokens, pos, cache, pos + 1, kernels=kernels)
                        return cache, acc + jnp.sum(sharding.argmax(model.logits(h)))
                    return jax.lax.fori_loop(0, a.inner, body, (cache, jnp.int32(0)))

                def measure():
                    cache = tgt.new_cache(B, C)
                    jax.block_until_ready(many(state, tokens, cache))
                    return 1e3 * _median_time(lambda: jax.block_until_ready(many(state, tokens, cache)),
                                              a.repeats) / a.inner
                ms = self.budget.run(f"widths {g}", f"widths B={B} w={w} {g}", measure, family="widths")
                if ms is None:
                    continue
                row[g] = ms
                f = row["floor_ms_independent"]
                cf = row.get("copy_floor_ms_independent", f)
                log(f"widths    B={B:<3} w={w:<3} {g:<22} {ms:8.3f} ms   independent-routing floor {f:7.3f} ms "
                    f"({ms / f:5.2f}x), {cf:7.3f} ms ({ms / cf:5.2f}x) at the copy figure")
                self.save()

    def count_rows(self):
        """The distinct experts actually touched, for the floors of the rows measured (a forward per
        (B, tokens per row), counted from the random model's routing)."""
        c, S = self.tcfg, self.args.block
        todo = [(r, r["batch"], S if r["kind"] == "dflash" else 1, r["kind"] == "dflash")
                for r in self.results.get("loop", []) if any(c in r for c in self.columns())]
        todo += [(r, r["batch"], r["width"], False) for r in self.results.get("widths", [])
                 if any(g in r for g in self.gmms)]
        for row, B, T, dflash in todo:
            got = self.budget.run("touched", f"touched B={B} T={T}", lambda: self.touched(B, T))
            if got is None:
                continue
            if "distinct" not in row:
                log(f"touched   B={B:<3} T={T:<3} {got:6.1f} experts/layer counted "
                    f"(independent routing {row['independent']:6.1f})")
            row["distinct"] = got
            self._floors(row, got, dflash)
        self.save()

    def loop_widths(self, sections):
        if "loop" in sections and self.args.precompile_workers > 0:
            self.precompile_loop()
        for g in self.gmms:
            if "loop" in sections:
                self.loop_rows(g)
            if "widths" in sections:
                self.width_rows(g)
            if g == self.gmms[0]:
                self.count_rows()
        self.count_rows()                                  # rows the later grouped matmuls added (cached)
        self.tables()

    def columns(self) -> list[str]:
        return [self.column(g, q) for g in self.gmms for q in [None] + self.quant]

    def tables(self):
        c = self.tcfg
        bw = f"{self._bandwidth() / 1e12:.2f} TB/s"
        copy = f"{self.bw / 1e12:.2f} TB/s copy" if self.bw else "copy n/a"

        def floor_cells(r):
            key = "floor_ms" if "floor_ms" in r else "floor_ms_independent"
            f, cf = r[key], r.get("copy_" + key)
            return f, [f"{r.get('distinct', float('nan')):.1f} ({r['independent']:.1f})",
                       f"{f:.3f}" + (f" ({cf:.3f})" if cf is not None else "")]

        head_f = ["experts/layer counted (indep.)", f"floor ms at {bw} ({copy})"]
        if self.results.get("loop"):
            rows = []
            for r in self.results["loop"]:
                f, cells = floor_cells(r)
                key = "floor_ms" if "floor_ms" in r else "floor_ms_independent"
                rows.append([r["batch"], r["kind"]] + cells + [
                    _cell(r.get(self.column(g, q)), r[key + (f"@{q}" if q else "")], 3)
                    for g in self.gmms for q in [None] + self.quant])
            table(f"(b) loop, {c.num_layers} target layers + {self.args.draft_layers}-layer draft, block "
                  f"{self.args.block} (ms per step / iteration; x: the floor at {bw} of that column's target "
                  f"bytes; a floor of counted experts where counted, else of independent routing; the bf16 "
                  f"floor in the floor column)", ["B", "kind"] + head_f
                  + [f"{col} ms (x floor)" for col in self.columns()], rows)
            self.quant_table()
        if self.results.get("widths"):
            rows = []
            for r in self.results["widths"]:
                f, cells = floor_cells(r)
                rows.append([r["batch"], r["width"]] + cells + [_cell(r.get(g), f, 3) for g in self.gmms])
            table(f"(c) verify width: target forward + LM head, {c.num_layers} layers, context {self.args.prompt}",
                  ["B", "w"] + head_f + [f"{g} ms (x floor)" for g in self.gmms], rows)

    def quant_table(self):
        """--quantize: bf16 against each quantized target, per grouped matmul and batch: ms, ratio, and
        each against its byte floor (its weights as stored + the touched experts, at the floors'
        bandwidth; KV is not in these floors, as in the other loop rows)."""
        if not self.quant:
            return
        bw = f"{self._bandwidth() / 1e12:.2f} TB/s"
        out = []
        for g in self.gmms:
            for q in self.quant:
                rows = []
                for B in self.args.batches:
                    cells, xs, rec = [B], [], dict(gmm=g, quant=q, batch=B)
                    for kind in ("plain", "dflash"):
                        r = next((r for r in self.results.get("loop", []) if r["batch"] == B and r["kind"] == kind), None)
                        m0, m1 = (r.get(self.column(g, x)) if r else None for x in (None, q))
                        key = "floor_ms" if r and "floor_ms" in r else "floor_ms_independent"
                        f0, f1 = (r.get(key), r.get(key + f"@{q}")) if r else (None, None)
                        ratio = m1 / m0 if m0 and m1 else None
                        cells += [_num(m0), _num(m1), _num(ratio)]
                        xs.append(f"{_num(m0 / f0 if m0 and f0 else None, 2)} / {_num(m1 / f1 if m1 and f1 else None, 2)}")
                        rec.update({f"{kind}_bf16_ms": m0, f"{kind}_{q}_ms": m1, f"{kind}_ratio": ratio,
                                    f"{kind}_bf16_floor_ms": f0, f"{kind}_{q}_floor_ms": f1})
                    rows.append(cells + xs)
                    out.append(rec)
                experts_q = self.expert_bytes_of[q] < self.expert_bytes
                table(f"(q) {q} target against bf16, {g}, {self.tcfg.num_layers} layers (experts "
                      f"{'quantized' if experts_q else 'NOT quantized: bf16 in both'}; x fl: ms over the byte "
                      f"floor at {bw}, weights as stored)",
                      ["B", "bf16 plain ms", f"{q} plain ms", "ratio", "bf16 DFlash ms", f"{q} DFlash ms", "ratio",
                       f"plain x fl bf16 / {q}", f"DFlash x fl bf16 / {q}"], rows)
        self.results["quant_table"] = out

    def save(self):
        """The JSON so far (a run killed by its time limit keeps the rows it measured)."""
        if self.args.out:
            self.results["skipped"] = self.budget.skipped
            self.results["failed_rows"] = self.budget.failed
            os.makedirs(self.args.out, exist_ok=True)
            with open(os.path.join(self.args.out, self.args.json), "w") as f:
                json.dump(self.results, f, indent=1)


def _num(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def expert_bytes(model, num_experts: int) -> int:
    """Bytes of one expert as stored (its gate|up and down, int8 and scales where quantized), from the
    first MoE layer's stacked expert parameters; 0 when the model has none."""
    import jax
    from flax import nnx
    from dflash_jax.models.moe import MoE
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            leaves = jax.tree.leaves(nnx.state(node, nnx.Param))
            total = sum(int(x.size) * x.dtype.itemsize for x in leaves)
            router = int(node.router[...].size) * node.router[...].dtype.itemsize
            return (total - router) // num_experts
    return 0


def _cell(v, floor, digits: int) -> str:
    return "skipped" if v is None else f"{v:.{digits}f} ({v / floor:.2f}x)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): prove every section runs")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--preset", default="qwen3-coder-30b-a3b")
    ap.add_argument("--layers", type=int, default=12, help="cut the target to its first L layers (0: all)")
    ap.add_argument("--moe-gmms", default="pallas_gpu,xla",
                    help="KernelConfig.moe_gmm values to compare, most important first (xla = ragged_dot)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip what would end past this many seconds")
    ap.add_argument("--floor-tbs", type=float, default=4.23,
                    help="bandwidth of the floors in TB/s (0: the copy figure of the bw section)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--width-batches", default="1,8")
    ap.add_argument("--layer-tokens", default="1,16,128")
    ap.add_argument("--layer-copies", type=int, default=4, help="distinct expert layers per timed pass")
    ap.add_argument("--draft-layers", type=int, default=8, help="the z-lab Coder-30B-A3B draft has 8")
    ap.add_argument("--draft-taps", type=int, default=5, help="target layers the draft reads (z-lab: 5)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--n1", type=int, default=8, help="max_new_tokens of the short run")
    ap.add_argument("--n2", type=int, default=40, help="max_new_tokens of the long run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inner", type=int, default=10, help="passes per dispatch in the layer and widths sections")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--json", default="bench_moe.json")
    ap.add_argument("--quantize", default="", metavar="int8,fp8@1",
                    help="also time the target quantized (dflash_jax.quantize.QUANTIZE or fp8, comma-separated; "
                         "NAME@1/8 limits one to those batches): its loop rows beside bf16's, same process, same "
                         "random weights")
    ap.add_argument("--precompile-workers", type=int, default=4,
                    help="threads compiling the loop programs ahead (0: each row compiles when timed)")
    args = ap.parse_args()
    if args.smoke:
        args.prompt, args.n1, args.n2, args.repeats, args.inner, args.block = 16, 4, 8, 1, 2, 4
        args.batches, args.widths, args.width_batches, args.layer_tokens = "1", "1,4", "1", "1,4"
        args.draft_layers, args.layer_copies = 2, 2
        args.budget_s = max(args.budget_s, 3600.0)      # a proof that every row runs, not a measurement
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.widths = [int(x) for x in args.widths.split(",")]
        args.width_batches = [int(x) for x in args.width_batches.split(",")]
        args.layer_tokens = [int(x) for x in args.layer_tokens.split(",")]
    except ValueError as e:
        ap.error(f"batches, widths, width-batches and layer-tokens are comma-separated integers ({e})")
    args.moe_gmms = [g for g in args.moe_gmms.split(",") if g]
    from bench_gpu import check_quantize_names, parse_quantize
    args.quantize = parse_quantize(args.quantize)
    badq = check_quantize_names(args.quantize[0])
    if badq:
        ap.error(f"--quantize: unknown {badq}; supported: dflash_jax.quantize.QUANTIZE and fp8")
    from dflash_jax.kernel_config import MOE_GMM
    bad = [g for g in args.moe_gmms if g not in MOE_GMM]
    if bad:
        ap.error(f"--moe-gmms: unknown {bad}; known: {', '.join(MOE_GMM)}")
    sections = [s for s in args.sections.split(",") if s]
    bad = set(sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; known: {', '.join(SECTIONS)}")
    sections = [s for s in SECTIONS if s in sections]
    import jax
    machine = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    log(f"# bench_moe on {machine}")
    b = MoeBench(args)
    b.results["machine"] = machine
    failed = []
    if ("loop" in sections or "widths" in sections) and "bw" not in sections and not args.smoke:
        sections.insert(0, "bw")              # the copy figure: the second floor of every row
    for s in sections:
        if s == "widths" and "loop" in sections:
            continue                          # run with the loop rows, in their priority order
        t = time.perf_counter()
        try:
            if s in ("loop", "widths"):
                b.loop_widths(sections)
            else:
                getattr(b, f"{s}_section")()
        except Exception as e:  # noqa: BLE001 - report and go on with the other sections
            traceback.print_exc()
            failed.append(s)
            log(f"{s}: FAILED {type(e).__name__}: {e}")
        log(f"# {s} took {time.perf_counter() - t:.1f}s")
    if b.budget.skipped:
        log(f"# skipped for the budget: {', '.join(b.budget.skipped)}")
    if b.budget.failed:
        log(f"# failed rows: {', '.join(b.budget.failed)}")
    b.save()
    if failed:
        sys.exit(f"failed sections: {', '.join(failed)}")


if __name__ == "__main__":
    main()
