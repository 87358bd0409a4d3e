"""Block attention for DFlash: one signature, several backends.

`block_attention(q[B,T,Hq,D], k_cache[B,Hkv,C,D], v_cache[B,Hkv,C,D], k_end[B,T]) -> [B,T,Hq,D]`,
row t of batch b attending keys [0, k_end[b, t]). `attention.reference.block_attention` is the oracle.

impl:
  "auto"  the kernel of the default backend (TPU -> "tpu", GPU -> "gpu"); on CPU "xla", or the TPU
          kernel in interpret mode when `interpret` is set.
  "tpu"   Pallas Mosaic TPU kernel (attention/tpu.py). Also what an ahead-of-time TPU compile
          from a CPU host must ask for, since the default backend there is "cpu".
  "gpu"   Pallas Triton kernel (attention/gpu.py); likewise for a CUDA export from a CPU host.
  "xla"   the reference in plain jnp: short query blocks loop over KV chunks up to the longest
          row (cost follows the lengths, not the capacity); long ones tile the queries (prefill).
A shape a kernel cannot tile (head_dim 96, capacity not a multiple of 128, ...) falls back to "xla".

Paged caches (pools [N,Hkv,page,D] read through a page table [B,P]; layout in attention/paged.py):
`block_attention_paged`, the same backends and fallback; `xla_block_attention_paged` is the gather +
`xla_block_attention`.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import Unsupported, check_shapes, warn_once
from pallas_kernels.attention.reference import block_attention as reference_block_attention
from pallas_kernels.attention.paged import check_paged_shapes, gather_pages

__all__ = ["block_attention", "reference_block_attention", "xla_block_attention", "IMPLS",
           "Unsupported", "block_attention_paged", "xla_block_attention_paged", "gather_pages"]

IMPLS = ("auto", "tpu", "gpu", "xla")
_log = logging.getLogger(__name__)

# Score elements (f32) one query chunk of the XLA path may materialise: 2**26 = 256 MiB.
_XLA_SCORE_BUDGET = 1 << 26
# Query blocks up to this length (decode, verify, the draft block: the shapes inside the generation
# loop) attend in KV chunks up to the longest row's k_end instead of over the whole capacity.
XLA_CHUNKED_MAX_T = 64


def kv_chunk_for(capacity: int) -> int:
    """Keys per chunk of that loop when none is given: large enough that the per-chunk loop overhead
    stays small next to the chunk's matmuls over the whole capacity, small enough that a short row
    reads little past its end: small caches gain from short chunks, long ones lose to the trips
    (the sweep behind these bounds: docs/perf-log.md)."""
    return 128 if capacity <= 2048 else 256 if capacity <= 8192 else 512


def _xla_dense(q, k_cache, v_cache, k_end, scale, k_start=None, ring=False):
    """The oracle's own math (its P.V einsum is batch-major, so bf16 batches also run on XLA:CPU)."""
    return reference_block_attention(q, k_cache, v_cache, k_end, scale=scale, k_start=k_start, ring=ring)


