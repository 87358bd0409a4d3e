#!/usr/bin/env python
"""Qwen3-Coder-30B-A3B + its z-lab draft compiled ahead of time for TPU meshes, on this CPU host:
per-chip memory (does it fit?) and HBM bytes of one iteration per chip against the touched-expert
floor (issue 36).

    python scripts/tpu_moe_aot.py                          # v5e-8 and v6e-4, DFlash iteration + plain step
    python scripts/tpu_moe_aot.py --chips v6e-4 --programs plain --layers 2,3 --draft-layers 1   # small
    python scripts/tpu_moe_aot.py --json out.json

Each program is one loop iteration (dflash_jax.decode.lower_iteration: the Mosaic attention kernel,
the Pallas TPU grouped matmul `moe_gmm="pallas_tpu"`) on a ('data', 'model') = (1, chips) mesh of
the topology: the experts split over 'model' (expert parallelism, E / chips per chip), attention
tensor parallel. Compiling the 48 unrolled layers takes minutes per program on a 2-core host, so
each program is compiled at two depths (--layers, default 5 and 6: the same 8-layer draft over taps
0..4 in both) and every figure is extrapolated linearly to 48 layers (all Coder layers are the same
MoE layer; a figure's per-layer part is the difference of the two compiles).

Figures per chip:
  memory     the compiler's argument + output - alias + temp bytes (weights, caches, loop state,
             scratch), against the chip's HBM (v5e 16 GiB, v6e 32 GiB).
  compiled   HBM traffic of the compiled iteration by scripts/tpu_bytes.py's breakdown (Pallas
             kernels by their BlockSpecs). The grouped matmul's grid is static: it counts every
             local expert (the schedule's worst case), while at run time the kernel copies only the
             experts some row chose.
  expected   compiled with the grouped matmul's weight bytes replaced by the experts a chip is
             expected to touch: E (1 - (1 - k/E)^T) / chips per layer for T routed tokens (B for a
             plain step, B x 16 for a DFlash verify; independent uniform routing, an upper estimate).
  floor      the chip's 1/tp of the attention weights and LM head (twice with a draft), its share
             of the draft, its KV rows, and its touched experts (as `expected`) once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# chip → (topology, HBM bytes per chip, TPU_ACCELERATOR_TYPE)
CHIPS = {"v5e-8": ("v5e:2x4", 16 * 2 ** 30, "v5litepod-8"), "v6e-4": ("v6e:2x2", 32 * 2 ** 30, "v6e-4")}
PROGRAMS = ("dflash", "plain")
FULL_LAYERS = 48


def log(*a):
    print(*a, flush=True)


def _tpu_bytes():
    spec = importlib.util.spec_from_file_location("tpu_bytes", os.path.join(REPO, "scripts", "tpu_bytes.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tpu_bytes", mod)
    spec.loader.exec_module(mod)
    return mod


def expected_distinct(E: int, k: int, T: int) -> float:
    return E * (1 - (1 - k / E) ** T)


def configs(layers: int, draft_layers: int, preset: str):
    from dflash_jax import DraftConfig, TargetConfig
    tc = dataclasses.replace(TargetConfig.preset(preset), num_layers=layers)
    taps = tuple(range(min(5, layers)))        # the same 5-tap draft at every depth (z-lab: [1, 12, 23, 34, 45])
    dc = DraftConfig.for_target(tc, num_layers=draft_layers, block_size=16, mask_token_id=151669,
                                target_layer_ids=taps)
    return tc, dc


def compile_one(chip: str, program: str, layers: int, args, tb) -> dict:
    """One compile: its memory, its HBM breakdown, the grouped matmul's share."""
    from jax.experimental import topologies
    from dflash_jax import decode, sharding
    from dflash_jax.kernel_config import KernelConfig
    topo, _, _ = CHIPS[chip]
    devs = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices
    tc, dc = configs(layers, args.draft_layers, args.preset)
    mesh = sharding.make_mesh(f"data=1,model={len(devs)}", devices=devs)
    kernels = KernelConfig(attention="pallas_tpu", moe_gmm="pallas_tpu")
    t = time.perf_counter()
    comp = decode.lower_iteration(tc, dc if program == "dflash" else None, batch=args.batch, prompt_len=512,
                                  capacity=args.capacity, kernels=kernels, mesh=mesh).compile()
    took = time.perf_counter() - t
    ma = comp.memory_analysis()
    s = tb.breakdown(comp)
    gmm = sum(r["hbm"] for r in s["records"] if "dflash_gmm_tpu" in (r["what"] + r["name"]))
    n_gmm = sum(1 for r in s["records"] if "dflash_gmm_tpu" in (r["what"] + r["name"]))
    out = dict(layers=layers, compile_s=took, argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
               alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes, hbm=s["hbm_total"], gmm_hbm=gmm,
               gmm_calls=n_gmm, compiler_bytes=s.get("compiler_bytes_accessed"),
               collectives=tb.collective_bytes(comp.as_text()))
    out["memory"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    log(f"  {chip} {program:6} {layers} layers: compiled in {took:.0f}s; memory {out['memory'] / 1e9:.3f} GB, "
        f"HBM {out['hbm'] / 1e9:.3f} GB of which grouped matmul {gmm / 1e9:.3f} GB ({n_gmm} calls)")
    return out


def extrapolate(a: dict, b: dict, L: int) -> dict:
    """Each figure at L layers from compiles at a['layers'] < b['layers'] (linear in depth)."""
    out = {}
    for k, v in a.items():
        if isinstance(v, (int, float)) and k not in ("layers", "compile_s") and v is not None and b[k] is not None:
            per = (b[k] - v) / (b["layers"] - a["layers"])
            out[k] = v + (L - a["layers"]) * per
    out["layers"] = L
    return out


def floors(chip: str, program: str, args, tb, fig: dict) -> dict:
    from dflash_jax import TargetConfig
    tc, dc = configs(FULL_LAYERS, args.draft_layers, args.preset)
    _, hbm_cap, _ = CHIPS[chip]
    tp = int(chip.split("-")[1])
    E, k = tc.num_experts, tc.num_experts_per_tok
    T = args.batch * (16 if program == "dflash" else 1)
    touched = expected_distinct(E, k, T) / tp                       # per chip per layer
    expert = 3 * tc.hidden_size * tc.moe_intermediate_size * 2
    sparse = sum(tc.is_sparse(i) for i in range(tc.num_layers))
    experts_read = touched * expert * sparse
    local_all = E // tp * expert * sparse
    # attention, norms, LM head, KV and draft per chip (the dense MLP term off: every layer is MoE)
    dense_tc = dataclasses.replace(tc, intermediate_size=0)
    assert isinstance(dense_tc, TargetConfig)
    ideal = tb.ideal_per_chip(dense_tc, dc, draft=program == "dflash", batch=args.batch, capacity=args.capacity,
                              dp=1, tp=tp, collectives=int(fig["collectives"]))
    router = tc.num_layers * tc.hidden_size * E * 2                 # replicated: every chip routes
    floor = ideal["total"] + router + experts_read
    # the gmm kernel's static grid counts its local experts (plus a row tile per step); swap in touched
    expected = fig["hbm"] - fig["gmm_hbm"] + experts_read + max(0.0, fig["gmm_hbm"] - local_all)
    return dict(tokens=T, experts_touched_per_chip_layer=touched, experts_local=E // tp,
                floor=floor, expected=expected, expected_x_floor=expected / floor,
                compiled_x_floor=fig["hbm"] / floor, fits=fig["memory"] <= hbm_cap, hbm_capacity=hbm_cap)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", default="v5e-8,v6e-4")
    ap.add_argument("--programs", default="dflash,plain")
    ap.add_argument("--preset", default="qwen3-coder-30b-a3b")
    ap.add_argument("--layers", default="5,6", help="the two depths compiled (extrapolated to 48)")
    ap.add_argument("--draft-layers", type=int, default=8, help="the z-lab Coder draft has 8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chips = [c for c in args.chips.split(",") if c]
    programs = [p for p in args.programs.split(",") if p]
    try:
        depths = sorted(int(x) for x in args.layers.split(","))
    except ValueError:
        ap.error(f"--layers: two comma-separated depths, got {args.layers!r}")
    if len(depths) != 2 or depths[0] == depths[1] or depths[0] < 1:
        ap.error(f"--layers: two different depths >= 1, got {args.layers!r}")
    if set(chips) - set(CHIPS) or set(programs) - set(PROGRAMS):
        ap.error(f"--chips from {sorted(CHIPS)}, --programs from {PROGRAMS}")
    for k, v in dict(JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost", TPU_ACCELERATOR_TYPE=CHIPS[chips[0]][2],
                     TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1").items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, REPO)
    tb = _tpu_bytes()
    results = []
    for chip in chips:
        for program in programs:
            a, b = (compile_one(chip, program, L, args, tb) for L in depths)
            full = extrapolate(a, b, FULL_LAYERS)
            f = floors(chip, program, args, tb, full)
            results.append(dict(chip=chip, program=program, batch=args.batch, compiled=[a, b], full=full, **f))
    G = 1e9
    log(f"\n### Qwen3-Coder-30B-A3B + 8-layer draft, one iteration per chip, B={args.batch}, capacity "
        f"{args.capacity} (compiled at {depths[0]} and {depths[1]} layers, extrapolated to {FULL_LAYERS})")
    log("| chip (mesh) | program | memory GB (fits?) | compiled HBM GB (static gmm grid) | expected GB "
        "| touched-expert floor GB | expected / floor | experts per chip-layer touched / local |")
    log("|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["full"]
        log(f"| {r['chip']} (1x{r['chip'].split('-')[1]}) | {r['program']} | {m['memory'] / G:.2f} of "
            f"{r['hbm_capacity'] / 2 ** 30:.0f} GiB ({'yes' if r['fits'] else 'NO'}) | {m['hbm'] / G:.3f} "
            f"| {r['expected'] / G:.3f} | {r['floor'] / G:.3f} | {r['expected_x_floor']:.3f}x "
            f"| {r['experts_touched_per_chip_layer']:.1f} / {r['experts_local']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
