"""Matmuls of few rows against 8-bit weights on the GPU: XLA's paths (bf16; int8 = the weight
converted then the dot, then the column scales; FP8 = the block-dequantized weight then the dot)
against the Pallas kernel that reads the 8-bit weight once (pallas_kernels/quantized/gpu.py), at
Qwen3-8B's projection shapes. Device time per matmul from a profiler trace, against the bytes the
matmul must move at a copy bandwidth.

    python scripts/bench_quantized_matmul.py --rows 1,16,128 --tbs 3.04          # default tiles
    python scripts/bench_quantized_matmul.py --rows 16 --sweep --out DIR          # + a tile sweep

Each program runs one matmul over L distinct weight copies (L x bytes >= 256 MB, so the L2 never
holds the next weight), traced over 5 calls after 2 warm-ups; "us" is the device time per matmul
(every kernel of the program: the pad of x, the split-K sum), "x floor" that over (8-bit weight +
scales + x + out bytes, or bf16 weight bytes for the bf16 row) / the copy bandwidth.
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

# (name, K, N): Qwen3-8B's fused qkv, o, gate|up, down, and the LM head (int8+head)
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096),
          ("lm_head", 4096, 151936)]

# (bn, bk, splits, num_warps, num_stages)
SWEEP = [(64, 128, 2, 4, 4), (128, 128, 1, 4, 4), (64, 128, 4, 4, 4), (64, 128, 8, 4, 4), (32, 128, 4, 4, 4),
         (128, 128, 4, 4, 4), (128, 128, 2, 4, 4), (64, 64, 4, 4, 4), (64, 64, 8, 4, 4), (32, 256, 4, 4, 3),
         (64, 256, 4, 4, 3), (128, 256, 4, 8, 3), (64, 128, 4, 2, 4), (32, 128, 8, 2, 4), (128, 64, 4, 4, 4)]


def device_us(fn, args, reps: int = 5) -> float:
    from bench_gpu import _find_trace, summarize_trace
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="bench_qmm_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    return summarize_trace(_find_trace(d))["busy_ms"] * 1000 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--methods", default="int8,fp8")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tilings (at --sweep-rows)")
    ap.add_argument("--sweep-rows", default=None, help="row counts to sweep (default: the first of --rows)")
    ap.add_argument("--tbs", type=float, default=3.04, help="copy bandwidth, TB/s (the floor)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dflash_jax.quantize import Fp8BlockWeight, quantize_int8
    from pallas_kernels.quantized import gpu as qgpu
    bw = a.tbs * 1e12
    dt = jnp.bfloat16
    names, methods = a.shapes.split(","), a.methods.split(",")
    rows = [int(r) for r in a.rows.split(",")]
    sweep_rows = [int(r) for r in a.sweep_rows.split(",")] if a.sweep_rows else rows[:1]
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  copy {a.tbs} TB/s")
    print(f"{'shape':>8} {'M':>4} {'variant':>30} {'us':>9} {'x floor':>8} {'/ bf16':>7}")
    lines = []
    for name, K, N in SHAPES:
        if name not in names:
            continue
        L = max(1, min(8, math.ceil(256e6 / (K * N))))
        keys = jax.random.split(jax.random.key(0), L)
        ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(dt) for k in keys]
        quant = {}
        if "int8" in methods:
            quant["int8"] = [quantize_int8(w) for w in ws]
        if "fp8" in methods:
            def fp8(w):
                wf = w.astype(jnp.float32).reshape(K // 128, 128, N // 128, 128)
                s = jnp.max(jnp.abs(wf), axis=(1, 3)) / 448.0
                q = (wf / s[:, None, :, None]).reshape(K, N).astype(jnp.float8_e4m3fn)
                return Fp8BlockWeight(q, s, (128, 128))
            quant["fp8"] = [fp8(w) for w in ws]
        for M in rows:
            x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(dt)
            io = M * K * 2 + M * N * 2
            variants = [("bf16 xla", "bf16", lambda x, w: x @ w, ws)]
            for meth, qs in quant.items():
                variants.append((f"{meth} xla", meth, lambda x, w: w.matmul(x), qs))
                block = None if meth == "int8" else (128, 128)
                if not qgpu.supported(M, K, N, dt, block):
                    continue
                configs = [None] + (SWEEP if a.sweep and M in sweep_rows else [])
                for c in configs:
                    if c is None:
                        fn1, label = (lambda x, w, b=block: qgpu.matmul(x, w.q, w.scale, block=b)), f"{meth} kernel"
                    else:
                        bn, bk, sp, nw, ns = c
                        if N % bn or K % (bk * sp) or (block and (128 % bk or 128 % bn)):
                            continue
                        fn1 = (lambda x, w, b=block, bn=bn, bk=bk, sp=sp, nw=nw, ns=ns: qgpu.matmul(
                            x, w.q, w.scale, block=b, bn=bn, bk=bk, splits=sp, num_warps=nw, num_stages=ns))
                        label = f"{meth} k {bn}/{bk}/s{sp}/w{nw}/st{ns}"
                    variants.append((label, meth, fn1, qs))
            bf16_us = None
            for vname, meth, one, wl in variants:
                wbytes = K * N * 2 if meth == "bf16" else K * N + (N * 4 if meth == "int8" else K * N // 16384 * 4)
                floor_us = (wbytes + io) / bw * 1e6
                fn = jax.jit(lambda x, *ws, one=one: [one(x, w) for w in ws])
                try:
                    us = device_us(fn, (x, *wl)) / L
                except Exception as e:  # noqa: BLE001  (a tiling Triton cannot compile: say so, go on)
                    print(f"{name:>8} {M:>4} {vname:>30}  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                if meth == "bf16":
                    bf16_us = us
                rel = us / bf16_us if bf16_us else float("nan")
                row = dict(shape=name, K=K, N=N, M=M, variant=vname, method=meth, us=us, floor_us=floor_us,
                           x_floor=us / floor_us, vs_bf16=rel, copies=L, device=jax.devices()[0].device_kind)
                lines.append(row)
                print(f"{name:>8} {M:>4} {vname:>30} {us:9.1f} {us / floor_us:8.3f} {rel:7.3f}", flush=True)
        del ws, quant
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        with open(Path(a.out) / "bench_quantized_matmul.jsonl", "w") as f:
            for r in lines:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
