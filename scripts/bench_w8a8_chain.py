#!/usr/bin/env python
"""The 8-bit matmuls of a whole B = 1 step, chained as the decoder runs them (issue 57): where W8A8's time
over its byte floor goes, launch gaps included.

bench_fp8_w8a8.py times one matmul's kernels (device busy time); a step runs 36 layers x 4 matmuls one
after another, and every extra kernel a form launches (x's quantization, the K-split sum) costs its
launch and its tail too. This script jits L layers of Qwen3-8B's four projections in a row, each layer
with its own weights (the L2 holds none of them) -- qkv, its first 4096 columns -> o, + residual ->
gate|up, silu(gate) * up -> down, + residual -- and times, for each form, the wall time per chain
(best of --reps after warm-ups), the device busy time (profiler trace), the kernels per layer, and
both against the byte floor of the 8-bit weights (their bytes / --tbs).

Forms (one row: the B = 1 plain step; 16 rows: the B = 1 DFlash verify):
  bf16              x @ w, bf16 weights (the byte floor is still the 8-bit one: the ratio shows bf16's 2x)
  fp8 weight-only   models.layers.linear on an Fp8BlockWeight (pallas_kernels/quantized/gpu.py)
  w8a8 model        models.layers.linear on an Fp8W8A8Weight: what the model runs (XLA's fp8 dot at one
                    row, the Pallas kernel at 2-128 rows: x quantized inside it up to 16 rows, by XLA
                    before it beyond)
  w8a8 xla          gpu_w8a8.matmul_xla at every row count
  w8a8 pallas       the fused Pallas kernel (x quantized inside it) at every row count, one row included,
                    with the model path's tiling (models.layers._w8a8_kernel_tiles)
  w8a8 channel      quantize.Fp8ChannelWeight (--w8a8 channel): the weight requantized to one scale per output
                    channel, x to one per row, one fp8 dot with the scales after it (gpu_w8a8.matmul_channel)
  w8a8 dequant      gpu_w8a8.matmul_dequant at every row count (the many-row form: if XLA fuses the weight's
                    dequantization into its GEMM, it reads the fp8 bytes once; if not, it writes a bf16 copy)

    python scripts/bench_w8a8_chain.py --rows 1,16 --tbs 4.3          # GPU: Qwen3-8B, 36 layers
    python scripts/bench_w8a8_chain.py --cpu-smoke                    # CPU: tiny shapes, 2 layers, interpreted
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# in run order: the comparison that decides the one-row path first (a timeout leaves it whole)
FORMS = ("bf16", "w8a8 model", "w8a8 channel", "w8a8 pallas", "w8a8 dequant", "fp8 weight-only", "w8a8 xla")
BLOCK = (128, 128)
# (hidden, q heads x head dim, kv width of qkv beyond q, intermediate): Qwen3-8B; the smoke's tiny one
QWEN3_8B = dict(hidden=4096, qkv=6144, o_in=4096, inter=12288)
TINY = dict(hidden=256, qkv=384, o_in=256, inter=384)


def _weights(key, geo, form):
    """One layer's four weights in `form`: {name: weight}. The FP8 ones are block-128 e4m3 with random
    block scales (the values do not matter for timing; they are finite and of the checkpoint's scale)."""
    from dflash_jax.quantize import Fp8BlockWeight, Fp8W8A8Weight
    H, I = geo["hidden"], geo["inter"]
    shapes = dict(qkv=(H, geo["qkv"]), o=(geo["o_in"], H), gate_up=(H, 2 * I), down=(I, H))
    out = {}
    for i, (name, (K, N)) in enumerate(shapes.items()):
        k = jax.random.fold_in(key, i)
        if form == "bf16":
            out[name] = (jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
            continue
        q = (jax.random.normal(k, (N, K), jnp.float32) * 60).astype(jnp.float8_e4m3fn)         # [N, K]
        s = jnp.full((N // BLOCK[1], K // BLOCK[0]), (K ** -0.5) / 60, jnp.float32)              # [Nb, Kb]
        w = Fp8W8A8Weight(q, s, BLOCK)
        if form == "w8a8 channel":
            from pallas_kernels.quantized import gpu_w8a8
            out[name] = gpu_w8a8.requantize_channels(q, s, BLOCK)
            continue
        out[name] = w.kn() if form == "fp8 weight-only" else w
    return out


def _matmul(form, interpret):
    from dflash_jax.models import layers
    from pallas_kernels.quantized import gpu_w8a8 as w8

    if form in ("bf16", "fp8 weight-only", "w8a8 model"):
        return layers.linear
    if form == "w8a8 xla":
        return lambda x, w: w8.matmul_xla(x, w.q, w.scale, w.block, "nk")
    if form == "w8a8 dequant":
        return lambda x, w: w8.matmul_dequant(x, w.q, w.scale, w.block, "nk")
    if form == "w8a8 channel":
        return lambda x, w: w8.matmul_channel(x, w[0], w[1])

    def pallas(x, w):
        bn, splits = layers._w8a8_kernel_tiles(jax.ShapeDtypeStruct((2, w.shape[0]), x.dtype), w)
        return w8.matmul_pallas(x, w.q, w.scale, block=w.block, layout="nk", bn=bn, bk=w.block[0],
                                splits=splits, fuse_quant=True, interpret=interpret)
    return pallas


def _chain(mm, o_in):
    def run(x, ws):
        for w in ws:
            qkv = mm(x, w["qkv"])
            h = x + mm(qkv[:, :o_in], w["o"])
            gu = mm(h, w["gate_up"])
            g, u = jnp.split(gu, 2, axis=-1)
            x = h + mm(jax.nn.silu(g) * u, w["down"])
        return x
    return jax.jit(run)


def _busy_us(fn, args, reps):
    """(device busy µs per call, kernels per call) from a profiler trace of `reps` calls."""
    from bench_gpu import _find_trace, summarize_trace
    d = tempfile.mkdtemp(prefix="bench_w8a8_chain_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    s = summarize_trace(_find_trace(d))
    n = sum(c for _, c in s["by_name"].values())
    return s["busy_ms"] * 1000 / reps, n / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16", help="row counts (1: a B = 1 plain step, 16: its DFlash verify)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma list of: {', '.join(FORMS)}")
    ap.add_argument("--tbs", type=float, default=4.3, help="copy bandwidth, TB/s (the floor)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, 2 layers, Pallas interpreted")
    a = ap.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    bad = set(forms) - set(FORMS)
    if bad:
        ap.error(f"--forms: unknown {sorted(bad)}; choose from {', '.join(FORMS)}")
    try:
        rows = [int(r) for r in a.rows.split(",") if r]
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if not rows or min(rows) < 1 or max(rows) > 4096:
        ap.error("--rows: one or more row counts in 1..4096 (beyond 128 rows: the forms that take them)")
    geo, L = (TINY, 2) if a.cpu_smoke else (QWEN3_8B, a.layers)
    reps = 2 if a.cpu_smoke else a.reps
    dev = jax.devices()[0]
    H, I = geo["hidden"], geo["inter"]
    fp8_bytes = L * sum(K * N * (1 + 4 / (BLOCK[0] * BLOCK[1]))
                        for K, N in ((H, geo["qkv"]), (geo["o_in"], H), (H, 2 * I), (I, H)))
    floor_us = fp8_bytes / (a.tbs * 1e12) * 1e6
    print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}; {L} layers of "
          f"{'Qwen3-8B' if not a.cpu_smoke else 'tiny'} projections; 8-bit weights {fp8_bytes / 1e9:.3f} GB, "
          f"floor {floor_us:.1f} us at {a.tbs} TB/s{'  [cpu smoke: interpreted Pallas]' if a.cpu_smoke else ''}",
          flush=True)
    print("| rows | form | wall us | busy us | gaps us | kernels / layer | wall x fp8 floor | wall / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for form in forms:
        t0 = time.perf_counter()
        ws = [_weights(jax.random.key(i), geo, form) for i in range(L)]
        jax.block_until_ready(ws)
        fn = _chain(_matmul(form, a.cpu_smoke), geo["o_in"])
        for M in rows:
            if M > 128 and form in ("w8a8 pallas", "fp8 weight-only"):
                continue                                     # kernels of at most 128 rows
            x = jax.random.normal(jax.random.key(99), (M, H), jnp.float32).astype(jnp.bfloat16) * 0.1
            try:
                jax.block_until_ready(fn(x, ws))
                jax.block_until_ready(fn(x, ws))
                best = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(x, ws))
                    best = min(best, time.perf_counter() - t)
                busy, kernels = _busy_us(fn, (x, ws), reps)
            except Exception as e:  # noqa: BLE001  (one form failing leaves the others' rows)
                msg = " ".join(f"{type(e).__name__}: {e}".split())
                print(f"| {M} | {form} | failed: {msg[:300]} |||||", flush=True)
                continue
            wall = best * 1e6
            results.append(dict(M=M, form=form, wall=wall))
            ref = next((r["wall"] for r in results if r["M"] == M and r["form"] == "bf16"), None)
            print(f"| {M} | {form} | {wall:.1f} | {busy:.1f} | {wall - busy:.1f} | {kernels / L:.1f} | "
                  f"{wall / floor_us:.2f} | {wall / ref if ref else float('nan'):.3f} |", flush=True)
        del ws
        print(f"# {form}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
