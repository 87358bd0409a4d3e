#!/usr/bin/env python
"""TPU projections for the Qwen3-8B DFlash loop, from the real TPU compiler on a CPU-only machine.

    python scripts/tpu_projection.py                  # v6e and v5p, Qwen3-8B + 5-layer draft (~4-6 min, 2 cores)
    python scripts/tpu_projection.py --full           # + the 512-prompt program and the B=32 iteration (~8-10 min)
    python scripts/tpu_projection.py --smoke          # tiny shapes, ~1 min
    python scripts/tpu_projection.py --chips v6e --h200-json out/bench_gpu.json --json tpu_projection.json

No TPU is used or needed: libtpu's compiler compiles the programs ahead of time for one chip of a
TPU topology (v6e: "v6e:2x2", v5p: "v5p:2x2x1"; device 0) with abstract arguments
(jax.ShapeDtypeStruct placed on that device), see docs/benchmarks-howto.md. Each chip runs in its
own child process (libtpu reads TPU_ACCELERATOR_TYPE when it loads), both at once.

What it reports, per chip:
  * memory_analysis of the WHOLE generation program (prefill + while_loop) at a few (batch, prompt,
    capacity) points: weights (arguments), the final loop state (outputs: KV caches, token buffer),
    temporaries. From these, a linear model weights + B*C*kv_bytes + temp(B) gives the largest
    KV capacity (context) that fits the chip's HBM at batch 1, 8, 32, 64.
  * cost_analysis of ONE loop iteration, compiled alone (the `iteration` body of dflash_jax.loop
    with the loop state donated, as it is inside the while_loop): bytes accessed and flops. The
    whole program's cost_analysis counts the while body once and adds the prefill, so it cannot give
    a per-iteration figure; it is printed too, for reference.
  * projected ms per iteration = bytes accessed / HBM bandwidth (v6e 1.64 TB/s, v5p 2.76 TB/s), and
    flops / peak bf16 rate (v6e 918 TFLOP/s, v5p 459 TFLOP/s) when that is larger; next to the H200
    floor (bytes / the 4.23 TB/s measured copy bandwidth) and, with --h200-json, the H200 measurement.

  * for each iteration, the bytes named (scripts/tpu_bytes.py, docs/tpu-bytes.md): per kind (weights, LM
    head, KV read/write, copies, sampling, activations) as the cost model counts them and as HBM traffic
    (weights the compiler prefetches into VMEM are charged four times by its cost model, read once from
    HBM), next to the ideal (every weight once per use, the LM head twice for DFlash, KV at capacity).
    `--full --iters-only` compiles just the iterations: DFlash and plain, B=1 and 32, 1k and 32k context.

These are PROJECTIONS FROM THE COMPILER'S ACCOUNTING, NOT MEASUREMENTS: the cost model counts the bytes
each HLO op reads and writes (a Pallas kernel: its declared operands, i.e. the whole KV capacity, not
only the tiles it visits), and real kernels reach some fraction of the HBM bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHIPS = {
    # name: topology, TPU_ACCELERATOR_TYPE, HBM bytes, HBM bandwidth B/s, peak bf16 FLOP/s
    "v6e": dict(topology="v6e:2x2", accel="v6e-4", hbm=32e9, bw=1.64e12, flops=918e12),
    "v5p": dict(topology="v5p:2x2x1", accel="v5p-8", hbm=95e9, bw=2.76e12, flops=459e12),
    "v5e": dict(topology="v5e:2x2", accel="v5litepod-4", hbm=16e9, bw=0.82e12, flops=197e12),
    "v4": dict(topology="v4:2x2x1", accel="v4-8", hbm=32e9, bw=1.2e12, flops=275e12),
}
H200 = dict(copy_bw=4.23e12, gemm_flops=780e12, name="H200 (4.23 TB/s copy, ~780 TFLOP/s bf16 GEMM, measured)")


_LOG_TO = [sys.stderr]


def log(*a):
    print(*a, flush=True, file=_LOG_TO[0])


# ---------------------------------------------------------------------------------------------
# the child: one chip
# ---------------------------------------------------------------------------------------------

def configs(smoke: bool):
    from dflash_jax import DraftConfig, TargetConfig
    if smoke:
        tc = TargetConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=128, rope_theta=1e6)
        dc = DraftConfig.for_target(tc, num_layers=2, block_size=16, mask_token_id=1023)
        return tc, dc
    tc = TargetConfig.preset("qwen3-8b")
    dc = DraftConfig.for_target(tc, num_layers=5, block_size=16, mask_token_id=151669,
                                target_layer_ids=(1, 9, 17, 25, 33))
    return tc, dc


def plan(smoke: bool, quick: bool, full: bool = False, iters_only: bool = False):
    """(kind, label, draft?, batch, prompt_len, capacity) in compile order."""
    if smoke:
        return [("iter", "DFlash iteration B=1 C=1024", True, 1, 512, 1024),
                ("iter", "plain step B=1 C=1024", False, 1, 512, 1024),
                ("whole", "DFlash program B=1 p512 C=1024", True, 1, 512, 1024),
                ("whole", "DFlash program B=4 p512 C=2048", True, 4, 512, 2048)]
    # Compile times on 2 idle CPU cores, both chips at once: iterations 20-45 s (B=32: 100-160 s),
    # whole programs 80-140 s (twice that when the machine is busy). Default ~4-6 min; --full ~8-10 min.
    p = [("iter", "DFlash iteration B=1 C=1024", True, 1, 512, 1024),
         ("iter", "plain step B=1 C=1024", False, 1, 512, 1024),
         ("iter", "DFlash iteration B=1 C=33792", True, 1, 32768, 33792),
         ("whole", "DFlash program B=1 p32768 C=33792", True, 1, 32768, 33792)]
    if full:
        p += [("iter", "plain step B=1 C=33792", False, 1, 32768, 33792),
              ("iter", "DFlash iteration B=32 C=1024", True, 32, 512, 1024),
              ("iter", "plain step B=32 C=1024", False, 32, 512, 1024),
              ("whole", "DFlash program B=1 p512 C=1024", True, 1, 512, 1024)]
    elif quick:
        p = p[:3]
    if iters_only:
        p = [q for q in p if q[0] == "iter"]
    return p


def _st_and_args(tc, dc, *, batch, prompt_len, capacity, attention_impl, device, sampling_mode="greedy"):
    """The library's abstract program: (static config, (tstate, dstate, params)) placed on `device`."""
    from dflash_jax import decode
    fn, args = decode.abstract_program(tc, dc, batch=batch, prompt_len=prompt_len, max_new_tokens=256,
                                        capacity=capacity, sampling_mode=sampling_mode, dtype="bfloat16",
                                        attention_impl=attention_impl, device=device)
    f = getattr(fn, "__wrapped__", None)
    st = f.args[0] if f is not None and hasattr(f, "args") else None
    return fn, st, args


