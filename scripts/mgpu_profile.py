#!/usr/bin/env python
"""Where the Mosaic GPU attention kernel's time goes: its in-kernel trace, summarised per region.

    python scripts/mgpu_profile.py                       # GPU (Hopper+, jax >= 0.11)
    python scripts/mgpu_profile.py --cases 1:32768,8:8192 --variants "kv_splits=16;block_k=128,stages=2"

`pallas_kernels/gpu_mosaic.py` names the regions of each compute warpgroup's tile loop (wait_k: the
K tile's TMA barrier, qk: the QK wgmma, softmax, wait_v, pv: the PV wgmma). With `profile_dir` set,
Mosaic GPU records a timestamp at every region's entry and exit on every warpgroup of every program
and writes one Chrome-trace JSON per kernel run. This script runs one verify-pattern call per case
(Qwen3-8B heads: 32 q / 8 kv, D 128, S 16, bf16) and prints, per variant: the kernel's span (first
event to last), the programs' own spans, the tiles a compute warpgroup handles, and the mean time per
tile in each region, so a stall (waiting on loads) tells apart from compute (softmax, wgmma). The
trace costs ~12 cycles an event; spans are a little longer than the unprofiled kernel.

Call 23 used this on the H200 (BENCHMARKS.md, benchmarks/results/call23_*).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import gpu_mosaic  # noqa: E402
from pallas_kernels.gpu import parse_settings  # noqa: E402

REGIONS = ("wait_k", "qk", "softmax", "wait_v", "pv")


def summarise(trace_file: str) -> dict:
    """Per-region mean µs per tile over the compute warpgroups, spans, tiles per warpgroup."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    by_wg = collections.defaultdict(list)
    for e in events:
        by_wg[(e["pid"], e["tid"])].append(e)
    region_time = collections.defaultdict(float)
    region_count = collections.Counter()
    tiles, spans, t_min, t_max = [], [], float("inf"), float("-inf")
    for evs in by_wg.values():
        stack = []
        n_qk = 0
        for e in evs:
            t_min, t_max = min(t_min, e["ts"]), max(t_max, e["ts"])
            if e["ph"] == "B":
                stack.append(e)
            elif stack:
                b = stack.pop()
                if b["name"] in REGIONS:
                    region_time[b["name"]] += e["ts"] - b["ts"]
                    region_count[b["name"]] += 1
                    n_qk += b["name"] == "qk"
        if n_qk:
            tiles.append(n_qk)
            spans.append(evs[-1]["ts"] - evs[0]["ts"])
    per_tile = {r: region_time[r] / max(1, region_count[r]) for r in REGIONS}
    return dict(kernel_span_us=t_max - t_min, compute_wgs=len(tiles),
                tiles_per_wg=statistics.mean(tiles) if tiles else 0.0,
                wg_span_us=statistics.median(spans) if spans else 0.0, per_tile_us=per_tile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1:32768,8:8192,1:8192", help="B:ctx,... (verify pattern)")
    ap.add_argument("--variants", default="", help="';'-separated tuning dicts, e.g. 'kv_splits=16;stages=2'")
    args = ap.parse_args()
    Hq, Hkv, D, S = 32, 8, 128, 16
    variants = [parse_settings(v, what="--variants") for v in args.variants.split(";")] if args.variants else [{}]
    print(f"# mgpu_profile on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    print(f"{'case':12s} {'variant':42s} {'kernel us':>9s} {'wg span':>8s} {'tiles/wg':>8s} "
          + " ".join(f"{r:>8s}" for r in REGIONS) + "   (us per tile)", flush=True)
    for case in args.cases.split(","):
        B, ctx = (int(x) for x in case.split(":"))
        C = -(-(ctx + S) // 128) * 128
        ks = jax.random.split(jax.random.key(ctx + B), 3)
        q = jax.random.normal(ks[0], (B, S, Hq, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, Hkv, C, D), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, Hkv, C, D), jnp.bfloat16)
        e = jnp.broadcast_to(ctx + jnp.arange(1, S + 1, dtype=jnp.int32)[None], (B, S))
        for var in variants:
            cfg = dict(gpu_mosaic.default_config(S, Hq // Hkv, C, D, B, Hkv), **var)
            d = tempfile.mkdtemp(prefix="mgpu_prof_")
            try:
                f = jax.jit(lambda q, k, v, e, cfg=cfg, d=d: gpu_mosaic.block_attention(
                    q, k, v, e, profile_dir=d, **cfg))
                for _ in range(2):      # the second run's trace: clocks up, code loaded
                    jax.block_until_ready(f(q, k, v, e))
                files = sorted(glob.glob(os.path.join(d, "*.json")))
                res = summarise(files[-1])
            except Exception as ex:  # noqa: BLE001 - report and go on
                print(f"{case:12s} {str(cfg)[:42]:42s} failed: {type(ex).__name__}: "
                      f"{str(ex).splitlines()[0][:200] if str(ex) else ''}", flush=True)
                continue
            name = ",".join(f"{a}={b}" for a, b in cfg.items() if a != "min_chunk")
            print(f"{case:12s} {name:42s} {res['kernel_span_us']:9.1f} {res['wg_span_us']:8.1f} "
                  f"{res['tiles_per_wg']:8.1f} " + " ".join(f"{res['per_tile_us'][r]:8.3f}" for r in REGIONS),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
