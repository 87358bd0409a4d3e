"""The grouped matmul as a Triton-lowered Pallas GPU kernel whose weight traffic follows the groups
that have rows (issue 36: `jax.lax.ragged_dot` on the H200 streams every expert whatever the
routing).

rows [M, K] sorted by group, group g = `group_sizes[g]` consecutive rows; out[r] = rows[r] @ rhs[g(r)].
The grid is (slots, N tiles). Slot i is the i-th NON-EMPTY group of a compacted list computed on the
device (`group_list`: group id, first row, row count; Triton has no scalar prefetch, so the kernel
reads the list from a small int32 array). A slot past the number of non-empty groups returns at
once, and there are at most min(G, M) slots (M rows fill at most M groups), so at decode the grid
is exactly the experts touched x N tiles and an expert no row chose has its weights never read.

A program (slot, column tile) walks its group's rows in tiles of `bm` (masked loads and stores;
one tile at decode: 1..16 tokens x top-8 over 128 experts is ~1 row per touched expert) and for each
runs a loop over K in `bk` steps: acc [bm, bn] += x [bm, bk] @ w [bk, bn] (f32 accumulation). With
so few rows the kernel is a weight stream (a GEMV per touched expert): `bn` is small enough that
touched experts x N / bn programs fill the SMs, and Triton pipelines the K loop (`num_stages`).

`swiglu=True` fuses the experts' first projection: rhs [G, K, 2I] holds gate columns [0, I) and up
columns [I, 2I) (the stacked `experts_gate_up`), a program loads both column tiles, and the output
is silu(x @ gate) * (x @ up) [M, I], each product rounded to the input dtype first as the unfused
path rounds them (the [M, 2I] intermediate is never written).

`gmm_rows` is the one-token path (each row its own group, the row groups themselves the list; x
may be one row shared by every choice and the output the raw [M + bm, N] buffer, which the next
launch reads as its lhs). `route` is the router after its matmul: softmax, top-k, renormalisation
and ascending ids in one one-warp program per row (KernelConfig.moe_route).

int8 experts (dflash_jax.quantize.Int8Weight: rhs int8 [G, K, N], `scale` [G, N] float32): each
K step loads the int8 [bk, bn] tile (half a bf16 tile's bytes) and converts it to the rows' dtype
in registers; the float32 accumulator is multiplied by the group's column scales after the K loop,
before the rounding (and before the SwiGLU, whose products are rounded as the float path's).

FP8 experts (an FP8 checkpoint's quantize.Fp8BlockWeight: rhs float8_e4m3fn [G, K, N], `scale` [G,
ceil(K / bk_s), ceil(N / bn_s)] float32 block scales, `block` = (bk_s, bn_s)): each K step loads the
float8 [bk, bn] tile, converts it in registers, and multiplies its float32 partial product by its
block's scale before adding it (the scales vary along K): one scalar per (K block, column block), or
with bn_s = 1 the K block's [bn] column scales. So bk divides bk_s (a step never straddles a K block)
and bn divides bn_s when bn_s > 1 (a tile never straddles a column block), as the dense
pallas_kernels/quantized/gpu.py kernel does.

lhs is padded by bm rows so every row tile's load stays in bounds (the interpreter clamps an
out-of-range slice instead of masking it); rows past sum(group_sizes) are zeroed by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, precision, pltriton, quiet_triton

__all__ = ["gmm", "gmm_rows", "route", "route_supported", "group_list", "choose_tiles", "plan_tiles", "supported"]


def group_list(group_sizes, slots: int):
    """The non-empty groups, compacted: int32 [4, slots] = (group id, first row, rows, count), row 3
    holding the number of non-empty groups in every column; slots past the count repeat group data
    of no use (the kernel skips them)."""
    sizes = group_sizes.astype(jnp.int32)
    G = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # slot i: the (i+1)-th non-empty group = how many groups have fewer than i+1 non-empty ones up
    # to them (a [slots, G] compare-and-count, not a sort of G keys; past the count: the last group)
    seen = jnp.cumsum((sizes > 0).astype(jnp.int32))                             # [G]
    i = jnp.arange(slots, dtype=jnp.int32)[:, None]
    order = jnp.minimum(jnp.sum(seen[None, :] <= i, axis=1, dtype=jnp.int32), G - 1)   # non-empty first, by id
    count = seen[-1]
    return jnp.stack([order, starts[order], sizes[order], jnp.broadcast_to(count, (slots,))])


def _pick(n: int, options) -> int | None:
    return next((b for b in options if n % b == 0), None)


# programs that keep an H100/H200's 132 SMs streaming (two per SM)
_FILL = 2 * 132
# The one-token path (gmm_rows): column tiles of 64 once they give every SM a program. Its down
# launch (8 rows x 2048 / 64 = 256 programs) measured a 12-layer Coder-30B-A3B B = 1 step faster
# than bn 32 on the H200 (0.898 / 0.903 ms against 0.921-0.928); gate_up's 96 programs keep 32, where
# bn 16 measured slower (0.969).
_ROWS_FILL = 132


def _divides(block, axis: int):
    """The FP8 block's constraint on a tile size along axis (0: K, 1: N) as a predicate."""
    if block is None or (axis == 1 and block[1] == 1):
        return lambda b: True
    return lambda b: block[axis] % b == 0


