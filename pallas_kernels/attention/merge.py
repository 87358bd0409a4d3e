"""The split-KV merge of the GPU block attention: each of S splits wrote a normalised partial output
and its log-sum-exp; the merge weights them into the attention output. Two forms with the same
arithmetic: `merge`, XLA ops that fuse into one small kernel (short caches), and `merge_splits`,
one Pallas program per output tile (long caches, many splits)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import pltriton

# Output tile of one program of the split merge kernel (merge_splits) when it fills the GPU; batch 1
# uses 4 x 32 (attention.gpu.default_config).
MERGE_ROWS = 16
MERGE_COLS = 64


def merge(o_parts, lse):
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


# The split merge as a Pallas kernel. XLA's fusion of `merge` is a sizeable share of a long-context
# call at batch 1 (32 splits of a 32k cache: megabytes of partials). This kernel spreads the
# partials over (row tile, column tile) programs, each loading all of its splits' tiles at once
# (unrolled: every load in flight together); small tiles (many programs) win at batch 1.
def _merge_kernel(o_ref, lse_ref, out_ref, *, n_split: int, n_rows: int, rows: int, width: int):
    """o_ref [S, N, D] (per-split normalised partials), lse_ref [S, N] f32 -> out_ref [N, D]: this
    program's `rows` rows x `width` columns. Same arithmetic as `merge`."""
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
    """o_parts [S, ..., D], lse [S, ...] -> [..., D] in out_dtype: `merge` as one Pallas kernel,
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
