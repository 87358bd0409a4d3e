"""The grouped matmul as a Pallas Mosaic TPU kernel whose weight traffic follows the groups that
have rows (megablox-style scheduling; our own code).

rows [M, K] sorted by group, group g = `group_sizes[g]` consecutive rows; out[r] = rows[r] @ rhs[g(r)].
The grid is (N tiles, steps). A step is one (group, row tile) pair of a non-empty group: a row tile
of `tm` rows that holds rows of several groups is visited once per group, each visit writing only
its group's rows (the others keep what earlier visits wrote, the block staying in VMEM while its
index does not change). The schedule (`group_metadata`) is computed on the device from group_sizes
and given to the index maps as scalar prefetch: a group with no rows gets no step, so its [K, tn]
weight tiles are never copied in. The grid has a static worst case of row tiles + groups - 1 steps;
the steps past the schedule repeat the last block indices (no copy) and compute nothing.
K is one block (the expert's whole input width), so each weight byte of a visited group is read
once per N tile. Rows past sum(group_sizes) are zeroed by the wrapper.

int8 experts (dflash_jax.quantize.Int8Weight: q [G, K, N] int8, scale [G, N] float32, one per expert
and output column): `gmm(lhs, q, group_sizes, scale=scale)`. The step copies the group's int8 [K, tn]
tile (half a bf16 tile's bytes) and its [1, tn] scales, converts the tile to the rows' dtype in
VMEM, and multiplies the float32 product by the scales before the one rounding: out = round((x @ q)
* scale), which is x @ dequantize(w) up to the float32 accumulation order.

FP8 experts (an FP8 checkpoint's quantize.Fp8BlockWeight: q [G, K, N] float8_e4m3fn, scale [G, Kb,
Nb] float32, one per (bk, bn) block; `gmm(lhs, q, group_sizes, scale=scale, block=(bk, bn))`): the
step copies the group's float8 [K, tn] tile, converts it in VMEM (float8 -> float32 -> the rows'
dtype: exact; v5e / v6e have no fp8 MXU), and walks K in the checkpoint's bk blocks: each block's
float32 partial product [tm, tn] is multiplied by its scales before it is added (the scales vary
along K, so they cannot wait for the end as int8's do). bn = 1 (one scale per column in each K
block): the group's [Kb, tn] scales come into VMEM beside the tile. bn > 1: the group's [Kb, Nb]
scales come into SMEM (a few hundred bytes) and a [1, tn] row of each K block's scales is built from
its scalars; a column tile never straddles a block boundary (tn a multiple of bn, or inside one
block). out = round(sum_kb (x_kb @ q_kb) * s_kb): x @ dequantize(w) in float32 up to the order of
the sums, without dequantize's own rounding of each weight to the rows' dtype (bf16 rows: closer to
the float64 product than the XLA path, which rounds q * scale to bf16 first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import Unsupported, precision, round_up

_SUBLANE = {4: 8, 2: 16}


def group_metadata(group_sizes, m_tiles: int, tm: int):
    """The schedule of the non-empty groups: (starts [G], ends [G] (each group's rows), step_group
    [S], step_tile [S] (the group and row tile of each grid step), active [1] (the steps in use)),
    S = m_tiles + G - 1, int32."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    tiles = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)                  # row tiles per group
    S = m_tiles + G - 1
    step_group = jnp.repeat(jnp.arange(G, dtype=jnp.int32), tiles, total_repeat_length=S)
    first_step = jnp.cumsum(tiles) - tiles
    i = jnp.arange(S, dtype=jnp.int32)
    active = jnp.sum(tiles).astype(jnp.int32)
    step_tile = first[step_group] + i - first_step[step_group]
    last = jnp.maximum(active - 1, 0)
    step_group = jnp.where(i < active, step_group, step_group[last])
    step_tile = jnp.clip(jnp.where(i < active, step_tile, step_tile[last]), 0, m_tiles - 1)
    return starts, ends, step_group, step_tile, active.reshape(1)


def _fp8_product(x_ref, w, s_ref, j, *, block, tn: int, N: int):
    """sum over the K blocks of (x [tm, K] @ w [K, tn]) block by block, each times its scales (module
    docstring); w already in x's dtype. s_ref: [Kb, tn] (bn = 1, VMEM) or [Kb, Nb] (SMEM)."""
    bk, bn = block
    K = w.shape[0]
    prec = precision(x_ref.dtype)
    if bn > 1 and tn > bn:          # tn a multiple of bn: each lane's block within the tile
        blk = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1), jnp.int32(bn))
    acc = None
    for kb in range(-(-K // bk)):
        k0, k1 = kb * bk, min(K, (kb + 1) * bk)
        d = jnp.dot(x_ref[:, k0:k1], w[k0:k1], preferred_element_type=jnp.float32, precision=prec)
        if bn == 1:
            d = d * s_ref[kb:kb + 1, :]
        elif tn <= bn:                                          # the tile inside one block
            d = d * s_ref[kb, jax.lax.div(j * tn, bn)]
        else:
            nb0 = j * (tn // bn)
            row = jnp.zeros((1, tn), jnp.float32)
            for c in range(tn // bn):
                row = jnp.where(blk == c, s_ref[kb, nb0 + c], row)
            d = d * row
        acc = d if acc is None else acc + d
    return acc


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, active_ref, x_ref, w_ref, *refs, tm: int,
            scaled: bool, block=None, tn: int = 0, N: int = 0):
    # (integer division by lax.div: operands >= 0, and Mosaic's floor division needs the chip's generation)
    # x_ref [tm, K], w_ref [K, tn] (group_ref[i]'s), scaled: s_ref [1, tn] float32 (its column
    # scales; with block, the FP8 block scales: _fp8_product); o_ref [tm, tn] (row tile tile_ref[i])
    s_ref, o_ref = refs if scaled else (None, refs[0])
    i = pl.program_id(1)

    @pl.when(i < active_ref[0])
    def _step():
        g = group_ref[i]
        w = w_ref[...]
        if scaled:      # the 8-bit tile converted in VMEM (int8 / float8 -> float32 -> the rows' dtype: exact)
            w = w.astype(jnp.float32).astype(x_ref.dtype)
        if block is not None:
            y = _fp8_product(x_ref, w, s_ref, pl.program_id(0), block=block, tn=tn, N=N)
        else:
            y = jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32, precision=precision(x_ref.dtype))
        if scaled and block is None:
            y = y * s_ref[...]
        row = tile_ref[i] * tm + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
        mine = (row >= starts_ref[g]) & (row < ends_ref[g])
        o_ref[...] = jnp.where(mine, y.astype(o_ref.dtype), o_ref[...])


def choose_tiles(M: int, K: int, N: int, itemsize: int, tm: int | None = None, tn: int | None = None,
                 w_itemsize: int | None = None):
    """(tm, tn): row tiles of up to 128 rows (sublane-aligned), weight tiles of N's columns that
    keep two [K, tn] weight buffers within ~8 MiB of VMEM (int8 weights, w_itemsize 1: the two int8
    buffers and the converted tile in the rows' dtype)."""
    sub = _SUBLANE.get(itemsize, 8)
    if tm is None:
        tm = min(128, round_up(M, sub))
    per_col = 2 * K * (w_itemsize or itemsize) + (K * itemsize if w_itemsize == 1 else 0)
    if tn is None:
        tn = next((b for b in (512, 256, 128) if N % b == 0 and per_col * b <= 8 << 20), N)
    return tm, tn


def block_fits(K: int, N: int, tn: int, block, mosaic: bool = True) -> bool:
    """Whether FP8 scales of `block` (bk, bn) go with column tiles of tn: no tile straddles a column
    block (bn 1, tn a multiple of bn, or every tile inside one block). mosaic (a real TPU, not the
    interpreter): K's blocks are whole lane-aligned slices (bk a multiple of 128 dividing K, or one
    block) and a per-block scale comes from SMEM (bn 1 or at least 128)."""
    bk, bn = block
    if bk < 1 or bn < 1:
        return False
    if not (bn == 1 or tn % bn == 0 or all((j * tn) // bn == (min(N, j * tn + tn) - 1) // bn
                                           for j in range(N // tn))):
        return False
    return not mosaic or ((K <= bk or (bk % 128 == 0 and K % bk == 0)) and (bn == 1 or bn >= 128))


def supported(M: int, K: int, N: int, dtype, w_dtype=None, block=None, mosaic: bool = True) -> bool:
    """Whether gmm takes these shapes: w_dtype None (rhs in the rows' dtype), int8 (scale [G, N]) or
    a float8 with `block` (FP8 block scales; mosaic: block_fits' real-TPU rules too)."""
    itemsize = jnp.dtype(dtype).itemsize
    w_itemsize = jnp.dtype(w_dtype).itemsize if w_dtype is not None else None
    tm, tn = choose_tiles(M, K, N, itemsize, w_itemsize=w_itemsize)
    per_col = 2 * K * (w_itemsize or itemsize) + (K * itemsize if w_itemsize == 1 else 0)
    if block is not None:
        if w_dtype is None or not _is_float8(w_dtype) or not block_fits(K, N, tn, block, mosaic):
            return False
    elif w_dtype is not None and jnp.dtype(w_dtype) not in (jnp.dtype(dtype), jnp.dtype(jnp.int8)):
        return False
    return itemsize in _SUBLANE and (N % 128 == 0 or tn == N) and per_col * tn <= 16 << 20


def _is_float8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


@functools.partial(jax.jit, static_argnames=("block", "tm", "tn", "interpret"))
def gmm(lhs, rhs, group_sizes, *, scale=None, block=None, tm: int | None = None, tn: int | None = None,
        interpret=False):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype
    (float32 accumulation); rows past sum(group_sizes) are zero. scale [G, N] float32: rhs is int8
    (an Int8Weight's q) and out = (lhs @ rhs[g]) * scale[g] per row of group g. With block (bk, bn):
    rhs is float8 (an Fp8BlockWeight's q), scale [G, ceil(K / bk), ceil(N / bn)] its block scales
    (module docstring). interpret: False on a TPU, or pltpu.InterpretParams() / True to run the
    kernel on CPU."""
    M, K = lhs.shape
    G, K2, N = rhs.shape
    if K2 != K or group_sizes.shape != (G,):
        raise Unsupported(f"gmm: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} do not agree")
    itemsize = jnp.dtype(lhs.dtype).itemsize
    if itemsize not in _SUBLANE:
        raise Unsupported(f"gmm: dtype {lhs.dtype} (float32 or a 16-bit float)")
    scaled = scale is not None
    if block is not None:
        block = tuple(int(b) for b in block)
        if not scaled or not _is_float8(rhs.dtype) or scale.shape != (G, -(-K // block[0]), -(-N // block[1])):
            raise Unsupported(f"gmm: block {block}, scale {None if scale is None else scale.shape} with rhs "
                              f"{rhs.shape} {rhs.dtype} (float8 [G, K, N], scale [G, ceil(K / bk), ceil(N / bn)])")
    elif scaled and (rhs.dtype != jnp.int8 or scale.shape != (G, N)):
        raise Unsupported(f"gmm: scale {scale.shape} with rhs {rhs.shape} {rhs.dtype} (int8 [G, K, N], scale [G, N])")
    if not scaled and rhs.dtype != lhs.dtype:
        raise Unsupported(f"gmm: rhs {rhs.dtype} with lhs {lhs.dtype} (an 8-bit rhs needs its scale)")
    w_itemsize = jnp.dtype(rhs.dtype).itemsize
    tm, tn = choose_tiles(M, K, N, itemsize, tm, tn, w_itemsize=w_itemsize if scaled else None)
    if N % tn:
        raise Unsupported(f"gmm: N={N} is not a multiple of the column tile {tn}")
    if block is not None and not block_fits(K, N, tn, block, mosaic=not interpret):
        raise Unsupported(f"gmm: FP8 block {block} with K={K}, column tiles of {tn}" +
                          ("" if interpret else " (Mosaic: bk a multiple of 128 dividing K, bn 1 or >= 128)"))
    M_pad = round_up(M, tm)
    x = jnp.pad(lhs, ((0, M_pad - M), (0, 0))) if M_pad != M else lhs
    m_tiles = M_pad // tm
    meta = group_metadata(group_sizes, m_tiles, tm)
    S = m_tiles + G - 1
    if interpret is True:
        interpret = pltpu.InterpretParams()
    if not interpret:
        # Keep the experts in HBM: where a layer's local experts fit in VMEM (v5e-8: 16 x 6.3 MB of
        # gate|up), XLA's memory-space assignment would otherwise prefetch them all into VMEM ahead
        # of the kernel, reading every expert whatever the routing (docs/moe.md).
        rhs = pltpu.with_memory_space_constraint(rhs, pltpu.HBM)
    in_specs = [
        pl.BlockSpec((tm, K), lambda j, i, st, en, grp, til, act: (til[i], 0)),
        pl.BlockSpec((None, K, tn), lambda j, i, st, en, grp, til, act: (grp[i], 0, j)),
    ]
    args = [x, rhs]
    if block is not None and block[1] == 1:        # [Kb, tn] column scales of each K block, in VMEM
        Kb = scale.shape[1]
        in_specs.append(pl.BlockSpec((None, Kb, tn), lambda j, i, st, en, grp, til, act: (grp[i], 0, j)))
        args.append(scale.astype(jnp.float32))
    elif block is not None:                         # the group's [Kb, Nb] block scales, in SMEM
        in_specs.append(pl.BlockSpec((None,) + scale.shape[1:], lambda j, i, st, en, grp, til, act: (grp[i], 0, 0),
                                     memory_space=pltpu.SMEM))
        args.append(scale.astype(jnp.float32))
    elif scaled:
        in_specs.append(pl.BlockSpec((None, 1, tn), lambda j, i, st, en, grp, til, act: (grp[i], 0, j)))
        args.append(scale.astype(jnp.float32).reshape(G, 1, N))
    name = "dflash_gmm_tpu_fp8" if block is not None else "dflash_gmm_tpu_int8" if scaled else "dflash_gmm_tpu"
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, scaled=scaled, block=block, tn=tn, N=N),
        out_shape=jax.ShapeDtypeStruct((M_pad, N), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(N // tn, S),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), lambda j, i, st, en, grp, til, act: (til[i], j)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * M_pad * K * N, transcendentals=0,
                                      bytes_accessed=w_itemsize * G * K * N + itemsize * (M_pad * K + M_pad * N)
                                      + (4 * scale.size if scaled else 0)),
        interpret=interpret,
        name=name,
    )(*meta, *args)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(M_pad)[:, None] < total, out, 0)[:M]
