"""Block attention as a Pallas GPU kernel through the Triton lowering.

Same contract as `reference.block_attention`. The Pallas Triton backend is deprecated upstream (JAX
0.11 warns); everything Triton-specific is inside this module so it can be swapped for Mosaic GPU or
tokamax later. The backend is picked by the type of `compiler_params` (pltriton.CompilerParams);
without it JAX >= 0.9 would lower through Mosaic GPU.

Layout (as in tpu.py): the GQA group is folded into the rows, R = T*G rows ordered (t, g) per kv
head, cut into row tiles of `block_q` (a power of two >= 16: Triton dots need >= 16 and loads need
powers of two).

Grid (B, Hkv, row tiles, kv splits). Unlike TPU, GPU programs run concurrently, so the KV loop is a
`fori_loop` inside the program. When B*Hkv*row_tiles cannot fill the GPU (batch 1 decode: 8 programs
on 132 SMs), the KV range [0, max k_end of the tile) is split into `kv_splits` chunks (sized from the
actual length, not the capacity, so all splits get work), each writes a normalised partial output
and its log-sum-exp, and a small XLA epilogue merges them.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tpu import Unsupported, check_shapes, fold_queries, unfold_output

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton

_MASK = -1e30
_HEAD_DIMS = (64, 128, 256)
H200_SMS = 132


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _precision(dtype):
    # f32 inputs: full-precision passes (the default is TF32 on GPU, bf16 passes on some TPUs).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# Shared memory Triton may use per program for the q tile and the pipelined K/V tiles (H200 has 227 KiB;
# Triton needs some for layout conversions too). Seen on the H200: the bf16 tuned prefill tile run in
# float32 asked for 288 KiB and failed, so wider dtypes shrink the pipeline until it fits.
_SMEM_BUDGET = 128 * 1024


def _fit_smem(cfg: dict, D: int, itemsize: int) -> dict:
    if itemsize <= 2:
        return cfg  # the H200 sweep's bf16/f16 settings fit as measured
    def need(c):
        return (c["block_q"] * D + 2 * c["num_stages"] * c["block_k"] * D) * itemsize
    while need(cfg) > _SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["block_k"] > 16:
            cfg["block_k"] //= 2
        elif cfg["block_q"] > 16:
            cfg["block_q"] //= 2
        else:
            break
    return cfg


def default_config(R: int, C: int, D: int, B: int, Hkv: int, *, n_sms: int = H200_SMS) -> dict:
    """Tile sizes, kv splits and Triton launch parameters for R folded rows over capacity C.

    From a sweep on an H200 (jax 0.11.2, Qwen3-8B heads, bf16, verify pattern): block_k 64 with
    4 warps and 3 stages read 3.9 TB/s at B=32 / 32k context (8 warps or 2 stages: 2-3 TB/s);
    block_k 128 with 4 stages runs out of shared memory. Prefill (T=4096): 128-row tiles, block_k
    64, 8 warps, 4 stages: 238 TFLOP/s (cuDNN 326, XLA 40).
    """
    block_q = min(max(16, _next_pow2(R)), 64 if D > 128 else 128)
    if block_q > 64:                     # prefill-sized row tiles: compute-bound, wider warps
        block_k, num_warps, num_stages = 64, 8, 4
    else:                                # decode/verify/draft: bandwidth-bound
        block_k, num_warps, num_stages = (32 if D > 128 else 64), 4, 3
    while block_k > 16 and C % block_k:
        block_k //= 2
    n_q = -(-R // block_q)
    programs = B * Hkv * n_q
    # Two waves' worth of programs; never more splits than KV tiles.
    kv_splits = 1 if programs >= n_sms else min(-(-2 * n_sms // programs), max(1, C // block_k), 32)
    return dict(block_q=block_q, block_k=block_k, kv_splits=kv_splits, num_warps=num_warps,
                num_stages=num_stages, min_chunk=512)


def _kernel(q_ref, k_ref, v_ref, kend_ref, *out_refs, scale: float, block_k: int, kv_splits: int,
            min_chunk: int):
    # q_ref [bq, D], k_ref/v_ref [C, D] (the whole head; tiles are sliced in the loop),
    # kend_ref [bq] int32; outputs: o [bq, D] (+ lse [bq] when split).
    s_idx = pl.program_id(3)
    kend = kend_ref[...]                                                      # [bq]
    hi = jnp.max(kend)
    # This split's KV range: [start, stop), a bk-aligned share of [0, hi) of at least min_chunk
    # keys. The split count is static (from the capacity) but the length is not: a 32k cache
    # holding 1k tokens uses 2 splits, not 32 tiny ones whose partials cost more than they save.
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(hi, kv_splits), block_k) * block_k, min_chunk)
    start = s_idx * chunk
    stop = jnp.minimum(start + chunk, hi)
    n_iter = jnp.maximum(pl.cdiv(stop - start, block_k), 0)

    # Tiles below every live row's k_end need no mask (most of a long context, the lower
    # triangle of a prefill). Rows with k_end == 0 (padding, or empty by contract) are left out of
    # the min and zeroed at the end.
    live = kend > 0                                                           # [bq]
    lo = jnp.min(jnp.where(live, kend, jnp.iinfo(jnp.int32).max))
    n_full = jnp.clip((lo - start) // block_k, 0, n_iter)

    q = q_ref[...]                                                            # [bq, D]
    bq, D = q.shape
    cols = lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)

    def make_body(masked: bool):
        def body(it, carry):
            acc, m, l = carry
            k0 = pl.multiple_of(start + it * block_k, block_k)
            k = k_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=_precision(q.dtype)) * scale            # [bq, bk]
            if masked:
                visible = (k0 + cols) < kend[:, None]
                s = jnp.where(visible, s, _MASK)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))                        # [bq]
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])                                   # [bq, bk]
            if masked:
                # A row with nothing visible yet has m_new == _MASK and exp(0) == 1: zero it.
                p = jnp.where(visible, p, 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            v = v_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32,
                                 precision=_precision(v.dtype))                   # [bq, D]
            acc = acc * alpha[:, None] + pv
            return acc, m_new, l
        return body

    acc0 = jnp.zeros((bq, D), jnp.float32)
    m0 = jnp.full((bq,), _MASK, jnp.float32)
    l0 = jnp.zeros((bq,), jnp.float32)
    carry = lax.fori_loop(0, n_full, make_body(False), (acc0, m0, l0))
    acc, m, l = lax.fori_loop(n_full, n_iter, make_body(True), carry)
    l = jnp.where(live, l, 0.0)
    o = jnp.where(live[:, None], acc, 0.0) / jnp.where(l > 0, l, 1.0)[:, None]
    if kv_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = o.astype(o_ref.dtype)
    else:
        o_ref, lse_ref = out_refs
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)

        # An empty split writes only lse = -inf; _merge never reads its (unwritten) o.
        @pl.when(n_iter > 0)
        def _store():
            o_ref[...] = o.astype(o_ref.dtype)


def _merge(o_parts, lse):
    """o_parts [S,B,Hkv,R,D] (normalised per split), lse [S,B,Hkv,R] f32 -> [B,Hkv,R,D] f32."""
    m = jnp.max(lse, axis=0)                                                  # [B,Hkv,R]
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))                     # [S,B,Hkv,R]; 0 for empty
    den = jnp.sum(w, axis=0)
    # where, not a product: an empty split's o was never written (may hold nan).
    o = jnp.sum(jnp.where(w[..., None] > 0, o_parts.astype(jnp.float32) * w[..., None], 0.0), axis=0)
    return o / jnp.where(den > 0, den, 1.0)[..., None]


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, interpret=False,
                    block_q: int | None = None, block_k: int | None = None,
                    kv_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, min_chunk: int | None = None,
                    n_sms: int = H200_SMS):
    """Pallas Triton block attention. Tuning arguments override `default_config`."""
    check_shapes(q, k_cache, v_cache, k_end)
    B, T, Hq, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = Hq // Hkv
    R = T * G
    if D not in _HEAD_DIMS:
        raise Unsupported(f"head_dim={D} not in {_HEAD_DIMS}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise Unsupported(f"dtype {q.dtype} not supported")
    cfg = _fit_smem(default_config(R, C, D, B, Hkv, n_sms=n_sms), D, jnp.dtype(q.dtype).itemsize)
    for name, val in dict(block_q=block_q, block_k=block_k, kv_splits=kv_splits,
                          num_warps=num_warps, num_stages=num_stages, min_chunk=min_chunk).items():
        if val is not None:
            cfg[name] = val
    bq, bk, n_split = cfg["block_q"], cfg["block_k"], cfg["kv_splits"]
    if bq < 16 or bq & (bq - 1) or bk < 16 or bk & (bk - 1):
        raise Unsupported(f"block_q={bq}, block_k={bk} must be powers of two >= 16")
    if C % bk:
        raise Unsupported(f"capacity C={C} is not a multiple of block_k={bk}")
    scale = D ** -0.5 if scale is None else float(scale)
    R_pad = _round_up(R, bq)
    n_q = R_pad // bq

    qf, kr = fold_queries(q, k_end, G, R_pad)                                # [B,Hkv,R_pad,D], [B,R_pad]
    kr = jnp.clip(kr, 0, C)
    # Triton cannot do two dtypes in one dot: keep K/V and q alike (the contract has them equal).
    k_cache = k_cache.astype(q.dtype)
    v_cache = v_cache.astype(q.dtype)

    in_specs = [
        pl.BlockSpec((None, None, bq, D), lambda b, h, i, s: (b, h, i, 0)),
        pl.BlockSpec((None, None, C, D), lambda b, h, i, s: (b, h, 0, 0)),
        pl.BlockSpec((None, None, C, D), lambda b, h, i, s: (b, h, 0, 0)),
        pl.BlockSpec((None, bq), lambda b, h, i, s: (b, i)),
    ]
    if n_split == 1:
        out_shape = jax.ShapeDtypeStruct((B, Hkv, R_pad, D), q.dtype)
        out_specs = pl.BlockSpec((None, None, bq, D), lambda b, h, i, s: (b, h, i, 0))
    else:
        # Partials in the input's dtype: for bf16 this halves the merge's traffic and costs about
        # one bf16 rounding (the output is bf16 anyway); f32 inputs keep f32 partials.
        out_shape = [jax.ShapeDtypeStruct((n_split, B, Hkv, R_pad, D), q.dtype),
                     jax.ShapeDtypeStruct((n_split, B, Hkv, R_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, bq, D), lambda b, h, i, s: (s, b, h, i, 0)),
                     pl.BlockSpec((None, None, None, bq), lambda b, h, i, s: (s, b, h, i))]
    min_chunk = _round_up(max(cfg["min_chunk"], bk), bk)
    kernel = functools.partial(_kernel, scale=scale, block_k=bk, kv_splits=n_split,
                               min_chunk=min_chunk)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        out = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(B, Hkv, n_q, n_split),
            in_specs=in_specs,
            out_specs=out_specs,
            compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"],
                                                    num_stages=cfg["num_stages"]),
            interpret=interpret,
            name="dflash_block_attention_gpu",
        )(qf, k_cache, v_cache, kr)
    if n_split > 1:
        out = _merge(*out).astype(q.dtype)
    return unfold_output(out, B, T, Hq, G)
