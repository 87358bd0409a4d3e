#!/usr/bin/env python
"""Does a slot-engine program call return before the device has run it? (issue 56)

The served engine thread spent half its wall inside program calls on an H100 (docs/perf-log.md,
session 53: `dflash_engine_seconds{phase}`), where py-spy saw it running a fifth of that time: the
calls wait, or spend host time. A call that waits for the step dispatched before it cannot be
pipelined: the host's reads and bookkeeping then sit on the device's critical path. This probe asks
each step program directly, per setting (verify width x while graphs x attention; --settings picks
them one by one):

- alone ms: one step dispatched on an idle device and waited for (the device's step, plus the call);
- call idle ms: the step call itself on an idle device, the last step's outputs freed (their
  addresses likely reused: host work of arguments and launch);
- call held ms: the same with the last step's outputs still held, as the pipeline holds them until
  read: new output addresses, which XLA:GPU writes into every CUDA-graph node that uses them before
  the graph runs (the update's host cost is held minus idle);
- call behind ms: the step call made while the step before it still runs. Near `call held`: the
  call queues and returns. Near `alone` or above: it waited for the device;
- pipelined ms: steps dispatched one ahead of the one read (slots.Pipeline's depth 1), per step;
- insert behind ms: a one-row prefill's call made while a step runs;
- whiles: the compiled step's while loops (trip count known / in CUDA-graph command buffers / neither:
  a loop XLA:GPU runs by reading its predicate on the host, which holds the calling thread), and the
  custom calls inside the host-read ones (XLA captures a loop only if every op in it is a command).
  The graphed count reads XLA's HLO-level command-buffer scheduling (`command_buffer` computations);
  an XLA that converts thunks to commands after HLO shows none there, so on it `host` counts every
  loop of unknown trip count and the timings alone tell whether the calls wait.

CPU smoke run (seconds):  python scripts/probe_dispatch.py --tiny
Any host, nothing run: the step lowered for CUDA, its while loops and those holding Pallas kernels:
  python scripts/probe_dispatch.py --tiny --lower-cuda --settings auto/on/auto,auto/on/xla,block/on/auto
GPU, Qwen3-8B shapes, simulated tau (the served setting):
  python scripts/probe_dispatch.py --preset qwen3-8b --random-init --slots 32 --capacity 1024 --steps 2 \
      --verify-width auto,block --while-graphs on,off --attention auto,xla --simulated-tau 6.35
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import numpy as np

from bench_engine import build   # scripts/ is on sys.path


_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_REF = re.compile(r"(?:to_apply|body|condition|calls|true_computation|false_computation)=%?([\w.\-]+)"
                  r"|branch_computations=\{([^}]*)\}")


def while_census(hlo: str) -> dict:
    """The while loops of optimized HLO text: total, with a known trip count, inside command buffers
    (computations reachable from one whose name starts with command_buffer: XLA:GPU's
    CommandBufferScheduling), and neither (a host-read predicate); blockers: the custom-call
    targets inside those host-read loops (a loop is captured only if all of it is)."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    calls = {c: {r for line in body for m in _REF.finditer(line)
                 for r in ([m.group(1)] if m.group(1) else [x.strip().lstrip("%") for x in m.group(2).split(",")])}
             for c, body in comps.items()}
    def reach(roots) -> set[str]:
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                todo.extend(calls.get(c, ()))
        return seen

    inside = reach(c for c in comps if c.startswith("command_buffer"))
    out = dict(whiles=0, known=0, graphed=0, host=0, blockers=set())
    for c, body in comps.items():
        for line in body:
            if re.search(r"\bwhile\(", line):
                known = "known_trip_count" in line
                out["whiles"] += 1
                out["known"] += known
                out["graphed"] += c in inside
                if not known and c not in inside:
                    out["host"] += 1
                    loop = reach(m.group(1) for m in re.finditer(r"(?:body|condition)=%?([\w.\-]+)", line))
                    out["blockers"].update(t for x in loop for l in comps.get(x, ())
                                           for t in re.findall(r'custom_call_target="([^"]+)"', l))
    out["blockers"] = ",".join(sorted(out["blockers"])) or "-"
    return out


_STR = re.compile(r'"(?:[^"\\]|\\.)*"')


