#!/usr/bin/env python
"""FP8 W8A8 at many rows (a prefill; a verify at B > 8): the two XLA forms side by side (issue 57).

- fp8 dots: `gpu_w8a8.matmul_xla`, one batched fp8 dot over the K blocks, float32 partials [Kb, rows, N];
- dequantized, one dot: `gpu_w8a8.matmul_dequant`, both quantized operands dequantized to x's dtype;
- bf16 x @ w: the unquantized dot, for scale.

Prints wall ms on this machine's default backend (best of --reps) and, with --tpu, the TPU compiler's "bytes
accessed" for each form compiled ahead of time for the named topologies (no TPU needed: libtpu's compiler).

    python scripts/bench_w8a8_rows.py                         # qkv and down of Qwen3-8B at 512 rows, + v5e/v6e bytes
    python scripts/bench_w8a8_rows.py --rows 256,1024 --tpu ""  # timing only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
          "tiny": (256, 384)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,down", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default="512", help="comma list of row counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tpu", default="v5e:2x2,v6e:2x2", help="TPU topologies to compile for ('' for none)")
    args = ap.parse_args(argv)
    try:
        shapes = [(n, SHAPES[n]) for n in args.shapes.split(",") if n]
        rows = [int(r) for r in args.rows.split(",") if r]
    except (KeyError, ValueError) as e:
        ap.error(f"--shapes / --rows: {e}")
    if not shapes or not rows or min(rows) < 1:
        ap.error("--shapes and --rows need at least one entry each, rows >= 1")
    topos = [t for t in args.tpu.split(",") if t]

    import jax
    import jax.numpy as jnp
    from pallas_kernels.quantized import gpu_w8a8 as w8

    print(f"# {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, bf16 x, block 128 x 128")
    print("| shape | rows | form | ms | " + " | ".join(f"{t} MB" for t in topos) + (" |" if topos else ""))
    print("|---|---|---|---|" + "---|" * len(topos))
    forms = (("fp8 dots (matmul_xla)", w8.matmul_xla), ("dequantized, one dot (matmul_dequant)", w8.matmul_dequant),
             ("bf16 x @ w", None))
    for name, (K, N) in shapes:
        q = (jax.random.normal(jax.random.key(0), (N, K)) * 60).astype(jnp.float8_e4m3fn)
        s = jnp.exp2(jax.random.uniform(jax.random.key(1), (N // 128, K // 128), minval=-8, maxval=-4))
        for M in rows:
            x = jax.random.normal(jax.random.key(2), (M, K), jnp.bfloat16)
            for form, f in forms:
                if f is None:
                    g, a = jax.jit(lambda x, w: x @ w), (x, jnp.asarray(q.T, jnp.bfloat16))
                else:
                    g, a = jax.jit(lambda x, q, s, f=f: f(x, q, s, (128, 128), "nk")), (x, q, s)
                g(*a).block_until_ready()
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    g(*a).block_until_ready()
                    best = min(best, time.perf_counter() - t0)
                cells = [f"{_tpu_bytes(g, a, t) / 1e6:.0f}" for t in topos]
                print(f"| {name} {K}x{N} | {M} | {form} | {best * 1e3:.2f} | " + " | ".join(cells)
                      + (" |" if cells else ""), flush=True)
    return 0


def _tpu_bytes(g, args, topology: str) -> float:
    import jax
    from jax.experimental import topologies
    dev = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    one = jax.sharding.SingleDeviceSharding(dev)
    c = g.trace(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in args]).lower().compile()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return float(ca.get("bytes accessed", float("nan")))


if __name__ == "__main__":
    sys.exit(main())
