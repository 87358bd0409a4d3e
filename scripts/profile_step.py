#!/usr/bin/env python
"""Where a plain step's and a DFlash iteration's device time goes, kernel by kernel, each kernel
named by what its HLO computes (benchmark only; random bf16 weights at a preset's shapes).

    python scripts/profile_step.py --preset qwen3-coder-30b-a3b --layers 12 --batch 1 --out $OUT
    python scripts/profile_step.py --smoke                      # CPU, tiny shapes: the script runs

Each program (`--kinds`: plain = generate without a draft, dflash = block-wide verify) runs twice
under jax.profiler (--n1 and --n2 new tokens, the same compiled program); a kernel's time per step
is the difference of the two traces over the difference of their steps, so the prefill cancels.
While loops run without CUDA graphs here (`KernelConfig(while_graphs=False)`): the profiler does not
see the kernels inside a graph. The kernels are the same; the host gaps between steps are not.
The optimized HLO of the run (the compiled program's `as_text()`) names each kernel: its result shape,
its operands' shapes and the ops of its fused computation. Prints the --top kernels by time per
step; `--out` also gets the table as JSON (profile_step_<preset>_<kind>_B<batch>.json)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for d in (os.path.dirname(HERE), HERE):
    if d not in sys.path:
        sys.path.insert(0, d)

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) (\w[\w\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def parse_hlo(text: str):
    """(instructions {name: (shape, opcode, rest)}, computations {name: [opcodes]}) of HLO text."""
    instrs, comps, cur = {}, {}, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            cur = m.group(1)
            comps[cur] = []
            continue
        m = _INSTR.match(line)
        if m:
            name, shape, op, rest = m.groups()
            instrs[name] = (shape, op, rest)
            if cur is not None:
                comps[cur].append(op)
    return instrs, comps


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in text (a tuple's parts added)."""
    tot = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        tot += n * _BYTES.get(dt, 0)
    return tot


def _sane(name: str) -> str:
    """An HLO name as kernel names write it: '.' and '-' as '_' (loop_add_fusion.24 -> loop_add_fusion_24)."""
    return re.sub(r"[.\-]", "_", name)


