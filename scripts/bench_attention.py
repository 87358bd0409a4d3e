"""Benchmark the block-attention kernels on a GPU (H200 target) against XLA, cuDNN and tokamax.

    python scripts/bench_attention.py              # on the GPU machine, ~3-4 minutes
    python scripts/bench_attention.py --smoke      # tiny sizes on CPU (kernel in interpret mode)

Qwen3-8B attention (32 q / 8 kv heads, head_dim 128, bf16, block S = 16), the DFlash draft pattern
(k_end = len + S for every row) and the verify pattern (k_end = len + t + 1), context 1k / 8k / 32k,
batch 1 / 8 / 32; then prefill (k_end = t + 1) at T = 512 and 4k. For each: the Pallas Triton kernel
(default config, checked against the reference on the device first), the XLA path, cuDNN through
jax.nn.dot_product_attention (cache in its [B, C, H, D] layout), tokamax if importable; then a sweep of
kernel variants (block_k, num_warps, num_stages, kv splits) until the time budget runs out.

Time: a jitted call chains the op over up to 8 rotated K/V buffers (from 16k context on they total
well over the L2 size, so L2 cannot serve the cache), each call's output the next call's query, so
the calls run back to back on the device and none can be dropped or merged. Two such programs, one
pass and three passes over the buffers, are timed (median over many calls after warm-up); the
difference divided by the extra calls is the time of one call on the device, without the ~45 us
host dispatch and sync that a single timed call pays (the previous method's floor for small cases). The XLA path runs first and its output checks the others. Bandwidth: K/V bytes the op must read (the first k_end keys) / time, shown against the
device's measured copy bandwidth (a large device-to-device copy: bytes read + written / time).
Prints one table at the end and writes $OUT/bench_attention.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels.attention import gpu  # noqa: E402

L2_BYTES = 60 << 20           # H200: 50 MiB L2; rotate buffers totalling >= 4x this
BUF_BYTES_CAP = 24 << 30      # never allocate more than this for rotated K/V buffers


# ---------------------------------------------------------------------------------------- timing

class _Stop(BaseException):
    """SIGTERM (e.g. `timeout`): stop measuring, still print the table and write the JSON.
    A BaseException so the per-impl `except Exception` guards do not swallow it."""


def _on_sigterm(signum, frame):
    raise _Stop()


def _time_calls(fn, args, *, min_reps: int, max_reps: int, target_s: float) -> float:
    """Median wall time of fn(*args) (seconds), after two warm-up calls (compile + first run)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, target_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chained(op, passes: int):
    """jit(q, e, ks, vs) -> (first output, last output): `passes` rounds over the buffers, each
    call's output the next call's q (same shape), so the device runs passes * len(ks) dependent
    calls back to back from one dispatch."""
    def f(q, e, ks, vs):
        first = None
        for _ in range(passes):
            for k, v in zip(ks, vs):
                q = op(q, k, v, e).astype(q.dtype)
                first = q if first is None else first
        return first, q
    return jax.jit(f)


CHAIN_PASSES = 3    # the long program's rounds over the buffers; the short one makes one


def per_call_time(f1, f3, args, n_buf: int, opts: dict) -> tuple[float, float]:
    """(seconds of one call on the device, the short program's wall time): the difference of the
    1-pass and the CHAIN_PASSES-pass chains over the extra calls; when noise exceeds the difference,
    the long program's average."""
    t1 = _time_calls(f1, args, **opts)
    t3 = _time_calls(f3, args, **opts)
    t = (t3 - t1) / ((CHAIN_PASSES - 1) * n_buf)
    return (t if t > 0 else t3 / (CHAIN_PASSES * n_buf)), t1


def device_call_time(f1, args, n_buf: int, reps: int = 3, parts: dict | None = None) -> float:
    """Seconds of device time per call: the kernels' own durations in a jax.profiler trace of `reps`
    runs of the one-pass chain (every kernel of the op, the split merge included), so host timing
    jitter, dispatch and launch gaps drop out. f1 must be compiled and warm. parts: filled with the
    seconds per call of each kernel name. The wall-clock difference (`per_call_time`) moved a lot
    between rounds at B=1, while rounds of this agree closely (measured: docs/perf-log.md, the
    attention kernel's calls)."""
    import tempfile

    from bench_gpu import _find_trace, summarize_trace   # scripts/ is on sys.path (this script's dir)
    d = tempfile.mkdtemp(prefix="attn_prof_")
    with jax.profiler.trace(d):
        for _ in range(reps):
            jax.block_until_ready(f1(*args))
    path = _find_trace(d)
    if path is None:
        raise RuntimeError(f"no trace written under {d}")
    summary = summarize_trace(path)
    if parts is not None:
        parts.update({name: t / 1e6 / (reps * n_buf) for name, (t, _) in summary["by_name"].items()})
    return summary["busy_ms"] / 1e3 / (reps * n_buf)


