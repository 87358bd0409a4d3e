"""Block attention as a Pallas GPU kernel through the Triton lowering.

Same contract as `reference.block_attention`. The Pallas Triton backend is deprecated upstream (JAX
0.11 warns); everything Triton-specific is inside this module so it can be swapped for Mosaic GPU or
tokamax later. The backend is picked by the type of `compiler_params` (pltriton.CompilerParams);
without it JAX >= 0.9 would lower through Mosaic GPU.

Layout: the G = Hq/Hkv query heads that share a kv head are read together, straight from q's
[B, T, Hq, D] layout (viewed as [B, T, Hkv, G, D], a free reshape), as a [block_t, G, D] tile that
the kernel reshapes to R = block_t*G rows ordered (t, g). The output is written back the same way,
so no transpose or pad runs around the kernel. Plain decode (T == 1, G < 16) reads its G rows as a
masked 16-row tile (Triton dots need >= 16 rows). Sizes must be powers of two (Triton tensors).

Grid (B, Hkv, row tiles, kv splits). Unlike TPU, GPU programs run concurrently, so the KV loop is a
`fori_loop` inside the program. When B*Hkv*row_tiles cannot fill the GPU (batch 1 decode: 8 programs
on 132 SMs), the KV range [0, max k_end of the tile) is split into `kv_splits` chunks (sized from the
actual length, not the capacity, so all splits get work), each writes a normalised partial output
and its log-sum-exp, and a merge combines them: `merge_splits`, a second Pallas kernel, for caches
of >= SPLIT_MIN_CAPACITY rows; for shorter ones a small XLA epilogue (one elementwise fusion).
Caches shorter than SPLIT_MIN_CAPACITY are split as SHORT_SPLITS says (8 ways in chunks of >= 64
keys for a batch-1 block, 4 of >= 128 for decode) when the block is short (decode, verify, draft)
and the programs few: at batch 1 and a 512-token prompt the unsplit kernel is latency-bound (8
programs, ~9 tiles each, 13 us a call).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tpu import Unsupported, check_shapes

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton

_MASK = -1e30
# The online softmax runs in base 2: scores are scaled by scale * log2(e) and exponentiated with
# exp2 (libdevice's exp2f, the hardware's ex2); jnp.exp lowers to libdevice's accurate expf
# (several instructions per element, on the per-tile critical path).
_LOG2E = math.log2(math.e)
_HEAD_DIMS = (64, 128, 256)
# SM count for a program built where no GPU can be asked (the interpreter, a CUDA export from a CPU
# host): a Hopper-class part. Library callers pass the device's (dflash_jax.KernelConfig.n_sms).
FALLBACK_SMS = 132


def sm_count(device=None) -> int:
    """The streaming multiprocessors of `device` (default: the first device) if it is a GPU that
    says, else FALLBACK_SMS."""
    device = device if device is not None else jax.devices()[0]
    n = getattr(device, "core_count", None) if device.platform in ("gpu", "cuda", "rocm") else None
    return n if isinstance(n, int) and n > 0 else FALLBACK_SMS


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


def _fit_smem(cfg: dict, rows: int, D: int, itemsize: int) -> dict:
    if itemsize <= 2:
        return cfg  # the H200 sweep's bf16/f16 settings fit as measured
    def need(c):
        return (rows * D + 2 * c["num_stages"] * c["block_k"] * D) * itemsize
    while need(cfg) > _SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["block_k"] > 16:
            cfg["block_k"] //= 2
        elif cfg["block_t"] > 1 and rows > 16:
            cfg["block_t"] //= 2
            rows //= 2
        else:
            break
    return cfg


def _row_tile(T: int, G: int, rows: int = 64) -> int:
    """Query positions per program (bt): a power of two dividing T, with bt*G <= rows (or bt = 1)."""
    bt = 1
    while bt * 2 <= T and T % (bt * 2) == 0 and bt * 2 * G <= rows:
        bt *= 2
    return bt


# Below this capacity the split count does not come from filling the GPU: short blocks with fewer
# programs than SMs split into the first (splits, min chunk) of SHORT_SPLITS whose programs fit in
# one wave of two per SM (blocks of 2+ positions: 8 of >= 64 keys up to batch 4 at Qwen3-8B heads,
# else 4 of >= 128), everything else not at all. Measured on the H200: in the whole loop (call 7,
# B=1, prompt 512) DFlash 5.59 ms per iteration with 4 splits of >= 128 keys against 5.78-5.87
# unsplit, plain decode 4.30 against 4.46 ms. The kernel alone (calls 33-34, device time, B=1 over
# 528 keys) 7.3-7.5 us with 8 splits of 64 keys against 8.9 with 4 and 8.0 with 16 of 32; in the
# loop (call 34) DFlash 5.488 / 5.473 ms with 8 against 5.532 / 5.495 with 4, but plain decode
# (T = 1, 16-row tiles of 4 live rows) 4.330 / 4.281 against 4.264 / 4.255: it keeps 4.
SPLIT_MIN_CAPACITY = 4096
SHORT_SPLITS = ((8, 64), (4, 128))
# Output tile of one program of the split merge kernel (merge_splits) when it fills the GPU; batch 1
# uses 4 x 32 (default_config).
MERGE_ROWS = 16
MERGE_COLS = 64


def default_config(T: int, G: int, C: int, D: int, B: int, Hkv: int, *, n_sms: int) -> dict:
    """Tile sizes, kv splits and Triton launch parameters for T query positions (G heads each) over C.

    From sweeps on an H200 (jax 0.11.2, Qwen3-8B heads, bf16; BENCHMARKS.md):
    - 64-row tiles, block_k 64, 4 warps, 3 stages: best for verify/draft (3.9 TB/s at B=32 / 32k)
      and for prefill too (T=4096: 558 us against 631-1004 us for 128-row tiles or 8 warps).
    - Splits: fewer programs than SMs (batch 1-8) -> two waves' worth of splits; B=32 at 32k
      (256 programs, under two waves) ran 1163 us with 2 splits against 1387 us with 1, while at 8k
      one split was better (344 vs 369 us).
    """
    block_t = _row_tile(T, G, 64)
    block_k = 32 if D > 128 else 64
    while block_k > 16 and C % block_k:
        block_k //= 2
    programs = B * Hkv * (T // block_t)
    min_chunk = 512
    if C < SPLIT_MIN_CAPACITY:
        kv_splits = 1
        if T <= 64 and programs < n_sms:
            splits, chunk = next((sc for sc in SHORT_SPLITS[:-1] if T > 1 and sc[0] * programs <= 2 * n_sms),
                                 SHORT_SPLITS[-1])
            if C >= 2 * chunk:
                kv_splits, min_chunk = splits, chunk
    elif programs < n_sms:
        # Two programs fit on an SM (~112 KiB of shared memory each): fill exactly one wave of
        # 2 * n_sms, rounding down. Rounding up (5 splits at B=8: 320 programs) left a second wave
        # of 56 programs that ran at a fraction of the bandwidth (B=8, 32k: 1.72 TB/s).
        # At most 16 splits below 16k rows: B=1 at 8k ran 20.9 us with 16 against 24.2 us with 32
        # (3 alternating rounds, call 8). From 16k on the wave is filled: B=1 at 32k takes 33
        # splits (264 programs, 16 tiles each; 32 splits left 17-tile chunks): 43.9-44.3 us against
        # 44.8-45.2 with 32 (device time, calls 26-30).
        cap = 16 if C < 16384 else 2 * n_sms
        kv_splits = max(1, min(2 * n_sms // programs, max(1, C // block_k), cap))
    elif programs < 4 * n_sms and C >= 16384:
        kv_splits = 2
    else:
        kv_splits = 1
    # Long caches merge their splits in merge_splits' kernel with >= 512 programs: 4 x 32 tiles when
    # the output is small (B=1: 512 rows), 16 x 64 from B=4 on. Device time (calls 28-31): the merge
    # 4.1 us against XLA's fusion's 5.7-5.9 at B=1 32k, 2.6 against 3.6-3.7 at B=1 8k, 3.0-3.2
    # against 4.1-4.3 at B=8; with the 33 splits, B=1 32k 42.5 against 44.6 us. Short caches (few,
    # small partials) keep XLA's fusion, which can overlap its launch with the next GEMM's (PDL);
    # call 28 saw no difference in the prompt-512 loop.
    big = B * T * Hkv * G * D // (MERGE_ROWS * MERGE_COLS) >= n_sms     # 16 x 64 tiles fill the GPU
    return dict(block_t=block_t, block_k=block_k, kv_splits=kv_splits, num_warps=4,
                num_stages=3, min_chunk=min_chunk,
                merge_kernel=int(kv_splits > 1 and C >= SPLIT_MIN_CAPACITY),
                merge_rows=MERGE_ROWS if big else 4, merge_cols=MERGE_COLS if big else 32)


def _kernel(q_ref, k_ref, v_ref, kend_ref, *out_refs, scale: float, block_k: int, kv_splits: int,
            min_chunk: int, decode_rows: int, G: int):
    """One (batch, kv head, row tile, kv split) program.

    Tiled mode (decode_rows == 0): q_ref [bt, G, D] holds bt query positions of the G query heads
    that share this kv head, read straight from q's [B, T, Hq, D] layout (no transpose before or
    after the kernel); kend_ref [bt]; outputs o [bt, G, D] (+ lse [bt, G] when split).
    Decode mode (T == 1, decode_rows = 16): q_ref is the whole [B*Hq, D] array; this program's G
    rows are loaded as a 16-row tile with a mask (Triton dots need 16 rows), kend_ref is the whole
    [B] array, outputs are whole [B*Hq, D] (+ [B*Hq]) arrays written with the same mask. This saves
    the pad and slice kernels an XLA-side fold would cost at every layer.
    k_ref/v_ref [C, D]: the whole head; tiles are sliced in the loop.
    """
    s_idx = pl.program_id(3)
    if decode_rows:
        b, h = pl.program_id(0), pl.program_id(1)
        n_kv = pl.num_programs(1)
        R = decode_rows
        r0 = (b * n_kv + h) * G
        row_ok = lax.broadcasted_iota(jnp.int32, (R,), 0) < G
        q = pltriton.load(q_ref.at[pl.ds(r0, R), :], mask=row_ok[:, None], other=0.0)  # [R, D]
        kend_b = kend_ref[b]
        kend = jnp.where(row_ok, kend_b, 0)                                   # [R]
        hi = kend_b
        lo = jnp.where(kend_b > 0, kend_b, jnp.iinfo(jnp.int32).max)
    else:
        bt, _, D = q_ref.shape
        R = bt * G
        q = q_ref[...].reshape(R, D)                                          # rows (t, g)
        kend_t = kend_ref[...]                                                # [bt]
        kend = jnp.broadcast_to(kend_t[:, None], (bt, G)).reshape(R)
        hi = jnp.max(kend_t)
        lo = jnp.min(jnp.where(kend_t > 0, kend_t, jnp.iinfo(jnp.int32).max))
    D = q.shape[1]
    # This split's KV range: [start, stop), a bk-aligned share of [0, hi) of at least min_chunk
    # keys. The split count is static (from the capacity) but the length is not: a 32k cache
    # holding 1k tokens uses 2 splits, not 32 tiny ones whose partials cost more than they save.
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(hi, kv_splits), block_k) * block_k, min_chunk)
    start = s_idx * chunk
    stop = jnp.minimum(start + chunk, hi)
    n_iter = jnp.maximum(pl.cdiv(stop - start, block_k), 0)
    # Tiles below every live row's k_end need no mask (most of a long context, the lower
    # triangle of a prefill). Rows with k_end == 0 (padding, or empty by contract) are left out of
    # `lo` and zeroed at the end.
    live = kend > 0                                                           # [R]
    n_full = jnp.clip((lo - start) // block_k, 0, n_iter)

    prec = _precision(q.dtype)
    base = _LOG2E
    scale2, exp = scale * base, jnp.exp2
    cols = lax.broadcasted_iota(jnp.int32, (R, block_k), 1)

    def make_body(masked: bool):
        def body(it, carry):
            acc, m, l = carry
            k0 = pl.multiple_of(start + it * block_k, block_k)
            k = k_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=prec) * scale2                      # [R, bk], log2 units
            if masked:
                visible = (k0 + cols) < kend[:, None]
                s = jnp.where(visible, s, _MASK)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))                        # [R]
            alpha = exp(m - m_new)
            p = exp(s - m_new[:, None])                                       # [R, bk]
            if masked:
                # A row with nothing visible yet has m_new == _MASK and exp(0) == 1: zero it.
                p = jnp.where(visible, p, 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            v = v_ref[pl.ds(k0, block_k), :]                                  # [bk, D]
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=prec)  # [R, D]
            acc = acc * alpha[:, None] + pv
            return acc, m_new, l
        return body

    acc0 = jnp.zeros((R, D), jnp.float32)
    m0 = jnp.full((R,), _MASK, jnp.float32)
    l0 = jnp.zeros((R,), jnp.float32)
    carry = lax.fori_loop(0, n_full, make_body(False), (acc0, m0, l0))
    acc, m, l = lax.fori_loop(n_full, n_iter, make_body(True), carry)
    l = jnp.where(live, l, 0.0)
    o = jnp.where(live[:, None], acc, 0.0) / jnp.where(l > 0, l, 1.0)[:, None]
    lse = jnp.where(l > 0, m / base + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)

    if decode_rows:
        o_ref = out_refs[0]
        o_at = o_ref.at[pl.ds(r0, R), :] if kv_splits == 1 else o_ref.at[s_idx, pl.ds(r0, R), :]

        def store_o():
            pltriton.store(o_at, o.astype(o_ref.dtype), mask=row_ok[:, None])
        if kv_splits > 1:
            lse_ref = out_refs[1]
            pltriton.store(lse_ref.at[s_idx, pl.ds(r0, R)], lse, mask=row_ok)
    else:
        o_ref = out_refs[0]

        def store_o():
            o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
        if kv_splits > 1:
            lse_ref = out_refs[1]
            lse_ref[...] = lse.reshape(lse_ref.shape)
    if kv_splits == 1:
        store_o()
    else:
        # An empty split writes only lse = -inf; _merge never reads its (unwritten) o.
        pl.when(n_iter > 0)(store_o)


def _merge(o_parts, lse):
    """o_parts [S, ..., D] (normalised per split), lse [S, ...] f32 -> [..., D] f32.

    Written as elementwise ops over the S static slices (no reductions over the split axis), so XLA
    emits the whole merge as one loop fusion: one small kernel per attention call instead of a
    reduce for the max and another for the weighted sum."""
    n = lse.shape[0]
    m = lse[0]
    for i in range(1, n):
        m = jnp.maximum(m, lse[i])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    den, o = 0.0, 0.0
    for i in range(n):
        w = jnp.exp(lse[i] - m)                                               # 0 for an empty split
        den = den + w
        # where, not a product: an empty split's o was never written (may hold nan).
        o = o + jnp.where(w[..., None] > 0, o_parts[i].astype(jnp.float32) * w[..., None], 0.0)
    return o / jnp.where(den > 0, den, 1.0)[..., None]


# The split merge as a Pallas kernel. XLA's fusion of `_merge` took 5.9 us of the call's 45.1 at B=1
# and 32k context (32 splits, 4 MB of partials; call 27, device time). This kernel spreads the
# partials over (row tile, column tile) programs, each loading all of its splits' tiles at once
# (unrolled: every load in flight together); small tiles (many programs) win at batch 1.
def _merge_kernel(o_ref, lse_ref, out_ref, *, n_split: int, n_rows: int, rows: int, width: int):
    """o_ref [S, N, D] (per-split normalised partials), lse_ref [S, N] f32 -> out_ref [N, D]: this
    program's `rows` rows x `width` columns. Same arithmetic as `_merge`."""
    r0 = pl.program_id(0) * rows
    cols = pl.ds(pl.multiple_of(pl.program_id(1) * width, width), width)
    row_ok = (r0 + lax.broadcasted_iota(jnp.int32, (rows,), 0)) < n_rows
    lse = [pltriton.load(lse_ref.at[jnp.int32(s), pl.ds(r0, rows)], mask=row_ok, other=-jnp.inf)
           for s in range(n_split)]
    parts = [pltriton.load(o_ref.at[jnp.int32(s), pl.ds(r0, rows), cols], mask=row_ok[:, None],
                           other=0.0) for s in range(n_split)]
    m = functools.reduce(jnp.maximum, lse)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    den = jnp.zeros((rows,), jnp.float32)
    acc = jnp.zeros((rows, width), jnp.float32)
    for x, o in zip(lse, parts):
        w = jnp.exp(x - m)                                                    # 0 for an empty split
        den = den + w
        # where, not a product: an empty split's o was never written (may hold nan)
        acc = acc + jnp.where(w[:, None] > 0, o.astype(jnp.float32) * w[:, None], 0.0)
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]
    pltriton.store(out_ref.at[pl.ds(r0, rows), cols], out.astype(out_ref.dtype), mask=row_ok[:, None])


