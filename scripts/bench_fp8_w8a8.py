"""FP8 W8A8 matmuls of few rows on the GPU (issue 57; the --w8a8 path): x quantized per (row, 128 columns
of K) to float8_e4m3fn at run time, fp8 x fp8 dots with float32 accumulation, each K block's product
times x's and the weight's block scales (pallas_kernels/quantized/gpu_w8a8.py), against the bf16 XLA
dot and the weight-only FP8 kernel (pallas_kernels/quantized/gpu.py: the 8-bit tile converted to bf16
in registers), at Qwen3-8B's projection shapes.

    python scripts/bench_fp8_w8a8.py --rows 1,16 --json OUT.json                # default tilings
    python scripts/bench_fp8_w8a8.py --rows 1,16 --sweep --budget-s 140          # + the Pallas tile sweep
    python scripts/bench_fp8_w8a8.py --cpu-smoke                                 # CPU: tiny shapes, interpreted
    python scripts/bench_fp8_w8a8.py --check                                     # CPU: the numerics check

Variants (every W8A8 time includes quantizing x, a part of the step; each copy gets its own x so
XLA cannot share one quantization between copies):
  bf16 xla          x @ w, w bf16
  fp8 wo kernel     gpu.matmul(x, q, s, block=(128, 128)): the weight-only FP8 kernel (x unquantized)
  x quant only      quantize_rows(x) alone (what the W8A8 rows pay for it)
  w8a8 xla kn|nk    XLA: a batched fp8 dot over the K blocks ([Kb, M, N] float32), scaled, summed;
                    kn: q [K, N] (ours), nk: q [N, K] (the HF checkpoint layout, both operands K-major)
  w8a8 pl kn|nk     the Pallas kernel at its default tiling (x quantized by XLA before it)
  w8a8 pl .. fused  the same with x quantized inside the kernel (fuse_quant)
  w8a8 pl .. bm64   rows padded to 64 (what Hopper's wgmma needs) instead of 16
  w8a8 dequant      gpu_w8a8.matmul_dequant (the block form beyond 128 rows)
  w8a8 channel      gpu_w8a8.matmul_channel (--w8a8 channel: the weight requantized to one scale per output
                    channel, x to one per row: one fp8 dot, cuBLASLt's fp8 GEMM shape)
  --sweep           bn 64/128, bk 128, splits 1/2/4, warps 4/8, stages 3/4 for --sweep-layouts, at
                    --sweep-rows; pass 2, after every default row of every shape
Pass 1 runs TIER1 (bf16, weight-only kernel, W8A8 XLA nk, Pallas nk / kn) for every shape and row count,
then the other default variants, so a --budget-s cut leaves the main comparison whole.
A variant that fails (compile or run) prints its error on one line and the rest go on; --budget-s stops
starting new variants after that many seconds (the ones not run are counted at the end).

Each program runs one matmul over L distinct weight copies (L x 8-bit bytes >= 256 MB, at most 8, so the
L2 never holds the next weight), traced over --reps calls after 2 warm-ups (bench_gpu's trace helpers, as
scripts/bench_quantized_matmul.py): "us" is the device time per matmul (every kernel of the program),
"x fp8" that over (fp8 weight bytes + block scales) / --tbs, for every row (bf16's too), "/ bf16" over
the bf16 dot's time, "err" the first copy's max |y - ref| / max |ref| against a float32 reference of its
scheme (W8A8 rows: x quantized as gpu_w8a8 does, both operands dequantized; bf16 and weight-only rows: x
as it is; bf16 output rounding alone is ~2e-3, a broken kernel shows ~1), "top kernels" the largest
kernels of the program per matmul.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# (name, K, N): Qwen3-8B's fused qkv, o, gate|up, down
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
SMOKE_SHAPES = [("tiny", 256, 384)]
BLOCK = (128, 128)
BASE = ("bf16 xla", "fp8 wo kernel", "x quant only", "w8a8 xla kn", "w8a8 xla nk", "w8a8 pl kn", "w8a8 pl nk",
        "w8a8 pl nk fused", "w8a8 pl kn fused", "w8a8 pl nk bm64",
        "w8a8 channel", "w8a8 dequant")
# pass 1 runs these first for every shape and row count, then the rest of BASE
TIER1 = ("bf16 xla", "fp8 wo kernel", "w8a8 xla nk", "w8a8 pl nk", "w8a8 pl kn")
# (bn, bk, splits, num_warps, num_stages)
SWEEP = [(bn, 128, sp, nw, ns) for bn in (64, 128) for sp in (1, 2, 4) for nw in (4, 8) for ns in (3, 4)]


def device_us(fn, args, reps: int = 5) -> tuple[float, list, object]:
    """Device time of one call of fn(*args) (µs, from a profiler trace over `reps` calls after 2
    warm-ups), its kernels [(name, µs per call)] largest first, and the warm-up's result."""
    from bench_gpu import _find_trace, summarize_trace
    for _ in range(2):
        out = jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="bench_w8a8_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    s = summarize_trace(_find_trace(d))
    top = sorted(((n, t / reps) for n, (t, c) in s["by_name"].items()), key=lambda p: -p[1])
    return s["busy_ms"] * 1000 / reps, top, out


