"""Benchmark a target layer's four projections at decode/verify sizes on a GPU (H200): the fused
Pallas kernels (pallas_kernels.gpu_linear) against the XLA path they replace, and a sweep of the
kernels' launch settings.

    python scripts/bench_linear.py                 # on the GPU machine, ~2-3 minutes
    python scripts/bench_linear.py --smoke         # tiny sizes on CPU (interpret mode)

Qwen3-8B shapes (hidden 4096, q/k/v 6144, intermediate 12288, bf16), rows M = 1 (plain decode) and
16 (a DFlash verify block). The ops, each as the layer runs it:
  qkv      XLA: h @ W_qkv (+ split-K reduction)          fused: one kernel
  o        XLA: x @ W_o (+ split-K reduction)            fused: one kernel
  gate_up  XLA: h @ W_gu, SwiGLU                         fused: one kernel (both halves, SwiGLU)
  down     XLA: x @ W_down (+ split-K reduction)         fused: one kernel
  layer    the four in sequence (the whole per-layer chain, attention left out)
With --prologue, qkv and gate_up also take the residual add and RMSNorm (XLA side: our add_rmsnorm
kernel before the GEMM): calls 12-13 measured that 2-3x slower than XLA, so the layer does not.
Time: a jitted program runs an op over L distinct weight sets (36 = a Qwen3-8B target, so the weights
never sit in L2); programs of 36 and 4 sets are timed (median of many calls) and the difference per
extra set is the op's device time, without host dispatch. Bandwidth: weight bytes / time, against the
measured copy bandwidth. The floor column is weight bytes at that bandwidth.
Prints one table; writes $OUT/bench_linear.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.modeling.layers import gated_silu  # noqa: E402
from pallas_kernels import gpu  # noqa: E402
from pallas_kernels import gpu_linear  # noqa: E402
from pallas_kernels.gpu_linear import fused_linear  # noqa: E402

EPS = 1e-6


def _time(fn, args, target_s=0.4, min_reps=10, max_reps=200) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    times = []
    for _ in range(int(min(max_reps, max(min_reps, target_s / max(one, 1e-6))))):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shapes(smoke: bool) -> dict:
    H, F, I = (256, 384, 512) if smoke else (4096, 6144, 12288)
    return {"H": H, "qkv": (H, F), "o": (H, H), "gate_up": (H, 2 * I), "down": (I, H)}


PROLOGUE = False   # --prologue: qkv and gate_up with the residual add and RMSNorm (see --help)


def op_xla(name, x, r, nw, w):
    """The XLA path as modeling.layers runs it (add + RMSNorm as our add_rmsnorm kernel)."""
    interp = jax.default_backend() == "cpu"
    if name in ("qkv", "gate_up"):
        h = x
        if PROLOGUE:
            x, h = gpu.add_rmsnorm(x, r, nw, EPS, interpret=interp)
        y = h @ w
        return x, gated_silu(y) if name == "gate_up" else y
    return x @ w


def op_fused(name, x, r, nw, w, cfg):
    interp = jax.default_backend() == "cpu"
    if name in ("qkv", "gate_up") and not PROLOGUE:
        return x, fused_linear(x, w, swiglu=name == "gate_up", interpret=interp, **cfg)
    if name in ("qkv", "gate_up"):
        return fused_linear(x, w, residual=r, norm_weight=nw, eps=EPS, swiglu=name == "gate_up",
                            interpret=interp, **cfg)
    return fused_linear(x, w, interpret=interp, **cfg)


def program(name, impl, cfg, n_sets):
    """jit(x, r, nw, ws) running op `name` over the first n_sets weight sets (or the whole layer)."""
    def one(op_name, x, r, nw, w):
        return op_xla(op_name, x, r, nw, w) if impl == "xla" else op_fused(op_name, x, r, nw, w, cfg.get(op_name, cfg))

    def f(x, r, nw, ws):
        outs = []
        if name != "layer":
            for w in ws[name][:n_sets]:
                outs.append(one(name, x[name], r[name], nw, w))
            return outs
        # the chain: qkv -> o (on the q part) -> gate_up (residual = o) -> down -> next residual
        h, d = x["qkv"], r["qkv"]
        for i in range(n_sets):
            h, qkv = one("qkv", h, d, nw, ws["qkv"][i])
            o = one("o", qkv[..., : h.shape[-1]], None, nw, ws["o"][i])
            h, act = one("gate_up", h, o, nw, ws["gate_up"][i])
            d = one("down", act, None, nw, ws["down"][i])
            outs.append(d)
        return outs
    return jax.jit(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--budget-s", type=float, default=180.0, help="start no op's sweep after this long")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None, help="write the best setting per shape here (JSON)")
    ap.add_argument("--prologue", action="store_true",
                    help="qkv and gate_up take x and the residual and fuse the add and RMSNorm "
                         "(DFLASH_LINEAR_PROLOGUE=1; XLA side: the add_rmsnorm kernel first); default: "
                         "they take the normed input, as the layer runs them")
    args = ap.parse_args(argv)
    global PROLOGUE
    PROLOGUE = args.prologue
    t_start = time.perf_counter()
    smoke = args.smoke
    S = shapes(smoke)
    H = S["H"]
    L, L0 = (3, 1) if smoke else (36, 4)
    dt = jnp.bfloat16
    print(f"# bench_linear on {jax.devices()[0].device_kind} ({jax.default_backend()}), L={L} weight sets, jax {jax.__version__}",
          flush=True)
    key = jax.random.key(0)
    ws = {}
    for name in ("qkv", "o", "gate_up", "down"):
        K, N = S[name]
        kn = jax.random.fold_in(key, ("qkv", "o", "gate_up", "down").index(name))
        ws[name] = [(jax.random.normal(jax.random.fold_in(kn, i), (K, N), jnp.float32)
                     * K ** -0.5).astype(dt) for i in range(L)]
    nbytes = {n: S[n][0] * S[n][1] * 2 for n in ("qkv", "o", "gate_up", "down")}
    nbytes["layer"] = sum(nbytes.values())
    nw = jnp.linspace(0.5, 1.5, H).astype(dt)
    # copy bandwidth
    big = jnp.ones((1 << (24 if smoke else 30),), dt)
    copy_bw = 2 * big.nbytes / _time(jax.jit(lambda a: a * 2), (big,))
    del big
    print(f"# copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)

    grid = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw_)
            for bn, bk, st, nw_ in itertools.product((32, 64), (128, 256, 512), (3, 4), (4,))]

    def sweep_for(name, M):
        """The grid less what cannot fit in shared memory (call 12 saw those fail to compile)."""
        res, sw = PROLOGUE and name in ("qkv", "gate_up"), name == "gate_up"
        out = [c for c in grid if gpu_linear._smem(c, gpu_linear.row_tile(M), 2, res, sw) <= 220 * 1024]
        return out[:3] if smoke else out
    results = {"copy_tb_s": copy_bw / 1e12, "rows": {}, "device": jax.devices()[0].device_kind}
    pool = cf.ThreadPoolExecutor(8)

    def compile_pair(name, impl, cfg, xs):
        progs = [program(name, impl, cfg, n) for n in (L0, L)]
        return [p.lower(*xs).compile() for p in progs]

    def measure(pair, xs, target_s=0.4):
        t0, t1 = (_time(p, xs, target_s=target_s) for p in pair)
        if t1 <= t0:  # noise larger than the difference (seen once in call 12): the long program's mean
            return t1 / L
        return (t1 - t0) / (L - L0)

    table = {}   # "M:K:N:swiglu" -> the best setting, for DFLASH_GPU_LINEAR_TABLE
    top_cfgs = {}

    # verify blocks (16 rows) first: their sweep seeds the decode rows' (the top settings only)
    for M in sorted((int(m) for m in args.rows.split(",")), key=lambda m: -m):
        kx = jax.random.split(jax.random.key(M), 8)
        xs = ({n: jax.random.normal(kx[i], (1, M, S[n][0]), jnp.float32).astype(dt)
               for i, n in enumerate(("qkv", "o", "gate_up", "down"))},
              {n: jax.random.normal(kx[4 + i], (1, M, S[n][0]), jnp.float32).astype(dt)
               for i, n in enumerate(("qkv", "o", "gate_up", "down"))}, nw, ws)
        rows = results["rows"].setdefault(str(M), {})
        for name in ("qkv", "o", "gate_up", "down"):
            rec = rows.setdefault(name, {"bytes": nbytes[name]})
            # correctness first: fused default against XLA on set 0
            a = op_xla(name, xs[0][name], xs[1][name], nw, ws[name][0])
            b = op_fused(name, xs[0][name], xs[1][name], nw, ws[name][0], {})
            a, b = (a[-1], b[-1]) if isinstance(a, tuple) else (a, b)
            err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        / (jnp.max(jnp.abs(a.astype(jnp.float32))) + 1e-9))
            rec["check_rel_err"] = err
            rec["xla_us"] = measure(compile_pair(name, "xla", {}, xs), xs) * 1e6
            rec["fused_default_us"] = measure(compile_pair(name, "fused", {}, xs), xs) * 1e6
            print(f"M={M:3d} {name:8s} check rel err {err:.2e}  xla {rec['xla_us']:8.2f} us  "
                  f"fused(default) {rec['fused_default_us']:8.2f} us  floor {nbytes[name] / copy_bw * 1e6:7.2f} us",
                  flush=True)
        # sweep each op's launch settings (compiles in parallel)
        for name in ("qkv", "o", "gate_up", "down"):
            if time.perf_counter() - t_start > args.budget_s:
                print(f"# budget reached: sweep of M={M} {name} skipped", flush=True)
                continue
            cands = sweep_for(name, M)
            if top_cfgs.get(name):   # a later row count: the earlier one's best few, and the default
                cands = top_cfgs[name]
            futs = [(cfg, pool.submit(compile_pair, name, "fused", cfg, xs)) for cfg in cands]
            best = []
            for cfg, fut in futs:
                try:
                    t = measure(fut.result(), xs, target_s=0.12) * 1e6
                except Exception as e:  # a setting Triton cannot compile (shared memory, ...)
                    print(f"  M={M} {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                best.append((t, cfg))
            best.sort(key=lambda x: x[0])
            rows[name]["sweep"] = [{"us": t, **c} for t, c in best]
            if best:
                K, N = S[name]
                sw = name == "gate_up"
                table[gpu_linear.table_key(M, K, N // 2 if sw else N, sw)] = best[0][1]
                top_cfgs.setdefault(name, [c for _, c in best[:4]])
            top = ", ".join(f"{t:.2f} us {c}" for t, c in best[:3])
            print(f"M={M:3d} {name:8s} sweep best: {top}", flush=True)
        # the whole layer chain: XLA, fused default, fused with each op's best setting
        best_cfg = {n: {k: v for k, v in rows[n]["sweep"][0].items() if k != "us"}
                    for n in ("qkv", "o", "gate_up", "down") if rows[n].get("sweep")}
        for tag, impl, cfg in (("xla", "xla", {}), ("fused_default", "fused", {}),
                               ("fused_best", "fused", best_cfg)):
            if tag == "fused_best" and len(best_cfg) < 4:
                continue
            rows.setdefault("layer", {"bytes": nbytes["layer"]})[f"{tag}_us"] = \
                measure(compile_pair("layer", impl, cfg, xs), xs) * 1e6
        rows["layer"]["best_cfg"] = best_cfg

    print("\n" + "=" * 100)
    print(f"projections of one Qwen3-8B layer, bf16, {results['device']}; copy {copy_bw / 1e12:.2f} TB/s; "
          f"us per layer (device time), % = floor / time")
    print(f"{'M':>3} {'op':8s} {'floor':>7} {'XLA':>8} {'%':>4} {'fused':>8} {'%':>4} {'best':>8} {'%':>4}  best setting")
    for M, rows in results["rows"].items():
        for name in ("qkv", "o", "gate_up", "down", "layer"):
            r = rows.get(name, {})
            fl = r.get("bytes", 0) / copy_bw * 1e6
            x_ = r.get("xla_us")
            f_ = r.get("fused_default_us")
            b_ = r["sweep"][0]["us"] if r.get("sweep") else r.get("fused_best_us")
            cfg = ({k: v for k, v in r["sweep"][0].items() if k != "us"} if r.get("sweep") else "")
            pct = lambda t: f"{100 * fl / t:4.0f}" if t else "   -"
            num = lambda t: f"{t:8.2f}" if t else "       -"
            print(f"{M:>3} {name:8s} {fl:7.2f} {num(x_)} {pct(x_)} {num(f_)} {pct(f_)} {num(b_)} {pct(b_)}  {cfg}")
    results["table"] = table
    path = args.json or (os.path.join(os.environ["OUT"], "bench_linear.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(results, indent=1, default=str))
        print(f"# wrote {path}")
    if args.table:
        Path(args.table).write_text(json.dumps(table, indent=1))
        print(f"# wrote {args.table} (DFLASH_GPU_LINEAR_TABLE for bench_gpu.py)")
    pool.shutdown(wait=False, cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
