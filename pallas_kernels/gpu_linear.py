"""Skinny linear layers for decode and verify as Pallas GPU kernels (Triton lowering), with the
layer's elementwise work optionally fused in. Opt-in (DFLASH_FUSED_LINEAR; see the measurements below).

At batch 1 a target layer's four projections read ~0.4 GB of weights for 1-16 activation rows:
pure weight streaming. XLA:GPU runs each as a split-K GEMM plus a reduction kernel, and the
residual adds, RMSNorms and SwiGLU as more kernels: 13 launches a layer, ~24 us of small kernels
next to ~100 us of GEMMs on the H200 (BENCHMARKS.md, "per-layer kernel sequence"). Here each
projection is one kernel; fully fused, a layer is four of them:

  fused_linear(x, W_qkv,     residual=delta, norm_weight=input_ln)   -> (x + delta, qkv)
  fused_linear(attn, W_o)                                              -> o
  fused_linear(x, W_gate_up, residual=o, norm_weight=post_ln, swiglu)  -> (x + o, silu(g) * u)
  fused_linear(act, W_down)                                            -> the next delta

One program per `block_n` output columns streams its [K, block_n] weight strip in `block_k` steps
(Triton pipelines the loop), so no split-K partials and no reduction kernel; the activation tile
([rows, block_k], 16-row minimum for Triton dots, rows past M masked) rides along from L2.

The RMSNorm is applied as a row scale after the dot: norm(s) @ W = r * ((s * w_norm) @ W), with
r = rsqrt(mean(s^2) + eps) summed in the same loop (one pass over s, no pre-pass). This rounds
differently from HF's `w * bf16(s * r)` (the bf16 rounding falls on s * w instead of s * r): the
same kind of difference as another GEMM tiling, well inside the tests' bf16 tolerances.
The residual sum s = x + residual is rounded to the input dtype (as `x + y` is) and written once:
k-block i by program i % num_programs, before the main loop.

Measured on the H200 (BENCHMARKS.md, calls 12-15): with the residual/norm prologue a kernel runs 2-3x
slower than XLA's GEMM (the elementwise work on the dot's operand costs Triton its load pipelining),
so the layer keeps add + norm in `add_rmsnorm` unless DFLASH_LINEAR_PROLOGUE=1; as plain GEMMs (gate/up
with its SwiGLU) the four chain in 92-95 us a layer against XLA's 89-91 us, 2-5% slower end to end.
Hence off by default; kept for other GPUs and for the next attempt.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import _next_pow2, env_settings
from pallas_kernels.tpu import Unsupported

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton

# Rows (B * T) up to which the fused kernels are used: decode and verify at small batch. Wider
# blocks reuse each weight tile over enough rows that XLA's GEMMs are the better fit.
MAX_ROWS = 64

_SETTINGS = ("block_n", "block_k", "num_warps", "num_stages")


def _pow2(x: int) -> bool:
    return x > 0 and not (x & (x - 1))


# Shared memory the pipelined tiles may take (H200: 227 KiB per block; Triton needs some besides).
_SMEM_BUDGET = 200 * 1024


def _smem(cfg: dict, Mp: int, itemsize: int, has_res: bool, swiglu: bool) -> int:
    bk, bn = cfg["block_k"], cfg["block_n"]
    per_stage = Mp * bk * (2 if has_res else 1) + bk * bn * (2 if swiglu else 1)
    return cfg["num_stages"] * per_stage * itemsize


def row_tile(M: int) -> int:
    """Rows of the activation tile: M padded to a power of two, at least 16 (Triton dots)."""
    return max(16, _next_pow2(M))


def table_key(M: int, K: int, N: int, swiglu: bool) -> str:
    """The DFLASH_GPU_LINEAR_TABLE key of a product: rows bucketed as 1 (decode), <= 16, <= 64."""
    return f"{1 if M == 1 else 16 if M <= 16 else 64}:{K}:{N}:{int(swiglu)}"


@functools.lru_cache(maxsize=4)
def _load_table(path: str) -> dict:
    import json
    with open(path) as f:
        return json.load(f)


def _table_config(M: int, K: int, N: int, swiglu: bool) -> dict:
    """DFLASH_GPU_LINEAR_TABLE=path: a JSON {table_key: {settings}} (bench_linear.py writes one
    from its sweep), read once per path; benchmarks only."""
    path = os.environ.get("DFLASH_GPU_LINEAR_TABLE", "")
    if not path or not os.path.exists(path):
        return {}
    return dict(_load_table(path).get(table_key(M, K, N, swiglu), {}))


def default_config(M: int, K: int, N: int, swiglu: bool, *, has_res: bool = False,
                   itemsize: int = 2) -> dict:
    """Launch settings for an [M, K] x [K, N] product (N the output width; per half with swiglu)."""
    # The H200 sweeps of call 14 (bench_linear.py, Qwen3-8B shapes, 1 and 16 rows): down
    # [12288, 4096] best at 32 columns x 512 keys, 4 stages; gate/up [4096, 2 x 12288] with SwiGLU
    # at 64 x 128, 3 stages; q/k/v [4096, 6144] at 64 x 256; o [4096, 4096] at 32 x 256, 4 stages.
    if K >= 8192:
        cfg = {"block_n": 32, "block_k": 512, "num_stages": 4}
    elif swiglu:
        cfg = {"block_n": 64, "block_k": 128, "num_stages": 3}
    elif N >= 6144:
        cfg = {"block_n": 64, "block_k": 256, "num_stages": 3}
    else:
        cfg = {"block_n": 32, "block_k": 256, "num_stages": 4}
    cfg["num_warps"] = 4
    cfg.update(_table_config(M, K, N, swiglu))
    # DFLASH_GPU_LINEAR="block_n=16,num_stages=5": overrides for every shape (benchmarks only)
    cfg.update(env_settings("DFLASH_GPU_LINEAR", _SETTINGS))
    while cfg["block_k"] > K:
        cfg["block_k"] //= 2
    while cfg["block_n"] > N:
        cfg["block_n"] //= 2
    while _smem(cfg, row_tile(M), itemsize, has_res, swiglu) > _SMEM_BUDGET:   # float32, wide tiles
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["block_k"] > 32:
            cfg["block_k"] //= 2
        else:
            break
    return cfg


def supported(M: int, K: int, N: int, dtype, *, swiglu: bool = False) -> bool:
    """Whether fused_linear takes an [M, K] x [K, N] product (N = 2 I with swiglu)."""
    half = N // 2 if swiglu else N
    return (1 <= M <= MAX_ROWS and K >= 16 and half >= 16
            and K % 16 == 0 and half % 16 == 0 and (not swiglu or N % 2 == 0)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                     jnp.dtype(jnp.float32)))


def _kernel(*refs, M: int, Mp: int, K: int, block_k: int, block_n: int, half: int,
            has_res: bool, has_norm: bool, swiglu: bool, eps: float):
    """One program: output columns [n0, n0 + block_n) (and [half + n0, ...) for the up half)."""
    it = iter(refs)
    x_ref = next(it)                                   # [M, K] whole
    r_ref = next(it) if has_res else None              # [M, K] whole
    nw_ref = next(it) if has_norm else None            # [K]
    w_ref = next(it)                                   # [K, N] whole
    o_ref = next(it)                                   # [M, N_out] whole
    s_ref = next(it) if has_res else None              # [M, K] whole: x + residual
    f32 = jnp.float32
    dt = x_ref.dtype
    j = pl.program_id(0)
    P = pl.num_programs(0)
    n0 = pl.multiple_of(j * block_n, block_n)
    row_ok = lax.broadcasted_iota(jnp.int32, (Mp, block_k), 0) < M
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
    n_k = K // block_k

    def dot(a, w):
        return lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=f32,
                               precision=prec)

    def load_sum(k0):
        a = pltriton.load(x_ref.at[pl.ds(0, Mp), pl.ds(k0, block_k)], mask=row_ok, other=0.0)
        if has_res:
            r = pltriton.load(r_ref.at[pl.ds(0, Mp), pl.ds(k0, block_k)], mask=row_ok, other=0.0)
            a = (a.astype(f32) + r.astype(f32)).astype(dt)
        return a

    if has_res:
        # The sum's k-blocks j, j + P, ... are this program's to write, before the main loop: a
        # store inside it would stop Triton from prefetching the next tiles (it cannot tell the
        # output from the inputs), which measured 3x slower on the H200.
        def store_sum(t, c):
            k0 = pl.multiple_of((j + t * P) * block_k, block_k)
            pltriton.store(s_ref.at[pl.ds(0, Mp), pl.ds(k0, block_k)], load_sum(k0), mask=row_ok)
            return c
        lax.fori_loop(0, lax.div(n_k - j + P - 1, P), store_sum, jnp.int32(0))

    def body(i, carry):
        acc, acc2, ss = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        a = load_sum(k0)
        if has_norm:
            af = a.astype(f32)
            ss = ss + jnp.sum(af * af, axis=1)
            a = (af * nw_ref[pl.ds(k0, block_k)].astype(f32)[None, :]).astype(dt)
        acc = acc + dot(a, w_ref[pl.ds(k0, block_k), pl.ds(n0, block_n)])
        if swiglu:
            acc2 = acc2 + dot(a, w_ref[pl.ds(k0, block_k), pl.ds(half + n0, block_n)])
        return acc, acc2, ss

    zeros = jnp.zeros((Mp, block_n), f32)
    acc, acc2, ss = lax.fori_loop(0, n_k, body, (zeros, zeros, jnp.zeros((Mp,), f32)))
    if has_norm:
        r = lax.rsqrt(ss / K + eps)[:, None]
        acc, acc2 = acc * r, acc2 * r
    if swiglu:
        g = acc.astype(dt).astype(f32)
        u = acc2.astype(dt).astype(f32)
        out = (jax.nn.silu(g).astype(dt).astype(f32) * u).astype(o_ref.dtype)
    else:
        out = acc.astype(o_ref.dtype)
    out_ok = lax.broadcasted_iota(jnp.int32, (Mp, block_n), 0) < M
    pltriton.store(o_ref.at[pl.ds(0, Mp), pl.ds(n0, block_n)], out, mask=out_ok)


def fused_linear(x, w, *, residual=None, norm_weight=None, eps: float = 1e-6, swiglu: bool = False,
                 interpret=False, **config):
    """y = f(x) @ w for x [..., K] (a few rows) and w [K, N], in one kernel.

    residual: s = x + residual (rounded to x.dtype) replaces x, and (s, y) is returned.
    norm_weight [K]: y = RMSNorm(s) @ w with the norm's weight (eps); see the module docstring.
    swiglu: w is [K, 2 I] = [gate | up]; y = silu(s @ gate) * (s @ up), [..., I].
    config: block_n, block_k, num_warps, num_stages (default_config; benchmarks)."""
    K = x.shape[-1]
    N = w.shape[-1]
    lead = x.shape[:-1]
    M = math.prod(lead)
    if (w.ndim != 2 or w.shape[0] != K or w.dtype != x.dtype
            or not supported(M, K, N, x.dtype, swiglu=swiglu)
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
            or (norm_weight is not None and norm_weight.shape != (K,))):
        raise Unsupported(f"fused_linear: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, "
                          f"residual {None if residual is None else residual.shape}, swiglu {swiglu}")
    half = N // 2 if swiglu else N
    cfg = default_config(M, K, half, swiglu, has_res=residual is not None,
                         itemsize=jnp.dtype(x.dtype).itemsize)
    cfg.update(config)
    bn, bk = cfg["block_n"], cfg["block_k"]
    if half % bn or K % bk or not (_pow2(bn) and _pow2(bk)):
        raise Unsupported(f"fused_linear: K {K} / N {half} do not tile by {bk} / {bn}")
    Mp = row_tile(M)
    has_res, has_norm = residual is not None, norm_weight is not None
    kernel = functools.partial(_kernel, M=M, Mp=Mp, K=K, block_k=bk, block_n=bn, half=half,
                               has_res=has_res, has_norm=has_norm, swiglu=swiglu, eps=float(eps))
    args = [x.reshape(M, K)]
    if has_res:
        args.append(residual.reshape(M, K))
    if has_norm:
        args.append(norm_weight.astype(x.dtype))
    args.append(w)
    out_shape = [jax.ShapeDtypeStruct((M, half), x.dtype)]
    if has_res:
        out_shape.append(jax.ShapeDtypeStruct((M, K), x.dtype))
    any_spec = lambda a: pl.BlockSpec(a.shape, lambda j, n=len(a.shape): (0,) * n)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        outs = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(half // bn,),
            in_specs=[any_spec(a) for a in args],
            out_specs=[any_spec(o) for o in out_shape],
            compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"],
                                                    num_stages=cfg["num_stages"]),
            interpret=interpret,
            name="dflash_linear" + ("_norm" if has_norm else "") + ("_swiglu" if swiglu else ""),
        )(*args)
    y = outs[0].reshape(*lead, half)
    if has_res:
        return outs[1].reshape(x.shape), y
    return y