def _chunked_forward(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start=None, ring=False):
    """Online softmax over KV chunks [i*K, (i+1)*K) for min(k_start) // K <= i < ceil(max(k_end) / K):
    the work follows the rows' key ranges, not the capacity. Requires K <= C. ring: i counts
    absolute key positions and chunk i is read from slots (i*K) mod C (K divides C)."""
    B, T, Hq, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    G, K = Hq // Hkv, kv_chunk
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, Hkv, G, D)
    if ring:      # absolute chunks: no clip to the capacity
        n_chunks = jnp.maximum((jnp.max(k_end) + K - 1) // K, 0)
    else:
        n_chunks = jnp.clip((jnp.max(k_end) + K - 1) // K, 0, -(-C // K))     # traced trip count
    first = 0 if k_start is None else jnp.clip(jnp.min(k_start) // K, 0, n_chunks)

    def chunk(i, carry):
        m, l, acc = carry
        lo = i * K
        # The tail chunk of a capacity that is no multiple of K slides back to end at C; the keys
        # it shares with the chunk before (pos < lo) are masked so none is counted twice.
        start = lax.rem(lo, C) if ring else jnp.minimum(lo, C - K)
        kc = lax.dynamic_slice_in_dim(k_cache, start, K, axis=2)            # [B, Hkv, K, D]
        vc = lax.dynamic_slice_in_dim(v_cache, start, K, axis=2)            # [B, Hkv, K, D]
        pos = (lo if ring else start) + jnp.arange(K)                       # [K] key positions
        visible = (pos >= lo)[None, None, :] & (pos[None, None, :] < k_end[:, :, None])   # [B, T, K]
        if k_start is not None:   # a sliding-window layer's rows start at their own key
            visible &= pos[None, None, :] >= k_start[:, :, None]
        s = jnp.einsum("btkgd,bkcd->bkgtc", qg, kc, preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible[:, None, None], s, -jnp.inf)                  # [B, Hkv, G, T, K]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)                 # no key yet: exp(-inf) = 0
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        pv = jnp.einsum("bkgtc,bkcd->bkgtd", p.astype(v_cache.dtype), vc,
                        preferred_element_type=jnp.float32)
        return m_new, l, alpha * acc + pv

    init = (jnp.full((B, Hkv, G, T, 1), -jnp.inf, jnp.float32),             # running max
            jnp.zeros((B, Hkv, G, T, 1), jnp.float32),                      # running sum
            jnp.zeros((B, Hkv, G, T, D), jnp.float32))                      # accumulator
    _, l, acc = lax.fori_loop(first, n_chunks, chunk, init)
    o = acc / jnp.where(l > 0, l, 1.0)                                      # rows with no key: 0
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


# A fori_loop with a traced trip count is a while_loop, which reverse-mode AD cannot transpose. The
# chunked path therefore differentiates through the dense oracle (same value, same gradient), so any
# caller that takes gradients (a short prompt's prefill inside training) still can. The long-query
# (prefill) path never uses the loop: training differentiates through the target's prefill forward.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 7))
def _xla_chunked(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start=None, ring=False):
    return _chunked_forward(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start, ring)


def _xla_chunked_fwd(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start=None, ring=False):
    return (_chunked_forward(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start, ring),
            (q, k_cache, v_cache, k_end, k_start))


def _xla_chunked_bwd(scale, kv_chunk, ring, res, g):
    q, k_cache, v_cache, k_end, k_start = res
    _, vjp = jax.vjp(lambda q_, k_, v_: _xla_dense(q_, k_, v_, k_end, scale, k_start, ring), q, k_cache, v_cache)
    return (*vjp(g), None, None if k_start is None else np.zeros(k_start.shape, jax.dtypes.float0))


_xla_chunked.defvjp(_xla_chunked_fwd, _xla_chunked_bwd)


def xla_block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None,
                        q_tile: int | None = None, kv_chunk: int | None = None, k_start=None,
                        ring: bool = False):
    """The reference in XLA ops, sized to the work rather than the buffers.

    Short query blocks (T <= XLA_CHUNKED_MAX_T) attend in chunks of `kv_chunk` keys (default
    kv_chunk_for(C)) up to the longest row's k_end: a generous capacity costs nothing until it is used.
    kv_chunk=0 keeps the dense path over the whole capacity (benchmarks compare against it).
    Longer queries (prefill) are processed in tiles (lax.map) so B*tile*Hq*C scores stay bounded:
    a 32k prompt over a 32k cache would otherwise build a [B, Hq, 32k, 32k] f32 score tensor.
    k_start [B, T] (or None): each row's first key, for sliding-window draft layers (block-sized
    queries only: the chunked or the dense path). ring: the cache is a ring of C slots (key p in
    slot p mod C) and k_start / k_end are absolute positions (reference.block_attention); the
    chunks then divide C (gcd(C, kv_chunk) keys each).
    """
    check_shapes(q, k_cache, v_cache, k_end)
    B, T, Hq, D = q.shape
    C = k_cache.shape[2]
    kv_chunk = kv_chunk_for(C) if kv_chunk is None else int(kv_chunk)
    if kv_chunk < 0:
        raise ValueError(f"kv_chunk must be >= 0 (0: dense over the whole capacity), got {kv_chunk}")
    if ring:
        if k_start is None:
            raise ValueError("ring=True needs k_start (absolute first keys)")
        kv_chunk = math.gcd(C, kv_chunk) if kv_chunk else 0
    if T <= XLA_CHUNKED_MAX_T and 0 < kv_chunk < C and q_tile is None:
        return _xla_chunked(q, k_cache, v_cache, k_end, scale, kv_chunk, k_start, ring)
    if k_start is not None:
        if T > XLA_CHUNKED_MAX_T or q_tile is not None:
            raise ValueError(f"k_start is for block-sized queries (T <= {XLA_CHUNKED_MAX_T}), got T={T}")
        return _xla_dense(q, k_cache, v_cache, k_end, scale, k_start, ring)
    if q_tile is None:
        if B * T * Hq * C <= _XLA_SCORE_BUDGET:
            return _xla_dense(q, k_cache, v_cache, k_end, scale)
        q_tile = 512
        while q_tile > 16 and B * q_tile * Hq * C > _XLA_SCORE_BUDGET:
            q_tile //= 2
    if q_tile >= T:
        return _xla_dense(q, k_cache, v_cache, k_end, scale)
    n = -(-T // q_tile)
    pad = n * q_tile - T
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))                      # [B, n*tile, Hq, D]
    ep = jnp.pad(k_end, ((0, 0), (0, pad)))                                   # [B, n*tile]
    qt = qp.reshape(B, n, q_tile, Hq, D).swapaxes(0, 1)                       # [n, B, tile, Hq, D]
    et = ep.reshape(B, n, q_tile).swapaxes(0, 1)                              # [n, B, tile]
    out = lax.map(lambda a: _xla_dense(a[0], k_cache, v_cache, a[1], scale), (qt, et))                                                   # [n, B, tile, Hq, D]
    return out.swapaxes(0, 1).reshape(B, n * q_tile, Hq, D)[:, :T]


def default_impl(interpret=False) -> str:
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if interpret else "xla"


def block_attention(q, k_cache, v_cache, k_end, *, impl: str = "auto", scale: float | None = None,
                    interpret=False, k_start=None, ring: bool = False, **tuning):
    """Dispatch to a kernel. interpret: False, True, or a pltpu.InterpretParams for the TPU kernel.

    tuning: block sizes etc. forwarded to the chosen kernel (benchmarks); ignored by "xla".
    k_start [B, T] or None: each row's first key (sliding-window draft layers). ring: the cache is
    a ring of C slots holding key p at slot p mod C, k_start / k_end absolute (reference.py).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    check_shapes(q, k_cache, v_cache, k_end)
    if impl == "auto":
        impl = default_impl(interpret)
    try:
        if impl == "tpu":
            from pallas_kernels.attention import tpu
            if interpret is True:
                from jax.experimental.pallas import tpu as pltpu
                interpret = pltpu.InterpretParams()
            return tpu.block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                       interpret=interpret, k_start=k_start, ring=ring, **tuning)
        if impl == "gpu":
            from pallas_kernels.attention import gpu
            return gpu.block_attention(q, k_cache, v_cache, k_end, scale=scale,
                                       interpret=bool(interpret), k_start=k_start, ring=ring, **tuning)
    except Unsupported as e:
        warn_once(_log, f"{impl}: {e}", "pallas %s kernel cannot take q%s cache%s (%s): using the XLA path "
                  "(said once per reason)", impl, q.shape, k_cache.shape, e)
    return xla_block_attention(q, k_cache, v_cache, k_end, scale=scale, k_start=k_start, ring=ring)


def xla_block_attention_paged(q, k_pool, v_pool, table, k_end, *, scale: float | None = None,
                              k_start=None, kv_chunk: int | None = None):
    """The paged reference: gather each row's pages into the dense view [B, Hkv, P*page, D]
    (attention/paged.py), then `xla_block_attention`."""
    check_paged_shapes(q, k_pool, v_pool, table, k_end)
    return xla_block_attention(q, gather_pages(k_pool, table), gather_pages(v_pool, table), k_end,
                               scale=scale, k_start=k_start, kv_chunk=kv_chunk)


def block_attention_paged(q, k_pool, v_pool, table, k_end, *, impl: str = "auto", interpret=False,
                          scale: float | None = None, k_start=None, **tuning):
    """`block_attention` over a paged cache: k_pool / v_pool [N, Hkv, page, D], table [B, P] int32
    (row b's key t in page table[b, t // page] at row t % page; attention/paged.py). The same result
    as block_attention on the gathered view. interpret: False, True, or a pltpu.InterpretParams for
    the TPU kernel. k_start [B, T] or None: each row's first key (sliding-window layers). tuning:
    forwarded to the chosen kernel (TPU: block_q, pages_per_block; GPU: gpu.block_attention's);
    ignored by "xla". A shape the kernel cannot take falls back to the gather (said once)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    check_paged_shapes(q, k_pool, v_pool, table, k_end)
    if impl == "auto":
        impl = default_impl(interpret)
    try:
        if impl == "tpu":
            from pallas_kernels.attention import tpu
            if interpret is True:
                from jax.experimental.pallas import tpu as pltpu
                interpret = pltpu.InterpretParams()
            return tpu.block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale,
                                             interpret=interpret, k_start=k_start, **tuning)
        if impl == "gpu":
            from pallas_kernels.attention import gpu
            return gpu.block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale,
                                             interpret=bool(interpret), k_start=k_start, **tuning)
    except Unsupported as e:
        warn_once(_log, f"paged {impl}: {e}", "pallas %s paged kernel cannot take q%s pool%s (%s): using "
                  "the XLA gather (said once per reason)", impl, q.shape, k_pool.shape, e)
    return xla_block_attention_paged(q, k_pool, v_pool, table, k_end, scale=scale, k_start=k_start)