def lower_iteration(tc, dc, *, batch, prompt_len, capacity, attention_impl, device, sampling_mode="greedy"):
    """One loop iteration alone (loop.iteration), the loop state donated as in the while_loop."""
    import jax
    from flax import nnx
    from dflash_jax import decode, loop
    if hasattr(decode, "lower_iteration"):
        return decode.lower_iteration(tc, dc, batch=batch, prompt_len=prompt_len, capacity=capacity,
                                      sampling_mode=sampling_mode, dtype="bfloat16",
                                      attention_impl=attention_impl, device=device)
    _, st, (tstate, dstate, p) = _st_and_args(tc, dc, batch=batch, prompt_len=prompt_len, capacity=capacity,
                                              attention_impl=attention_impl, device=device,
                                              sampling_mode=sampling_mode)
    if st is None:
        raise RuntimeError("cannot find the static config inside decode.abstract_program's function")

    def models(ts, ds):
        t = nnx.merge(st.target_def, ts)
        d = None if st.draft_def is None else nnx.merge(st.draft_def, ds)
        return t, d

    def prefill(ts, ds, p):
        t, d = models(ts, ds)
        return loop.prefill(st, t, d, p)

    shapes = jax.eval_shape(prefill, tstate, dstate, p)
    sharding = jax.sharding.SingleDeviceSharding(device)
    loop = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)

    def one(ts, ds, p, s):
        t, d = models(ts, ds)
        return loop.iteration(st, t, d, p, s)

    return jax.jit(one, donate_argnums=(3,)).trace(tstate, dstate, p, loop).lower()


