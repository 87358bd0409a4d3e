"""Block attention for short blocks (verify, draft) as a Pallas Mosaic GPU kernel (Hopper and later).

Same contract as `reference.block_attention`, for the shapes the speculative loop runs at small batch:
T * G query rows in 64-row tiles (Qwen3-8B: a block of 16 positions x 4 query heads per kv head),
head_dim 64 or 128, bf16 or f16. Everything else stays on the Triton kernel (`gpu.py`).

Why a second GPU kernel: the Triton kernel streams K/V at the copy rate only when every SM holds
programs with long loops (batch 32); at batch 1-8 a program's tile chain (load, QK, softmax, PV) is
serial inside one warpgroup and its loads are issued by the same warps (BENCHMARKS.md: 38-67% of copy
bandwidth). Here each program (batch row, kv head, row tile, kv split) is warp specialised:

  - one memory warpgroup issues TMA copies of K and V tiles `stages` deep into shared memory,
    refilling a slot as soon as the warpgroup that used it signals the slot free;
  - `compute_wgs` compute warpgroups take the split's tiles in turn (tile j goes to warpgroup
    j % compute_wgs), each with its own online-softmax state over the shared q tile (wgmma for QK
    and PV), so one warpgroup's softmax overlaps the other's matmuls and the loads never wait for
    compute.

Each compute warpgroup's (o, lse) is a partial over its tiles; the partials of all splits and
warpgroups are merged by the same one-fusion epilogue as the Triton kernel's splits (`gpu._merge`).

Row order inside a tile is (g, t) (the G heads' rows of consecutive positions), so q is read and o
written with one TMA copy per head of the group, straight from and to the [B, T, Hq, D] layout.

Measured on the H200 (BENCHMARKS.md, calls 20-23): not faster than the Triton kernel (a tie at
batch 8, slower at batch 1 and at 1k), and ~18 s of compile a kernel, so it is opt-in
(`DFLASH_GPU_ATTN_KERNEL=mosaic`, see `pallas_kernels.block_attention`). Its in-kernel profile
(`profile_dir`, `scripts/mgpu_profile.py`) shows the overlap working and the compute warpgroups then
waiting on K tiles: at batch 1 the limit is on the memory side, not in the tile chain.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import H200_SMS, _merge
from pallas_kernels.tpu import Unsupported, check_shapes

ROWS = 64          # a wgmma tile's rows: one warpgroup's share of the query tile
_MASK = -1e30
_LOG2E = math.log2(math.e)
SMEM_BYTES = 227 * 1024   # shared memory one Hopper program may use
# DFLASH_GPU_ATTN_KERNEL=mosaic routes only caches this long to the kernel: on short ones its launch
# and merge cost more than the Triton kernel's (call 20, B=1 1k: 16.2 us against 13.8; the B=1
# prompt-512 loop 5.691 ms against 5.593).
MIN_CAPACITY = 4096


def available() -> bool:
    """True when this jax has the Mosaic GPU Pallas API this kernel is written against."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return all(hasattr(plgpu, n) for n in ("kernel", "wgmma", "ACC", "Barrier", "copy_gmem_to_smem",
                                           "TilingTransform", "SwizzleTransform", "set_max_registers"))


