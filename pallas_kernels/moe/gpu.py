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

lhs is padded by bm rows so every row tile's load stays in bounds (the interpreter clamps an
out-of-range slice instead of masking it); rows past sum(group_sizes) are zeroed by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, next_pow2, precision, pltriton, quiet_triton

__all__ = ["gmm", "group_list", "choose_tiles", "supported", "experts_small", "small_supported"]


def group_list(group_sizes, slots: int):
    """The non-empty groups, compacted: int32 [4, slots] = (group id, first row, rows, count), row 3
    holding the number of non-empty groups in every column; slots past the count repeat group data
    of no use (the kernel skips them)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    order = jnp.argsort(sizes == 0, stable=True)[:slots].astype(jnp.int32)       # non-empty first, by id
    count = jnp.sum(sizes > 0).astype(jnp.int32)
    return jnp.stack([order, starts[order], sizes[order], jnp.broadcast_to(count, (slots,))])


def _pick(n: int, options) -> int | None:
    return next((b for b in options if n % b == 0), None)


# programs that keep an H100/H200's 132 SMs streaming (two per SM)
_FILL = 2 * 132


def choose_tiles(M: int, K: int, N: int, bm: int | None = None, bn: int | None = None,
                 bk: int | None = None, slots: int | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk): 16-row tiles up to 1024 rows (decode, verify; Triton's smallest dot), 64 beyond
    (prefill: fewer re-reads of a group's weights from L2); column tiles of 64, or 32 when slots x
    N / 64 programs would leave SMs idle (B = 1 decode: 8 experts x 768 / 64 = 96 programs); K
    steps of up to 256. bn and bk must divide N and K."""
    bm = bm or (16 if M <= 1024 else 64)
    if bn is None:
        wide = slots is None or slots * (N // 64) >= _FILL
        bn = _pick(N, (64, 128, 32, 16) if wide else (32, 16, 64, 128))
    bk = bk or _pick(K, (256, 128, 64, 32, 16))
    return bm, bn, bk


def supported(M: int, K: int, N: int, dtype, swiglu: bool = False) -> bool:
    bm, bn, bk = choose_tiles(M, K, N // 2 if swiglu else N)
    return (jnp.dtype(dtype).itemsize in (2, 4) and bn is not None and bk is not None
            and (not swiglu or N % 2 == 0))


def _kernel(meta_ref, x_ref, w_ref, o_ref, *, bm: int, bn: int, bk: int, K: int, half: int,
            swiglu: bool):
    # meta_ref [4, slots]; x_ref [M + bm, K], w_ref [G, K, N], o_ref [M + bm, N or N / 2]: whole
    # arrays, sliced here
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < meta_ref[3, i])
    def _group():
        g, start, size = meta_ref[0, i], meta_ref[1, i], meta_ref[2, i]
        n0 = pl.multiple_of(j * bn, bn)
        rows = lax.broadcasted_iota(jnp.int32, (bm,), 0)
        prec = precision(x_ref.dtype)

        def row_tile(t, carry):
            r0 = start + t * bm
            ok = (t * bm + rows < size)[:, None]                                      # [bm, 1]

            def k_step(kk, accs):
                k0 = pl.multiple_of(kk * bk, bk)
                x = pltriton.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=ok, other=0.0)  # [bm, bk]
                out = []
                for acc, c0 in zip(accs, (n0, half + n0) if swiglu else (n0,)):
                    w = w_ref[g, pl.ds(k0, bk), pl.ds(c0, bn)]                          # [bk, bn]
                    out.append(acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=prec))
                return tuple(out)

            zero = jnp.zeros((bm, bn), jnp.float32)
            accs = lax.fori_loop(0, K // bk, k_step, (zero, zero) if swiglu else (zero,))
            if swiglu:
                gate = accs[0].astype(o_ref.dtype).astype(jnp.float32)
                up = accs[1].astype(o_ref.dtype).astype(jnp.float32)
                y = (gate / (1.0 + jnp.exp(-gate))).astype(o_ref.dtype).astype(jnp.float32) * up
            else:
                y = accs[0]
            pltriton.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(o_ref.dtype), mask=ok)
            return carry

        lax.fori_loop(0, pl.cdiv(size, bm), row_tile, 0)


@functools.partial(jax.jit, static_argnames=("swiglu", "bm", "bn", "bk", "num_warps", "num_stages",
                                             "interpret"))