def param_bytes(tc, dc) -> dict:
    """Parameter bytes of the abstract models (nothing allocated)."""
    import jax
    _, _, (tstate, dstate, _) = _st_and_args(tc, dc, batch=1, prompt_len=512, capacity=1024,
                                             attention_impl="xla", device=None)
    tl = jax.tree_util.tree_flatten_with_path(tstate)[0]
    t_total = sum(x.size * x.dtype.itemsize for _, x in tl)
    emb = sum(x.size * x.dtype.itemsize for pth, x in tl if "embed" in jax.tree_util.keystr(pth).lower())
    d_total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dstate))
    lm = tc.vocab_size * tc.hidden_size * 2
    return {"target_total": t_total, "embed": emb, "draft": d_total, "lm_head": lm,
            "target_read": t_total - (0 if tc.tie_word_embeddings else emb)}


def lower_whole(tc, dc, *, batch, prompt_len, capacity, attention_impl, device):
    from dflash_jax import decode
    return decode.lower_generate(tc, dc, batch=batch, prompt_len=prompt_len, max_new_tokens=256,
                                 capacity=capacity, dtype="bfloat16", attention_impl=attention_impl, device=device)


def child(chip: str, out_path: str, smoke: bool, quick: bool, attention_impl: str, full: bool = False,
          iters_only: bool = False):
    import jax
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tpu_bytes
    from jax.experimental import topologies
    spec = CHIPS[chip]
    topo = topologies.get_topology_desc(platform="tpu", topology_name=spec["topology"])
    dev = topo.devices[0]
    tc, dc = configs(smoke)
    res = {"chip": chip, "device_kind": dev.device_kind, "topology": spec["topology"], "jax": jax.__version__,
           "attention_impl": attention_impl, "points": []}
    kv_t = 2 * tc.num_layers * tc.num_kv_heads * tc.head_dim * 2
    kv_d = 2 * dc.num_layers * dc.num_kv_heads * dc.head_dim * 2
    res["kv_bytes_per_token"] = {"target": kv_t, "draft": kv_d}
    res["max_positions"] = tc.max_position_embeddings
    res["param_bytes"] = param_bytes(tc, dc)

    def save():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    for kind, label, with_draft, B, P, C in plan(smoke, quick, full, iters_only):
        d = dc if with_draft else None
        t = time.perf_counter()
        pt = dict(kind=kind, label=label, draft=with_draft, batch=B, prompt=P, capacity=C)
        try:
            if kind == "iter":
                low = lower_iteration(tc, d, batch=B, prompt_len=P, capacity=C, attention_impl=attention_impl,
                                      device=dev)
            else:
                low = lower_whole(tc, d, batch=B, prompt_len=P, capacity=C, attention_impl=attention_impl,
                                  device=dev)
            t1 = time.perf_counter()
            comp = low.compile()
            pt["lower_s"], pt["compile_s"] = t1 - t, time.perf_counter() - t1
            ma = comp.memory_analysis()
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                      "temp_size_in_bytes", "generated_code_size_in_bytes"):
                pt[k] = int(getattr(ma, k, 0) or 0)
            pt["total_bytes"] = (pt["argument_size_in_bytes"] + pt["output_size_in_bytes"]
                                 - pt["alias_size_in_bytes"] + pt["temp_size_in_bytes"])
            ca = comp.cost_analysis()
            if isinstance(ca, (list, tuple)):
                ca = ca[0] if ca else {}
            pt["bytes_accessed"] = float(ca.get("bytes accessed", float("nan")))
            pt["flops"] = float(ca.get("flops", float("nan")))
            pt["fits"] = pt["total_bytes"] <= spec["hbm"]
            if kind == "iter":  # the bytes named (scripts/tpu_bytes.py): per kind, cost model and HBM
                bd = tpu_bytes.breakdown(comp.as_text())
                pt["bytes_by_kind"] = {k: float(bd["kinds_model"].get(k, 0)) for k in tpu_bytes.KINDS}
                pt["hbm_bytes_by_kind"] = {k: float(bd["kinds_hbm"].get(k, 0)) for k in tpu_bytes.KINDS}
                pt["tool_bytes_accessed"] = float(bd["model_total"])
                pt["hbm_bytes"] = float(bd["hbm_total"])
                pt["ideal_by_kind"] = tpu_bytes.ideal_bytes(tc, dc, draft=with_draft, batch=B, capacity=C)
                pt["bytes_by_op"] = {k: float(v) for k, v in bd["ops_model"].items() if v > 1e6}
                pt["hbm_bytes_by_op"] = {k: float(v) for k, v in bd["ops_hbm"].items() if v > 1e6}
            log(f"[{chip}] {label}: compiled in {pt['compile_s']:.0f}s; args {pt['argument_size_in_bytes'] / 1e9:.2f} GB, "
                f"out {pt['output_size_in_bytes'] / 1e9:.2f}, alias {pt['alias_size_in_bytes'] / 1e9:.2f}, "
                f"temp {pt['temp_size_in_bytes'] / 1e9:.2f}; bytes accessed {pt['bytes_accessed'] / 1e9:.2f} GB, "
                f"{pt['flops'] / 1e12:.2f} TFLOP")
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            pt["error"] = msg[:3000]
            pt["compile_s"] = time.perf_counter() - t
            pt["oom"] = any(s in msg for s in ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory"))
            log(f"[{chip}] {label}: FAILED after {pt['compile_s']:.0f}s: {msg[:400]}")
        res["points"].append(pt)
        save()
    save()


# ---------------------------------------------------------------------------------------------
# the parent: run the children, fit, print
# ---------------------------------------------------------------------------------------------

def run_children(chips, args) -> dict:
    procs = {}
    for chip in chips:
        fd, path = tempfile.mkstemp(suffix=f"_{chip}.json")
        os.close(fd)
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost",
                   TPU_ACCELERATOR_TYPE=CHIPS[chip]["accel"], TPU_SKIP_MDS_QUERY="1",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # one libtpu per child, at once
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", chip, "--_out", path,
               "--attention-impl", args.attention_impl] + (["--smoke"] if args.smoke else []) + \
              (["--quick"] if args.quick else []) + (["--full"] if args.full else []) + \
              (["--iters-only"] if args.iters_only else [])
        errf = tempfile.TemporaryFile(mode="w+")
        procs[chip] = (subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=errf, text=True), path, errf)
        log(f"started {chip} ({CHIPS[chip]['topology']})")
    out = {}
    for chip, (p, path, errf) in procs.items():
        try:
            rc = p.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        errf.seek(0)
        err = [l for l in errf.read().splitlines()
               if not any(s in l for s in ("E0000", "Logging before InitGoogle", "common_lib.cc", "Source Location",
                                           "libtpu_init_utils", "=== Source"))]
        for l in err:
            log(l)
        try:
            with open(path) as f:
                out[chip] = json.load(f)
        except Exception as e:
            out[chip] = {"chip": chip, "points": [], "error": f"child rc={rc}: {e}; {' | '.join(err[-5:])}"}
        out[chip]["rc"] = rc
    return out