def stablehlo_census(mlir: str) -> dict:
    """The while loops and conditionals of a lowered (StableHLO) program and how many of each hold a
    Pallas-Triton kernel (a `__gpu$xla.gpu.triton` custom call in its regions or in a function they
    call): those XLA:GPU cannot put into a command buffer if that call is not a command."""
    lines = mlir.splitlines()
    clean = [_STR.sub('""', ln) for ln in lines]

    def extent(k: int) -> int:                 # the line closing the op or function opened at line k
        depth, opened = 0, False
        for j in range(k, len(clean)):
            depth += clean[j].count("{") - clean[j].count("}")
            opened = opened or "{" in clean[j]
            if opened and depth <= 0:
                return j
        return len(clean) - 1

    funcs = {}
    for i, ln in enumerate(clean):
        m = re.match(r"\s*func\.func (?:public |private )?@([\w.$\-]+)", ln)
        if m:
            funcs[m.group(1)] = "\n".join(lines[i:extent(i) + 1])

    def pallas(text: str, seen: set) -> bool:
        if "xla.gpu.triton" in text:
            return True
        for c in re.findall(r"call @([\w.$\-]+)", text):
            if c in funcs and c not in seen:
                seen.add(c)
                if pallas(funcs[c], seen):
                    return True
        return False

    def ops(name: str) -> list[bool]:
        return [pallas("\n".join(lines[k:extent(k) + 1]), set()) for k, ln in enumerate(lines)
                if re.match(rf'\s*(?:%[\w:#, ]+= )?"?{re.escape(name)}\b', ln)]   # pretty or generic form

    loops, conds = ops("stablehlo.while"), ops("stablehlo.if") + ops("stablehlo.case")
    return dict(whiles=len(loops), with_pallas=sum(loops), conds=len(conds), conds_with_pallas=sum(conds))


def engine(args, target, draft, vw, attention, graphs=None):
    """The slot engine of one setting, as the server builds it for the measured shapes (no step buckets)."""
    from dflash_jax.kernel_config import KernelConfig
    from dflash_jax.serving.slots import Slots

    return Slots(target, draft, slots=args.slots, capacity=args.capacity, block_size=args.block, steps=args.steps,
                 insert_width=min(8, args.slots), step_buckets=None, verify_width=None if vw == "block" else vw,
                 kernels=KernelConfig(attention=attention, while_graphs=graphs))


def lowered_census(args, target, draft, vw, attention) -> dict:
    """--lower-cuda: the step program of this setting lowered for CUDA on this host (nothing runs), its
    while loops counted (stablehlo_census). "auto" attention is what auto means on a GPU (pallas_gpu)."""
    import functools

    import jax

    from dflash_jax.serving import slot_programs

    attention = "pallas_gpu" if attention in ("auto", "pallas") else attention
    eng = engine(args, target, draft, vw, attention)
    st, K, rows = eng._step_static("greedy", None)
    fn = jax.jit(functools.partial(slot_programs._slots_step, st, K), donate_argnums=(2,))
    low = fn.trace(eng._tstate, eng._dstate, eng.state, eng._put(eng._release),
                   eng.programs.width_fields(st, K, rows)).lower(lowering_platforms=("cuda",))
    return {"verify_width": str(vw), "attention": eng.kernels.attention, **stablehlo_census(low.as_text())}