@jax.jit
def _refs(x, q, s):
    """float32 references for the first copy: (W8A8: x quantized as gpu_w8a8 does, both dequantized;
    weight-only: x as it is) @ the dequantized weight, full precision."""
    from pallas_kernels.quantized.gpu_w8a8 import quantize_rows
    bks, bns = BLOCK
    K, N = q.shape
    wd = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, bks, 0), bns, 1)[:K, :N]
    xq, sx = quantize_rows(x, bks)
    xd = xq.astype(jnp.float32) * jnp.repeat(sx, bks, 1)
    hi = jax.lax.Precision.HIGHEST
    return jnp.dot(xd, wd, precision=hi), jnp.dot(x.astype(jnp.float32), wd, precision=hi)

def _fp8_weight(key, K, N, dt):
    """(w in dt, q_kn [K, N] fp8, s_kn [Kb, Nb]): w rounded to the FP8 block weight, as the checkpoint's."""
    bks, bns = BLOCK
    wf = (jax.random.normal(key, (K, N), jnp.float32) * K ** -0.5).reshape(K // bks, bks, N // bns, bns)
    s = jnp.max(jnp.abs(wf), axis=(1, 3)) / 448.0
    q8 = (wf / s[:, None, :, None]).astype(jnp.float8_e4m3fn)
    w = (q8.astype(jnp.float32) * s[:, None, :, None]).reshape(K, N).astype(dt)
    return w, q8.reshape(K, N), s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16", help="row counts (M) to time")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--variants", default=",".join(BASE), help="the default-tiling variants to run (names above)")
    ap.add_argument("--sweep", action="store_true", help="also time the Pallas tile sweep (pass 2)")
    ap.add_argument("--sweep-rows", default=None, help="row counts to sweep (default: all of --rows)")
    ap.add_argument("--sweep-shapes", default=None, help="shapes to sweep (default: all of --shapes)")
    ap.add_argument("--sweep-layouts", default="nk,kn", help="weight layouts the sweep covers")
    ap.add_argument("--sweep-bm", default="16", help="row paddings (bm) the sweep covers, e.g. 16,64")
    ap.add_argument("--sweep-fused", action="store_true", help="sweep the fused-quantization kernel too")
    ap.add_argument("--tbs", type=float, default=3.04, help="copy bandwidth, TB/s (the floor)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new variant after this many seconds")
    ap.add_argument("--json", default=None, help="write the rows (and the run's settings) here")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpreted, sweep of 2")
    ap.add_argument("--check", action="store_true", help="run gpu_w8a8's numerics check and exit")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    from pallas_kernels.quantized import gpu as qgpu
    from pallas_kernels.quantized import gpu_w8a8 as w8

    if a.check:
        worst = w8.check(verbose=False)
        for k, v in worst.items():
            print(f"  {k:32s} {v:.2e}")
        return 0

    smoke = a.cpu_smoke
    interp = smoke
    shapes = SMOKE_SHAPES if smoke else [s for s in SHAPES if s[0] in a.shapes.split(",")]
    rows = [int(r) for r in (("1,3" if a.rows == "1,16" else a.rows) if smoke else a.rows).split(",")]
    sweep_rows = [int(r) for r in a.sweep_rows.split(",")] if a.sweep_rows else rows
    sweep_shapes = a.sweep_shapes.split(",") if a.sweep_shapes else [s[0] for s in shapes]
    sweep = SWEEP[:2] if smoke else SWEEP
    do_sweep = a.sweep or smoke
    want = set(a.variants.split(","))
    bad = want - set(BASE)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}; choose from {', '.join(BASE)}")
    bw = a.tbs * 1e12
    dt = jnp.bfloat16
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform})  jax {jax.__version__}  copy {a.tbs} TB/s"
          f"{'  [cpu smoke: interpreted Pallas]' if smoke else ''}", flush=True)

    # the weights of every shape, built once (the sweep comes back to them)
    data = {}
    for name, K, N in shapes:
        L = 2 if smoke else max(1, min(8, math.ceil(256e6 / (K * N))))
        keys = jax.random.split(jax.random.key(0), L)
        ws, qs, ss = zip(*[_fp8_weight(k, K, N, dt) for k in keys])
        qnk = [jnp.asarray(q.T) for q in qs]          # materialized: the HF layout as stored
        snk = [s.T for s in ss]
        jax.block_until_ready((ws, qs, ss, qnk, snk))
        ch = [w8.requantize_channels(q, s, BLOCK) for q, s in zip(qnk, snk)]
        jax.block_until_ready(ch)
        data[name] = dict(K=K, N=N, L=L, bf16=list(ws), kn=list(zip(qs, ss)), nk=list(zip(qnk, snk)), ch=ch)
    print(f"weights built in {time.perf_counter() - t_start:.1f} s", flush=True)

    def pl_fn(layout, **kw):
        return lambda x, w, layout=layout, kw=kw: w8.matmul_pallas(x, w[0], w[1], BLOCK, layout,
                                                                  interpret=interp, **kw)

    base_defs = {
        "bf16 xla": ("bf16", lambda x, w: x @ w),
        "fp8 wo kernel": ("kn", lambda x, w: qgpu.matmul(x, w[0], w[1], block=BLOCK, interpret=interp)),
        "x quant only": ("kn", lambda x, w: w8.quantize_rows(x, BLOCK[0])),
        "w8a8 xla kn": ("kn", lambda x, w: w8.matmul_xla(x, w[0], w[1], BLOCK, "kn")),
        "w8a8 xla nk": ("nk", lambda x, w: w8.matmul_xla(x, w[0], w[1], BLOCK, "nk")),
        "w8a8 pl kn": ("kn", pl_fn("kn")),
        "w8a8 pl nk": ("nk", pl_fn("nk")),
        "w8a8 pl nk fused": ("nk", pl_fn("nk", fuse_quant=True)),
        "w8a8 pl kn fused": ("kn", pl_fn("kn", fuse_quant=True)),
        "w8a8 pl nk bm64": ("nk", pl_fn("nk", bm=64)),
        "w8a8 channel": ("ch", lambda x, w: w8.matmul_channel(x, w[0], w[1])),
        "w8a8 dequant": ("nk", lambda x, w: w8.matmul_dequant(x, w[0], w[1], BLOCK, "nk")),
    }

    # the work list: pass 1 every default variant, pass 2 the sweep
    jobs = []
    for tier in (TIER1, tuple(v for v in BASE if v not in TIER1)):
        for name, K, N in shapes:
            for M in rows:
                for v in tier:
                    if v in want:
                        jobs.append((name, M, v) + base_defs[v])
    if do_sweep:
        for name, K, N in shapes:
            if name not in sweep_shapes:
                continue
            for M in sweep_rows:
                for layout in a.sweep_layouts.split(","):
                    for fused in ((False, True) if a.sweep_fused else (False,)):
                        for bm in (int(b) for b in a.sweep_bm.split(",")):
                            for bn, bk, sp, nw, ns in sweep:
                                if N % bn or K % (bk * sp) or BLOCK[1] % bn:
                                    continue
                                label = (f"w8a8 pl {layout}{' fused' if fused else ''} {bn}/{bk}/s{sp}/w{nw}/st{ns}"
                                         f"{f'/bm{bm}' if bm != 16 else ''}")
                                jobs.append((name, M, label, layout, pl_fn(layout, bn=bn, bk=bk, splits=sp,
                                                                           num_warps=nw, num_stages=ns,
                                                                           fuse_quant=fused, bm=bm)))
    print(f"{len(jobs)} variants queued", flush=True)
    print(f"{'shape':>8} {'M':>3} {'variant':>34} {'us':>8} {'x fp8':>6} {'/ bf16':>6} {'err':>8} {'wall s':>6}  "
          "top kernels (us)",
          flush=True)

    lines, bf16_us, refs, skipped = [], {}, {}, 0
    xs_cache = {}
    for i, (name, M, vname, wkey, one) in enumerate(jobs):
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
            skipped = len(jobs) - i
            print(f"budget {a.budget_s:.0f} s spent: {skipped} variants not started "
                  f"(first: {name} M={M} {vname})", flush=True)
            break
        d = data[name]
        K, N, L = d["K"], d["N"], d["L"]
        if (name, M) not in xs_cache:
            xs_cache[(name, M)] = [jax.random.normal(jax.random.key(100 + c), (M, K), jnp.float32).astype(dt)
                                   for c in range(L)]
        xs = xs_cache[(name, M)]
        wl = d[wkey]
        fp8_bytes = K * N + (-(-K // BLOCK[0])) * (-(-N // BLOCK[1])) * 4
        floor_us = fp8_bytes / bw * 1e6
        fn = jax.jit(lambda xs, ws, one=one: [one(x, w) for x, w in zip(xs, ws)])
        t0 = time.perf_counter()
        try:
            us, top, out = device_us(fn, (xs, wl), a.reps)
        except Exception as e:  # noqa: BLE001  (a tiling that does not compile: say so, go on)
            msg = " ".join(f"{type(e).__name__}: {e}".split())
            print(f"{name:>8} {M:>3} {vname:>34}  failed ({time.perf_counter() - t0:.1f} s): {msg[:400]}", flush=True)
            lines.append(dict(shape=name, K=K, N=N, M=M, variant=vname, error=msg[:2000]))
            continue
        wall = time.perf_counter() - t0
        us /= L
        # error of the first copy's result against the float32 reference of its scheme
        err = float("nan")
        if vname != "x quant only":
            if (name, M) not in refs:
                refs[(name, M)] = jax.device_get(_refs(xs[0], *d["kn"][0]))
            r = refs[(name, M)][0 if vname.startswith("w8a8") else 1]
            y = np.asarray(jax.device_get(out[0]).astype(np.float32), np.float64)
            err = float(np.max(np.abs(y - r)) / max(np.max(np.abs(r)), 1e-30))
        top = [(n, t / L) for n, t in top[:4]]
        if vname == "bf16 xla":
            bf16_us[(name, M)] = us
        ref = bf16_us.get((name, M))
        rel = us / ref if ref else float("nan")
        tops = ", ".join(f"{n[:28]} {t:.1f}" for n, t in top[:3])
        print(f"{name:>8} {M:>3} {vname:>34} {us:8.1f} {us / floor_us:6.3f} {rel:6.3f} {err:8.1e} {wall:6.1f}  {tops}",
              flush=True)
        lines.append(dict(shape=name, K=K, N=N, M=M, variant=vname, us=us, floor_us=floor_us, x_fp8_floor=us / floor_us,
                          vs_bf16=rel, err=err, copies=L, wall_s=wall, top_kernels=top, device=dev.device_kind))
    total = time.perf_counter() - t_start
    print(f"done: {len(lines)} rows in {total:.1f} s{f', {skipped} skipped for the budget' if skipped else ''}",
          flush=True)
    # best of each family per (shape, M)
    best = {}
    for r in lines:
        if "us" not in r or r["variant"] in ("x quant only",):
            continue
        fam = "w8a8 pallas" if r["variant"].startswith("w8a8 pl") else r["variant"]
        k = (r["shape"], r["M"], fam)
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    if best:
        print("best per family:")
        for (shape, M, fam), r in best.items():
            print(f"{shape:>8} {M:>3} {fam:>14} {r['us']:8.1f} us  x fp8 {r['x_fp8_floor']:.3f}  "
                  f"/ bf16 {r['vs_bf16']:.3f}  ({r['variant']})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, tbs=a.tbs, args=vars(a), seconds=total,
                           skipped_for_budget=skipped, rows=lines), f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