def fit_memory(r: dict, spec: dict) -> dict:
    """weights + B*C*kv + other, other = base + slope * B * prompt_bucket (prefill activations), from the
    whole-program points; the largest capacity per batch, with a 512-token prompt and with the prompt
    filling the context."""
    kv = r["kv_bytes_per_token"]["target"] + r["kv_bytes_per_token"]["draft"]
    whole = [p for p in r["points"] if p["kind"] == "whole" and "total_bytes" in p and p["draft"]]
    if not whole:
        return {}
    weights = min(p["argument_size_in_bytes"] for p in whole)
    pts = sorted((p["batch"] * _pow2(p["prompt"]), p["total_bytes"] - weights - p["batch"] * p["capacity"] * kv)
                 for p in whole)
    if len(pts) >= 2 and pts[-1][0] != pts[0][0]:
        (t0, x0), (t1, x1) = pts[0], pts[-1]
        slope = max(0.0, (x1 - x0) / (t1 - t0))
        base = x0 - slope * t0
    else:  # one point: the part that is neither weights nor KV is taken as prefill temporaries
        t0, x0 = pts[0]
        slope, base = max(0.0, x0) / t0, 0.0
    out = {"weights_bytes": weights, "kv_bytes_per_token": kv, "other_base_bytes": base,
           "other_per_prefill_token_bytes": slope, "model_max_positions": r.get("max_positions"),
           "other_by_point": [dict(prefill_tokens=t, bytes=x) for t, x in pts],
           "max_context_prompt512": {}, "max_context_prompt_fills": {}}
    for B in (1, 8, 32, 64):
        free = spec["hbm"] - weights - base
        out["max_context_prompt512"][B] = int(max(0, (free - slope * B * 512) / (B * kv)))
        out["max_context_prompt_fills"][B] = int(max(0, free / (B * (kv + slope))))
    return out


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