def measure_bandwidth(nbytes: int, opts, device_time: bool = False) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a device-to-device copy counted as bytes read + written
    (best of a bf16 and an f32 elementwise pass), and a read-only pass (a sum). device_time: timed
    from a profiler trace (the kernels' own durations), like the ops it is compared with."""
    def seconds(f, x):
        if device_time:
            jax.block_until_ready(f(x))
            t = device_call_time(f, (x,), 1)
            if t > 0:           # 0: no kernel in the trace (a memcpy, or the CPU): wall clock
                return t
        return _time_calls(f, (x,), **opts)
    best_copy = 0.0
    for dt in (jnp.bfloat16, jnp.float32):
        x = jnp.zeros((nbytes // jnp.dtype(dt).itemsize,), dt) + 1
        # one read and one write per element; a jit output never aliases an undonated input, so
        # jnp.copy is a real device-to-device copy (a memcpy), a * 2 an elementwise kernel.
        for f in (jax.jit(jnp.copy), jax.jit(lambda a: a * 2)):
            best_copy = max(best_copy, 2 * nbytes / seconds(f, x))
        del x
    x = jnp.zeros((nbytes // 4,), jnp.float32) + 1
    read = nbytes / seconds(jax.jit(jnp.sum), x)
    del x
    return best_copy, read


def read_ceiling_seconds(k_end, ks, vs, n_buf: int) -> float:
    """Device seconds per buffer pair for a plain XLA reduction over exactly the K/V bytes the
    attention must read (keys [0, max k_end)): what one kernel that only reads them reaches at this
    size, launch ramp included; the ceiling for that row. Profiler-timed like --device-time."""
    kmax = int(np.asarray(k_end).max())
    f = jax.jit(lambda ks, vs: [jnp.sum(k[:, :, :kmax], dtype=jnp.float32)
                                + jnp.sum(v[:, :, :kmax], dtype=jnp.float32) for k, v in zip(ks, vs)])
    jax.block_until_ready(f(ks, vs))
    return device_call_time(f, (ks, vs), n_buf)


def warm_up_device(seconds: float):
    """Keep the GPU busy until its clocks have ramped up (an idle H200 sits at a few hundred MHz)."""
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(f(x))


# ----------------------------------------------------------------------------------------- cases

def k_end_for(pattern: str, B: int, T: int, ctx: int) -> jnp.ndarray:
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    if pattern == "verify":
        e = ctx + t + 1
    elif pattern == "draft":
        e = jnp.full((1, T), ctx + T, jnp.int32)
    elif pattern == "prefill":
        e = t + 1
    else:
        raise ValueError(pattern)
    return jnp.broadcast_to(e, (B, T)).astype(jnp.int32)


def kv_read_bytes(k_end, Hkv, D, itemsize) -> int:
    """Bytes of K and V the op must read: per batch row, the keys up to its largest k_end."""
    per_row = np.asarray(k_end).max(axis=1)
    return int(2 * Hkv * D * itemsize * per_row.sum())


def n_buffers(alloc: int) -> int:
    """How many rotated K/V buffers of `alloc` bytes: >= 4x the L2 in total, 2 to 8, within the cap."""
    return int(min(max(2, math.ceil(4 * L2_BYTES / alloc)), 8, max(1, BUF_BYTES_CAP // alloc)))


def make_buffers(n, B, Hkv, C, D, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 2 * n)
    ks = [jax.random.normal(keys[2 * i], (B, Hkv, C, D), dtype) for i in range(n)]        # [B,Hkv,C,D]
    vs = [jax.random.normal(keys[2 * i + 1], (B, Hkv, C, D), dtype) for i in range(n)]
    return ks, vs


# ------------------------------------------------------------------------------------ the impls

def pallas_op(cfg, interpret):
    return lambda q, k, v, e: gpu.block_attention(q, k, v, e, interpret=interpret, **cfg)


def xla_op(q, k, v, e):
    return pallas_kernels.xla_block_attention(q, k, v, e)


def cudnn_op(pattern):
    """jax.nn.dot_product_attention(implementation="cudnn") over the [B, C, Hkv, D] layout."""
    def op(q, k, v, e):  # k, v: [B, C, Hkv, D]
        C = k.shape[1]
        if pattern == "draft":      # every row sees len + S keys: cuDNN's own padding mask
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=e[:, 0],
                                                implementation="cudnn")
        if pattern == "prefill":    # T == C, aligned causal
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        # verify: causal with an offset; an additive bias [B, 1, T, C] expresses it exactly
        visible = jnp.arange(C)[None, None, :] < e[:, :, None]                   # [B, T, C]
        bias = jnp.where(visible, 0.0, -1e9).astype(q.dtype)[:, None]
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")
    return op


def tokamax_op():
    import tokamax  # noqa: F401  (ImportError -> reported as not available)

    def op(q, k, v, e):  # k, v: [B, C, Hkv, D]
        C = k.shape[1]
        mask = (jnp.arange(C)[None, None, :] < e[:, :, None])[:, None]          # [B, 1, T, C]
        return tokamax.dot_product_attention(q, k, v, mask=mask, implementation="triton")
    return op


def to_bthd(ks, vs):
    """The cache in the [B, C, Hkv, D] layout cuDNN / tokamax take (done once, outside timing)."""
    return [jnp.swapaxes(k, 1, 2) for k in ks], [jnp.swapaxes(v, 1, 2) for v in vs]


# ---------------------------------------------------------------------------------- correctness

def check_kernel(interpret: bool, verbose: bool, impl: str = "gpu") -> list[dict]:
    """The Pallas GPU kernel against the reference on the device: ragged rows (0, 1, capacity,
    mid-tile), GQA 1/4/8, f32/bf16, head_dim 64/128/256, decode, verify, draft, prefill, kv splits."""
    rng = np.random.default_rng(0)
    kernel = gpu.block_attention
    cases = [  # B, T, Hq, Hkv, C, D, dtype, pattern, tuning
        (3, 1, 32, 8, 4096, 128, jnp.bfloat16, "ragged", {}),
        (2, 16, 32, 8, 8192, 128, jnp.bfloat16, "verify", {}),
        (2, 16, 32, 8, 8192, 128, jnp.bfloat16, "draft", dict(kv_splits=7)),
        (2, 16, 32, 8, 1024, 128, jnp.float32, "verify", {}),
        (2, 16, 16, 2, 2048, 64, jnp.bfloat16, "ragged", dict(kv_splits=4, block_k=64)),
        (2, 8, 4, 4, 1024, 256, jnp.float32, "ragged", {}),
        (2, 16, 8, 1, 1024, 256, jnp.bfloat16, "draft", {}),
        (1, 1024, 32, 8, 1024, 128, jnp.bfloat16, "prefill", {}),
        (1, 512, 16, 2, 640, 64, jnp.float32, "prefill", {}),
    ]
    if interpret:   # CPU: the interpreter is slow; small shapes, same patterns
        cases = [(B, min(T, 64), 8, 2 if Hq // Hkv > 1 else 8, min(C, 256), D, dt, pat, tun)
                 for (B, T, Hq, Hkv, C, D, dt, pat, tun) in cases[::2]]
    out = []
    for B, T, Hq, Hkv, C, D, dtype, pattern, tuning in cases:
        kq, kk, kv = jax.random.split(jax.random.key(B * T + C), 3)
        q = jax.random.normal(kq, (B, T, Hq, D), dtype)
        k = jax.random.normal(kk, (B, Hkv, C, D), dtype)
        v = jax.random.normal(kv, (B, Hkv, C, D), dtype)
        if pattern == "ragged":
            e = rng.integers(0, C + 1, size=(B, T))
            e.flat[0], e.flat[-1] = 1, C
            if e.size > 2:
                e.flat[1] = 0
            e = jnp.asarray(e, jnp.int32)
        else:
            e = k_end_for(pattern, B, T, C - T if pattern != "prefill" else 0)
        rec = dict(B=B, T=T, Hq=Hq, Hkv=Hkv, C=C, D=D, dtype=jnp.dtype(dtype).name, pattern=pattern,
                   tuning=tuning)
        try:
            kw = dict(interpret=interpret)
            got = jax.jit(lambda q, k, v, e: kernel(q, k, v, e, **kw, **tuning))(q, k, v, e)
            # The oracle in f32 on the host CPU: exact, and no GPU compile (XLA's autotuning of a
            # fresh GPU program costs seconds) for each of these shapes.
            cpu = jax.devices("cpu")[0]
            host = lambda x: jax.device_put(x.astype(jnp.float32), cpu)
            ref = np.asarray(jax.jit(pallas_kernels.reference_block_attention)(
                host(q), host(k), host(v), jax.device_put(e, cpu)))
            err = float(np.max(np.abs(np.asarray(got.astype(jnp.float32)) - ref)))
            tol = 1e-5 if dtype == jnp.float32 else 2e-2 * float(np.max(np.abs(ref)))
            rec.update(max_abs_err=err, ok=bool(err <= tol and np.isfinite(err)))
        except Exception as ex:  # noqa: BLE001
            rec.update(ok=False, error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}")
            if verbose:
                traceback.print_exc()
        out.append(rec)
        print(f"check {impl} {pattern:8s} B={B} T={T} Hq={Hq} Hkv={Hkv} C={C} D={D} {rec['dtype']:8s} "
              f"{tuning}: {'ok' if rec['ok'] else 'FAIL'} {rec.get('max_abs_err', rec.get('error'))}",
              flush=True)
    return out


# --------------------------------------------------------------------------------------- driver

AB_CASES = (  # (B, ctx, variants): default_config against each variant, verify pattern; "xla" = reference
    # the short cache of the prompt-512 loop, the long B=1 rows, and B=8 8k (history: docs/perf-log.md)
    (1, 512, (dict(kv_splits=4, min_chunk=128), "xla")),
    (1, 8192, (dict(kv_splits=32),)),
    (1, 32768, (dict(kv_splits=32), "xla")),
    (8, 8192, (dict(kv_splits=2),)),
)


def ab_rounds(args, copy_bw: float, opts: dict) -> list[dict]:
    """Repeated A/B of default_config against variants (AB_CASES): every program compiled once,
    then all timed in turn, `--ab-rounds` times; the median per-call time of each. The sweep
    times every variant once, and its single samples moved by 10-20% between calls."""
    Hq, Hkv, D, S, dtype = 32, 8, 128, 16, jnp.bfloat16
    cases, interpret = AB_CASES, False
    if args.smoke:          # CPU: tiny heads, the kernel in interpret mode
        Hq, Hkv, cases, interpret = 8, 2, ((1, 240, (dict(kv_splits=2), "xla")),), jax.default_backend() == "cpu"
    if args.only:       # "B:ctx,...": just these cases
        keep = {tuple(int(v) for v in x.split(":")) for x in args.only.split(",")}
        cases = [c for c in cases if (c[0], c[1]) in keep]
    out = []
    for B, ctx, variants in cases:
        C = -(-(ctx + S) // 128) * 128
        q = jax.random.normal(jax.random.key(1), (B, S, Hq, D), dtype)
        e = k_end_for("verify", B, S, ctx)
        kv_bytes = kv_read_bytes(e, Hkv, D, 2)
        n_buf = n_buffers(2 * B * Hkv * C * D * 2)
        ks, vs = make_buffers(n_buf, B, Hkv, C, D, dtype, seed=ctx + B)
        base = gpu.default_config(S, Hq // Hkv, C, D, B, Hkv, n_sms=gpu.sm_count())
        progs, errs = {}, {}
        ref = None
        for var in ("default",) + tuple(variants):
            op = xla_op if var == "xla" else pallas_op(base if var == "default" else dict(base, **var), interpret)
            name = var if isinstance(var, str) else ",".join(f"{k}={v}" for k, v in var.items())
            try:
                # --device-time reads the one-pass chain's trace: the long chain is not needed
                pair = (chained(op, 1), None if args.device_time else chained(op, CHAIN_PASSES))
                first = pair[0](q, e, ks, vs)[0].astype(jnp.float32)
                for f in filter(None, pair):
                    jax.block_until_ready(f(q, e, ks, vs))
            except Exception as ex:  # noqa: BLE001  (a variant that fails must not end the run)
                print(f"ab        {name}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0][:300]}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                continue
            if ref is None:
                ref = first          # the Triton default: every other variant must match it
            errs[name] = float(jnp.max(jnp.abs(first - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-6))
            if not errs[name] <= 2e-2:
                print(f"ab        {name}: WRONG RESULT (rel err {errs[name]:.3g} against the default)", flush=True)
                continue
            progs[name] = pair
        times = {name: [] for name in progs}
        split = {}        # --device-time: name -> (attention kernel us, everything else us), last round
        for _ in range(args.ab_rounds):
            for name, (f1, f3) in progs.items():
                if args.device_time:
                    parts = {}
                    times[name].append(device_call_time(f1, (q, e, ks, vs), n_buf, parts=parts) * 1e6)
                    attn = sum(t for n, t in parts.items() if "block_attention" in n) * 1e6
                    split[name] = (attn, sum(parts.values()) * 1e6 - attn)
                else:
                    times[name].append(per_call_time(f1, f3, (q, e, ks, vs), n_buf, opts)[0] * 1e6)
        if args.device_time:      # the same bytes read by a plain XLA reduction: the row's ceiling
            name = "read-only ceiling (XLA sum of the same bytes)"
            times[name] = [read_ceiling_seconds(e, ks, vs, n_buf) * 1e6 for _ in range(args.ab_rounds)]
            errs[name] = float("nan")
        rec = dict(B=B, ctx=ctx, default_cfg=base, kv_MB=kv_bytes / 1e6, rounds=times, results={})
        for name in times:
            us = statistics.median(times[name])
            rec["results"][name] = dict(us=us, TBps=kv_bytes / us / 1e6, rel_err=errs[name],
                                        pct_copy=100 * kv_bytes / us / 1e6 / (copy_bw / 1e12))
            if name in split:
                rec["results"][name]["kernel_us"], rec["results"][name]["other_us"] = split[name]
        out.append(rec)
        if "default" not in rec["results"]:
            continue
        d = rec["results"]["default"]["us"]
        print(f"ab      B={B:<3d} ctx={ctx:<6d} kv={kv_bytes / 1e6:.1f}MB default {base}", flush=True)
        for name, r in rec["results"].items():
            kern = (f" [attention kernel {r['kernel_us']:.1f} + merge/other {r['other_us']:.1f}us]"
                    if r.get("kernel_us") else "")
            print(f"ab        {name:48s} {r['us']:7.1f}us {r['TBps']:.2f} TB/s {r['pct_copy']:4.0f}% ({r['us'] / d:.2f}x default, err {r['rel_err']:.1e}){kern}; rounds "
                  + "/".join(f"{t:.0f}" for t in times[name]), flush=True)
        del ks, vs, q, progs
        gc.collect()
    return out


# How fast can ONE kernel read a batch-1 row's K/V at all? The read-only ceiling above is XLA's
# reduction; this sweeps Pallas Triton kernels that only stream the same [C, D] slabs, laid out and
# split as the attention reads them (grid: kv heads x splits of the keys), each tile fed to a dot
# (as the attention's are, so Triton pipelines the loads) or summed elementwise.
READ_SWEEP = dict(splits=(16, 33, 66), block=(64, 128), stages=(3, 4), warps=(4, 8), kind=("dot", "sum"))


def read_op(kmax: int, splits: int, block: int, stages: int, kind: str, interpret: bool = False,
            warps: int = 4):
    """k, v [1, Hkv, C, D] -> a small f32 array, having read keys [0, kmax) of every head once."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    chunk = math.ceil(math.ceil(kmax / splits) / block) * block      # this program's keys, whole tiles

    def kernel(k_ref, v_ref, o_ref):
        start = pl.program_id(1) * chunk
        n = jnp.maximum(pl.cdiv(jnp.minimum(start + chunk, kmax) - start, block), 0)
        D = k_ref.shape[1]
        if kind == "dot":
            ones = jnp.ones((16, block), k_ref.dtype)

            def body(i, acc):
                r = pl.multiple_of(start + i * block, block)
                for ref in (k_ref, v_ref):
                    acc = acc + lax.dot_general(ones, ref[pl.ds(r, block), :], (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.float32)
                return acc
            o_ref[...] = lax.fori_loop(0, n, body, jnp.zeros((16, D), jnp.float32))
        else:
            def body(i, acc):
                r = pl.multiple_of(start + i * block, block)
                t = k_ref[pl.ds(r, block), :].astype(jnp.float32) + v_ref[pl.ds(r, block), :].astype(jnp.float32)
                return acc + jnp.sum(t, axis=0, keepdims=True)
            o_ref[...] = jnp.broadcast_to(lax.fori_loop(0, n, body, jnp.zeros((1, D), jnp.float32)), (16, D))

    def op(k, v):
        _, Hkv, C, D = k.shape
        spec = pl.BlockSpec((None, None, C, D), lambda h, s: (0, h, 0, 0))
        return pl.pallas_call(
            kernel, grid=(Hkv, splits), in_specs=[spec, spec],
            out_specs=pl.BlockSpec((None, None, 16, D), lambda h, s: (h, s, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((Hkv, splits, 16, D), jnp.float32),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=interpret, name="read_sweep")(k, v)
    return op


def read_sweep(args, copy_bw: float) -> list[dict]:
    """B=1, 8k and 32k (verify pattern): the best streaming-read kernel over the row's K/V bytes
    (READ_SWEEP), next to the attention's default config and XLA's read-only reduction, all by device
    time in one run: is >= 75% of copy bandwidth at batch 1 reachable by any kernel that reads
    those bytes?"""
    Hq, Hkv, D, S, dtype = 32, 8, 128, 16, jnp.bfloat16
    grid = READ_SWEEP
    cases, interpret = (8192, 32768), False
    if args.smoke:
        Hq, Hkv, cases, interpret = 8, 2, (240,), jax.default_backend() == "cpu"
        grid = dict(splits=(2,), block=(64,), stages=(3,), warps=(4,), kind=("dot", "sum"))
    out = []
    for ctx in cases:
        C = -(-(ctx + S) // 128) * 128
        e = k_end_for("verify", 1, S, ctx)
        kmax = ctx + S
        kv_bytes = kv_read_bytes(e, Hkv, D, 2)
        n_buf = n_buffers(2 * Hkv * C * D * 2)
        ks, vs = make_buffers(n_buf, 1, Hkv, C, D, dtype, seed=ctx)
        q = jax.random.normal(jax.random.key(1), (1, S, Hq, D), dtype)
        rec = dict(ctx=ctx, kv_MB=kv_bytes / 1e6, results={})

        def record(name, seconds):
            """Time `seconds()` (device seconds per buffer pair) and print it against the copy rate."""
            try:
                us = seconds() * 1e6
            except Exception as ex:  # noqa: BLE001
                print(f"read      ctx={ctx} {name}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)
                return
            rec["results"][name] = dict(us=us, pct_copy=100 * kv_bytes / us / 1e6 / (copy_bw / 1e12))
            print(f"read      ctx={ctx:<6d} {name:44s} {us:7.1f}us {rec['results'][name]['pct_copy']:5.1f}% of copy", flush=True)

        def device_time(f, fargs):
            jax.block_until_ready(f(*fargs))
            return device_call_time(f, fargs, n_buf)

        base = gpu.default_config(S, Hq // Hkv, C, D, 1, Hkv, n_sms=gpu.sm_count())
        record("attention (default config)",
               lambda: device_time(chained(pallas_op(base, interpret), 1), (q, e, ks, vs)))
        record("read-only ceiling (XLA sum)", lambda: read_ceiling_seconds(e, ks, vs, n_buf))
        for kind, splits, block, stages, warps in itertools.product(
                grid["kind"], grid["splits"], grid["block"], grid["stages"], grid["warps"]):
            op = read_op(kmax, splits, block, stages, kind, interpret, warps)
            f = jax.jit(lambda ks, vs, op=op: [op(k, v) for k, v in zip(ks, vs)])
            record(f"read {kind} splits={splits} block={block} stages={stages} warps={warps}",
                   lambda: device_time(f, (ks, vs)))
        reads = {n: r for n, r in rec["results"].items() if n.startswith("read ") and r}
        if reads:
            best = min(reads, key=lambda n: reads[n]["us"])
            rec["best_read"] = best
            print(f"read      ctx={ctx:<6d} BEST streaming read: {best} {reads[best]['us']:.1f}us "
                  f"= {reads[best]['pct_copy']:.1f}% of copy bandwidth", flush=True)
        out.append(rec)
        del ks, vs
        gc.collect()
    return out


def run(args) -> dict:
    smoke = args.smoke
    interpret = smoke and jax.default_backend() == "cpu"
    dtype = jnp.bfloat16
    if smoke:
        Hq, Hkv, D, S = 8, 2, 128, 16
        contexts, batches, prefill_T = [240], [2], [64]   # B = 2: batching and the split-KV path in one row
        copy_bytes = 8 << 20
        opts = dict(min_reps=2, max_reps=3, target_s=0.05)
        n_sms = 8               # so the split-KV path runs in the smoke test too
        budget_s = 1e9
    else:
        Hq, Hkv, D, S = 32, 8, 128, 16
        contexts, batches, prefill_T = [1024, 8192, 32768], [1, 8, 32], [512, 4096]
        copy_bytes = 2 << 30
        opts = dict(min_reps=8, max_reps=100, target_s=0.08)
        n_sms = gpu.sm_count()
        budget_s = args.budget_s
    t_start = time.perf_counter()
    deadline = t_start + budget_s
    itemsize = jnp.dtype(dtype).itemsize

    dev = jax.devices()[0]
    info = dict(device=str(getattr(dev, "device_kind", dev.platform)), backend=jax.default_backend(),
                jax=jax.__version__, smoke=smoke, heads=(Hq, Hkv), head_dim=D, block=S,
                dtype=jnp.dtype(dtype).name)
    try:
        import tokamax  # noqa: F401
        have_tokamax = True
    except Exception as e:  # noqa: BLE001
        have_tokamax = False
        info["tokamax"] = f"not importable: {type(e).__name__}: {e}"
    print(f"# {info}", flush=True)
    if not smoke:
        warm_up_device(1.0)
    copy_bw, read_bw = measure_bandwidth(copy_bytes, opts, args.device_time)
    info["copy_bw_TBps"], info["read_bw_TBps"] = copy_bw / 1e12, read_bw / 1e12
    print(f"# device copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write), "
          f"read-only {read_bw / 1e12:.3f} TB/s", flush=True)

    if args.read_sweep:
        return dict(info=info, checks=[], cases=[], prefill=[], sweep=[], read=read_sweep(args, copy_bw))
    if args.ab:
        checks = []
        ab = ab_rounds(args, copy_bw, opts)
        n_bad = sum(not c["ok"] for c in checks)
        print(f"# kernel checks: {len(checks) - n_bad}/{len(checks)} ok")
        return dict(info=info, checks=checks, cases=[], prefill=[], sweep=[], ab=ab)
    checks, results, prefill_results, sweep = [], [], [], []
    ref_outs = {}       # (pattern, B, ctx or T) -> the XLA path's output, the check for variants

    def timed(name, op, q, e, ks, vs, kv_bytes, n_buf, ref=None, outs=None):
        """Time op over the rotated buffers (one jitted call runs it on each buffer); check its
        output against ref first if given; put its first output in outs[name] if given."""
        rec = dict(impl=name)
        try:
            f = chained(op, 1)
            f_long = None if args.device_time else chained(op, CHAIN_PASSES)
            out = f(q, e, ks, vs)[0].astype(jnp.float32)          # compiles; also the warm-up
            if outs is not None:
                outs[name] = out
            if ref is not None:
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-6))
                rec["rel_err"] = err
                if not err <= 2e-2:
                    rec["error"] = f"wrong result: rel err {err:.3g}"
                    return rec
            if args.device_time:
                t, t1 = device_call_time(f, (q, e, ks, vs), n_buf), float("nan")
            else:
                t, t1 = per_call_time(f, f_long, (q, e, ks, vs), n_buf, opts)
            rec.update(us=t * 1e6, TBps=kv_bytes / t / 1e12, pct_copy=100 * kv_bytes / t / copy_bw,
                       us_single_dispatch=t1 / n_buf * 1e6)
        except Exception as ex:  # noqa: BLE001  (one failing impl must not end the run)
            rec["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
            if args.verbose:
                traceback.print_exc()
        return rec

    def best_of(row, candidates, timing_args, tag: dict, describe):
        """Time each (variant, cfg) that differs from the row's default config until the deadline;
        every timing goes to `sweep`; returns the fastest record (the default's included)."""
        best = dict(row["pallas"], cfg=row["default_cfg"])
        for var, cfg in candidates:
            if time.perf_counter() > deadline:
                break
            if cfg == row["default_cfg"]:
                continue
            rec = timed("pallas", pallas_op(cfg, interpret), *timing_args)
            rec["cfg"] = cfg
            line = describe(rec)
            sweep.append(dict(tag, **rec))
            if args.sweep_only:
                print(f"  {line}  {var}", flush=True)
            if "us" in rec and ("us" not in best or rec["us"] < best["us"]):
                best = rec
        return best

    def fmt(rec):
        if rec is None:
            return "-"
        if "error" in rec:
            return "ERR"
        return f"{rec['us']:.0f}us {rec['TBps']:.2f}TB/s"

    stopped = False
    try:
        checks.extend([] if args.sweep_only or args.only else check_kernel(interpret, args.verbose))
        # ---- decode-time patterns: draft and verify over a long cache
        cases = [(p, B, ctx) for ctx in contexts for B in batches for p in ("verify", "draft")]
        if args.focus:      # the small batches that miss the bandwidth goal, and 1k at B=1
            cases = [(p, B, ctx) for (p, B, ctx) in cases if B <= 8 and (ctx >= 8192 or B == 1)]
        if args.only:       # "B:ctx,B:ctx": just these rows, no sweep
            keep = {tuple(int(v) for v in x.split(":")) for x in args.only.split(",")}
            cases = [(p, B, ctx) for (p, B, ctx) in cases if (B, ctx) in keep]
            prefill_T = []
        if args.sweep_only:
            cases = [("verify", B, ctx) for ctx in contexts for B in batches
                     if (B, ctx) in ((1, 32768), (8, 8192), (32, 32768), (1, 8192), (32, 1024))] or cases[:2]
            prefill_T = [4096]
        case_data = {}
        for pattern, B, ctx in cases:
            C = -(-(ctx + S) // 128) * 128
            q = jax.random.normal(jax.random.key(1), (B, S, Hq, D), dtype)                 # [B,S,Hq,D]
            e = k_end_for(pattern, B, S, ctx)                                                # [B,S]
            kv_bytes = kv_read_bytes(e, Hkv, D, itemsize)
            n_buf = n_buffers(2 * B * Hkv * C * D * itemsize)
            ks, vs = make_buffers(n_buf, B, Hkv, C, D, dtype, seed=ctx + B)
            cfg = gpu.default_config(S, Hq // Hkv, C, D, B, Hkv, n_sms=n_sms)
            row = dict(pattern=pattern, B=B, ctx=ctx, C=C, kv_MB=kv_bytes / 1e6, n_buf=n_buf,
                       default_cfg=cfg)
            # The XLA path first: its output (bf16 inputs, f32 accumulation) checks the others.
            outs = {}
            row["xla"] = timed("xla", xla_op, q, e, ks, vs, kv_bytes, n_buf, outs=outs)
            ref = outs.get("xla")
            ref_outs[(pattern, B, ctx)] = ref
            row["pallas"] = timed("pallas", pallas_op(cfg, interpret), q, e, ks, vs, kv_bytes, n_buf, ref)
            if args.device_time:      # the bytes alone: a plain XLA read of them (the row's ceiling)
                t = read_ceiling_seconds(e, ks, vs, n_buf)
                row["read"] = dict(impl="read", us=t * 1e6, TBps=kv_bytes / t / 1e12,
                                   pct_copy=100 * kv_bytes / t / copy_bw)
            if not interpret and not args.sweep_only and not args.focus:
                kt, vt = to_bthd(ks, vs)
                row["cudnn"] = timed("cudnn", cudnn_op(pattern), q, e, kt, vt, kv_bytes, n_buf, ref)
                if have_tokamax:
                    row["tokamax"] = timed("tokamax", tokamax_op(), q, e, kt, vt, kv_bytes, n_buf, ref)
                del kt, vt
            results.append(row)
            print(f"{pattern:7s} B={B:<3d} ctx={ctx:<6d} kv={kv_bytes / 1e6:8.1f}MB  pallas {fmt(row['pallas'])}"
                  f"  xla {fmt(row['xla'])}  cudnn {fmt(row.get('cudnn'))}  tokamax {fmt(row.get('tokamax'))}"
                  f"  read-only {fmt(row.get('read'))}"
                  f"  [{time.perf_counter() - t_start:.0f}s]",
                  flush=True)
            del ks, vs, ref, q
            gc.collect()

        # ---- prefill: T queries over their own T keys, causal
        for T in ([] if args.focus else prefill_T):
            C = T
            q = jax.random.normal(jax.random.key(2), (1, T, Hq, D), dtype)                  # [1,T,Hq,D]
            ks, vs = make_buffers(2, 1, Hkv, C, D, dtype, seed=T)
            e = k_end_for("prefill", 1, T, 0)
            flops = 4 * T * (T + 1) / 2 * Hq * D
            cfg = gpu.default_config(T, Hq // Hkv, C, D, 1, Hkv, n_sms=n_sms)
            row = dict(pattern="prefill", B=1, T=T, default_cfg=cfg)
            outs = {}
            row["xla"] = timed("xla", xla_op, q, e, ks, vs, 1, 2, outs=outs)
            ref = outs.get("xla")
            ref_outs[("prefill", 1, T)] = ref
            row["pallas"] = timed("pallas", pallas_op(cfg, interpret), q, e, ks, vs, 1, 2, ref)
            if not interpret:
                kt, vt = to_bthd(ks, vs)
                row["cudnn"] = timed("cudnn", cudnn_op("prefill"), q, e, kt, vt, 1, 2, ref)
                del kt, vt
            for name in ("pallas", "xla", "cudnn"):
                if row.get(name) and "us" in row[name]:
                    row[name]["TFLOPs"] = flops / (row[name]["us"] * 1e-6) / 1e12
            prefill_results.append(row)
            print(f"prefill T={T:<5d} " + "  ".join(
                f"{n} {row[n]['us']:.0f}us" if row.get(n) and "us" in row[n] else
                f"{n} {'ERR' if row.get(n) else '-'}" for n in ("pallas", "xla", "cudnn")), flush=True)
            del ks, vs, ref, q
            gc.collect()

        # ---- prefill variants
        pre_variants = [dict(block_t=16, block_k=64, num_warps=4, num_stages=3),
                        dict(block_t=32, block_k=128, num_warps=8, num_stages=2),
                        dict(block_t=32, block_k=64, num_warps=4, num_stages=3),
                        dict(block_t=32, block_k=64, num_warps=8, num_stages=4),
                        dict(block_t=32, block_k=32, num_warps=4, num_stages=4)]
        if args.sweep_only:
            pre_variants += [dict(block_t=32, block_k=128, num_warps=8, num_stages=3),
                             dict(block_t=16, block_k=128, num_warps=4, num_stages=2),
                             dict(block_t=16, block_k=32, num_warps=4, num_stages=4),
                             dict(block_t=32, block_k=32, num_warps=8, num_stages=3)]
        if smoke:
            pre_variants = pre_variants[:1]
        for row in prefill_results:
            if time.perf_counter() > deadline:
                break
            T = row["T"]
            q = jax.random.normal(jax.random.key(2), (1, T, Hq, D), dtype)
            ks, vs = make_buffers(2, 1, Hkv, T, D, dtype, seed=T)
            e = k_end_for("prefill", 1, T, 0)
            ref = ref_outs.get(("prefill", 1, T))
            flops = 4 * T * (T + 1) / 2 * Hq * D

            def tflops(rec):
                if "us" in rec:
                    rec["TFLOPs"] = flops / (rec["us"] * 1e-6) / 1e12
                return f"prefill T={T:<5d} {rec.get('us', float('nan')):.0f}us"
            best = best_of(row, [(var, dict(row["default_cfg"], **var)) for var in pre_variants],
                           (q, e, ks, vs, 1, 2, ref), dict(T=T), tflops)
            row["pallas_best"] = best
            print(f"best    prefill T={T:<5d} {best.get('us', float('nan')):.0f}us  {best.get('cfg')}", flush=True)
            del ks, vs, ref, q
            gc.collect()

        # ---- kernel variants, verify pattern (draft costs the same reads), biggest cases first
        if smoke:
            variants = [dict(block_k=64, num_warps=4, num_stages=2), dict(kv_splits=1), "splits*2"]
        elif args.sweep_only:   # the wide grid, for choosing default_config
            variants = [dict(block_k=bk, num_warps=w, num_stages=st)
                        for bk in (32, 64, 128, 256) for w in (4, 8) for st in (2, 3, 4)
                        if not (bk == 256 and st == 4)]
            variants += ["splits*2", "splits*4", "splits/2", dict(block_t=8), dict(block_t=4)]
        else:
            variants = [dict(block_k=128, num_warps=8, num_stages=3), "splits*2", "splits/2"]
        order = sorted((r for r in results if r["pattern"] == "verify"), key=lambda r: -r["kv_MB"])
        if args.only:
            order, variants = [], []
        if not args.sweep_only and not smoke:
            # the >= 8k cases, small batches first (they miss the bandwidth goal; B=32 meets it);
            # with --focus also B=1 at 1k (launch-bound: splits against XLA's fused ops)
            order = sorted((r for r in order if r["ctx"] >= 8192 or (args.focus and r["B"] == 1)),
                           key=lambda r: (r["B"] > 8, r["ctx"] < 8192, -r["kv_MB"]))
            if args.focus:  # the misses first (the points furthest from the copy bandwidth: docs/perf-log.md)
                rank = {(8, 8192): 0, (1, 32768): 1, (1, 8192): 2, (1, 1024): 3}
                order.sort(key=lambda r: rank.get((r["B"], r["ctx"]), 9))
        for row in order:
            if time.perf_counter() > deadline:
                print("# time budget reached: variant sweep stopped", flush=True)
                break
            B, ctx, C = row["B"], row["ctx"], row["C"]
            q = jax.random.normal(jax.random.key(1), (B, S, Hq, D), dtype)
            e = k_end_for("verify", B, S, ctx)
            kv_bytes = kv_read_bytes(e, Hkv, D, itemsize)
            ks, vs = make_buffers(row["n_buf"], B, Hkv, C, D, dtype, seed=ctx + B)
            ref = ref_outs.get(("verify", B, ctx))
            splits = row["default_cfg"]["kv_splits"]
            named = {"splits*2": dict(kv_splits=min(128, splits * 2)),
                     "splits*4": dict(kv_splits=min(128, splits * 4)),
                     "splits/2": dict(kv_splits=max(1, splits // 2))}
            row_vars = list(variants)
            if args.focus and ctx < 8192:           # short context: splits need a smaller min_chunk
                row_vars = [dict(kv_splits=n, min_chunk=128) for n in (2, 4, 8)]
            elif args.focus:
                row_vars = [dict(kv_splits=n) for n in (4, 8, 16, 32, 64) if n != splits]
                row_vars += [dict(num_stages=4), dict(block_k=128, num_warps=8, num_stages=3),
                             dict(block_k=32, num_stages=4)]
            elif B <= 8 and not smoke and not args.sweep_only:     # the split count, around the default
                row_vars += [dict(kv_splits=n) for n in (2, 4, 8, 16, 32) if n != splits]
            cands = [(var, dict(row["default_cfg"], **named.get(var, var) if isinstance(var, str) else var))
                     for var in row_vars]
            best = best_of(row, [(v, c) for v, c in cands if C % c["block_k"] == 0],
                           (q, e, ks, vs, kv_bytes, row["n_buf"], ref), dict(B=B, ctx=ctx),
                           lambda rec: f"B={B:<3d} ctx={ctx:<6d} {fmt(rec)}")
            row["pallas_best"] = best
            print(f"best    B={B:<3d} ctx={ctx:<6d} {fmt(best)}  {best.get('cfg')}", flush=True)
            del ks, vs, ref, q
            gc.collect()

    except _Stop:
        stopped = True
        print("# SIGTERM: measurements stopped; partial results follow", flush=True)

    # ---- the table
    print()
    print(f"device {info['device']}  jax {info['jax']}  copy {copy_bw / 1e12:.2f} TB/s  "
          f"read {read_bw / 1e12:.2f} TB/s  "
          f"(TB/s = K/V bytes read / time; % = of copy bandwidth)")
    hdr = (f"{'pattern':8s}{'B':>4s}{'ctx':>7s}{'KV MB':>9s} | {'pallas':>22s} | {'pallas best':>22s} | "
           f"{'xla':>22s} | {'cudnn':>22s} | {'tokamax':>22s} | {'read-only (ceiling)':>22s}")
    print(hdr)
    print("-" * len(hdr))

    def cell(rec):
        if rec is None:
            return f"{'-':>22s}"
        if "error" in rec:
            return f"{'ERR':>22s}"
        return f"{rec['us']:8.1f}us {rec['TBps']:5.2f} {rec['pct_copy']:4.0f}%"

    for r in results:
        print(f"{r['pattern']:8s}{r['B']:>4d}{r['ctx']:>7d}{r['kv_MB']:>9.1f} | {cell(r['pallas'])} | "
              f"{cell(r.get('pallas_best'))} | {cell(r['xla'])} | {cell(r.get('cudnn'))} | "
              f"{cell(r.get('tokamax'))} | {cell(r.get('read'))}")
    for r in prefill_results:
        cells = []
        for n in ("pallas", "pallas_best", "xla", "cudnn"):
            rec = r.get(n)
            txt = ("-" if rec is None else "ERR" if "error" in rec else
                   "%.0fus %.0fTF/s" % (rec["us"], rec.get("TFLOPs", 0.0)))
            cells.append(f"{txt:>22s}")
        print(f"{'prefill':8s}{1:>4d}{r['T']:>7d}{'':>9s} | " + " | ".join(cells) + " |")
    errors = [(r["pattern"], r.get("B"), r.get("ctx", r.get("T")), n, r[n]["error"])
              for r in results + prefill_results for n in ("pallas", "xla", "cudnn", "tokamax")
              if isinstance(r.get(n), dict) and "error" in r[n]]
    for err in errors:
        print("# error:", *err)
    info["wall_s"] = time.perf_counter() - t_start
    info["stopped_by_sigterm"] = stopped
    print(f"# total {info['wall_s']:.0f}s")
    n_bad = sum(not c["ok"] for c in checks)
    print(f"# kernel checks: {len(checks) - n_bad}/{len(checks)} ok")
    return dict(info=info, checks=checks, cases=results, prefill=prefill_results, sweep=sweep)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU in interpret mode")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="start no new variant sweeps after this many seconds of the run (default 100: "
                         "the whole run fits scripts/gpu_call.sh's 120 s; the baseline table always "
                         "completes unless SIGTERM arrives, which still prints what was measured)")
    ap.add_argument("--focus", action="store_true",
                    help="only batch 1 and 8 (8k and 32k; 1k at B=1), Pallas and XLA, then sweep split "
                         "counts and pipeline settings on them (no cuDNN, no prefill)")
    ap.add_argument("--only", default="", help="B:ctx[,B:ctx...]: only these draft/verify rows (or --ab cases), no sweep")
    ap.add_argument("--ab", action="store_true",
                    help="only the repeated A/B of default_config against the variants in AB_CASES")
    ap.add_argument("--device-time", action="store_true",
                    help="every time (table, sweep, --ab rounds, the copy and read bandwidth) "
                         "taken as the kernels' device time in a profiler trace (no host jitter or "
                         "launch gaps) instead of the wall-clock difference of two chains; the table "
                         "gains a read-only column: a plain XLA reduction over the same K/V bytes")
    ap.add_argument("--ab-rounds", type=int, default=3, help="alternating rounds of --ab")
    ap.add_argument("--read-sweep", action="store_true",
                    help="batch 1 at 8k and 32k: streaming-read kernels over the row's K/V bytes "
                         "(READ_SWEEP), the attention and XLA's reduction, by device time (implies "
                         "--device-time): the fastest any kernel reads those bytes")
    ap.add_argument("--sweep-only", action="store_true",
                    help="skip the baselines; sweep a wide grid of kernel variants on a few verify cases")
    ap.add_argument("--json", default=None, help="write results here (default $OUT/bench_attention.json)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing impls")
    args = ap.parse_args(argv)
    args.device_time = args.device_time or args.read_sweep
    signal.signal(signal.SIGTERM, _on_sigterm)
    res = run(args)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=1, default=str))
        print(f"# wrote {path}")
    bad = [r for r in res["cases"] + res["prefill"] if "error" in r.get("pallas", {})]
    bad += [c for c in res["checks"] if not c["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
