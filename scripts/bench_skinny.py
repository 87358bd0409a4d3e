"""Matmuls of few rows: XLA's GEMM against the Pallas skinny kernel (pallas_kernels/skinny/gpu.py)
at the Qwen3.5-9B / Qwen3-8B projection shapes, device time per matmul from a profiler trace,
against the bytes the matmul must move at the H200's measured copy bandwidth.

    python scripts/bench_skinny.py --rows 16,1 --out DIR          # every shape, the default tiles
    python scripts/bench_skinny.py --rows 16 --sweep              # + a tile sweep per shape

Each program runs one matmul over L distinct weight copies (L x bytes >= 256 MB, so the 50 MB L2
never holds the next weight), traced over 5 calls after 2 warm-ups; "us" is the device kernel time
per matmul (every kernel of the program: the pad of x, the split-K sum, the SwiGLU in XLA), "x
floor" that over (weights + x + out bytes) / 4.23 TB/s. A table, and JSON lines with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

COPY_TBPS = 4.23e12

# (name, K, N, swiglu, out f32): the 9B's GDN input / output projections, full-attention qkv (q, its
# gate, k, v), the MLP's gate|up (SwiGLU after) and down, the LM head (f32 logits), the draft's fc
# over five taps
SHAPES = [
    ("gdn_in", 4096, 12352, False, False),
    ("out_o", 4096, 4096, False, False),
    ("attn_qkv", 4096, 10240, False, False),
    ("gate_up", 4096, 24576, True, False),
    ("down", 12288, 4096, False, False),
    ("draft_fc", 20480, 4096, False, False),
    ("lm_head", 4096, 248320, False, True),
]

# (bn, bk, splits, num_warps, num_stages)
DEFAULT = (64, 256, 1, 4, 4)
SWEEP = [(32, 256, 1, 4, 4), (128, 128, 1, 4, 4), (64, 128, 1, 4, 6), (64, 256, 1, 4, 3), (64, 512, 1, 4, 3),
         (64, 256, 1, 8, 4), (32, 512, 1, 4, 4), (64, 256, 2, 4, 4), (32, 256, 2, 4, 4)]


def device_us(fn, args, reps: int = 5) -> float:
    from bench_gpu import _find_trace, summarize_trace
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="bench_skinny_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    return summarize_trace(_find_trace(d))["busy_ms"] * 1000 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,1")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tilings (first row count only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from pallas_kernels.skinny import gpu as skinny
    dt = jnp.bfloat16
    names = a.shapes.split(",")
    rows = [int(r) for r in a.rows.split(",")]
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print(f"{'shape':>9} {'M':>3} {'variant':>22} {'us':>9} {'x floor':>8}")
    lines = []
    for name, K, N, swiglu, f32 in SHAPES:
        if name not in names:
            continue
        wbytes = K * N * 2
        L = max(1, min(8, math.ceil(256e6 / wbytes)))
        keys = jax.random.split(jax.random.key(0), L)
        ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(dt) for k in keys]
        for M in rows:
            x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(dt)
            out_n = N // 2 if swiglu else N
            floor_us = (wbytes + M * K * 2 + M * out_n * (4 if f32 else 2)) / COPY_TBPS * 1e6
            od = jnp.float32 if f32 else None

            def xla_one(x, w):
                y = jnp.dot(x, w, preferred_element_type=jnp.float32 if f32 else None)
                if swiglu:
                    g, u = jnp.split(y, 2, axis=-1)
                    y = jax.nn.silu(g) * u
                return y

            variants = [("xla", xla_one)]
            configs = [DEFAULT] + (SWEEP if a.sweep and M == rows[0] else [])
            for bn, bk, sp, nw, ns in configs:
                if not skinny.supported(M, K, N, dt, swiglu) or (N // (2 if swiglu else 1)) % bn or K % (bk * sp):
                    continue
                fn1 = (lambda x, w, bn=bn, bk=bk, sp=sp, nw=nw, ns=ns: skinny.matmul(
                    x, w, swiglu=swiglu, out_dtype=od, bn=bn, bk=bk, splits=sp, num_warps=nw, num_stages=ns))
                variants.append((f"pallas {bn}/{bk}/s{sp}/w{nw}/st{ns}", fn1))
            for vname, one in variants:
                fn = jax.jit(lambda x, *ws, one=one: [one(x, w) for w in ws])
                try:
                    us = device_us(fn, (x, *ws)) / L
                except Exception as e:  # noqa: BLE001  (a tiling Triton cannot compile: say so, go on)
                    print(f"{name:>9} {M:>3} {vname:>22}  failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                row = dict(shape=name, K=K, N=N, M=M, variant=vname, us=us, floor_us=floor_us,
                           x_floor=us / floor_us, copies=L)
                lines.append(row)
                print(f"{name:>9} {M:>3} {vname:>22} {us:9.1f} {us / floor_us:8.3f}", flush=True)
        del ws
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        with open(Path(a.out) / "bench_skinny.jsonl", "w") as f:
            for r in lines:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