def h200_numbers(h200_json: str | None, tc_bytes: dict) -> dict:
    res = {}
    if h200_json and os.path.exists(h200_json):
        with open(h200_json) as f:
            d = json.load(f)
        for k, r in d.get("curves", {}).items():
            res[k] = dict(ms=r.get("ms_per_iter"), floor_ms=r.get("floor_ms"))
    return res


def report(results: dict, args) -> dict:
    lines = []
    P = lines.append
    P("")
    P("=" * 110)
    P("TPU PROJECTIONS for the " + ("tiny smoke model" if args.smoke else "Qwen3-8B + 5-layer DFlash draft (S=16), bf16")
      + " -- from the TPU compiler's own accounting (memory_analysis, cost_analysis) on a CPU host;")
    P("NOT MEASUREMENTS. ms/iter = bytes accessed / HBM bandwidth (or flops / peak when larger); attention "
      f"impl {args.attention_impl}.")
    P("")
    P("GB/iter = the compiler's bytes accessed for one iteration; ideal = parameters read once per use (the LM head "
      "twice for DFlash) + KV at capacity + the KV rows written, ms at the chip's HBM bandwidth. (whole program: "
      "prefill + one loop body)")
    P(f"{'chip':5} {'program':36} {'args GB':>8} {'out GB':>7} {'temp GB':>8} {'total GB':>9} {'HBM':>5} {'fits':>5} "
      f"{'GB/iter':>8} {'TFLOP':>7} {'ms proj':>8} {'bound':>6} {'ideal GB':>8} {'ideal ms':>8} {'compile':>8}")
    summary = {}
    pb = None
    for chip, r in results.items():
        spec = CHIPS[chip]
        if "param_bytes" not in r:  # an older --json: compute them here (abstract, no compile)
            if pb is None:
                sys.path.insert(0, REPO)
                os.environ.setdefault("JAX_PLATFORMS", "cpu")
                pb = param_bytes(*configs(args.smoke))
            r["param_bytes"] = pb
        if r.get("error") and not r["points"]:
            P(f"{chip:5} ERROR {r['error'][:200]}")
            continue
        for p in r["points"]:
            if "error" in p:
                P(f"{chip:5} {p['label']:36} {'OOM: does not fit' if p.get('oom') else 'ERROR'}  {p['error'][:120]}")
                continue
            proj = ""
            bound = ""
            if p["kind"] == "iter":
                pb = r.get("param_bytes")
                if pb:  # the floor: parameters read once + KV over the capacity
                    S = 16 if p["draft"] else 1
                    ideal = pb["target_read"] + (pb["draft"] + pb["lm_head"] if p["draft"] else 0) + \
                        p["batch"] * p["capacity"] * (r["kv_bytes_per_token"]["target"] +
                                                      (r["kv_bytes_per_token"]["draft"] if p["draft"] else 0))
                    if "ideal_by_kind" in p:  # + the KV rows the iteration writes (tpu_bytes.ideal_bytes)
                        ideal = p["ideal_by_kind"]["total"]
                    p["ideal_bytes"] = ideal
                    p["ideal_ms"] = 1000 * max(ideal / spec["bw"], p["flops"] / spec["flops"])
                tb = p["bytes_accessed"] / spec["bw"]
                tf = p["flops"] / spec["flops"]
                p["proj_ms"] = 1000 * max(tb, tf)
                p["proj_bound"] = "bytes" if tb >= tf else "flops"
                proj, bound = f"{p['proj_ms']:8.2f}", p["proj_bound"]
                ideal = (f"{p['ideal_bytes'] / 1e9:8.2f} {p['ideal_ms']:8.2f}" if "ideal_ms" in p else f"{'':8} {'':8}")
                gb = f"{p['bytes_accessed'] / 1e9:8.2f}"
                tfl = f"{p['flops'] / 1e12:7.2f}"
            else:
                gb = f"{'(' + format(p['bytes_accessed'] / 1e9, '.1f') + ')':>8}"
                tfl = f"{'(' + format(p['flops'] / 1e12, '.1f') + ')':>7}"
                ideal = f"{'':8} {'':8}"
            P(f"{chip:5} {p['label']:36} {p['argument_size_in_bytes'] / 1e9:8.2f} {p['output_size_in_bytes'] / 1e9:7.2f} "
              f"{p['temp_size_in_bytes'] / 1e9:8.2f} {p['total_bytes'] / 1e9:9.2f} {spec['hbm'] / 1e9:5.0f} "
              f"{'yes' if p['fits'] else 'NO':>5} {gb} {tfl} {proj:>8} {bound:>6} {ideal} {p['compile_s']:7.0f}s")
        fm = fit_memory(r, spec)
        r["memory_fit"] = fm
        if fm:
            mp = fm.get("model_max_positions") or 0
            P(f"{chip:5} memory model: weights {fm['weights_bytes'] / 1e9:.2f} GB + B x C x {fm['kv_bytes_per_token'] / 1024:.0f} KiB "
              f"(target+draft KV per token) + {fm['other_base_bytes'] / 1e9:.2f} GB + "
              f"{fm['other_per_prefill_token_bytes'] / 1e3:.0f} KB x B x prompt bucket (prefill temporaries)")
            for key, what in (("max_context_prompt512", "prompt 512"), ("max_context_prompt_fills", "prompt = context")):
                P(f"{chip:5} largest context that fits {spec['hbm'] / 1e9:.0f} GB, {what}: "
                  + ", ".join(f"B={b}: {c:,}" + ("*" if mp and c > mp else "") for b, c in fm[key].items())
                  + (f"   (* past the model's {mp:,} positions)" if mp else ""))
        summary[chip] = r
    P("")
    P("bytes named (scripts/tpu_bytes.py, per op of the optimized HLO): 'compiler' = cost_analysis; 'HBM' = the")
    P("traffic to and from HBM (weights the compiler prefetches into VMEM by async slices are charged by its cost")
    P("model at the slice's read and write, at the ConcatBitcast that joins the pieces and again at the matmul that")
    P("reads the VMEM copy: one HBM read, four charges). x ideal = / ideal (weights once per use + KV at capacity).")
    P(f"{'chip':5} {'program':36} {'compiler':>9} {'x ideal':>7} {'HBM GB':>8} {'x ideal':>7} {'ms HBM':>7}  "
      "HBM by kind GB: " + " ".join(k for k in ("weights", "lm_head", "kv_read", "kv_write", "copies", "activations")))
    for chip, r in results.items():
        for p in r["points"]:
            if p.get("kind") != "iter" or "hbm_bytes" not in p or "ideal_bytes" not in p:
                continue
            hb = p["hbm_bytes_by_kind"]
            p["hbm_ms"] = 1000 * max(p["hbm_bytes"] / CHIPS[chip]["bw"], p["flops"] / CHIPS[chip]["flops"])
            P(f"{chip:5} {p['label']:36} {p['bytes_accessed'] / 1e9:9.2f} {p['bytes_accessed'] / p['ideal_bytes']:7.2f} "
              f"{p['hbm_bytes'] / 1e9:8.2f} {p['hbm_bytes'] / p['ideal_bytes']:7.3f} {p['hbm_ms']:7.2f}  "
              + " ".join(f"{hb.get(k, 0) / 1e9:.3f}" for k in ("weights", "lm_head", "kv_read", "kv_write", "copies",
                                                               "activations")))
    P("")
    gpu = h200_numbers(args.h200_json, {})
    P("per-iteration ms: TPU compiler's bytes / HBM bandwidth ('proj'), the ideal bytes / HBM bandwidth ('ideal'),")
    P("the H200 floor (ideal bytes / 4.23 TB/s copy bandwidth, or flops / 780 TFLOP/s when larger) and, with")
    P("--h200-json, the H200 measurement. 'ideal' uses the compiler's flops / peak bf16 when that is larger.")
    P(f"{'program':36} " + " ".join(f"{c + ' proj':>9} {c + ' ideal':>9}" for c in results)
      + f" {'H200 floor':>10} {'H200 meas.':>10}")
    labels = []
    for r in results.values():
        for p in r["points"]:
            if p["kind"] == "iter" and p["label"] not in labels:
                labels.append(p["label"])
    keymap = {"DFlash iteration B=1 C=1024": "dflash_b1", "plain step B=1 C=1024": "plain_b1",
              "DFlash iteration B=32 C=1024": "dflash_b32", "DFlash iteration B=1 C=33792": "dflash_long_pallas"}
    for lab in labels:
        cells, h200_floor = [], None
        for chip, r in results.items():
            p = next((q for q in r["points"] if q["label"] == lab and "proj_ms" in q), None)
            cells.append(f"{p['proj_ms']:9.2f} {p.get('ideal_ms', float('nan')):9.2f}" if p else f"{'-':>9} {'-':>9}")
            if p and h200_floor is None and "ideal_bytes" in p:
                h200_floor = 1000 * max(p["ideal_bytes"] / H200["copy_bw"], p["flops"] / H200["gemm_flops"])
        g = gpu.get(keymap.get(lab, ""), {})
        meas = g.get("ms")
        P(f"{lab:36} " + " ".join(cells) + f" {h200_floor if h200_floor is not None else float('nan'):10.2f} "
          f"{(format(meas, '10.2f') if meas else '-'):>10}")
    P("=" * 110)
    print("\n".join(lines), flush=True)
    return {"results": results, "report": lines}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (about a minute)")
    ap.add_argument("--quick", action="store_true", help="iterations only (no whole-program memory point), ~2 min")
    ap.add_argument("--full", action="store_true", help="add the 512-prompt program and the B=32 iteration (~8-10 min)")
    ap.add_argument("--iters-only", action="store_true",
                    help="only the one-iteration points (with --full: DFlash and plain, B=1 and 32, 32k context)")
    ap.add_argument("--chips", default="v6e,v5p", help=f"comma-separated subset of {','.join(CHIPS)}")
    ap.add_argument("--attention-impl", default="pallas_tpu", help="pallas_tpu (the Mosaic kernel) or xla")
    ap.add_argument("--h200-json", default=None, help="bench_gpu.json of an H200 run, for the side-by-side column")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--timeout-s", type=float, default=1500)
    ap.add_argument("--report-only", default=None, help="re-print the report of an earlier --json (no compiling)")
    ap.add_argument("--_child", dest="child", help=argparse.SUPPRESS)
    ap.add_argument("--_out", dest="out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _LOG_TO[0] = sys.stdout  # the parent passes our stdout through live; stderr (libtpu noise) is filtered
        sys.path.insert(0, REPO)
        child(args.child, args.out, args.smoke, args.quick, args.attention_impl, args.full, args.iters_only)
        return
    chips = [c.strip() for c in args.chips.split(",") if c.strip()]
    bad = [c for c in chips if c not in CHIPS]
    if bad:
        ap.error(f"unknown chips {bad}; known {list(CHIPS)}")
    t = time.perf_counter()
    if args.report_only:
        with open(args.report_only) as f:
            results = json.load(f)["results"]
        report(results, args)
        return
    results = run_children(chips, args)
    out = report(results, args)
    out["wall_s"] = time.perf_counter() - t
    print(f"(total {out['wall_s']:.0f}s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
