#!/usr/bin/env python
"""TPU projections of the Qwen3-8B DFlash loop on a 4-chip mesh, from the real TPU compiler on a
CPU-only machine (no TPU used or needed).

    python scripts/tpu_sharded_projection.py                       # v5e:2x2 TP=4, v6e:2x2 TP=4 and DP=4
    python scripts/tpu_sharded_projection.py --smoke               # tiny shapes, ~1 min
    python scripts/tpu_sharded_projection.py --batches 1,8 --json out.json

One loop iteration (dflash_jax.decode.lower_iteration(mesh=...): draft + verify + accept +
commit, the loop state donated as inside the while_loop) is compiled for the 4 devices of a TPU
topology with the weights laid out as sharding.shard_model places them (fused TP layout) and rows
on 'data'. Per configuration it reports, per chip (the compiled SPMD program is one chip's):
  * memory_analysis: arguments (weights + loop state), temporaries; whether it fits the chip's HBM,
    and the largest KV capacity (context) that fits at batch 1 / 8 / 32, from the compiled point
    plus the analytic KV bytes per token per chip (linear in B·C);
  * cost_analysis: bytes accessed per iteration and the projected ms at HBM bandwidth
    (v5e 0.82 TB/s, v6e 1.64 TB/s);
  * the collectives in the compiled HLO: count and result bytes per iteration, by kind (the target
    is two all-reduces of [B, S, H] per layer plus one per embedding lookup; no weight all-gather).
PROJECTIONS FROM THE COMPILER'S ACCOUNTING, NOT MEASUREMENTS; collectives' time over ICI is not in
the ms column (it is small at decode sizes: [B, 16, 4096] bf16 = 128 KB per all-reduce at B=1).
Each chip kind runs in its own child process (libtpu reads TPU_ACCELERATOR_TYPE when it loads).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHIPS = {
    "v5e": dict(topology="v5e:2x2", accel="v5litepod-4", hbm=16e9, bw=0.82e12),
    "v6e": dict(topology="v6e:2x2", accel="v6e-4", hbm=32e9, bw=1.64e12),
}
# (chip, mesh spec): TP=4 on both; DP=4 (the model replicated on each chip) where it can fit
CONFIGS = [("v5e", "data=1,model=4"), ("v6e", "data=1,model=4"), ("v6e", "data=4,model=1")]
_SIZES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "s8": 1, "u8": 1}


def collectives(hlo: str) -> dict:
    """{kind: [count, result bytes]} of the collectives in compiled HLO text (per chip)."""
    out: dict = {}
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                      r"(-start)?\(", line)
        if not m:
            continue
        b = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = 1
            for x in filter(None, dims.split(",")):
                n *= int(x)
            b += n * _SIZES.get(dt, 4)
        c = out.setdefault(m.group(2), [0, 0])
        c[0] += 1
        c[1] += b
    return out


def configs(smoke: bool):
    from dflash_jax import DraftConfig, TargetConfig
    if smoke:
        tc = TargetConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                          num_kv_heads=4, head_dim=128, rope_theta=1e6)
        return tc, DraftConfig.for_target(tc, num_layers=2, block_size=16, mask_token_id=1023)
    tc = TargetConfig.preset("qwen3-8b")
    return tc, DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=151669,
                                      target_layer_ids=(1, 9, 17, 25, 33))


def child(chip: str, meshes: list[str], batches: list[int], capacity: int, smoke: bool, attention: str, out: str):
    import jax
    from jax.experimental import topologies
    from dflash_jax import decode, sharding
    spec = CHIPS[chip]
    topo = topologies.get_topology_desc(platform="tpu", topology_name=spec["topology"])
    tc, dc = configs(smoke)
    res = []
    for m in meshes:
        mesh = sharding.make_mesh(m, devices=topo.devices)
        dp, tp = sharding.parse_mesh(m)
        hkv_t = max(tc.num_kv_heads, tp) // tp if tp > 1 else tc.num_kv_heads
        hkv_d = max(dc.num_kv_heads, tp) // tp if tp > 1 else dc.num_kv_heads
        kv_tok = 2 * 2 * (tc.num_layers * hkv_t + dc.num_layers * hkv_d) * tc.head_dim   # bf16 K+V, per chip
        for B in batches:
            B = -(-B // dp) * dp          # generate pads the batch to a multiple of the data axis
            pt = dict(chip=chip, mesh=m, batch=B, capacity=capacity, kv_bytes_per_token_per_chip=kv_tok)
            t0 = time.perf_counter()
            try:
                low = decode.lower_iteration(tc, dc, batch=B, prompt_len=min(512, capacity // 2), capacity=capacity,
                                             dtype="bfloat16", attention_impl=attention, mesh=mesh)
                comp = low.compile()
                ma = comp.memory_analysis()
                for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                          "temp_size_in_bytes"):
                    pt[k] = int(getattr(ma, k, 0) or 0)
                pt["total_bytes"] = (pt["argument_size_in_bytes"] + pt["output_size_in_bytes"]
                                     - pt["alias_size_in_bytes"] + pt["temp_size_in_bytes"])
                ca = comp.cost_analysis()
                ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else ca
                pt["bytes_accessed"] = float(ca.get("bytes accessed", float("nan")))
                pt["ms_at_hbm_bw"] = pt["bytes_accessed"] / spec["bw"] * 1e3
                pt["collectives"] = collectives(comp.as_text())
                # per-chip KV of the loop state at this point; the rest is fixed (weights, buffers) or
                # temporaries, which grow little with C
                kv_now = B // dp * capacity * kv_tok
                fixed = pt["total_bytes"] - kv_now
                pt["fits"] = pt["total_bytes"] <= spec["hbm"]
                pt["max_context"] = {b: max(0, int((spec["hbm"] - fixed) / (max(1, b // dp) * kv_tok)))
                                     for b in (1, 8, 32)}
            except Exception as e:   # noqa: BLE001 (a point that does not compile is reported, not fatal)
                msg = f"{type(e).__name__}: {e}"
                pt["error"] = msg[:2000]
                pt["oom"] = any(s in msg for s in ("RESOURCE_EXHAUSTED", "out of memory", "Ran out of memory"))
            pt["compile_s"] = time.perf_counter() - t0
            print(f"[{chip} {m} B={B}] {pt.get('error', '')[:300] or 'ok'} ({pt['compile_s']:.0f} s)",
                  file=sys.stderr, flush=True)
            res.append(pt)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)


def table(points) -> str:
    rows = ["| chip | mesh | B | C | per-chip memory (GB: args + temp) | fits | max context B=1 / 8 / 32 | "
            "bytes / iteration (GB) | projected ms | collectives per iteration (count, MB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        head = f"| {p['chip']} | {p['mesh']} | {p['batch']} | {p['capacity']} |"
        if "error" in p:
            rows.append(head + f" {'out of memory' if p.get('oom') else 'failed: ' + p['error'][:80]} | no | | | | |")
            continue
        mem = f"{p['total_bytes'] / 1e9:.2f} ({p['argument_size_in_bytes'] / 1e9:.2f} + {p['temp_size_in_bytes'] / 1e9:.2f})"
        ctx = " / ".join(f"{v // 1000}k" if v >= 1000 else str(v) for v in p["max_context"].values())
        col = ", ".join(f"{k} {n} ({b / 1e6:.2f})" for k, (n, b) in sorted(p["collectives"].items())) or "none"
        rows.append(head + f" {mem} | {'yes' if p['fits'] else 'no'} | {ctx} | {p['bytes_accessed'] / 1e9:.2f} | "
                    f"{p['ms_at_hbm_bw']:.2f} | {col} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model shapes")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--capacity", type=int, default=4096, help="KV capacity of the compiled points")
    ap.add_argument("--attention", default="pallas_tpu", help="attention backend (pallas_tpu or xla)")
    ap.add_argument("--json", help="write the points here")
    ap.add_argument("--_child")
    ap.add_argument("--_meshes")
    ap.add_argument("--_out")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if a._child:
        return child(a._child, a._meshes.split(";"), batches, a.capacity, a.smoke, a.attention, a._out)
    procs = []
    for chip in dict.fromkeys(c for c, _ in CONFIGS):
        fd, path = tempfile.mkstemp(suffix=f"_{chip}.json")
        os.close(fd)
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost",
                   TPU_ACCELERATOR_TYPE=CHIPS[chip]["accel"], TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                   PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
        meshes = ";".join(m for c, m in CONFIGS if c == chip)
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", chip, "--_meshes", meshes, "--_out", path,
               "--batches", a.batches, "--capacity", str(a.capacity), "--attention", a.attention] + \
              (["--smoke"] if a.smoke else [])
        procs.append((subprocess.Popen(cmd, env=env), path))
    points = []
    for proc, path in procs:
        proc.wait()
        try:
            with open(path) as f:
                points += json.load(f)
        except (OSError, ValueError):
            print(f"a child wrote no results ({path})", file=sys.stderr)
    print(table(points))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(points, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