def merge_splits(o_parts, lse, out_dtype, *, rows: int = MERGE_ROWS, cols: int = MERGE_COLS,
                 interpret=False):
    """o_parts [S, ..., D], lse [S, ...] -> [..., D] in out_dtype: `_merge` as one Pallas kernel,
    one program per `rows` x `cols` tile of the output."""
    S, D = o_parts.shape[0], o_parts.shape[-1]
    cols = min(cols, D)
    o2 = o_parts.reshape(S, -1, D)
    N = o2.shape[1]
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        out = pl.pallas_call(
            functools.partial(_merge_kernel, n_split=S, n_rows=N, rows=rows, width=cols),
            out_shape=jax.ShapeDtypeStruct((N, D), out_dtype),
            grid=(pl.cdiv(N, rows), D // cols),
            in_specs=[whole((S, N, D)), whole((S, N))],
            out_specs=whole((N, D)),
            compiler_params=pltriton.CompilerParams(num_warps=max(1, min(4, rows * cols // 256)),
                                                    num_stages=1),
            interpret=interpret,
            name="dflash_attention_merge",
        )(o2, lse.reshape(S, N))
    return out.reshape(o_parts.shape[1:])


def parse_settings(spec: str, allowed: tuple | None = None, what: str = "settings") -> dict:
    """Integer launch settings written "a=1,b=2" -> {"a": 1, "b": 2}; a name outside `allowed`
    (when given) is an error naming `what`."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.strip().split(","))):
        name, _, val = item.partition("=")
        if allowed is not None and name not in allowed:
            raise ValueError(f"{what}: unknown setting {name!r} in {spec!r}")
        out[name] = int(val)
    return out


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, interpret=False,
                    block_t: int | None = None, block_k: int | None = None,
                    kv_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, min_chunk: int | None = None,
                    merge_kernel: bool | None = None,
                    merge_rows: int | None = None, merge_cols: int | None = None,
                    n_sms: int | None = None):
    """Pallas Triton block attention. Tuning arguments override `default_config`.

    merge_kernel: split partials merged by `merge_splits` (a Pallas kernel) instead of XLA's fusion
    of `_merge`; None: as default_config says. n_sms: the GPU's SM count (None: `sm_count()`)."""
    check_shapes(q, k_cache, v_cache, k_end)
    B, T, Hq, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = Hq // Hkv
    if D not in _HEAD_DIMS:
        raise Unsupported(f"head_dim={D} not in {_HEAD_DIMS}")
    if G & (G - 1):
        raise Unsupported(f"GQA group {G} is not a power of two (Triton tensor shapes)")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise Unsupported(f"dtype {q.dtype} not supported")
    if T > 1 and T * G < 16:
        # Too few rows for a Triton dot and not the decode layout (T == 1): pad the positions
        # with empty rows (k_end 0). No Qwen3 shape takes this path (T is 1, the block, or a prefill).
        Tp = 16 // G
        out = block_attention(jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))), k_cache, v_cache,
                              jnp.pad(k_end, ((0, 0), (0, Tp - T))), scale=scale,
                              interpret=interpret, block_k=block_k, kv_splits=kv_splits,
                              num_warps=num_warps, num_stages=num_stages, min_chunk=min_chunk,
                              merge_kernel=merge_kernel, merge_rows=merge_rows,
                              merge_cols=merge_cols, n_sms=n_sms)
        return out[:, :T]
    n_sms = sm_count() if n_sms is None else n_sms
    cfg = default_config(T, G, C, D, B, Hkv, n_sms=n_sms)
    if block_t is not None:
        cfg["block_t"] = block_t
    cfg = _fit_smem(cfg, 16 if T == 1 else cfg["block_t"] * G, D, jnp.dtype(q.dtype).itemsize)
    for name, val in dict(block_k=block_k, kv_splits=kv_splits, num_warps=num_warps,
                          num_stages=num_stages, min_chunk=min_chunk,
                          merge_kernel=merge_kernel, merge_rows=merge_rows,
                          merge_cols=merge_cols).items():
        if val is not None:
            cfg[name] = val
    bt, bk, n_split = cfg["block_t"], cfg["block_k"], cfg["kv_splits"]
    if bk < 16 or bk & (bk - 1):
        raise Unsupported(f"block_k={bk} must be a power of two >= 16")
    if C % bk:
        raise Unsupported(f"capacity C={C} is not a multiple of block_k={bk}")
    decode_rows = 16 if (T == 1 and G < 16) else 0
    if not decode_rows:
        if bt < 1 or bt & (bt - 1) or T % bt:
            raise Unsupported(f"block_t={bt} must be a power of two dividing T={T}")
        if bt * G < 16:
            raise Unsupported(f"row tile {bt}x{G} < 16 rows (Triton dots need 16)")
    scale = D ** -0.5 if scale is None else float(scale)
    k_end = jnp.clip(k_end.astype(jnp.int32), 0, C)
    # Triton cannot do two dtypes in one dot: keep K/V and q alike (the contract has them equal).
    k_cache = k_cache.astype(q.dtype)
    v_cache = v_cache.astype(q.dtype)
    kv_spec = pl.BlockSpec((None, None, C, D), lambda b, h, i, s: (b, h, 0, 0))
    # Split partials in the input's dtype: for bf16 this halves the merge's traffic and costs about
    # one bf16 rounding (the output is bf16 anyway); f32 inputs keep f32 partials.
    if decode_rows:                      # q, k_end and the outputs as whole arrays (see _kernel)
        n_t = 1
        q_in, kend_in = q.reshape(B * Hq, D), k_end.reshape(B)
        q_spec = pl.BlockSpec((B * Hq, D), lambda b, h, i, s: (0, 0))
        kend_spec = pl.BlockSpec((B,), lambda b, h, i, s: (0,))
        if n_split == 1:
            out_shape = jax.ShapeDtypeStruct((B * Hq, D), q.dtype)
            out_specs = q_spec
        else:
            out_shape = [jax.ShapeDtypeStruct((n_split, B * Hq, D), q.dtype),
                         jax.ShapeDtypeStruct((n_split, B * Hq), jnp.float32)]
            out_specs = [pl.BlockSpec((n_split, B * Hq, D), lambda b, h, i, s: (0, 0, 0)),
                         pl.BlockSpec((n_split, B * Hq), lambda b, h, i, s: (0, 0))]
    else:                                # q as [B, T, Hkv, G, D]: a free reshape
        n_t = T // bt
        q_in, kend_in = q.reshape(B, T, Hkv, G, D), k_end
        q_spec = pl.BlockSpec((None, bt, None, G, D), lambda b, h, i, s: (b, i, h, 0, 0))
        kend_spec = pl.BlockSpec((None, bt), lambda b, h, i, s: (b, i))
        if n_split == 1:
            out_shape = jax.ShapeDtypeStruct((B, T, Hkv, G, D), q.dtype)
            out_specs = q_spec
        else:
            out_shape = [jax.ShapeDtypeStruct((n_split, B, T, Hkv, G, D), q.dtype),
                         jax.ShapeDtypeStruct((n_split, B, T, Hkv, G), jnp.float32)]
            out_specs = [pl.BlockSpec((None, None, bt, None, G, D), lambda b, h, i, s: (s, b, i, h, 0, 0)),
                         pl.BlockSpec((None, None, bt, None, G), lambda b, h, i, s: (s, b, i, h, 0))]
    min_chunk = _round_up(max(cfg["min_chunk"], bk), bk)
    kernel = functools.partial(_kernel, scale=scale, block_k=bk, kv_splits=n_split,
                               min_chunk=min_chunk, decode_rows=decode_rows, G=G)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        out = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(B, Hkv, n_t, n_split),
            in_specs=[q_spec, kv_spec, kv_spec, kend_spec],
            out_specs=out_specs,
            compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"],
                                                    num_stages=cfg["num_stages"]),
            interpret=interpret,
            name="dflash_block_attention_gpu",
        )(q_in, k_cache, v_cache, kend_in)
    if n_split > 1 and cfg["merge_kernel"]:
        out = merge_splits(*out, q.dtype, rows=cfg["merge_rows"], cols=cfg["merge_cols"],
                           interpret=interpret)
    elif n_split > 1:
        out = _merge(*out).astype(q.dtype)
    return out.reshape(B, T, Hq, D)


