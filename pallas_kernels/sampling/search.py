"""Sampling's top-k / top-p threshold search (dflash_jax.sampling) as Pallas Triton kernels: one
kernel per search pass (`count_pass`) and the gather of top-k's candidates (`gather_above`)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import Unsupported, pltriton, round_up as _round_up

# Sampling's top-k / top-p threshold search (dflash_jax.sampling) on the GPU. The search finds, per
# row n, the smallest key x with  offset[n] + sum_v weight[n, v] * (keys[n, v] > x)  <  budget[n],
# deciding `width` bits of x per pass from 2**width candidates. XLA emits each pass as an
# [N, V, K] -> [N, K] column reduction with little parallelism over V (26 passes per iteration with
# top-k and top-p) plus small kernels for the
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