def probe(args, target, draft, vw, graphs, attention) -> dict:
    import jax

    from dflash_jax.serving.slots import RowRequest

    B, C, K = args.slots, args.capacity, args.steps
    eng = engine(args, target, draft, vw, attention, graphs)
    S = eng.block_size
    rng = np.random.default_rng(0)
    V = target.config.vocab_size

    def request():
        n = int(rng.integers(args.prompt // 2, args.prompt + 1))
        return RowRequest(prompt=tuple(int(x) for x in rng.integers(1, V, n)), max_new=C - args.prompt - S * (K + 2))

    t0 = time.perf_counter()
    eng.insert([(s, request()) for s in range(B)])
    jax.block_until_ready(eng.step_async())
    eng.release(0)                                      # the insert program of one row, compiled too
    eng.insert([(0, request())])
    jax.block_until_ready(eng.step_async())
    compile_s = time.perf_counter() - t0

    def call(fn):
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t

    alone, idle, held, behind, insert_behind = [], [], [], [], []
    for _ in range(args.reps):
        jax.block_until_ready(eng.step_async())         # the release flags back to clear; outputs dropped
        t = time.perf_counter()
        out, dt = call(eng.step_async)                  # idle device, the last step's outputs freed
        jax.block_until_ready(out)
        alone.append(time.perf_counter() - t)
        idle.append(dt)
        nxt, dt = call(eng.step_async)                  # idle device, `out` still held: new output addresses
        held.append(dt)
        jax.block_until_ready(nxt)
        out = nxt = None
        first, _ = call(eng.step_async)                 # a step runs; the next call is made behind it
        out, dt = call(eng.step_async)
        behind.append(dt)
        jax.block_until_ready((first, out))
        first = out = None
        eng.release(0)
        first, _ = call(eng.step_async)                 # slot 0 freed by this step; its prefill behind it
        ins, dt = call(lambda: eng.insert_async([(0, request())]))
        insert_behind.append(dt)
        jax.block_until_ready((first, ins))
        first = ins = None
    # depth 1: dispatch step n, then read step n-1 (Pipeline's order)
    prev = eng.step_async()
    t = time.perf_counter()
    for _ in range(args.reps):
        cur = eng.step_async()
        [np.asarray(x) for x in jax.device_get(prev)]
        prev = cur
    jax.block_until_ready(prev)
    pipelined = (time.perf_counter() - t) / args.reps
    hlo = eng._step_program("greedy").as_text()
    if args.dump_hlo:
        import os
        os.makedirs(args.dump_hlo, exist_ok=True)
        name = f"step_{vw}_graphs_{eng.kernels.while_graphs}_{eng.kernels.attention}.txt"
        with open(os.path.join(args.dump_hlo, name), "w") as f:
            f.write(hlo)
    census = while_census(hlo)
    ms = lambda xs: 1e3 * statistics.median(xs)       # noqa: E731
    return {"verify_width": str(vw), "while_graphs": eng.kernels.while_graphs, "attention": eng.kernels.attention,
            "compile_s": compile_s, "alone_ms": ms(alone),
            "call_idle_ms": ms(idle), "call_held_ms": ms(held), "call_behind_ms": ms(behind), "pipelined_ms": 1e3 * pipelined,
            "insert_behind_ms": ms(insert_behind), **census}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random pair (CPU smoke run)")
    p.add_argument("--tiny-layers", type=int, default=2)
    p.add_argument("--preset", default=None)
    p.add_argument("--random-init", action="store_true", help="random weights of --preset's shapes")
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--dtype", default=None, help="default: float32 with --tiny, else bfloat16")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--prompt", type=int, default=128, help="longest prompt (each row's is drawn in [half, this])")
    p.add_argument("--steps", type=int, default=2, help="iterations per step (K)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--attention", default="auto", help="comma list of attention backends (xla on a GPU: no Pallas "
                   "kernel in the step, so XLA can put its loops in command buffers)")
    p.add_argument("--verify-width", default="auto,block", help="comma list: auto, block or a width")
    p.add_argument("--while-graphs", default="on,off", help="comma list of on/off (CUDA only; elsewhere off)")
    p.add_argument("--simulated-tau", type=float, default=None, metavar="TAU",
                   help="the adaptive programs accept a geometric survival draw at this tau (as serve_simulated)")
    p.add_argument("--settings", default=None, metavar="W/G/A,...",
                   help="instead of the product of the three lists: the settings to run, each verify width/while "
                        "graphs/attention (e.g. auto/on/auto,auto/on/xla,block/on/auto)")
    p.add_argument("--lower-cuda", action="store_true",
                   help="run nothing: lower each setting's step for CUDA on this host and count its while loops and "
                        "those holding a Pallas-Triton kernel (while graphs do not change the lowering)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--dump-hlo", default=None, metavar="DIR", help="write each setting's compiled step (HLO text) here")
    args = p.parse_args(argv)
    if not (args.tiny or args.random_init or args.model):
        p.error("give --tiny, --random-init (with --preset) or --model/--draft")
    if args.random_init and not args.preset:
        p.error("--random-init needs --preset")
    for name in ("slots", "capacity", "prompt", "steps", "reps", "tiny_layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.capacity <= args.prompt + 4 * 16:
        p.error(f"--capacity {args.capacity} leaves no room after a --prompt of {args.prompt}")
    def width_of(w):
        if w in ("auto", "block"):
            return w
        if w.isdigit():
            return int(w)
        p.error(f"--verify-width: give auto, block or a width, got {w!r}")

    def graphs_of(g):
        if g not in ("on", "off"):
            p.error(f"--while-graphs: give on or off, got {g!r}")
        return g == "on"

    from dflash_jax.kernel_config import ATTENTION_BACKENDS, RESOLVED_ATTENTION

    def attention_of(a):
        if a not in ATTENTION_BACKENDS + RESOLVED_ATTENTION:
            p.error(f"--attention: give one of {', '.join(dict.fromkeys(ATTENTION_BACKENDS + RESOLVED_ATTENTION))}, got {a!r}")
        return a

    if args.settings:
        settings = []
        for item in args.settings.split(","):
            parts = item.split("/")
            if len(parts) != 3:
                p.error(f"--settings: each item is width/graphs/attention (e.g. auto/on/xla), got {item!r}")
            settings.append((width_of(parts[0]), graphs_of(parts[1]), attention_of(parts[2])))
    else:
        settings = [(width_of(w), graphs_of(g), attention_of(a)) for w in args.verify_width.split(",")
                    for g in args.while_graphs.split(",") for a in args.attention.split(",")]
    widths = [w for w, _, _ in settings]
    if args.simulated_tau is not None and all(w == "block" for w in widths):
        p.error("--simulated-tau needs an adaptive --verify-width (auto or a width)")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.default = False
    import contextlib

    import jax

    from dflash_jax import loop, width
    sim = contextlib.nullcontext()
    if args.simulated_tau is not None:
        try:
            sim = loop._simulated_acceptance(width.geometric_profile(args.simulated_tau))
        except ValueError as e:
            p.error(f"--simulated-tau: {e}")
    if args.tiny:     # head_dim 128: a size the Pallas GPU kernels take (--lower-cuda lowers them)
        import dflash_jax as dj
        from dflash_jax.config import TargetConfig
        cfg = TargetConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=args.tiny_layers,
                           num_heads=2, num_kv_heads=1, head_dim=128)
        target = dj.init_target(cfg, seed=0, dtype=args.dtype)
        draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=args.block or 16), seed=1,
                              dtype=args.dtype)
    else:
        target, draft, _ = build(args)
    if draft is None:
        p.error("the probe needs a draft (the DFlash step programs)")
    dev = jax.devices()[0]
    print(f"[probe_dispatch] {dev.platform} {dev.device_kind}: slots {args.slots}, capacity {args.capacity}, "
          f"K {args.steps}, prompts <= {args.prompt}"
          + (f", SIMULATED ACCEPTANCE tau {args.simulated_tau}" if args.simulated_tau is not None else ""), flush=True)
    rows = []
    if args.lower_cuda:
        with sim:
            for vw, a in dict.fromkeys((vw, a) for vw, _, a in settings):
                rows.append(lowered_census(args, target, draft, vw, a))
        print("| verify width | attention | while loops | holding a Pallas-Triton kernel | conditionals | holding one |\n"
              "|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['verify_width']} | {r['attention']} | {r['whiles']} | {r['with_pallas']} | {r['conds']} "
                  f"| {r['conds_with_pallas']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"lowered_for": "cuda", "args": vars(args), "rows": rows}, f, indent=1)
        return 0
    with sim:
        for vw, g, a in settings:
            rows.append(probe(args, target, draft, vw, g, a))
            print(f"[probe_dispatch] verify width {vw}, while graphs {g}, attention {a}: done", flush=True)
    cols = ("verify_width", "while_graphs", "attention", "alone_ms", "call_idle_ms", "call_held_ms", "call_behind_ms", "pipelined_ms",
            "insert_behind_ms", "whiles", "known", "graphed", "host", "compile_s", "blockers")
    print("| " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print("(call held - call idle: the host cost of new output addresses (graph updates); call behind near call held: "
          "the call queued behind the running step and returned, near alone or above: it waited for the device. "
          "graphed: loops in command_buffer computations, where XLA schedules command buffers on HLO; an XLA that "
          "converts thunks instead shows 0 there, and host then counts every loop of unknown trip count)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": f"{dev.platform} {dev.device_kind}", "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
