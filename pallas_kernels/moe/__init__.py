"""The MoE block's grouped matmul: rows sorted by expert times each expert's matrix.

  reference.py  the oracle (a masked dense matmul per group)
  xla.py        `jax.lax.ragged_dot` (CPU, and the GPU baseline)
  tpu.py        Pallas Mosaic TPU kernel that schedules only non-empty groups (weights of experts
                no token chose are never read)
  gpu.py        Pallas Triton GPU kernel over the non-empty groups only (a weight stream per
                touched expert), with the gate|up projection and SwiGLU fused

`gmm(lhs, rhs, group_sizes, impl=)` and `gmm_swiglu` (the experts' first projection and SwiGLU)
dispatch on the resolved `KernelConfig.moe_gmm` (with `scale=`: int8 experts, read as int8 by the
kernels of INT8_IMPLS; with `scale=` and `block=`: an FP8 checkpoint's float8 experts and their
block scales, read as float8 by the same kernels); `gmm_rows` (every row its own group: a one-token
decode, no sort) runs the GPU kernel on the GPU and gathers the rows' matrices elsewhere;
`route_ascending` is the router's softmax, top-k, renormalisation and ascending order as one GPU
kernel (`KernelConfig.moe_route`). A shape a kernel cannot tile falls back to XLA (logged once)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels._common import Unsupported, warn_once
from pallas_kernels.moe.reference import gmm_reference
from pallas_kernels.moe.xla import gmm_xla

__all__ = ["gmm", "gmm_swiglu", "gmm_rows", "int8_supported", "fp8_supported", "INT8_IMPLS", "route_ascending", "gmm_reference",
           "gmm_xla", "GMM_IMPLS"]

log = logging.getLogger(__name__)

# resolved implementations: the XLA op, the TPU kernel, the GPU kernel, each kernel in the
# interpreter (tests)
GMM_IMPLS = ("xla", "pallas_tpu", "pallas_tpu_interpret", "pallas_gpu", "pallas_gpu_interpret")
# the implementations that read int8 experts (q and per-column scales) and FP8 experts (float8 q and
# block scales) themselves
INT8_IMPLS = ("pallas_tpu", "pallas_tpu_interpret", "pallas_gpu", "pallas_gpu_interpret")


def gmm(lhs, rhs, group_sizes, impl: str = "xla", scale=None, block=None):
    """lhs [M, K] rows grouped by expert, rhs [E, K, N], group_sizes [E] -> [M, N] (rows past the
    groups are zero). scale [E, N] float32: rhs is int8 (dflash_jax.quantize.Int8Weight's q) and
    each row's product is scaled by its expert's column scales; with block (bk, bn): rhs is float8
    (quantize.Fp8BlockWeight's q) and scale [E, ceil(K / bk), ceil(N / bn)] its block scales, each
    K block's partial product scaled. The kernels of INT8_IMPLS read the 8-bit tiles and convert
    them on chip; "xla" raises Unsupported (models/moe.py has its own XLA path for quantized
    experts, quantized_gmm)."""
    if scale is not None:
        if impl not in INT8_IMPLS:
            raise Unsupported(f"gmm impl={impl!r} does not read 8-bit weights; int8 / fp8 on {INT8_IMPLS}")
        if impl in ("pallas_gpu", "pallas_gpu_interpret"):
            from pallas_kernels.moe import gpu
            return gpu.gmm(lhs, rhs, group_sizes, scale=scale, block=block, interpret=impl == "pallas_gpu_interpret")
        from pallas_kernels.moe import tpu
        return tpu.gmm(lhs, rhs, group_sizes, scale=scale, block=block, interpret=impl == "pallas_tpu_interpret")
    if impl == "xla":
        return gmm_xla(lhs, rhs, group_sizes)
    if impl in ("pallas_tpu", "pallas_tpu_interpret"):
        from pallas_kernels.moe import tpu
        return tpu.gmm(lhs, rhs, group_sizes, interpret=impl == "pallas_tpu_interpret")
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe import gpu
        try:
            return gpu.gmm(lhs, rhs, group_sizes, interpret=impl == "pallas_gpu_interpret")
        except Unsupported as e:
            warn_once(log, f"gmm {lhs.shape} {rhs.shape}", "MoE gmm on XLA: %s", e)
            return gmm_xla(lhs, rhs, group_sizes)
    raise ValueError(f"gmm impl={impl!r}; expected one of {GMM_IMPLS}")


def int8_supported(impl: str, M: int, K: int, N: int, dtype, swiglu: bool = False) -> bool:
    """Whether `gmm(..., impl, scale=)` (swiglu: gmm_swiglu) takes int8 experts [E, K, N] for M
    rows of `dtype`."""
    if impl not in INT8_IMPLS:
        return False
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe import gpu
        return gpu.supported(M, K, N, dtype, swiglu=swiglu)
    from pallas_kernels.moe import tpu
    return tpu.supported(M, K, N, dtype, jnp.int8)


def fp8_supported(impl: str, M: int, K: int, N: int, dtype, block, swiglu: bool = False,
                  w_dtype=jnp.float8_e4m3fn) -> bool:
    """Whether `gmm(..., impl, scale=, block=)` (swiglu: gmm_swiglu; on the GPU one row: gmm_rows)
    takes FP8 experts [E, K, N] of `w_dtype` with block scales `block` (bk, bn) for M rows of
    `dtype`: the tiles must fit the blocks (tpu.block_fits, gpu.choose_tiles)."""
    if impl not in INT8_IMPLS:
        return False
    block = tuple(int(b) for b in block)
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe import gpu
        return gpu.supported(M, K, N, dtype, swiglu=swiglu, block=block)
    from pallas_kernels.moe import tpu
    return tpu.supported(M, K, N, dtype, w_dtype, block=block, mosaic=impl == "pallas_tpu")


def gmm_swiglu(lhs, gate_up, group_sizes, impl: str = "xla", scale=None, block=None):
    """The experts' first projection: lhs [M, K] grouped by expert, gate_up [E, K, 2I] (gate
    columns first) -> silu(lhs @ gate) * (lhs @ up) [M, I] in lhs's dtype. The GPU kernel fuses it
    (the [M, 2I] product is never written); elsewhere one gmm and the SwiGLU in XLA. scale: as
    gmm's (int8 gate_up; with block, FP8)."""
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe import gpu
        if scale is not None:       # 8-bit: no XLA fallback here (models/moe.py checks int8_ / fp8_supported)
            return gpu.gmm(lhs, gate_up, group_sizes, swiglu=True, scale=scale, block=block,
                           interpret=impl == "pallas_gpu_interpret")
        try:
            return gpu.gmm(lhs, gate_up, group_sizes, swiglu=True, interpret=impl == "pallas_gpu_interpret")
        except Unsupported as e:
            warn_once(log, f"gmm_swiglu {lhs.shape} {gate_up.shape}", "MoE gmm on XLA: %s", e)
            impl = "xla"
    gate, up = jnp.split(gmm(lhs, gate_up, group_sizes, impl, scale=scale, block=block), 2, axis=-1)
    return jax.nn.silu(gate) * up


def gmm_rows(lhs, rhs, row_group, impl: str = "xla", swiglu: bool = False, shared: bool = False,
             raw: bool = False, tiles: dict | None = None, scale=None, block=None):
    """Every row its own group: lhs [M, K], rhs [G, K, N], row_group [M] int32 (-1: a zero row) ->
    out[r] = lhs[r] @ rhs[row_group[r]] [M, N], or with swiglu silu(gate) * up [M, N / 2] as
    gmm_swiglu. Meant for few rows (a one-token decode's k experts): the GPU kernel lists the rows
    as its groups (no sort, no counts); elsewhere the rows' matrices are gathered.
    shared: lhs is one row [1, K] for every row. raw: the GPU kernel's [M + bm, N] buffer as it is
    (rows of group -1 and past M undefined: the caller masks them; elsewhere the [M, N] result).
    tiles: the GPU kernel's bn / bk / num_warps / num_stages (KernelConfig.moe_tuning; A/Bs).
    scale [G, N] float32: rhs is int8 (as gmm's); with block, rhs float8 and its block scales."""
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe import gpu
        try:
            return gpu.gmm_rows(lhs, rhs, row_group, swiglu=swiglu, shared=shared, raw=raw, scale=scale,
                                block=block, interpret=impl == "pallas_gpu_interpret", **(tiles or {}))
        except Unsupported as e:
            warn_once(log, f"gmm_rows {lhs.shape} {rhs.shape}", "MoE gmm on XLA: %s", e)
    M = row_group.shape[0]
    lhs = jnp.broadcast_to(lhs[:1], (M, lhs.shape[1])) if shared else lhs[:M]
    g = jnp.maximum(row_group, 0)
    w = jnp.take(rhs, g, axis=0)                                                 # [M, K, N]
    if block is not None:                       # the rows' FP8 matrices dequantized (XLA's path)
        K, N = w.shape[1:]
        s = jnp.repeat(jnp.repeat(jnp.take(scale, g, axis=0), block[0], axis=1)[:, :K], block[1], axis=2)[:, :, :N]
        w = (w.astype(jnp.float32) * s).astype(lhs.dtype)
    elif scale is not None:
        w = w.astype(lhs.dtype)
    out = jnp.einsum("mk,mkn->mn", lhs, w, preferred_element_type=jnp.float32)
    if scale is not None and block is None:
        out = out * jnp.take(scale, g, axis=0)
    out = out.astype(lhs.dtype)
    if swiglu:
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    return jnp.where((row_group >= 0)[:, None], out, 0)


def route_ascending(logits, k: int, norm: bool, impl: str = "xla"):
    """The GPU routing kernel (`gpu.route`): an MoE router's (weights [N, k], ids [N, k]) from its
    logits [N, E], in ascending id order, in one launch; None where it does not apply (another
    impl, or a shape it does not take): the caller routes in XLA."""
    if impl not in ("pallas_gpu", "pallas_gpu_interpret"):
        return None
    from pallas_kernels.moe import gpu
    if not gpu.route_supported(logits.shape[-1], k):
        warn_once(log, f"route {logits.shape} {k}", "MoE routing on XLA: %d experts, top-%d",
                  logits.shape[-1], k)
        return None
    return gpu.route(logits, k=k, norm=norm, interpret=impl == "pallas_gpu_interpret")