def describe(hlo_op: str, instrs: dict, comps: dict) -> str:
    """One line: result shape, opcode (fusion: its computation's ops), operand shapes, custom target."""
    got = instrs.get(hlo_op) or instrs.get(_sane(hlo_op))
    if got is None:
        return "?"
    shape, op, rest = got
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    what = op
    if called and called.group(1) in comps:
        c = collections.Counter(o for o in comps[called.group(1)] if o not in ("parameter", "constant", "bitcast"))
        what = f"{op}[" + " ".join(f"{o}x{n}" if n > 1 else o for o, n in c.most_common(8)) + "]"
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    if target:
        what += f" {target.group(1)}"
    args = rest.split(")", 1)[0]
    operands = [instrs[n][0] if n in instrs else "?" for n in re.findall(r"%([\w.\-]+)", args)]
    shp = lambda s: re.sub(r"\{[^}]*\}", "", s)                                      # noqa: E731
    return f"{shp(shape)} = {what}(" + ", ".join(shp(o) for o in operands[:4]) + ")"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-coder-30b-a3b")
    ap.add_argument("--layers", type=int, default=12, help="cut the target to its first L layers (0: all)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kinds", default="plain,dflash")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=80)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--small-dot", type=int, default=None,
                    help="A/B only: models.layers.SMALL_DOT for this run (0: every one-row dot as written)")
    ap.add_argument("--time-only", choices=("on", "off"), default=None,
                    help="no profile: the default program's wall ms per step (median of 3 N1/N2 differences) "
                         "with while graphs on or off (an A/B of KernelConfig.while_graphs on the user's program)")
    ap.add_argument("--moe-route", choices=("on", "off"), default="on",
                    help="A/B: KernelConfig.moe_route (MoE targets' routing kernel on the GPU gmm path)")
    ap.add_argument("--moe-tuning", default="",
                    help="A/B: KernelConfig.moe_tuning, e.g. 'gate_up_bn=16,down_bn=64'; with --time-only a "
                         "';'-separated list is timed config by config in this one process")
    ap.add_argument("--quantize", default="", metavar="fp8-w8a8",
                    help="profile the target quantized by this method (bench_gpu.py's --quantize names: int8, "
                         "int8+head, fp8, fp8-w8a8, fp8-w8a8+head)")
    ap.add_argument("--save-hlo", action="store_true", help="also write the program's HLO text to --out (gzip)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    if a.quantize:
        from bench_gpu import check_quantize_names
        if check_quantize_names([a.quantize]):
            ap.error(f"--quantize {a.quantize}: not a method (int8, int8+head, fp8, fp8-w8a8, fp8-w8a8+head)")
    import dataclasses

    import jax
    import numpy as np
    from bench_gpu import traced_difference

    from dflash_jax import KernelConfig, decode, loop
    from dflash_jax.config import PRESETS, DraftConfig, default_target_layer_ids
    from dflash_jax.weights import init_draft, init_target
    if a.small_dot is not None:
        from dflash_jax.models import layers
        layers.SMALL_DOT = a.small_dot                             # read while tracing only
    if a.smoke:
        from dflash_jax.config import Qwen3MoeConfig
        tcfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                              moe_intermediate_size=32, norm_topk_prob=True)
        prompt, n1, n2, dtype, a.draft_layers = 16, 3, 7, "float32", 1
    else:
        if a.preset == "qwen3.5-9b":                   # bench_hybrid's shapes (no preset of ours)
            from bench_hybrid import QWEN35_9B, config
            tcfg = config(QWEN35_9B, "chunk")
        else:
            tcfg = PRESETS[a.preset]
        if a.layers:
            tcfg = dataclasses.replace(tcfg, num_layers=a.layers, **(
                dict(layer_types=tcfg.layer_types[:a.layers]) if getattr(tcfg, "layer_types", None) else {}))
        prompt, n1, n2, dtype = a.prompt, a.n1, a.n2, "bfloat16"
    if a.quantize:
        from bench_gpu import quantized_target
        target = quantized_target(init_target, tcfg, a.quantize, dtype)
    else:
        target = init_target(tcfg, seed=0, dtype=dtype)
    taps = default_target_layer_ids(tcfg.num_layers, 5) if tcfg.num_layers >= 10 else None
    dcfg = DraftConfig.for_target(tcfg, num_layers=a.draft_layers, block_size=16 if not a.smoke else 4,
                                  target_layer_ids=taps)
    draft = init_draft(dcfg, seed=1, dtype=dtype)
    cap = -(-(prompt + n2 + 40) // 512) * 512
    prompts = np.random.default_rng(0).integers(0, tcfg.vocab_size - 2, (a.batch, prompt)).tolist()
    tunings = [KernelConfig.parse_tuning(t) for t in a.moe_tuning.split(";")] if a.time_only else \
        [KernelConfig.parse_tuning(a.moe_tuning)]
    for kind, tuning in [(k, t) for k in a.kinds.split(",") for t in tunings]:
        kw = dict(draft=None) if kind == "plain" else dict(draft=draft, block_size=dcfg.block_size,
                                                           verify_width="block")

        def gen(n, kw=kw, tuning=tuning):
            # while loops as CUDA graphs hide their kernels from the profiler: off here (the kernels
            # are the same; the host gaps between steps are not the default program's)
            return decode.generate(target, kw["draft"], prompts, max_new_tokens=n, capacity=cap, seed=0,
                                   kernels=KernelConfig(while_graphs=a.time_only == "on",
                                                        moe_route=a.moe_route == "on", moe_tuning=tuning),
                                   **{k: v for k, v in kw.items() if k != "draft"})
        if a.time_only:
            gen(n1)
            runs = [(gen(n1), gen(n2)) for _ in range(3)]
            ms = sorted(1e3 * (y.run_time_s - x.run_time_s) / max(1, y.num_iterations - x.num_iterations)
                        for x, y in runs)
            print(f"{a.preset} {kind} B={a.batch} while graphs {a.time_only} moe_route {a.moe_route}"
                  f"{' moe_tuning ' + str(dict(tuning)) if tuning else ''}: {ms[1]:.3f} ms/step "
                  f"(runs {', '.join(f'{m:.3f}' for m in ms)})", flush=True)
            continue
        before = set(map(id, loop._COMPILED.values()))
        gen(n1)                                                    # compile and warm
        instrs, comps = {}, {}
        for exe in loop._COMPILED.values():                        # this program's optimized HLO
            if id(exe) not in before:
                text = exe.as_text()
                i, c = parse_hlo(text)
                instrs.update(i)
                instrs.update({_sane(k): v for k, v in i.items()})
                comps.update(c)
                if a.save_hlo and a.out:
                    import gzip
                    os.makedirs(a.out, exist_ok=True)
                    with gzip.open(os.path.join(a.out, f"hlo_{kind}_B{a.batch}.txt.gz"), "wt") as f:
                        f.write(text)
        print(f"# {kind}: {len(instrs)} HLO instructions read", flush=True)
        per, ds, x, y = traced_difference(gen, n1, n2, f"profile_step_{kind}_")
        hlo_of = {}
        for sm in (x, y):
            hlo_of.update(sm.get("hlo_of_name", {}))
        busy = (y["busy_ms"] - x["busy_ms"]) / ds
        wall = (y["run_ms"] - x["run_ms"]) / ds
        kernels = sum(c for _, c in per.values())
        print(f"\n{a.preset if not a.smoke else 'smoke'} {kind} B={a.batch}: {ds} steps; device busy {busy:.3f} "
              f"ms/step, wall {wall:.3f} (gaps {wall - busy:.3f}); {kernels:.0f} kernels/step", flush=True)
        rows = sorted(per.items(), key=lambda kv: -kv[1][0])
        table = []
        print(f"{'us':>8} {'n':>6} {'GB/s':>6}  kernel: what it computes (operands + result once: GB/s)")
        for k, (t, c) in rows[:a.top]:
            what = describe(hlo_of.get(k, k), instrs, comps)
            if what == "?":                      # kernels in a command buffer carry the buffer's name
                what = describe(k, instrs, comps)
            # operands + result over the kernel's time: its memory rate if it read each once
            gbs = shape_bytes(what) * c / (t * 1e3) if t > 0 and what != "?" else 0.0
            table.append(dict(kernel=k, us=round(t, 2), count=round(c, 2), gb_s=round(gbs), hlo=what))
            print(f"{t:8.1f} {c:6.2f} {gbs:6.0f}  {k[:40]}: {what[:200]}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            tag = ("" if a.small_dot is None else f"_sd{a.small_dot}") + ("" if a.moe_route == "on" else "_noroute")
            name = f"profile_step_{'smoke' if a.smoke else a.preset}_{kind}_B{a.batch}{tag}.json"
            with open(os.path.join(a.out, name), "w") as f:
                json.dump(dict(preset=a.preset, layers=tcfg.num_layers, kind=kind, batch=a.batch, steps=ds,
                               busy_ms=busy, wall_ms=wall, kernels=kernels, top=table,
                               unnamed=[k for k, _ in rows[:a.top] if k not in instrs and hlo_of.get(k, k) not in instrs],
                               hlo_of_name={k: hlo_of.get(k) for k, _ in rows[:a.top]},
                               hlo_names_sample=sorted(n for n in instrs if "reduce_fusion" in n)[:40]), f, indent=1)


if __name__ == "__main__":
    main()