# ----------------------------------------------------------------------------------------------
# Fused attention prologue for short blocks (decode T=1, verify T=16) on the GPU path.
#
# After the fused q/k/v projection, XLA runs q-norm, k-norm, RoPE and the two cache writes as about
# six small kernels per layer (two row reductions, two elementwise fusions, two dynamic-update-slices;
# ~2 us each on the H200, launch-bound). This kernel does all of it in one launch: one program per
# (batch row, head), q heads first, then kv heads. The caches are updated in place
# (input_output_aliases). Numerics follow modeling.layers exactly: RMSNorm in float32, cast back,
# times the weight in the input dtype; RoPE in float32 from that, cast back.

def _prologue_kernel(qkv_ref, cos_ref, sin_ref, qw_ref, kw_ref, start_ref, ctx_start_ref, kc_in, vc_in,
                     q_ref, kc_ref, vc_ref, *, Hq: int, D: int, eps: float, Tc: int, barrier: bool):
    """qkv_ref [Tc + T, F]: Tc context rows (the draft's; their K/V only) then the block's T rows."""
    del kc_in, vc_in  # aliased to kc_ref / vc_ref
    b, h = pl.program_id(0), pl.program_id(1)
    half = D // 2
    dt = qkv_ref.dtype
    f32 = jnp.float32
    T = q_ref.shape[1]

    def norm_rope(r0, n, col0, w_ref):
        rows = pl.ds(r0, n)
        cos, sin = cos_ref[rows, :], sin_ref[rows, :]                           # [n, D/2] f32
        x1 = qkv_ref[rows, pl.ds(col0, half)].astype(f32)                      # [n, D/2]
        x2 = qkv_ref[rows, pl.ds(col0 + half, half)].astype(f32)
        r = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        y1 = (w_ref[pl.ds(0, half)][None, :].astype(f32) * (x1 * r).astype(dt).astype(f32)).astype(dt).astype(f32)
        y2 = (w_ref[pl.ds(half, half)][None, :].astype(f32) * (x2 * r).astype(dt).astype(f32)).astype(dt).astype(f32)
        return (y1 * cos - y2 * sin).astype(dt), (y2 * cos + y1 * sin).astype(dt)

    @pl.when(h < Hq)
    def _q():
        o1, o2 = norm_rope(Tc, T, h * D, qw_ref)
        pltriton.store(q_ref.at[b, :, h, pl.ds(0, half)], o1.astype(q_ref.dtype))
        pltriton.store(q_ref.at[b, :, h, pl.ds(half, half)], o2.astype(q_ref.dtype))

    @pl.when(h >= Hq)
    def _kv():
        j = h - Hq
        n_kv = pl.num_programs(1) - Hq

        def write(r0, n, start):
            o1, o2 = norm_rope(r0, n, (Hq + j) * D, kw_ref)
            pltriton.store(kc_ref.at[b, j, pl.ds(start, n), pl.ds(0, half)], o1.astype(kc_ref.dtype))
            pltriton.store(kc_ref.at[b, j, pl.ds(start, n), pl.ds(half, half)], o2.astype(kc_ref.dtype))
            v = qkv_ref[pl.ds(r0, n), pl.ds((Hq + n_kv + j) * D, D)]                 # [n, D]
            pltriton.store(vc_ref.at[b, j, pl.ds(start, n), :], v.astype(vc_ref.dtype))

        if Tc:
            write(0, Tc, ctx_start_ref[b])
            # the block's rows win where the two ranges overlap: every thread's context stores
            # land before any block store (the interpreter runs them in order and has no barrier)
            if barrier:
                pltriton.debug_barrier()
        write(Tc, T, start_ref[b])


