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


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, active_ref, x_ref, w_ref, *refs, tm: int,
            scaled: bool):
    # x_ref [tm, K], w_ref [K, tn] (group_ref[i]'s), scaled: s_ref [1, tn] float32 (its column
    # scales); o_ref [tm, tn] (row tile tile_ref[i])
    s_ref, o_ref = refs if scaled else (None, refs[0])
    i = pl.program_id(1)

    @pl.when(i < active_ref[0])
    def _step():
        g = group_ref[i]
        w = w_ref[...]
        if scaled:      # the int8 tile converted in VMEM (int8 -> float32 -> the rows' dtype: exact)
            w = w.astype(jnp.float32).astype(x_ref.dtype)
        y = jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32, precision=precision(x_ref.dtype))
        if scaled:
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


def supported(M: int, K: int, N: int, dtype, w_dtype=None) -> bool:
    itemsize = jnp.dtype(dtype).itemsize
    w_itemsize = jnp.dtype(w_dtype).itemsize if w_dtype is not None else None
    tm, tn = choose_tiles(M, K, N, itemsize, w_itemsize=w_itemsize)
    per_col = 2 * K * (w_itemsize or itemsize) + (K * itemsize if w_itemsize == 1 else 0)
    return (itemsize in _SUBLANE and (N % 128 == 0 or tn == N) and per_col * tn <= 16 << 20
            and (w_dtype is None or jnp.dtype(w_dtype) in (jnp.dtype(dtype), jnp.dtype(jnp.int8))))


@functools.partial(jax.jit, static_argnames=("tm", "tn", "interpret"))
def gmm(lhs, rhs, group_sizes, *, scale=None, tm: int | None = None, tn: int | None = None, interpret=False):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype
    (float32 accumulation); rows past sum(group_sizes) are zero. scale [G, N] float32: rhs is int8
    (an Int8Weight's q) and out = (lhs @ rhs[g]) * scale[g] per row of group g. interpret: False on
    a TPU, or pltpu.InterpretParams() / True to run the kernel on CPU."""
    M, K = lhs.shape
    G, K2, N = rhs.shape
    if K2 != K or group_sizes.shape != (G,):
        raise Unsupported(f"gmm: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} do not agree")
    itemsize = jnp.dtype(lhs.dtype).itemsize
    if itemsize not in _SUBLANE:
        raise Unsupported(f"gmm: dtype {lhs.dtype} (float32 or a 16-bit float)")
    scaled = scale is not None
    if scaled and (rhs.dtype != jnp.int8 or scale.shape != (G, N)):
        raise Unsupported(f"gmm: scale {scale.shape} with rhs {rhs.shape} {rhs.dtype} (int8 [G, K, N], scale [G, N])")
    if not scaled and rhs.dtype != lhs.dtype:
        raise Unsupported(f"gmm: rhs {rhs.dtype} with lhs {lhs.dtype} (int8 rhs needs its scale)")
    w_itemsize = jnp.dtype(rhs.dtype).itemsize
    tm, tn = choose_tiles(M, K, N, itemsize, tm, tn, w_itemsize=w_itemsize if scaled else None)
    if N % tn:
        raise Unsupported(f"gmm: N={N} is not a multiple of the column tile {tn}")
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
    if scaled:
        in_specs.append(pl.BlockSpec((None, 1, tn), lambda j, i, st, en, grp, til, act: (grp[i], 0, j)))
        args.append(scale.astype(jnp.float32).reshape(G, 1, N))
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, scaled=scaled),
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
                                      + (4 * G * N if scaled else 0)),
        interpret=interpret,
        name="dflash_gmm_tpu_int8" if scaled else "dflash_gmm_tpu",
    )(*meta, *args)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(M_pad)[:, None] < total, out, 0)[:M]
