"""The slot engine's paged step against its dense step, compiled ahead of time for one TPU chip on
this CPU host (issue 56: "the paged step compiles, HBM bytes <= 1.10x what it must read").

Both programs are `decode.lower_slot_step` (Qwen3-8B target + its 5-layer DFlash draft, block 16,
greedy, K iterations over every slot, Pallas TPU attention: the paged one reads K/V through the page
table with pallas_kernels.block_attention_paged), same rows, capacity and K. "Must read" is what a
step cannot avoid: K x (the weights as stored, target and draft, + every row's K/V over the table's
pages, target and draft layers) -- the attention reads whole tables here (a compiled program does not
know the rows' lengths). Two byte counts: "HBM", scripts/tpu_bytes.py's per-op charging of the compiled
program (the traffic to and from HBM: operands the compiler placed in VMEM cost nothing, Pallas kernels
what their BlockSpecs move; the slot step's cond charged as its iterations branch), the issue's measure;
and the compiler's own `bytes accessed`, a cost model that charges every weight it prefetches into VMEM
about four times (docs/tpu-bytes.md, item 1), printed beside it with the temporaries.

    python scripts/tpu_paged_step.py                        # v6e bf16 and v5e int8 (~1 min on 2 cores)
    python scripts/tpu_paged_step.py --layers 4 --draft-layers 1   # small, quick
    python scripts/tpu_paged_step.py --top 20               # + tpu_bytes' per-kind, per-group and top-op tables
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

# (topology, weights, rows, capacity): Qwen3-8B bf16 + draft does not fit a v5e chip's 16 GB; int8 does
CASES = {"v6e": ("v6e:2x2", None, 8, 4096), "v5e": ("v5e:2x2", "int8", 4, 2048)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default="v6e,v5e")
    ap.add_argument("--layers", type=int, default=None, help="target layers (default: Qwen3-8B's 36)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="iterations per step (K)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=0, help="print tpu_bytes' breakdown of each program, this many top ops")
    ap.add_argument("--save-hlo", default=None, help="a folder: each compiled program's as_text() (tpu_bytes.py --hlo)")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tpu_bytes
    from jax.experimental import topologies

    from dflash_jax import KernelConfig
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.decode import lower_slot_step

    cfg = TargetConfig.preset("qwen3-8b")
    if a.layers:
        cfg = dataclasses.replace(cfg, num_layers=a.layers)
    dcfg = DraftConfig.for_target(cfg, num_layers=a.draft_layers, block_size=16)
    print(f"Qwen3-8B shapes ({cfg.num_layers} layers) + DFlash draft ({a.draft_layers} layers, block 16), greedy, "
          f"K = {a.steps}, pages of {a.page_size}; bytes from the TPU compiler (ahead of time, this CPU host)")
    print("| chip | weights | rows x capacity | program | compile s | must read GB | HBM GB | HBM x must read "
          "| compiler bytes accessed GB | compiler x must read | temp GB | paged / dense HBM | paged / dense compiler |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for chip in a.chips.split(","):
        topo, quant, rows, cap = CASES[chip]
        dev = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
        kw = dict(slots=rows, capacity=cap, steps=a.steps, dtype="bfloat16", device=dev,
                  kernels=KernelConfig(attention="pallas_tpu"), quantize=quant)
        got = {}
        for name, extra in (("dense", {}), ("paged", dict(page_size=a.page_size))):
            t0 = time.perf_counter()
            lowered = lower_slot_step(cfg, dcfg, **kw, **extra)
            compiled = lowered.compile()
            secs = time.perf_counter() - t0
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, (list, tuple)) else ca
            ma = compiled.memory_analysis()
            args = lowered.args_info[0]
            weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves((args[0], args[1])))
            kv = _kv_bytes(cfg, dcfg, rows, cap)
            must = a.steps * (weights + kv)
            text = compiled.as_text()
            if a.save_hlo:
                os.makedirs(a.save_hlo, exist_ok=True)
                with open(os.path.join(a.save_hlo, f"{chip}_{name}.hlo"), "w") as f:
                    f.write(text)
            bd = tpu_bytes.breakdown(text)
            got[name] = (bd["hbm_total"], float(ca.get("bytes accessed", 0.0)))
            hbm, comp = got[name]
            ratio = "| | |" if name == "dense" else (f"| {hbm / got['dense'][0]:.3f} | "
                                                   f"{comp / got['dense'][1]:.3f} |")
            print(f"| {chip} | {quant or 'bf16'} | {rows} x {cap} | {name} | {secs:.0f} | {must / 1e9:.2f} | "
                  f"{hbm / 1e9:.2f} | {hbm / must:.3f} | {comp / 1e9:.2f} | {comp / must:.3f} | "
                  f"{ma.temp_size_in_bytes / 1e9:.2f} {ratio}", flush=True)
            if a.top:
                bd["compiler_bytes_accessed"] = comp
                tpu_bytes.print_report(bd, a.top, must)
    return 0


def _kv_bytes(cfg, dcfg, rows: int, capacity: int) -> int:
    """K and V (bf16) over every row's capacity: the target's layers and the draft's."""
    per_pos = 2 * 2 * (cfg.num_layers * cfg.num_kv_heads * cfg.head_dim + dcfg.num_layers * dcfg.num_kv_heads * dcfg.head_dim)
    return rows * capacity * per_pos


if __name__ == "__main__":
    raise SystemExit(main())