def prologue_supported(T: int, D: int) -> bool:
    return D in _HEAD_DIMS and 1 <= T <= 64 and not (T & (T - 1))


def qk_norm_rope_write(qkv, cos, sin, q_weight, k_weight, eps: float, k_cache, v_cache, start, *,
                       num_heads: int, ctx_rows: int = 0, ctx_start=None, interpret=False):
    """qkv [B, T, (Hq + 2 Hkv) D] (the fused projection's output), cos/sin [B, T, D/2] float32,
    q/k norm weights [D], caches [B, Hkv, C, D], start [B] (the block's first cache row, clamped to
    [0, C - T] as dynamic_update_slice would). Returns (q [B, T, Hq, D] normed and rotated, k_cache, v_cache) with
    rows [start, start + T) of every kv head holding the block's normed, rotated keys and its values.

    ctx_rows = Tc > 0 (the draft's layers): the first Tc rows of qkv (and cos/sin) are context
    tokens, whose keys and values only are written, at rows [ctx_start, ctx_start + Tc) (clamped
    likewise), before the block's; q then covers the last T - Tc rows."""
    B, T_all, F = qkv.shape
    _, Hkv, C, D = k_cache.shape
    Hq, Tc = num_heads, ctx_rows
    T = T_all - Tc
    if (F != (Hq + 2 * Hkv) * D or not prologue_supported(T, D) or cos.shape[1] != T_all
            or (Tc and (not prologue_supported(Tc, D) or ctx_start is None))):
        raise Unsupported(f"prologue: qkv {qkv.shape} ({Tc} context rows), cache {k_cache.shape}, Hq {Hq}")
    full = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    kernel = functools.partial(_prologue_kernel, Hq=Hq, D=D, eps=float(eps), Tc=Tc, barrier=not interpret)
    # clamped as dynamic_update_slice clamps: finished rows still run the (fixed-shape) iteration,
    # and their writes must stay inside their own rows
    clamp = lambda s, n: jnp.clip(s.astype(jnp.int32), 0, C - n)
    ctx_start = clamp(ctx_start, Tc) if Tc else jnp.zeros((B,), jnp.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        q, k_cache, v_cache = pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((B, T, Hq, D), qkv.dtype),
                       jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                       jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
            grid=(B, Hq + Hkv),
            in_specs=[pl.BlockSpec((None, T_all, F), lambda b, h: (b, 0, 0)),
                      pl.BlockSpec((None, T_all, D // 2), lambda b, h: (b, 0, 0)),
                      pl.BlockSpec((None, T_all, D // 2), lambda b, h: (b, 0, 0)),
                      full((D,)), full((D,)), full((B,)), full((B,)),
                      full(k_cache.shape), full(v_cache.shape)],
            out_specs=[full((B, T, Hq, D)), full(k_cache.shape), full(v_cache.shape)],
            input_output_aliases={7: 1, 8: 2},
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret,
            name="dflash_qk_norm_rope_write",
        )(qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), q_weight, k_weight,
          clamp(start, T), ctx_start, k_cache, v_cache)
    return q, k_cache, v_cache


# ----------------------------------------------------------------------------------------------
# Residual add + RMSNorm in one kernel (GPU path, short blocks). XLA:GPU runs `x + attn_out` and the
# post-attention RMSNorm as two launches (~2 us each at decode sizes); this is one program per row.

def _add_rmsnorm_kernel(x_ref, y_ref, w_ref, s_ref, n_ref, *, eps: float):
    f32 = jnp.float32
    dt = x_ref.dtype
    s = (x_ref[...].astype(f32) + y_ref[...].astype(f32)).astype(dt)          # [H], as x + y in dt
    sf = s.astype(f32)
    r = lax.rsqrt(jnp.mean(sf * sf) + eps)
    s_ref[...] = s
    n_ref[...] = (w_ref[...].astype(f32) * (sf * r).astype(dt).astype(f32)).astype(n_ref.dtype)


def add_rmsnorm_supported(H: int) -> bool:
    return 16 <= H <= 16384 and not (H & (H - 1))


def add_rmsnorm(x, y, weight, eps: float, *, interpret=False):
    """(x + y, RMSNorm(x + y) * weight) for x, y [..., H] of one dtype, as modeling.layers computes
    them (the sum rounded to the input dtype, the norm in float32, cast back, times the weight)."""
    H = x.shape[-1]
    if x.shape != y.shape or x.dtype != y.dtype or not add_rmsnorm_supported(H):
        raise Unsupported(f"add_rmsnorm: {x.shape} {x.dtype} + {y.shape} {y.dtype}")
    lead = x.shape[:-1]
    N = math.prod(lead)
    row = pl.BlockSpec((None, H), lambda i: (i, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        s, n = pl.pallas_call(
            functools.partial(_add_rmsnorm_kernel, eps=float(eps)),
            out_shape=[jax.ShapeDtypeStruct((N, H), x.dtype), jax.ShapeDtypeStruct((N, H), x.dtype)],
            grid=(N,),
            in_specs=[row, row, pl.BlockSpec((H,), lambda i: (0,))],
            out_specs=[row, row],
            compiler_params=pltriton.CompilerParams(num_warps=4 if H <= 4096 else 8, num_stages=1),
            interpret=interpret,
            name="dflash_add_rmsnorm",
        )(x.reshape(N, H), y.reshape(N, H), weight.astype(x.dtype))
    return s.reshape(x.shape), n.reshape(x.shape)


# ----------------------------------------------------------------------------------------------
# Sampling's top-k / top-p threshold search (dflash_jax.sampling) on the GPU. The search finds, per
# row n, the smallest key x with  offset[n] + sum_v weight[n, v] * (keys[n, v] > x)  <  budget[n],
# deciding `width` bits of x per pass from 2**width candidates. XLA emits each pass as an
# [N, V, K] -> [N, K] column reduction with little parallelism over V (~14 us a pass for 16 x
# 151,936 on the H200; 26 passes per iteration with top-k and top-p) plus small kernels for the
# digit decision. Here a pass is one kernel: each row's vocabulary is cut into P chunks, one
# program each (N * P programs fill the GPU); a program first decides the previous pass's digit
# from that pass's P partial sums (every program of a row computes the same digit), then sums its
# chunk for the new candidates and writes its partial sums and the prefix x.

COUNT_BLOCK = 512      # keys per loop step, per candidate one [512] accumulator
COUNT_PROGRAMS = 1024  # N * P target: ~8 small programs per SM, enough warps to hide load latency


def count_layout(N: int, V: int) -> tuple[int, int]:
    """(P chunks per row, a power of two <= 64; chunk, a multiple of COUNT_BLOCK, P * chunk >= V)."""
    P = max(1, min(64, COUNT_PROGRAMS // max(N, 1), -(-V // COUNT_BLOCK)))
    P = 1 << (P.bit_length() - 1)
    return P, _round_up(-(-V // P), COUNT_BLOCK)


def _count_pass_kernel(*refs, V: int, chunk: int, weighted: bool, first: bool, shift: int,
                       width: int, prev_shift: int):
    refs = list(refs)
    keys_ref = refs.pop(0)
    w_ref = refs.pop(0) if weighted else None
    if first:
        part_out, x_out = refs
        x = jnp.int32(0)
    else:
        part_ref, x_ref, off_ref, bud_ref, part_out, x_out = refs
        tot = jnp.sum(part_ref[...], axis=0)                                  # [K_prev]
        k_prev = tot.shape[0]
        passing = (off_ref[...] + tot) < bud_ref[...]
        d = jnp.min(jnp.where(passing, lax.broadcasted_iota(jnp.int32, (k_prev,), 0), k_prev - 1))
        x = jnp.max(x_ref[...]) | (d << prev_shift)          # bit 31 wraps into the sign: intended
    K = 1 << width
    low = (1 << shift) - 1
    # candidates as uint32 bit patterns, compared as signed int32 (sign bit flipped), as scalars:
    # the loop is K independent 1-D compare-select-add streams, no 2-D layouts to convert
    def i32(v):  # a uint32 bit pattern as an int32 constant
        return jnp.int32(v - (1 << 32) if v >= 1 << 31 else v)
    cands = [(x | i32((j << shift) | low)) ^ jnp.int32(-2**31) for j in range(K)]
    base = pl.program_id(1) * chunk
    lanes = lax.broadcasted_iota(jnp.int32, (COUNT_BLOCK,), 0)

    def body(i, accs):
        off = pl.multiple_of(base + i * COUNT_BLOCK, COUNT_BLOCK)
        ok = off + lanes < V                      # the last chunk ends inside its last block
        k = pltriton.load(keys_ref.at[pl.ds(off, COUNT_BLOCK)], mask=ok, other=jnp.iinfo(jnp.int32).min)
        if weighted:
            w = pltriton.load(w_ref.at[pl.ds(off, COUNT_BLOCK)], mask=ok, other=0.0)
            return tuple(a + jnp.where(k > c, w, 0.0) for a, c in zip(accs, cands))
        return tuple(a + jnp.where(k > c, 1.0, 0.0) for a, c in zip(accs, cands))

    accs = lax.fori_loop(0, chunk // COUNT_BLOCK, body,
                         tuple(jnp.zeros((COUNT_BLOCK,), jnp.float32) for _ in range(K)))
    slot = lax.broadcasted_iota(jnp.int32, (K,), 0)
    out = jnp.zeros((K,), jnp.float32)
    for j, a in enumerate(accs):
        out = jnp.where(slot == j, jnp.sum(a), out)
    part_out[...] = out
    x_out[...] = jnp.full((16,), x, jnp.int32)


def count_pass(keys, weight, prev, offset, budget, *, P: int, chunk: int, shift: int, width: int,
               prev_shift: int = 0, interpret=False):
    """One pass of the threshold search. keys [N or 1, V] int32 (uint32 keys with the sign bit
    flipped), weight [N, V] float32 or None (weight 1); P, chunk from count_layout.
    prev: None for the first pass (prefix 0), else the previous pass's (partials, x) outputs;
    offset, budget [N] float32. The pass decides the previous digit (at bit prev_shift), then sums
    the weights above the candidates  x | d << shift | (1 << shift) - 1  for d < 2**width.
    Returns (partials [N, P, 2**width] float32, x [N, P, 16] int32: the prefix, as uint32 bits)."""
    Nk, V = keys.shape
    N = budget.shape[0]
    K = 1 << width
    if P * chunk < V or chunk % COUNT_BLOCK or Nk not in (1, N) or P & (P - 1) or not 1 <= width <= 5:
        raise Unsupported(f"count_pass: keys {keys.shape}, P={P}, chunk={chunk}, width={width}")
    in_specs = [pl.BlockSpec((None, V), (lambda n, p: (n, 0)) if Nk == N else (lambda n, p: (0, 0)))]
    args = [keys]
    if weight is not None:
        in_specs.append(pl.BlockSpec((None, V), lambda n, p: (n, 0)))
        args.append(weight.astype(jnp.float32))
    if prev is not None:
        part, x = prev
        kp = part.shape[2]
        in_specs += [pl.BlockSpec((None, P, kp), lambda n, p: (n, 0, 0)),
                     pl.BlockSpec((None, None, 16), lambda n, p: (n, 0, 0)),
                     pl.BlockSpec((None, kp), lambda n, p: (n, 0)),
                     pl.BlockSpec((None, kp), lambda n, p: (n, 0))]
        args += [part, x, jnp.broadcast_to(offset.astype(jnp.float32)[:, None], (N, kp)),
                 jnp.broadcast_to(budget.astype(jnp.float32)[:, None], (N, kp))]
    kernel = functools.partial(_count_pass_kernel, V=V, chunk=chunk, weighted=weight is not None,
                               first=prev is None, shift=shift, width=width, prev_shift=prev_shift)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        return pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((N, P, K), jnp.float32),
                       jax.ShapeDtypeStruct((N, P, 16), jnp.int32)],
            grid=(N, P),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, None, K), lambda n, p: (n, p, 0)),
                       pl.BlockSpec((None, None, 16), lambda n, p: (n, p, 0))],
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
            name="dflash_sampling_count",
        )(*args)


# ----------------------------------------------------------------------------------------------
# Sampling's top-k survivors, gathered (dflash_jax.sampling). Once the top-k score threshold h is
# known, the tokens with key >= h (k of them, more only with ties at h) are written to a small
# per-row buffer, so the top-k tie cut and the top-p cut run on <= GATHER_MAX values instead of
# 13 more passes over the vocabulary each. Same N x P layout as count_pass; a block with survivors
# takes its slots with one atomic add on its row's counter and places them by a prefix sum. Slots
# are taken in no fixed order: consumers sort by (key, index), so the result does not depend on it.

GATHER_MAX = 256


def _gather_kernel(keys_ref, h_ref, cnt_in, key_in, idx_in, cnt_ref, key_ref, idx_ref, *,
                   V: int, chunk: int, kmax: int):
    del cnt_in, key_in, idx_in  # aliased to the outputs (pre-filled: 0, INT_MIN, V)
    n = pl.program_id(0)
    h = h_ref[n]
    base = pl.program_id(1) * chunk
    lanes = lax.broadcasted_iota(jnp.int32, (COUNT_BLOCK,), 0)

    def body(i, carry):
        off = pl.multiple_of(base + i * COUNT_BLOCK, COUNT_BLOCK)
        ok = off + lanes < V
        k = pltriton.load(keys_ref.at[pl.ds(off, COUNT_BLOCK)], mask=ok, other=jnp.iinfo(jnp.int32).min)
        sel = ((k >= h) & ok).astype(jnp.int32)
        c = jnp.sum(sel)

        @pl.when(c > 0)
        def _put():
            first = pltriton.atomic_add(cnt_ref, (n,), c)
            pos = first + jnp.cumsum(sel) - 1
            put = (sel > 0) & (pos < kmax)
            # lanes that write nothing still get distinct slots (a spare tail of COUNT_BLOCK per
            # row): the interpreter runs a masked store as a scatter, where duplicates would race
            slot = jnp.where(put, pos, kmax + lanes)
            pltriton.store(key_ref.at[n, slot], k, mask=put)
            pltriton.store(idx_ref.at[n, slot], off + lanes, mask=put)
        return carry

    lax.fori_loop(0, chunk // COUNT_BLOCK, body, 0)


def gather_above(keys, h, *, kmax: int = GATHER_MAX, interpret=False):
    """keys [N, V] int32 (uint32 keys with the sign bit flipped, as count_pass takes them), h [N]
    int32 in the same encoding. Returns (count [N] int32: how many keys are >= h; keys [N, kmax]
    int32 and idx [N, kmax] int32: up to kmax of them and their vocabulary indices, in no fixed
    order; unused slots hold INT_MIN and V)."""
    N, V = keys.shape
    P, chunk = count_layout(N, V)
    full = lambda shape: pl.BlockSpec(shape, lambda n, p: (0,) * len(shape))
    kernel = functools.partial(_gather_kernel, V=V, chunk=chunk, kmax=kmax)
    W = kmax + COUNT_BLOCK
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*", category=DeprecationWarning)
        cnt, k, idx = pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((N,), jnp.int32), jax.ShapeDtypeStruct((N, W), jnp.int32),
                       jax.ShapeDtypeStruct((N, W), jnp.int32)],
            grid=(N, P),
            in_specs=[pl.BlockSpec((None, V), lambda n, p: (n, 0)), full((N,)),
                      full((N,)), full((N, W)), full((N, W))],
            out_specs=[full((N,)), full((N, W)), full((N, W))],
            input_output_aliases={2: 0, 3: 1, 4: 2},
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
            name="dflash_sampling_gather",
        )(keys, h.astype(jnp.int32), jnp.zeros((N,), jnp.int32),
          jnp.full((N, W), jnp.iinfo(jnp.int32).min, jnp.int32), jnp.full((N, W), V, jnp.int32))
    return cnt, k[:, :kmax], idx[:, :kmax]