def gmm(lhs, rhs, group_sizes, *, swiglu: bool = False, bm: int | None = None, bn: int | None = None,
        bk: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M) -> [M, N] in lhs's dtype (f32
    accumulation), or with swiglu [M, N / 2] = silu(lhs @ rhs[..., :N/2]) * (lhs @ rhs[..., N/2:]);
    rows past sum(group_sizes) are zero. interpret=True runs the kernel on CPU (tests)."""
    M, K = lhs.shape
    G, K2, N = rhs.shape
    if K2 != K or group_sizes.shape != (G,) or lhs.dtype != rhs.dtype:
        raise Unsupported(f"gmm: lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} {rhs.dtype}, "
                          f"group_sizes {group_sizes.shape} do not agree")
    if jnp.dtype(lhs.dtype).itemsize not in (2, 4):
        raise Unsupported(f"gmm: dtype {lhs.dtype} (float32 or a 16-bit float)")
    if swiglu and N % 2:
        raise Unsupported(f"gmm: swiglu needs gate|up columns, got N={N}")
    if G * K * N >= 2 ** 31 or (M + 16) * max(K, N) >= 2 ** 31:
        raise Unsupported(f"gmm: rhs {rhs.shape} / lhs {lhs.shape} past int32 element offsets")
    half = N // 2 if swiglu else N
    slots = max(1, min(G, M))
    bm, bn, bk = choose_tiles(M, K, half, bm, bn, bk, slots)
    if bn is None or bk is None or half % bn or K % bk:
        raise Unsupported(f"gmm: K={K}, N={half} have no tiling (multiples of 16)")
    meta = group_list(group_sizes, slots)
    x = jnp.pad(lhs, ((0, bm), (0, 0)))
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, K=K, half=half, swiglu=swiglu)
    with quiet_triton():
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((M + bm, half), lhs.dtype),
            grid=(slots, half // bn),
            in_specs=[
                pl.BlockSpec((4, slots), lambda i, j: (0, 0)),
                pl.BlockSpec((M + bm, K), lambda i, j: (0, 0)),
                pl.BlockSpec((G, K, N), lambda i, j: (0, 0, 0)),
            ],
            out_specs=pl.BlockSpec((M + bm, half), lambda i, j: (0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="dflash_gmm_gpu",
        )(meta, x, rhs)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(M)[:, None] < total, out[:M], 0)


# ------------------------------------------------------------------------------------------------
# The small-T path: a few tokens (decode, narrow verifies), no sort of the rows by expert.
#
# At 1..4 tokens x top-8 the grouped path's bookkeeping (the rows' sort, bincount, the slot list's
# cumsum and sort, the gather of x, the weights' gather, the scatter back and the k-way combine) is
# ~25 XLA kernels per layer around two weight streams that take ~20 us together: per-launch costs,
# not bytes (docs/moe.md). Here the whole expert block is two kernels over the (token, choice) rows
# in their own order: each row reads its expert id and weight from small int/float arrays (Triton
# has no scalar prefetch; a scalar load per program), so nothing is sorted or gathered in XLA.
#   swiglu_rows: grid (rows, I / bn): a[r] = silu(x[r // k] @ gate[e_r]) * (x[r // k] @ up[e_r])
#   down_combine: grid (tokens, H / bn): out[t] = sum over its k choices, in ascending expert id
#                (transformers' order; each choice's rank counted from the k ids with scalar
#                loads, its result kept in row `rank` of a [k, bn] register tile), of
#                (a[t k + s] @ down[e]) * w, each product and each partial sum rounded to the
#                input dtype as the unfused path rounds them (the combine is the kernel's epilogue).
# With one row per program these are GEMVs (a broadcast multiply and a reduction, f32, no 16-row
# dot). Two tokens that chose the same expert read its weights twice, so the caller keeps this
# path to few rows (moe.LEAN_ROWS), where repeats are rare.


def _swiglu_rows_kernel(ids_ref, x_ref, w_ref, o_ref, *, k: int, bn: int, bk: int, K: int, half: int):
    r, j = pl.program_id(0), pl.program_id(1)
    e = ids_ref[r]
    t = r // k
    n0 = pl.multiple_of(j * bn, bn)

    def k_step(kk, accs):
        k0 = pl.multiple_of(kk * bk, bk)
        x = x_ref[t, pl.ds(k0, bk)].astype(jnp.float32)[:, None]                          # [bk, 1]
        g = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)].astype(jnp.float32)                    # [bk, bn]
        u = w_ref[e, pl.ds(k0, bk), pl.ds(half + n0, bn)].astype(jnp.float32)
        return accs[0] + jnp.sum(x * g, axis=0), accs[1] + jnp.sum(x * u, axis=0)

    zero = jnp.zeros((bn,), jnp.float32)
    gate, up = lax.fori_loop(0, K // bk, k_step, (zero, zero))
    gate = gate.astype(o_ref.dtype).astype(jnp.float32)
    up = up.astype(o_ref.dtype).astype(jnp.float32)
    y = (gate / (1.0 + jnp.exp(-gate))).astype(o_ref.dtype).astype(jnp.float32) * up
    o_ref[r, pl.ds(n0, bn)] = y.astype(o_ref.dtype)


def _down_combine_kernel(ids_ref, wts_ref, a_ref, w_ref, o_ref, *, k: int, kp: int, bn: int, bk: int, K: int):
    t, j = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    dt = o_ref.dtype
    slot = lax.broadcasted_iota(jnp.int32, (kp, 1), 0)                                     # [kp, 1]

    def choice(s, ys):
        r = t * k + s
        e = ids_ref[r]
        # this choice's place in the token's ascending expert order (its k ids are distinct)
        rank = lax.fori_loop(0, k, lambda q, n: n + (ids_ref[t * k + q] < e).astype(jnp.int32), 0)

        def k_step(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            a = a_ref[r, pl.ds(k0, bk)].astype(jnp.float32)[:, None]                      # [bk, 1]
            w = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)].astype(jnp.float32)                # [bk, bn]
            return acc + jnp.sum(a * w, axis=0)

        y = lax.fori_loop(0, K // bk, k_step, jnp.zeros((bn,), jnp.float32))
        y = y.astype(dt).astype(jnp.float32) * wts_ref[r].astype(jnp.float32)             # weight after down
        return jnp.where(slot == rank, y.astype(dt).astype(jnp.float32)[None, :], ys)      # row `rank`

    ys = lax.fori_loop(0, k, choice, jnp.zeros((kp, bn), jnp.float32))
    out = jnp.zeros((bn,), jnp.float32)
    for q in range(k):                       # the combine: ascending expert order, rounded as it adds
        out = (out + jnp.sum(jnp.where(slot == q, ys, 0.0), axis=0)).astype(dt).astype(jnp.float32)
    o_ref[t, pl.ds(n0, bn)] = out.astype(dt)


def _small_tiles(programs_per_tile: int, N: int, bn: int | None, bk: int | None, K: int, itemsize: int):
    """Column tiles of 64 when programs x N / 64 fill the SMs, else 32 (a [bk, bn] weight tile's rows
    stay >= 64 bytes: narrower rows waste DRAM bursts; 16 only for f32 or when nothing wider
    divides N); K steps of up to 128 ([bk, bn] f32 products stay in registers)."""
    if bn is None:
        options = (64, 32) if itemsize == 2 else (64, 32, 16)
        bn = next((b for b in options if N % b == 0 and programs_per_tile * (N // b) >= _FILL), None)
        bn = bn or _pick(N, options[::-1] + (16, 64))
    bk = bk or _pick(K, (128, 64, 32, 16))
    return bn, bk


def small_supported(K: int, I: int, H: int, dtype) -> bool:
    """Shapes the small-T kernels tile: K (= H), I and H multiples of 16, a 16- or 32-bit float."""
    return (jnp.dtype(dtype).itemsize in (2, 4) and all(n % 16 == 0 for n in (K, I, H)))


@functools.partial(jax.jit, static_argnames=("bn", "bk", "num_warps", "num_stages", "interpret"))
def experts_small(x, ids, wts, gate_up, down, *, bn: int | None = None, bk: int | None = None,
                  num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """The whole expert block of a few tokens, no sort: x [N, H], ids / wts [N, k] (each token's
    choices in any order, distinct, in [0, E): their outputs are added in ascending expert id,
    transformers' order), gate_up [E, H, 2I] (gate columns first), down [E, I, H] -> [N, H] in x's dtype:
    sum_s (silu(x @ gate[e_s]) * (x @ up[e_s])) @ down[e_s] * w_s, each product rounded to x's dtype
    as the unfused path (experts() over gmm_swiglu and gmm) rounds it."""
    N, H = x.shape
    _, k = ids.shape
    E, K, I2 = gate_up.shape
    I = I2 // 2
    if (K != H or down.shape != (E, I, H) or wts.shape != ids.shape or x.dtype != gate_up.dtype
            or x.dtype != down.dtype or not small_supported(K, I, H, x.dtype)):
        raise Unsupported(f"experts_small: x {x.shape} {x.dtype}, ids {ids.shape}, gate_up {gate_up.shape}, "
                          f"down {down.shape} (K, I, H multiples of 16, 16/32-bit floats)")
    R = N * k
    ids = ids.reshape(R).astype(jnp.int32)
    wts = wts.reshape(R).astype(x.dtype)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    item = jnp.dtype(x.dtype).itemsize
    bn1, bk1 = _small_tiles(R, I, bn, bk, K, item)
    bn2, bk2 = _small_tiles(N, H, bn, bk, I, item)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))     # noqa: E731
    with quiet_triton():
        a = pl.pallas_call(
            functools.partial(_swiglu_rows_kernel, k=k, bn=bn1, bk=bk1, K=K, half=I),
            out_shape=jax.ShapeDtypeStruct((R, I), x.dtype),
            grid=(R, I // bn1),
            in_specs=[whole((R,)), whole((N, K)), whole((E, K, I2))],
            out_specs=whole((R, I)),
            compiler_params=params, interpret=interpret, name="dflash_moe_swiglu_rows",
        )(ids, x, gate_up)
        return pl.pallas_call(
            functools.partial(_down_combine_kernel, k=k, kp=next_pow2(k), bn=bn2, bk=bk2, K=I),
            out_shape=jax.ShapeDtypeStruct((N, H), x.dtype),
            grid=(N, H // bn2),
            in_specs=[whole((R,)), whole((R,)), whole((R, I)), whole((E, I, H))],
            out_specs=whole((N, H)),
            compiler_params=params, interpret=interpret, name="dflash_moe_down_combine",
        )(ids, wts, a, down)