def choose_tiles(M: int, K: int, N: int, bm: int | None = None, bn: int | None = None,
                 bk: int | None = None, slots: int | None = None, block=None) -> tuple[int, int, int]:
    """(bm, bn, bk): 16-row tiles up to 1024 rows (decode, verify; Triton's smallest dot), 64 beyond
    (prefill: fewer re-reads of a group's weights from L2); column tiles of 64, or 32 when slots x
    N / 64 programs would leave SMs idle (B = 1 decode: 8 experts x 768 / 64 = 96 programs); K
    steps of up to 256. bn and bk must divide N and K (FP8 `block` (bk_s, bn_s): bk divides bk_s
    and bn divides bn_s unless it is 1)."""
    bm = bm or (16 if M <= 1024 else 64)
    ok_n, ok_k = _divides(block, 1), _divides(block, 0)
    if bn is None:
        wide = slots is None or slots * (N // 64) >= _FILL
        bn = _pick(N, [b for b in ((64, 128, 32, 16) if wide else (32, 16, 64, 128)) if ok_n(b)])
    bk = bk or _pick(K, [b for b in (256, 128, 64, 32, 16) if ok_k(b)])
    return bm, bn, bk


# Shared memory the K loop's pipeline may take per program: num_stages copies of the x tile [bm, bk]
# and the weight tile(s) [bk, bn] (two with swiglu). An H200 gives a program 227 KiB and Triton
# needs some for the epilogue's layout conversions. Prefill's 64-row tiles with bk 256 asked 288 KiB
# in bf16 (swiglu) and failed to launch on the H200 (RESOURCE_EXHAUSTED), so bk halves
# until it fits.
SMEM_BUDGET = 160 * 1024


def smem_bytes(bm: int, bn: int, bk: int, itemsize: int, swiglu: bool, num_stages: int) -> int:
    return (bm * bk + (2 if swiglu else 1) * bk * bn) * itemsize * num_stages


def fit_bk(bm: int, bn: int, bk: int, K: int, itemsize: int, swiglu: bool, num_stages: int) -> int:
    """The largest bk <= the given one (halving) whose pipeline fits SMEM_BUDGET and divides K."""
    while (smem_bytes(bm, bn, bk, itemsize, swiglu, num_stages) > SMEM_BUDGET and bk > 16
           and K % (bk // 2) == 0):
        bk //= 2
    return bk


def plan_tiles(M: int, K: int, N: int, itemsize: int, swiglu: bool, num_stages: int, bm: int | None = None,
               bn: int | None = None, bk: int | None = None, slots: int | None = None, block=None):
    """gmm's (bm, bn, bk): choose_tiles, then an automatic bk fitted to shared memory (fit_bk); a
    bk the caller gave is kept. bn or bk None: no tiling."""
    auto_bk = bk is None
    bm, bn, bk = choose_tiles(M, K, N, bm, bn, bk, slots, block)
    if auto_bk and bn is not None and bk is not None and K % bk == 0:
        bk = fit_bk(bm, bn, bk, K, itemsize, swiglu, num_stages)
    return bm, bn, bk


def supported(M: int, K: int, N: int, dtype, swiglu: bool = False, block=None) -> bool:
    """Whether gmm / gmm_rows take these shapes (block: FP8 block scales, which the tiles must fit)."""
    bm, bn, bk = choose_tiles(M, K, N // 2 if swiglu else N, block=block)
    return (jnp.dtype(dtype).itemsize in (2, 4) and bn is not None and bk is not None
            and (not swiglu or N % 2 == 0) and (block is None or min(block) >= 1))


def _kernel(meta_ref, x_ref, w_ref, *refs, bm: int, bn: int, bk: int, K: int, half: int,
            swiglu: bool, rows_mode: bool = False, shared: bool = False, scaled: bool = False, block=None):
    # meta_ref [4, slots] (group_list's layout), or with rows_mode the row groups [M] (slot i = row
    # i, its group meta_ref[i], -1: none); x_ref [>= M + bm, K], or with shared one row [1, K] that
    # every slot multiplies; w_ref [G, K, N] (int8 with scaled: s_ref [G, N] float32, its column
    # scales; float8 with block: s_ref [G, Kb, Nb] its block scales), o_ref [M + bm, N or N / 2]:
    # whole arrays, sliced here
    s_ref, o_ref = refs if scaled else (None, refs[0])
    i, j = pl.program_id(0), pl.program_id(1)
    if rows_mode:
        g = meta_ref[i]
        live = g >= 0
    else:
        live = i < meta_ref[3, i]

    @pl.when(live)
    def _group():
        if rows_mode:
            gg, start, size = g, i, 1
        else:
            gg, start, size = meta_ref[0, i], meta_ref[1, i], meta_ref[2, i]
        n0 = pl.multiple_of(j * bn, bn)
        rows = lax.broadcasted_iota(jnp.int32, (bm,), 0)
        prec = precision(x_ref.dtype)

        def row_tile(t, carry):
            r0 = start + t * bm
            ok = (t * bm + rows < size)[:, None]                                      # [bm, 1]

            def k_step(kk, accs):
                k0 = pl.multiple_of(kk * bk, bk)
                if shared:                                                           # [1, bk] -> [bm, bk]
                    x = jnp.broadcast_to(x_ref[pl.ds(0, 1), pl.ds(k0, bk)], (bm, bk))
                else:
                    x = pltriton.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=ok, other=0.0)  # [bm, bk]
                out = []
                for acc, c0 in zip(accs, (n0, half + n0) if swiglu else (n0,)):
                    w = w_ref[gg, pl.ds(k0, bk), pl.ds(c0, bn)]                         # [bk, bn]
                    if scaled:                             # int8 / float8 -> float32 -> x's dtype: exact
                        w = w.astype(jnp.float32).astype(x.dtype)
                    d = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=prec)
                    if block is not None:                    # this K step's block scale(s)
                        kb = lax.div(k0, block[0])
                        if block[1] == 1:
                            d = d * s_ref[gg, pl.ds(kb, 1), pl.ds(c0, bn)]                 # [1, bn]
                        else:
                            d = d * s_ref[gg, pl.ds(kb, 1), pl.ds(lax.div(c0, block[1]), 1)]   # [1, 1]
                    out.append(acc + d)
                return tuple(out)

            zero = jnp.zeros((bm, bn), jnp.float32)
            accs = lax.fori_loop(0, K // bk, k_step, (zero, zero) if swiglu else (zero,))
            if scaled and block is None:                            # the group's column scales [1, bn]
                accs = tuple(a * s_ref[gg, pl.ds(c0, bn)][None, :]
                             for a, c0 in zip(accs, (n0, half + n0) if swiglu else (n0,)))
            if swiglu:
                gate = accs[0].astype(o_ref.dtype).astype(jnp.float32)
                up = accs[1].astype(o_ref.dtype).astype(jnp.float32)
                y = (gate / (1.0 + jnp.exp(-gate))).astype(o_ref.dtype).astype(jnp.float32) * up
            else:
                y = accs[0]
            pltriton.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(o_ref.dtype), mask=ok)
            return carry

        lax.fori_loop(0, pl.cdiv(size, bm), row_tile, 0)


def _is_float8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _check(lhs, rhs, swiglu: bool, scale=None, block=None):
    M, K = lhs.shape
    G, K2, N = rhs.shape
    want8 = (lambda d: True) if scale is None else _is_float8 if block is not None else (lambda d: d == jnp.int8)
    if K2 != K or (lhs.dtype != rhs.dtype if scale is None else not want8(rhs.dtype)):
        raise Unsupported(f"gmm: lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} {rhs.dtype} do not agree"
                          + ("" if scale is None else f" ({'float8' if block else 'int8'} rhs with a scale)"))
    if block is not None and (scale is None or min(block) < 1
                              or scale.shape != (G, -(-K // block[0]), -(-N // block[1]))):
        raise Unsupported(f"gmm: FP8 block {block}, scale {None if scale is None else scale.shape} for rhs "
                          f"{rhs.shape} (one per group and (bk, bn) block)")
    if scale is not None and block is None and scale.shape != (G, N):
        raise Unsupported(f"gmm: scale {scale.shape} for rhs {rhs.shape} (one per group and column)")
    if jnp.dtype(lhs.dtype).itemsize not in (2, 4):
        raise Unsupported(f"gmm: dtype {lhs.dtype} (float32 or a 16-bit float)")
    if swiglu and N % 2:
        raise Unsupported(f"gmm: swiglu needs gate|up columns, got N={N}")
    if G * K * N >= 2 ** 31 or (M + 16) * max(K, N) >= 2 ** 31:
        raise Unsupported(f"gmm: rhs {rhs.shape} / lhs {lhs.shape} past int32 element offsets")


def _launch(lhs, rhs, meta, slots: int, *, swiglu, bm, bn, bk, num_warps, num_stages, interpret,
            rows: int | None = None, shared: bool = False, scale=None, block=None):
    """The kernel over the group list `meta` [4, slots] (group_list's layout) -> [M + bm, N or N / 2]
    (M = lhs's rows); rows no listed group covers, and the bm rows past M, are left unwritten (the
    callers zero or ignore them). With `rows` (rows_mode), meta is the row groups [rows] and M =
    rows: lhs holds at least those rows (more, e.g. a previous call's [rows + bm] output, are not
    read), or with `shared` a single row that every listed row multiplies."""
    M, K = lhs.shape
    if rows is not None:
        M = rows
    G, _, N = rhs.shape
    half = N // 2 if swiglu else N
    if rows is not None and bn is None and half % 64 == 0 and M * (half // 64) >= _ROWS_FILL \
            and _divides(block, 1)(64):
        bn = 64
    bm, bn, bk = plan_tiles(M, K, half, jnp.dtype(lhs.dtype).itemsize, swiglu, num_stages, bm, bn, bk, slots,
                            block)
    if bn is None or bk is None or half % bn or K % bk:
        raise Unsupported(f"gmm: K={K}, N={half} have no tiling (multiples of 16)")
    if block is not None and not (_divides(block, 0)(bk) and _divides(block, 1)(bn)):
        raise Unsupported(f"gmm: tiles bk={bk}, bn={bn} straddle the FP8 blocks {block}")
    x = lhs if shared or lhs.shape[0] >= M + bm else jnp.pad(lhs, ((0, M + bm - lhs.shape[0]), (0, 0)))
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, K=K, half=half, swiglu=swiglu,
                               rows_mode=rows is not None, shared=shared, scaled=scale is not None, block=block)
    extra_specs, extra = [], []
    if scale is not None:
        extra_specs, extra = [pl.BlockSpec(scale.shape, lambda i, j: (0,) * scale.ndim)], [scale.astype(jnp.float32)]
    with quiet_triton():
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((M + bm, half), lhs.dtype),
            grid=(slots, half // bn),
            in_specs=[
                pl.BlockSpec(meta.shape, lambda i, j: (0,) * meta.ndim),
                pl.BlockSpec(x.shape, lambda i, j: (0, 0)),
                pl.BlockSpec((G, K, N), lambda i, j: (0, 0, 0)),
                *extra_specs,
            ],
            out_specs=pl.BlockSpec((M + bm, half), lambda i, j: (0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="dflash_gmm_gpu_fp8" if block is not None else "dflash_gmm_gpu_int8" if scale is not None
            else "dflash_gmm_gpu",
        )(meta, x, rhs, *extra)
    return out


_STATIC = ("swiglu", "bm", "bn", "bk", "num_warps", "num_stages", "interpret", "block")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gmm(lhs, rhs, group_sizes, *, swiglu: bool = False, bm: int | None = None, bn: int | None = None,
        bk: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False, scale=None,
        block=None):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype (f32
    accumulation), or with swiglu [M, N / 2] = silu(lhs @ rhs[..., :N/2]) * (lhs @ rhs[..., N/2:]);
    rows past sum(group_sizes) are zero. scale [G, N] float32: rhs is int8 and each product is
    scaled by its group's column scales; with block (bk_s, bn_s), rhs is float8 and scale [G,
    ceil(K / bk_s), ceil(N / bn_s)] its block scales (module docstring). interpret=True runs the
    kernel on CPU."""
    block = None if block is None else tuple(int(b) for b in block)
    _check(lhs, rhs, swiglu, scale, block)
    M, G = lhs.shape[0], rhs.shape[0]
    if group_sizes.shape != (G,):
        raise Unsupported(f"gmm: group_sizes {group_sizes.shape} for {G} groups")
    slots = max(1, min(G, M))
    out = _launch(lhs, rhs, group_list(group_sizes, slots), slots, swiglu=swiglu, bm=bm, bn=bn, bk=bk,
                  num_warps=num_warps, num_stages=num_stages, interpret=interpret, scale=scale, block=block)[:M]
    return jnp.where(jnp.arange(M)[:, None] < jnp.sum(group_sizes), out, 0)


@functools.partial(jax.jit, static_argnames=_STATIC + ("shared", "raw"))
def gmm_rows(lhs, rhs, row_group, *, swiglu: bool = False, bm: int | None = None, bn: int | None = None,
             bk: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False,
             shared: bool = False, raw: bool = False, scale=None, block=None):
    """Every row its own group: lhs [M, K], rhs [G, K, N], row_group [M] int32 (the group of row r,
    or -1: no group, a zero row) -> [M, N] (or [M, N / 2] with swiglu), out[r] = lhs[r] @
    rhs[row_group[r]]. The kernel reads row_group itself as its list (no sort, no counts, no
    metadata: a one-token decode's k choices are k distinct experts), so the grid is M x N tiles and
    only the rows' experts are read.

    shared: lhs is ONE row [1, K] that every listed row multiplies (a token's k choices; never
    broadcast in memory). raw: return the kernel's buffer [M + bm, N] as it is: rows of group -1 and
    the bm rows past M unwritten (undefined); a raw buffer is a valid lhs of the next call (its
    rows past M are not read), so chained projections need no slice or pad between them.
    scale, block: as gmm's (int8 or float8 rhs)."""
    block = None if block is None else tuple(int(b) for b in block)
    _check(lhs, rhs, swiglu, scale, block)
    M = row_group.shape[0]
    if row_group.ndim != 1 or lhs.shape[0] < (1 if shared else M):
        raise Unsupported(f"gmm_rows: row_group {row_group.shape} for lhs {lhs.shape} (shared={shared})")
    g = row_group.astype(jnp.int32)
    out = _launch(lhs, rhs, g, M, swiglu=swiglu, bm=bm, bn=bn, bk=bk, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret, rows=M, shared=shared, scale=scale, block=block)
    if raw:
        return out
    return jnp.where((g >= 0)[:, None], out[:M], 0)


# ------------------------------------------------------------------------------------- routing

def route_supported(E: int, k: int) -> bool:
    """route's shapes: a power-of-two expert count up to 1024 (Triton's block shapes) and a top-k
    with a sorting network here (1, 2, 4, 8: Qwen3-MoE and Qwen3.5-MoE take 8, gpt-oss 4)."""
    return E > 0 and E & (E - 1) == 0 and k in _SORT_NETWORKS and k <= E <= 1024


# Batcher's odd-even merge sort of 2, 4 and 8 keys (compare-exchange pairs, in order)
_SORT_NETWORKS = {
    1: (),
    2: ((0, 1),),
    4: ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2)),
    8: ((0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6), (5, 7), (1, 2), (5, 6), (0, 4), (1, 5),
        (2, 6), (3, 7), (2, 4), (3, 5), (1, 2), (3, 4), (5, 6)),
}


def _route_kernel(l_ref, w_ref, i_ref, *, E: int, k: int, norm: bool):
    # one row: l_ref [1, E] router logits; w_ref [1, k] weights, i_ref [1, k] expert ids, out.
    # A warp per row: every reduction below stays in the warp (shuffles), so the k picks cost k
    # argmax reductions and nothing else (an XLA top-k is a sort of all E).
    f32 = jnp.float32
    l = l_ref[0, :].astype(f32)                                                 # [E]
    m = jnp.max(l)
    e = jnp.exp(l - m)
    s = jnp.sum(e)
    p = e / s                                                                   # softmax over all E
    col = lax.broadcasted_iota(jnp.int32, (E,), 0)
    ids = []
    for _ in range(k):          # the largest left, ties to the lower id (jax.lax.top_k's order)
        i = jnp.argmax(p).astype(jnp.int32)
        ids.append(i)
        p = jnp.where(col == i, -1.0, p)                                        # p >= 0: never again
    # each pick's probability, recomputed from its logit by the same operations as p's
    vals = [jnp.exp(l_ref[0, i].astype(f32) - m) / s for i in ids]
    if norm:
        tot = vals[0]
        for v in vals[1:]:
            tot = tot + v
        vals = [v / tot for v in vals]
    for a, b in _SORT_NETWORKS[k]:                                              # ascending ids
        swap = ids[a] > ids[b]
        ids[a], ids[b] = jnp.where(swap, ids[b], ids[a]), jnp.where(swap, ids[a], ids[b])
        vals[a], vals[b] = jnp.where(swap, vals[b], vals[a]), jnp.where(swap, vals[a], vals[b])
    slot = lax.broadcasted_iota(jnp.int32, (k,), 0)
    iv, wv = jnp.zeros((k,), jnp.int32), jnp.zeros((k,), f32)
    for j in range(k):
        iv = jnp.where(slot == j, ids[j], iv)
        wv = jnp.where(slot == j, vals[j], wv)
    w_ref[0, :] = wv.astype(w_ref.dtype)
    i_ref[0, :] = iv


@functools.partial(jax.jit, static_argnames=("k", "norm", "num_warps", "interpret"))
def route(logits, *, k: int, norm: bool, num_warps: int = 1, interpret: bool = False):
    """An MoE router's choices from its logits [N, E] in one kernel: softmax over all E in float32,
    the top k (ties to the lower id), divided by their sum when `norm`, cast to the logits' dtype,
    returned in ASCENDING expert order per row: (weights [N, k], ids [N, k] int32). The same values
    as `dflash_jax.models.moe.route` then a sort by id, in one launch of a one-warp program per row
    where XLA takes four or five (the softmax, top-k's sort of all E, the renormalisation, the
    choices' sort: a measurable share of a B = 1 Coder-30B-A3B layer; on the H200 this kernel took
    its 12-layer plain step from 0.962 to 0.917 ms)."""
    N, E = logits.shape
    if not route_supported(E, k):
        raise Unsupported(f"route: {E} experts, top-{k} (E a power of two <= 1024; k 1, 2, 4 or 8 <= E)")
    with quiet_triton():
        return pl.pallas_call(
            functools.partial(_route_kernel, E=E, k=k, norm=norm),
            out_shape=(jax.ShapeDtypeStruct((N, k), logits.dtype), jax.ShapeDtypeStruct((N, k), jnp.int32)),
            grid=(N,),
            in_specs=[pl.BlockSpec((1, E), lambda r: (r, 0))],
            out_specs=[pl.BlockSpec((1, k), lambda r: (r, 0)), pl.BlockSpec((1, k), lambda r: (r, 0))],
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="dflash_moe_route",
        )(logits)
