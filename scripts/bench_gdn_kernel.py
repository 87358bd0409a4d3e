"""The GDN block kernel alone (pallas_kernels/gated_delta/gpu.py): microseconds per layer call at
Qwen3.5-9B widths for each (block_v, num_warps), the verify block (T = 16) and the plain step (T = 1),
and the fold kernel beside it. A layer's call is timed inside one program that runs `--layers`
distinct layers' states through it in a scan (as the model's GDN layers run), so a row is device
time per layer, not one launch's host dispatch. One JSON line per row.

    python scripts/bench_gdn_kernel.py --block-v 8,16,32,64,128 --warps 0,1,2,4,8   # H200
    python scripts/bench_gdn_kernel.py --smoke                                     # CPU, interpret mode

Why: at B = 1 the hybrid DFlash iteration is well above its floor and its extra time is per-GDN-layer
work of the 16-row verify (measured: docs/hybrid-targets.md, docs/perf-log.md); the kernel's tiling (value dims per program,
warps) decides how much of the GPU the 32 v-heads of one row occupy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta import gpu as gdn  # noqa: E402

SHAPES = {"9b": dict(HK=16, HV=32, dk=128, dv=128, K=4), "smoke": dict(HK=2, HV=4, dk=16, dv=16, K=4)}


def timed(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-v", default="16,32,64")
    ap.add_argument("--warps", default="0,2,4,8", help="num_warps values (0: the kernel's own choice)")
    ap.add_argument("--T", default="16,1", help="block lengths (16: a block-16 verify, 1: a plain step)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24, help="distinct layers per timed program (9B: 24 GDN)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    a = ap.parse_args(argv)
    shape = SHAPES["smoke" if a.smoke else "9b"]
    HK, HV, dk, dv, K = (shape[k] for k in ("HK", "HV", "dk", "dv", "K"))
    C = 2 * HK * dk + HV * dv
    F = C + HV * dv + 2 * HV
    B, L = a.batch, (2 if a.smoke else a.layers)
    interpret = a.smoke or jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    conv_w = jnp.asarray(rng.standard_normal((C, K)) * 0.3, dt)
    A_log = jnp.asarray(rng.uniform(0, 2, HV), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV), jnp.float32)
    norm_w = jnp.asarray(1 + 0.1 * rng.standard_normal(dv), dt)
    states = jnp.asarray(rng.standard_normal((L, B, HV, dk, dv)) * 0.05, jnp.float32)
    out = open(a.out, "a") if a.out else None

    def emit(row):
        row["device"] = jax.devices()[0].device_kind
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    for T in [int(t) for t in a.T.split(",")]:
        p = jnp.asarray(rng.standard_normal((L, B, T, F)), dt)
        win = jnp.asarray(rng.standard_normal((L, B, K - 1, C)), dt)
        n = jnp.full((B,), T // 2 + 1 if T > 1 else 1, jnp.int32)
        for bv in [int(v) for v in a.block_v.split(",")]:
            if not gdn.block_supported(T, HK, HV, dk, dv, K, bv):
                emit(dict(T=T, block_v=bv, skipped="unsupported"))
                continue
            for w in [int(v) for v in a.warps.split(",")]:
                def layers(p, win, states, bv=bv, w=w):
                    def body(acc, xs):
                        pi, wi, si = xs
                        o, rec = gdn.gdn_block(pi, wi, conv_w, A_log, dt_bias, norm_w, si, num_k_heads=HK,
                                               key_dim=dk, value_dim=dv, norm_eps=1e-6, block_v=bv,
                                               num_warps=w, interpret=interpret)
                        return acc + jnp.sum(o[..., :1].astype(jnp.float32)), rec
                    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (p, win, states))

                def folds(recs, states, bv=bv, w=w):
                    def body(acc, xs):
                        (k, G, d), si = xs
                        s = gdn.fold_deltas(k, G, d, si, n, block_v=bv, num_warps=w, interpret=interpret)
                        return acc + s[0, 0, 0, 0], None
                    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (recs, states))[0]
                try:
                    fwd = jax.jit(layers)
                    _, recs = fwd(p, win, states)
                    t_fwd = timed(fwd, (p, win, states), a.reps)
                    fold = jax.jit(folds)
                    t_fold = timed(fold, (recs, states), a.reps)
                except Exception as e:  # noqa: BLE001  (a tiling Triton refuses: report it, go on)
                    emit(dict(T=T, block_v=bv, num_warps=w, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                emit(dict(T=T, batch=B, block_v=bv, num_warps=w, programs=B * HV * (dv // bv),
                          us_per_layer=round(1e6 * t_fwd / L, 2), fold_us_per_layer=round(1e6 * t_fold / L, 2),
                          layers=L))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