def default_config(T: int, G: int, C: int, D: int, B: int, Hkv: int, *, n_sms: int = H200_SMS) -> dict:
    """Tile sizes, warpgroups and kv splits. One program per SM (its shared memory is ~180 KiB), so
    the splits fill one wave of `n_sms` programs; a split keeps >= min_chunk keys."""
    block_k = 64
    programs = B * Hkv * max(1, (T * G) // ROWS)
    kv_splits = max(1, min(n_sms // programs, C // (4 * block_k), 32))
    return dict(block_k=block_k, stages=4, compute_wgs=2, kv_splits=kv_splits, min_chunk=256)


def supports(q, k_cache) -> str | None:
    """None if the kernel takes these shapes, else why not."""
    B, T, Hq, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    if not available():
        return "this jax has no Mosaic GPU Pallas API"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16/f16 only)"
    if D not in (64, 128):
        return f"head_dim {D} (64 or 128 only)"
    if (T * G) % ROWS or ROWS % G or (ROWS // G) % 8 or T % (ROWS // G):
        return f"T={T} x G={G} rows do not form {ROWS}-row tiles of >= 8 positions"
    if C % 64:
        return f"capacity {C} not a multiple of 64"
    return None


def _kernel(q_ref, k_ref, v_ref, kend_ref, bounds_ref, o_ref, lse_ref,
            q_smem, k_smem, v_smem, o_smem, lse_smem, kend_smem, q_bar, k_bars, v_bars, k_free, v_free, *,
            plgpu, G: int, bt: int, n_split: int, block_k: int, stages: int, cw: int,
            min_chunk: int, scale_log2: float, mma_by_dot: bool):
    h = lax.axis_index("h")
    ts = lax.axis_index("ts")
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")
    i = ts // n_split                  # row tile
    s = ts % n_split                   # kv split
    dt = q_smem.dtype
    D = q_smem.shape[-1]

    hi = bounds_ref[b, i, 0]           # max k_end over the tile's rows
    lo = bounds_ref[b, i, 1]           # min k_end over its live rows (k_end > 0)
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(hi, n_split), block_k) * block_k, min_chunk)
    start = s * chunk
    stop = jnp.minimum(start + chunk, hi)
    n_steps = jnp.maximum(pl.cdiv(stop - start, block_k), 0)
    # Tiles below every live row's k_end need no mask (most of a long context).
    n_full = jnp.clip((lo - start) // block_k, 0, n_steps)

    @pl.when(wg == cw)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        for g in range(G):             # the q tile: one copy per head of the group, rows (g, t)
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(i * bt, bt), h * G + g],
                                    q_smem.at[pl.ds(g * bt, bt)], q_bar)
        plgpu.copy_gmem_to_smem(kend_ref.at[b, i], kend_smem, q_bar)

        def load(step, slot):
            rows = pl.ds(start + step * block_k, block_k)
            plgpu.copy_gmem_to_smem(k_ref.at[b, h, rows], k_smem.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, h, rows], v_smem.at[slot], v_bars.at[slot])

        for j in range(stages):
            pl.when(j < n_steps)(functools.partial(load, j, j))

        @pl.loop(stages, jnp.maximum(n_steps, stages))
        def _refill(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            load(step, slot)

        # Observe the last slot releases too (the interpreter insists that every completed phase of
        # a barrier is seen by its waiter; on the GPU it costs nothing, the compute ends later).
        @pl.loop(jnp.maximum(n_steps, stages) - stages, n_steps)
        def _drain(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

    @pl.when(wg < cw)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        layout = plgpu.Layout.WGMMA
        R = kend_smem.shape[0]
        acc = plgpu.layout_cast(jnp.zeros((R, D), jnp.float32), layout)
        m = plgpu.layout_cast(jnp.full((R,), _MASK, jnp.float32), layout.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((R,), jnp.float32), layout.reduce(1))
        plgpu.barrier_wait(q_bar)
        kend = plgpu.load(kend_smem, (), layout=layout.reduce(1))                  # [R] int32
        mine = jnp.maximum(pl.cdiv(n_steps - wg, cw), 0)   # tiles wg, wg + cw, ... of this split
        mine_full = jnp.maximum(pl.cdiv(n_full - wg, cw), 0)  # those of them below every k_end

        def make_body(masked: bool):
            def body(j, carry):
                acc, m, l = carry
                step = wg + j * cw
                slot = lax.rem(step, stages)
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_bars.at[slot])
                with jax.named_scope("qk"):
                    if mma_by_dot:     # interpret mode has no wgmma: the same products as plain dots
                        sc = lax.dot_general(q_smem[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)
                    else:
                        def qk(acc_ref):
                            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                            return acc_ref[...]
                        sc = pl.run_scoped(qk, plgpu.ACC((R, block_k), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                with jax.named_scope("softmax"):
                    sc = sc * scale_log2
                    if masked:
                        cols = plgpu.broadcasted_iota(jnp.int32, (R, block_k), 1, layout=layout)
                        visible = ((cols + (start + step * block_k))
                                   < lax.broadcast_in_dim(kend, (R, block_k), [0]))
                        sc = jnp.where(visible, sc, _MASK)
                    m_new = jnp.maximum(m, sc.max(axis=1))
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                    if masked:         # a row with nothing visible yet has exp2(0) == 1 there
                        p = jnp.where(visible, p, 0.0)
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16 = p.astype(dt)
                with jax.named_scope("wait_v"):
                    plgpu.barrier_wait(v_bars.at[slot])
                with jax.named_scope("pv"):
                    if mma_by_dot:
                        acc = acc + lax.dot_general(p16, v_smem.at[slot][...], (((1,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32)
                    else:
                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l
            return body

        carry = lax.fori_loop(0, mine_full, make_body(False), (acc, m, l))
        acc, m, l = lax.fori_loop(mine_full, mine, make_body(True), carry)
        ok = l > 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
        o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(ok, (m + jnp.log2(jnp.where(ok, l, 1.0))) / _LOG2E, -jnp.inf)
        o_smem.at[wg][...] = o.astype(dt)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        part = s * cw + wg
        for g in range(G):
            plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(g * bt, bt)],
                                    o_ref.at[part, b, pl.ds(i * bt, bt), h * G + g])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[part, b, i, h])
        plgpu.wait_smem_to_gmem(0)


def block_attention(q, k_cache, v_cache, k_end, *, scale: float | None = None, interpret=None,
                    block_k: int | None = None, stages: int | None = None,
                    compute_wgs: int | None = None, kv_splits: int | None = None,
                    min_chunk: int | None = None, n_sms: int = H200_SMS, profile_dir: str | None = None):
    """Mosaic GPU block attention; raises Unsupported for shapes it does not take (see `supports`).

    interpret: None on a GPU, or a `plgpu.InterpretGPUParams()` to run on CPU (jax >= 0.11).
    profile_dir: write Mosaic GPU's in-kernel trace of each warpgroup's regions (wait_k, qk, softmax,
    wait_v, pv) there as Chrome-trace JSON (`scripts/mgpu_profile.py` summarises it); benchmarks only.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    check_shapes(q, k_cache, v_cache, k_end)
    why = supports(q, k_cache)
    if why:
        raise Unsupported(why)
    B, T, Hq, D = q.shape
    _, Hkv, C, _ = k_cache.shape
    G = Hq // Hkv
    cfg = default_config(T, G, C, D, B, Hkv, n_sms=n_sms)
    for name, val in dict(block_k=block_k, stages=stages, compute_wgs=compute_wgs,
                          kv_splits=kv_splits, min_chunk=min_chunk).items():
        if val is not None:
            cfg[name] = val
    bk, stages, cw, n_split = cfg["block_k"], cfg["stages"], cfg["compute_wgs"], cfg["kv_splits"]
    if bk not in (64, 128) or C % bk:
        raise Unsupported(f"block_k={bk} (64 or 128, dividing C={C})")
    if cw < 1 or stages < cw or stages % cw:
        raise Unsupported(f"stages={stages} must be a multiple of compute_wgs={cw}")
    itemsize = jnp.dtype(q.dtype).itemsize
    smem = (ROWS * D * (1 + cw) + 2 * stages * bk * D) * itemsize + (cw + 1) * ROWS * 4
    if smem > SMEM_BYTES:
        raise Unsupported(f"block_k={bk} x stages={stages} x compute_wgs={cw} needs {smem // 1024} KiB of "
                          f"shared memory (at most {SMEM_BYTES // 1024})")
    bt = ROWS // G
    n_t = T // bt
    scale = D ** -0.5 if scale is None else float(scale)
    k_end = jnp.clip(k_end.astype(jnp.int32), 0, C)
    kt = k_end.reshape(B, n_t, bt)
    kend_rows = jnp.broadcast_to(kt[:, :, None, :], (B, n_t, G, bt)).reshape(B, n_t, ROWS)
    live_min = jnp.min(jnp.where(kt > 0, kt, jnp.iinfo(jnp.int32).max), axis=2)
    bounds = jnp.stack([jnp.max(kt, axis=2), live_min], axis=-1)                # [B, n_t, 2]
    k_cache = k_cache.astype(q.dtype)
    v_cache = v_cache.astype(q.dtype)
    n_parts = n_split * cw
    swizzle = 128 if D * itemsize >= 128 else 64
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    kernel = functools.partial(
        _kernel, plgpu=plgpu, G=G, bt=bt, n_split=n_split, block_k=bk, stages=stages, cw=cw,
        min_chunk=max(bk, -(-cfg["min_chunk"] // bk) * bk), scale_log2=scale * _LOG2E,
        mma_by_dot=interpret is not None)
    o_parts, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((n_parts, B, T, Hq, D), q.dtype),
                  jax.ShapeDtypeStruct((n_parts, B, n_t, Hkv, ROWS), jnp.float32)],
        scratch_types=[
            plgpu.SMEM((ROWS, D), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, D), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, D), q.dtype, transforms=transforms),
            plgpu.SMEM((cw, ROWS, D), q.dtype, transforms=transforms),
            plgpu.SMEM((cw, ROWS), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.int32),
            plgpu.Barrier(num_arrivals=G + 1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ],
        grid=(Hkv, n_t * n_split, B),
        grid_names=("h", "ts", "b"),
        num_threads=cw + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            **(dict(profile_space=512, profile_dir=profile_dir) if profile_dir else {})),
        interpret=interpret,
    )(q, k_cache, v_cache, kend_rows, bounds)
    # lse rows are (g, t) per tile: back to [parts, B, T, Hq] to match o_parts
    lse = lse.reshape(n_parts, B, n_t, Hkv, G, bt).transpose(0, 1, 2, 5, 3, 4).reshape(n_parts, B, T, Hq)
    return _merge(o_parts, lse).astype(q.dtype)
