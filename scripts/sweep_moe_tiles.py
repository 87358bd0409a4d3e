#!/usr/bin/env python
"""Tile sweep of the GPU grouped matmul (pallas_kernels/moe/gpu.gmm) at the Coder-30B-A3B expert
shapes: the fused gate|up + SwiGLU launch (K = H 2048, N = 2 x 768) and the down launch (K = 768,
N = 2048), for T tokens x top-8 uniform random routing over 128 experts (T = 8: a B = 8 decode
step's 64 rows; T = 128: a B = 8 block-16 verify's 1,024), each configuration against the default
tiles (choose_tiles / plan_tiles) and the touched experts' bytes at --floor-tbs.

    python scripts/sweep_moe_tiles.py --tokens 8,128 --out $OUT       # H200 (issue 36's B = 8 rows)
    python scripts/sweep_moe_tiles.py --smoke                          # CPU, interpreted, tiny

Timed over --copies distinct layers' weights per pass (L2 holds no expert between passes), --inner
passes per dispatch, median of --repeats dispatches; us per launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8,128")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--floor-tbs", type=float, default=4.23)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from pallas_kernels.moe import gpu
    from dflash_jax.models import moe

    t0 = time.perf_counter()
    E, k, H, I = a.experts, a.top_k, a.hidden, a.inter
    interpret = a.smoke
    if a.smoke:
        E, k, H, I, a.copies, a.inner, a.repeats = 8, 2, 64, 32, 1, 1, 1
    dt = jnp.bfloat16 if not a.smoke else jnp.float32
    keys = jax.random.split(jax.random.key(0), 2 * a.copies)
    gate_up = [(jax.random.normal(keys[2 * i], (E, H, 2 * I)) * H ** -0.5).astype(dt) for i in range(a.copies)]
    down = [(jax.random.normal(keys[2 * i + 1], (E, I, H)) * I ** -0.5).astype(dt) for i in range(a.copies)]
    bw = a.floor_tbs * 1e12
    item = jnp.dtype(dt).itemsize
    configs = [None]                       # None: the defaults
    grid = dict(bn=(32, 64, 128), bk=(64, 128, 256), num_warps=(4,), num_stages=(2, 3, 4))
    wide = dict(bn=(128,), bk=(64, 128, 256), num_warps=(8,), num_stages=(2, 3, 4))   # 8 warps: wide tiles only
    if a.smoke:
        grid, wide = dict(bn=(16,), bk=(16, 32), num_warps=(4,), num_stages=(2,)), {}
    for g in (grid, wide):
        configs += [dict(zip(g, v)) for v in itertools.product(*g.values())] if g else []
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        kx, kr = jax.random.split(jax.random.key(T))
        idx = jnp.argsort(jax.random.uniform(kr, (T, E)), axis=-1)[:, :k].astype(jnp.int32)
        flat = idx.reshape(-1)
        order, _, sizes = moe.group_rows(flat, E)
        x = jax.random.normal(kx, (T * k, H)).astype(dt)[order]
        h = jax.random.normal(kx, (T * k, I)).astype(dt)
        distinct = int(jnp.sum(sizes > 0))
        for which, lhs, ws, swiglu, K, N in (("gate_up", x, gate_up, True, H, 2 * I), ("down", h, down, False, I, H)):
            floor_us = 1e6 * distinct * K * N * item / bw
            base = None
            for cfg in configs:
                if time.perf_counter() - t0 > a.budget_s:
                    print(f"budget: stopping at T={T} {which}", flush=True)
                    break
                kw = dict(cfg or {})
                half = N // 2 if swiglu else N
                if "bn" in kw and half % kw["bn"] or "bk" in kw and K % kw["bk"]:
                    continue

                @jax.jit
                def many(lhs, sizes, ws, kw=kw, swiglu=swiglu):
                    def body(_, acc):
                        for w in ws:
                            acc = acc + gpu.gmm(lhs, w, sizes, swiglu=swiglu, interpret=interpret, **kw)[:1, :1].astype(jnp.float32)
                        return acc
                    return jax.lax.fori_loop(0, a.inner, body, jnp.zeros((1, 1), jnp.float32))
                try:
                    jax.block_until_ready(many(lhs, sizes, ws))
                    ts = []
                    for _ in range(a.repeats):
                        s = time.perf_counter()
                        jax.block_until_ready(many(lhs, sizes, ws))
                        ts.append(time.perf_counter() - s)
                    us = 1e6 * statistics.median(ts) / (a.inner * len(ws))
                except Exception as e:            # a tiling Triton refuses (shared memory): listed, skipped
                    print(f"T={T} {which} {kw}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                    continue
                base = us if cfg is None else base
                tiles = gpu.plan_tiles(T * k, K, half, item, swiglu, kw.get("num_stages", 3), None,
                                       kw.get("bn"), kw.get("bk"), max(1, min(E, T * k)))
                row = dict(tokens=T, rows=T * k, which=which, distinct=distinct, cfg=kw or "default",
                           tiles=tiles, us=us, x_floor=us / floor_us, vs_default=us / base)
                rows.append(row)
                print(f"T={T:<4} {which:8s} {str(kw or 'default'):60s} tiles {tiles}  {us:8.1f} us  "
                      f"{us / floor_us:5.2f}x floor ({floor_us:.1f})  {us / base:5.3f}x default", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "sweep_moe_tiles.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print("\nbest per (T, launch):")
    for key in sorted({(r["tokens"], r["which"]) for r in rows}):
        rs = [r for r in rows if (r["tokens"], r["which"]) == key]
        best = min(rs, key=lambda r: r["us"])
        d = next((r for r in rs if r["cfg"] == "default"), None)
        print(f"  T={key[0]:<4} {key[1]:8s} best {best['cfg']} {best['us']:.1f} us ({best['x_floor']:.2f}x floor)"
              + (f" against default {d['us']:.1f} us ({d['x_floor']:.2f}x)" if d else ""))


if __name__ == "__main__":
    main()
