#!/usr/bin/env python
"""Qwen3-Coder-30B-A3B + its z-lab draft compiled ahead of time for TPU meshes, on this CPU host:
per-chip memory (does it fit?) and HBM bytes of one iteration per chip against the touched-expert
floor (issue 36).

    python scripts/tpu_moe_aot.py                          # v5e-8 and v6e-4, DFlash iteration + plain step
    python scripts/tpu_moe_aot.py --chips v6e-4 --programs plain --layers 2,3 --draft-layers 1   # small
    python scripts/tpu_moe_aot.py --json out.json
    python scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash --quantize none,int8   # bf16 vs int8
    python scripts/tpu_moe_aot.py --layer --layer-chip v5e-4    # one MoE layer: bf16 / int8 / fp8, kernel / XLA
    python scripts/tpu_moe_aot.py --chips v5e-4,v6e-1 --programs dflash --quantize fp8   # Qwen3-Coder-30B-A3B-FP8

--quantize int8 compiles the target as load_target(..., quantize="int8") holds it (dflash_jax.quantize:
the layers' linears and the stacked experts int8 with float32 per-output-column scales; embeddings,
LM head, router and the draft as loaded). On a mesh the int8 matrices are placed as sharding._place
places them (each scale with its weight's columns: experts by expert over 'model'). A one-chip
"mesh" (v6e-1) is one device, no mesh. --quantize fp8 compiles the target as load_target holds an FP8
checkpoint (Qwen3-Coder-30B-A3B-Instruct-FP8: the layers' linears and the experts float8_e4m3fn with
float32 scales per 128 x 128 block, on a mesh each scale grid on its weight's spec; embeddings, LM
head, router and the draft as loaded). --moe-gmm picks the grouped matmul (pallas_tpu: the kernel,
int8 / fp8 experts read as 8 bits where it takes them; xla: ragged_dot on the converted experts).

Each program is one loop iteration (dflash_jax.decode.lower_iteration: the Mosaic attention kernel,
the Pallas TPU grouped matmul `moe_gmm="pallas_tpu"`) on a ('data', 'model') = (1, chips) mesh of
the topology: the experts split over 'model' (expert parallelism, E / chips per chip), attention
tensor parallel. Compiling the 48 unrolled layers takes minutes per program on a 2-core host, so
each program is compiled at two depths (--layers, default 5 and 6: the same 8-layer draft over taps
0..4 in both) and every figure is extrapolated linearly to 48 layers (all Coder layers are the same
MoE layer; a figure's per-layer part is the difference of the two compiles).

Figures per chip:
  memory     the compiler's argument + output - alias + temp bytes (weights, caches, loop state,
             scratch), against the HBM a program may use (v5e 15.75 of 16 GiB, v6e 31.25 of 32);
             "free" is the rest, room for more KV.
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
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# chip → (topology, HBM bytes per chip a program may use, TPU_ACCELERATOR_TYPE). The usable HBM is what
# the compiler reports when it refuses a program ("exceeds available HBM"): 15.75 GiB of v5e's 16 and
# 31.25 GiB of v6e's 32 (docs/perf-log.md, 'int8 weight-only targets' and 'Coder-30B-A3B int8 per chip').
V5E_HBM, V6E_HBM = int(15.75 * 2 ** 30), int(31.25 * 2 ** 30)
CHIPS = {"v5e-8": ("v5e:2x4", V5E_HBM, "v5litepod-8"), "v6e-4": ("v6e:2x2", V6E_HBM, "v6e-4"),
         "v5e-4": ("v5e:2x2", V5E_HBM, "v5litepod-4"),
         "v6e-1": ("v6e:2x2", V6E_HBM, "v6e-4")}      # (one chip: the topology's first device)
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


def chips_of(chip: str) -> int:
    return int(chip.split("-")[1])


FP8_BLOCK = (128, 128)        # Qwen3-Coder-30B-A3B-Instruct-FP8's weight_block_size


def fp8_weight(x, shape=None, sharding_=None, mesh=None, spec=None):
    """An FP8 checkpoint's weight as load_target holds it (quantize.Fp8BlockWeight, block 128 x 128):
    from a traced float `x` (one device: inside the model's eval_shape), or abstract with its
    NamedSharding on `mesh` (the block scales on q's spec, spread per row / column where a shard
    boundary cuts a block, as sharding._place_quantized does)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from dflash_jax.quantize import Fp8BlockWeight
    bk, bn = FP8_BLOCK
    if mesh is None:
        K, N = x.shape[-2:]
        return Fp8BlockWeight(x.astype(jnp.float8_e4m3fn),
                              jnp.ones(x.shape[:-2] + (-(-K // bk), -(-N // bn)), jnp.float32), FP8_BLOCK)
    full = tuple(spec) + (None,) * (len(shape) - len(spec))
    block = list(FP8_BLOCK)
    for ax in (-2, -1):
        if full[ax] is not None:
            axes = (full[ax],) if isinstance(full[ax], str) else full[ax]
            n = math.prod(mesh.shape[a] for a in axes)
            if (shape[ax] // n) % block[ax]:
                block[ax] = 1
    sshape = shape[:-2] + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    return Fp8BlockWeight(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn, sharding=sharding_),
                          jax.ShapeDtypeStruct(sshape, jnp.float32, sharding=NamedSharding(mesh, P(*full))),
                          tuple(block))


def _fp8_params(model, make):
    """Every decoder-layer linear (2-D) and stacked expert matrix (3-D) of `model` replaced by
    make(value) (an FP8 checkpoint's layout: embeddings, LM head, norms and the router stay)."""
    from flax import nnx
    from dflash_jax.quantize import EXPERT_NAMES, LINEAR_NAMES, QUANTIZED, mark
    mark(model, "fp8")
    for _, node in nnx.iter_graph(model.layers):
        if not isinstance(node, nnx.Module):
            continue
        for name, ndim in [(n, 2) for n in LINEAR_NAMES] + [(n, 3) for n in EXPERT_NAMES]:
            p = getattr(node, name, None)
            if not isinstance(p, nnx.Param) or isinstance(p.get_value(), QUANTIZED):
                continue
            x = p.get_value()
            if x.ndim == ndim:
                p.set_value(make(x))
    return model


@contextlib.contextmanager
def fp8_target():
    """While open, decode's abstract target is an FP8 checkpoint's as load_target(<FP8 dir>) holds it
    (one device: quantize="fp8" to lower_iteration; on a mesh: placed as load_target(mesh=) places
    it, whatever quantize says). The draft stays as loaded."""
    import dflash_jax.quantize as qz
    from dflash_jax import sharding
    orig_q, orig_place = qz.quantize_target, sharding.abstract_on_mesh

    def quantize_target(model, quantize):
        return _fp8_params(model, fp8_weight) if quantize == "fp8" else orig_q(model, quantize)

    def place(model, mesh, **kw):
        out = orig_place(model, mesh, **kw)
        if not type(model).__module__.startswith("dflash_jax.models"):
            return out
        return _fp8_params(out, lambda x: fp8_weight(None, x.shape, x.sharding, mesh, x.sharding.spec))

    qz.quantize_target, sharding.abstract_on_mesh = quantize_target, place
    try:
        yield
    finally:
        qz.quantize_target, sharding.abstract_on_mesh = orig_q, orig_place


def expert_bytes(quantize: str | None, H: int, I: int) -> float:
    """One expert's HBM bytes (gate | up [H, 2I] and down [I, H]): bf16, int8 + a float32 scale per
    column, or float8 + a float32 scale per 128 x 128 block."""
    if quantize is None:
        return 3 * H * I * 2
    if quantize == "fp8":
        bk, bn = FP8_BLOCK
        return 3 * H * I + 4 * (-(-H // bk) * -(-2 * I // bn) + -(-I // bk) * -(-H // bn))
    return 3 * H * I + (2 * I + H) * 4


def lower(chip: str, program: str, layers: int, args, quantize: str | None, moe_gmm: str = "pallas_tpu"):
    """decode.lower_iteration of Coder at `layers` for the chip (a 1 x chips mesh, one device for
    v6e-1), the target's weights as `quantize` says (None: bf16)."""
    from jax.experimental import topologies
    from dflash_jax import decode, sharding
    from dflash_jax.kernel_config import KernelConfig
    topo, _, _ = CHIPS[chip]
    devs = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices
    tc, dc = configs(layers, args.draft_layers, args.preset)
    kernels = KernelConfig(attention="pallas_tpu", moe_gmm=moe_gmm)
    kw = dict(batch=args.batch, prompt_len=512, capacity=args.capacity, kernels=kernels)
    draft = dc if program == "dflash" else None
    if quantize == "fp8":
        with fp8_target():
            if chips_of(chip) == 1:
                return decode.lower_iteration(tc, draft, device=devs[0], quantize="fp8", **kw)
            mesh = sharding.make_mesh(f"data=1,model={chips_of(chip)}", devices=devs[:chips_of(chip)])
            return decode.lower_iteration(tc, draft, mesh=mesh, **kw)
    if chips_of(chip) == 1:
        return decode.lower_iteration(tc, draft, device=devs[0], quantize=quantize, **kw)
    mesh = sharding.make_mesh(f"data=1,model={chips_of(chip)}", devices=devs[:chips_of(chip)])
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize={quantize!r} on a mesh: int8 or fp8")
    return decode.lower_iteration(tc, draft, mesh=mesh, quantize=quantize, **kw)   # int8: placed as load_target(mesh=)


def compile_one(chip: str, program: str, layers: int, args, tb, quantize: str | None = None,
                moe_gmm: str = "pallas_tpu") -> dict:
    """One compile: its memory, its HBM breakdown, the grouped matmul's share."""
    t = time.perf_counter()
    comp = lower(chip, program, layers, args, quantize, moe_gmm).compile()
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
    q = quantize or "bf16"
    log(f"  {chip} {program:6} {q:5} {moe_gmm:10} {layers} layers: compiled in {took:.0f}s; memory {out['memory'] / 1e9:.3f} GB, "
        f"(args {out['argument'] / 1e9:.3f}, temp {out['temp'] / 1e9:.3f}), "
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


def floors(chip: str, program: str, args, tb, fig: dict, quantize: str | None = None) -> dict:
    from dflash_jax import TargetConfig
    tc, dc = configs(FULL_LAYERS, args.draft_layers, args.preset)
    _, hbm_cap, _ = CHIPS[chip]
    tp = chips_of(chip)
    E, k = tc.num_experts, tc.num_experts_per_tok
    T = args.batch * (16 if program == "dflash" else 1)
    touched = expected_distinct(E, k, T) / tp                       # per chip per layer
    H, I = tc.hidden_size, tc.moe_intermediate_size
    wb = 1 if quantize else 2
    expert = expert_bytes(quantize, H, I)                           # + the 8-bit weights' float32 scales
    sparse = sum(tc.is_sparse(i) for i in range(tc.num_layers))
    experts_read = touched * expert * sparse
    local_all = E // tp * expert * sparse
    # attention, norms, LM head, KV and draft per chip (the dense MLP term off: every layer is MoE)
    dense_tc = dataclasses.replace(tc, intermediate_size=0)
    assert isinstance(dense_tc, TargetConfig)
    ideal = tb.ideal_per_chip(dense_tc, dc, draft=program == "dflash", batch=args.batch, capacity=args.capacity,
                              dp=1, tp=tp, collectives=int(fig["collectives"]), weight_bytes=wb)
    router = tc.num_layers * tc.hidden_size * E * 2                 # replicated: every chip routes
    floor = ideal["total"] + router + experts_read
    if fig["gmm_calls"]:
        # the gmm kernel's static grid counts its local experts (plus a row tile per step); swap in touched
        expected = fig["hbm"] - fig["gmm_hbm"] + experts_read + max(0.0, fig["gmm_hbm"] - local_all)
    else:        # XLA's ragged_dot: what it reads is what the compiled program says
        expected = fig["hbm"]
    return dict(tokens=T, experts_touched_per_chip_layer=touched, experts_local=E // tp,
                floor=floor, expected=expected, expected_x_floor=expected / floor,
                compiled_x_floor=fig["hbm"] / floor, fits=fig["memory"] <= hbm_cap, hbm_capacity=hbm_cap,
                free_gib=(hbm_cap - fig["memory"]) / 2 ** 30)


def moe_layer(topology: str, tokens: int, quantize: str | None, moe_gmm: str, preset: str, tb) -> dict:
    """One Coder MoE block alone (router + all E experts, bf16 rows [1, tokens, H]) compiled for one
    chip of `topology`: its HBM bytes (scripts/tpu_bytes.py's breakdown), the grouped matmul's,
    memory, and the expected bytes with the kernel's static grid swapped for the touched experts."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies
    from dflash_jax import TargetConfig
    from dflash_jax.kernel_config import KernelConfig
    from dflash_jax.models.moe import MoE
    from dflash_jax.quantize import EXPERT_NAMES, quantize_int8
    tc = TargetConfig.preset(preset)
    make = {"int8": quantize_int8, "fp8": fp8_weight}.get(quantize)
    dev = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    H, I, E, k = tc.hidden_size, tc.moe_intermediate_size, tc.num_experts, tc.num_experts_per_tok

    def build():
        m = MoE(H, I, E, k, tc.norm_topk_prob, jnp.bfloat16, rngs=nnx.Rngs(0))
        if quantize:
            for name in EXPERT_NAMES:
                getattr(m, name).set_value(make(getattr(m, name).get_value()))
        return m

    gdef, state = nnx.split(nnx.eval_shape(build))
    one = jax.sharding.SingleDeviceSharding(dev)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)
    h = jax.ShapeDtypeStruct((1, tokens, H), jnp.bfloat16, sharding=one)
    kernels = KernelConfig(attention="pallas_tpu", moe_gmm=moe_gmm).resolve("tpu")
    comp = jax.jit(lambda st, h: nnx.merge(gdef, st)(h, kernels=kernels)).trace(state, h).lower().compile()
    s = tb.breakdown(comp)
    gmm = sum(r["hbm"] for r in s["records"] if "dflash_gmm_tpu" in (r["what"] + r["name"]))
    expert = expert_bytes(quantize, H, I)
    touched = expected_distinct(E, k, tokens)
    expected = s["hbm_total"] - gmm + touched * expert + max(0.0, gmm - E * expert) if gmm else s["hbm_total"]
    ma = comp.memory_analysis()
    return dict(tokens=tokens, rows=tokens * k, quantize=quantize or "bf16", moe_gmm=moe_gmm, hbm=s["hbm_total"],
                gmm_hbm=gmm, expected=expected, touched=touched, all_experts=E * expert,
                touched_experts=touched * expert, argument=ma.argument_size_in_bytes, temp=ma.temp_size_in_bytes)


def main_layer(args, tb):
    topo = CHIPS[args.layer_chip][0]
    rows = []
    for tokens in (1, 16):
        for q, g in ((None, "pallas_tpu"), ("int8", "pallas_tpu"), ("int8", "xla"), ("fp8", "pallas_tpu"),
                     ("fp8", "xla")):
            r = moe_layer(topo, tokens, q, g, args.preset, tb)
            log(f"  {args.layer_chip} one MoE layer, {tokens} tokens, {r['quantize']} {g}: HBM {r['hbm'] / 1e6:.1f} MB "
                f"(grouped matmul {r['gmm_hbm'] / 1e6:.1f}), temp {r['temp'] / 1e6:.1f} MB")
            rows.append(r)
    M = 1e6
    log(f"\n### One Qwen3-Coder-30B-A3B MoE layer on one {args.layer_chip.split('-')[0]} chip (every expert "
        "local; bf16 rows)")
    log("| tokens (rows) | experts | grouped matmul | compiled HBM MB (static grid) | expected MB (touched experts) "
        "| touched experts' bytes MB | temporaries MB |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['tokens']} ({r['rows']}) | {r['quantize']} | {r['moe_gmm']} | {r['hbm'] / M:.1f} | {r['expected'] / M:.1f} "
            f"| {r['touched_experts'] / M:.1f} | {r['temp'] / M:.1f} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", default="v5e-8,v6e-4")
    ap.add_argument("--programs", default="dflash,plain")
    ap.add_argument("--preset", default="qwen3-coder-30b-a3b")
    ap.add_argument("--layers", default="5,6", help="the two depths compiled (extrapolated to 48)")
    ap.add_argument("--draft-layers", type=int, default=8, help="the z-lab Coder draft has 8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--quantize", default="none",
                    help="comma-separated target weights to compile: none (bf16), int8, fp8 (an FP8 "
                         "checkpoint's float8 linears and experts, 128 x 128 block scales; e.g. none,int8,fp8)")
    ap.add_argument("--moe-gmm", default="pallas_tpu", choices=("pallas_tpu", "xla"),
                    help="the grouped matmul (KernelConfig.moe_gmm)")
    ap.add_argument("--layer", action="store_true",
                    help="instead: one MoE layer alone on one chip of --layer-chip, 1 and 16 tokens, bf16 kernel "
                         "vs int8 / fp8 kernel vs int8 / fp8 ragged_dot")
    ap.add_argument("--layer-chip", default="v5e-4", choices=sorted(CHIPS))
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
    if args.layer:
        rows = main_layer(args, tb)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    quants = [None if q == "none" else q for q in args.quantize.split(",") if q]
    if set(quants) - {None, "int8", "fp8"}:
        ap.error(f"--quantize: none, int8 and / or fp8, got {args.quantize!r}")
    results = []
    for chip in chips:
        for program in programs:
            for q in quants:
                a, b = (compile_one(chip, program, L, args, tb, q, args.moe_gmm) for L in depths)
                full = extrapolate(a, b, FULL_LAYERS)
                f = floors(chip, program, args, tb, full, q)
                results.append(dict(chip=chip, program=program, batch=args.batch, quantize=q or "bf16",
                                    moe_gmm=args.moe_gmm, compiled=[a, b], full=full, **f))
    G, GiB = 1e9, 2 ** 30
    log(f"\n### Qwen3-Coder-30B-A3B + {args.draft_layers}-layer draft, one iteration per chip, B={args.batch}, "
        f"capacity {args.capacity}, moe_gmm {args.moe_gmm} (compiled at {depths[0]} and {depths[1]} layers, "
        f"extrapolated to {FULL_LAYERS})")
    log("| chip (mesh) | program | weights | arguments GiB | temporaries GiB | memory GiB of HBM (fits?) "
        "| free GiB | compiled HBM GB (static gmm grid) | expected GB | touched-expert floor GB | expected / floor "
        "| experts per chip-layer touched / local |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["full"]
        n = chips_of(r["chip"])
        log(f"| {r['chip']} ({'1x' + str(n) if n > 1 else 'one chip'}) | {r['program']} | {r['quantize']} "
            f"| {m['argument'] / GiB:.2f} | {m['temp'] / GiB:.2f} | {m['memory'] / GiB:.2f} of "
            f"{r['hbm_capacity'] / GiB:.2f} ({'yes' if r['fits'] else 'NO'}) | {r['free_gib']:.2f} "
            f"| {m['hbm'] / G:.3f} | {r['expected'] / G:.3f} | {r['floor'] / G:.3f} | {r['expected_x_floor']:.3f}x "
            f"| {r['experts_touched_per_chip_layer']:.1f} / {r['experts_local']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
