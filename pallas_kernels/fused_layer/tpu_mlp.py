"""The SwiGLU MLP as one Pallas Mosaic TPU kernel: down(silu(x @ gate) * (x @ up)) with the [M, I]
intermediate kept in VMEM.

XLA:TPU writes the gate/up matmul's output ([M, 2I], 50 MB at M = 512 rows of Qwen3-8B) to HBM and
reads it back for the down projection wherever it does not fit VMEM (v5p at the DFlash B=32 verify).
This kernel tiles the intermediate dim: step j reads the gate and up columns [j*bi, (j+1)*bi) of the
fused [H, 2I] weight and rows [j*bi, (j+1)*bi) of the down weight, computes the [M, bi] gated tile
and accumulates its down projection into an [M, H] float32 VMEM accumulator. Every weight byte is
read once and the intermediate never leaves the chip. Rows: one tile of all M rows (M <= MAX_ROWS,
the shapes inside the generation loop), so the weights are not re-read per row tile.

With norm_weight, the post-attention RMSNorm (at the first step, into VMEM) and the residual add
(at the last) run in the kernel as well: the layer's MLP block reads x and writes x + mlp(norm(x)).
With row_scale_eps, the kernel also returns the output rows' RMS scale rsqrt(mean(y²) + eps)
([M, 1] float32, from y rounded to its dtype): the next RMSNorm of y (the next layer's input norm,
or the final norm) is then elementwise, fused into its matmul, with no reduction pass over y in HBM.

Numerics as models.layers: the matmuls accumulate in float32 and round to the input dtype, silu·up
in the input dtype, the down projection accumulated in float32 over all of I and rounded once.

int8 weights (dflash_jax.quantize.Int8Weight: q int8 and a float32 scale per output column): pass
q as gate_up / down and the scales as gate_up_scale [2I] / down_scale [H]. Each step copies the
int8 tiles (half the bytes of bf16 ones) and converts them to x's dtype in VMEM; the gate and up
products are scaled per column in float32 before their rounding, the down projection's float32
accumulator once at the end (its scales are per output column, constant over I).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import Unsupported, precision, round_up

# The rows of one call (x, the accumulator and the output live in VMEM whole).
MAX_ROWS = 1024
_SUBLANE = {4: 8, 2: 16}


def _kernel(x_ref, g_ref, u_ref, d_ref, *refs, norm: bool, eps: float, scale_eps: float | None, int8: bool):
    # x_ref [M, H], g_ref/u_ref [H, bi], d_ref [bi, H]; int8: gs_ref/us_ref [1, bi], ds_ref [1, H]
    # f32 (the column scales); norm: nw_ref [1, H] and h_sc [M, H] (the normed rows, once); o_ref
    # [M, H], scale: s_ref [M, 1] f32; acc_ref [M, H] f32
    refs = list(refs)
    gs_ref, us_ref, ds_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if int8 else (None, None, None)
    nw_ref = refs.pop(0) if norm else None
    o_ref = refs.pop(0)
    s_ref = refs.pop(0) if scale_eps is not None else None
    acc_ref = refs.pop(0)
    h_sc = refs.pop(0) if norm else None
    j = pl.program_id(0)
    dt = x_ref.dtype
    prec = precision(dt)

    def w(ref):         # an int8 tile converted in VMEM (int8 -> float32 -> x's dtype: exact)
        return ref[...].astype(jnp.float32).astype(dt) if int8 else ref[...]

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if norm:   # models.layers.RMSNorm: float32, cast back, times the weight in x's dtype
            xf = x_ref[...].astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            h_sc[...] = (nw_ref[...].astype(jnp.float32) * xf.astype(dt).astype(jnp.float32)).astype(dt)

    x = h_sc[...] if norm else x_ref[...]
    g = jnp.dot(x, w(g_ref), preferred_element_type=jnp.float32, precision=prec)                 # [M, bi]
    u = jnp.dot(x, w(u_ref), preferred_element_type=jnp.float32, precision=prec)                 # [M, bi]
    if int8:
        g, u = g * gs_ref[...], u * us_ref[...]
    g, u = g.astype(dt), u.astype(dt)
    gf = g.astype(jnp.float32)
    h = ((gf * jax.nn.sigmoid(gf)).astype(dt) * u).astype(dt)                                     # [M, bi]
    acc_ref[...] += jnp.dot(h, w(d_ref), preferred_element_type=jnp.float32, precision=prec)

    @pl.when(j == pl.num_programs(0) - 1)
    def _finish():
        acc = acc_ref[...] * ds_ref[...] if int8 else acc_ref[...]
        y = acc.astype(o_ref.dtype)
        if norm:   # the residual: x + mlp(norm(x)), the sum rounded to x's dtype
            y = (x_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(o_ref.dtype)
        o_ref[...] = y
        if s_ref is not None:   # the next RMSNorm's scale of y (models.layers.RMSNorm's float32)
            yf = y.astype(jnp.float32)
            s_ref[...] = jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + scale_eps)


def choose_block(I: int, H: int, M: int, itemsize: int, block_i: int | None = None, w_itemsize: int | None = None) -> int:
    w_itemsize = w_itemsize or itemsize
    if block_i is None:
        # 3 weight tiles of H x bi, double-buffered, next to x, out and the f32 accumulator (int8
        # tiles: and their 3 converted copies in x's dtype).
        per = 6 * H * w_itemsize + (3 * H * itemsize if w_itemsize != itemsize else 0)
        block_i = next((b for b in (512, 256, 128) if I % b == 0 and per * b <= 24 << 20), None)
        if block_i is None:
            raise Unsupported(f"tpu_mlp: intermediate {I} has no tile (a multiple of 128 dividing it)")
    if I % block_i or block_i % 128:
        raise Unsupported(f"tpu_mlp: block_i={block_i} must divide I={I} and be a multiple of 128")
    return block_i


def supported(M: int, H: int, I: int, dtype) -> bool:
    return (M <= MAX_ROWS and H % 128 == 0 and I % 128 == 0 and jnp.dtype(dtype).itemsize in _SUBLANE)


def mlp(x, gate_up, down, *, norm_weight=None, eps: float = 0.0, row_scale_eps: float | None = None,
        gate_up_scale=None, down_scale=None, block_i: int | None = None, interpret=False):
    """down(silu(x @ gate) * (x @ up)) for x [..., H], gate_up [H, 2I] ([gate | up] columns), down
    [I, H] → [..., H] in x's dtype. With norm_weight [H]: the layer's whole MLP block,
    x + mlp(RMSNorm(x)) (the post-attention norm and the residual in the kernel too, so neither
    the normed rows nor the MLP output exist in HBM apart from the result). With row_scale_eps:
    (y, rsqrt(mean(y²) + row_scale_eps) [..., 1] float32), the RMS scale of y's rows.
    gate_up_scale [2I] / down_scale [H] float32: gate_up / down are int8 (Int8Weight q's), w = q *
    scale per output column (or pass the Int8Weights themselves as gate_up / down). interpret: False, or pltpu.InterpretParams() to run on CPU. Raises
    Unsupported for a shape it does not tile (callers use the XLA ops)."""
    if hasattr(gate_up, "q") and hasattr(gate_up, "scale"):        # an Int8Weight (dflash_jax.quantize)
        gate_up, gate_up_scale = gate_up.q, gate_up.scale
    if hasattr(down, "q") and hasattr(down, "scale"):
        down, down_scale = down.q, down.scale
    H = x.shape[-1]
    I = down.shape[0]
    lead = x.shape[:-1]
    M = 1
    for d in lead:
        M *= d
    if gate_up.shape != (H, 2 * I) or down.shape != (I, H):
        raise ValueError(f"tpu_mlp: gate_up {gate_up.shape} / down {down.shape} do not fit x {x.shape}")
    int8 = gate_up_scale is not None
    if int8 != (down_scale is not None):
        raise ValueError("tpu_mlp: int8 weights need both gate_up_scale and down_scale")
    wdt = jnp.int8 if int8 else x.dtype
    if not supported(M, H, I, x.dtype) or gate_up.dtype != wdt or down.dtype != wdt:
        raise Unsupported(f"tpu_mlp: x {x.shape} {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    if int8 and (gate_up_scale.shape != (2 * I,) or down_scale.shape != (H,)):
        raise ValueError(f"tpu_mlp: scales {gate_up_scale.shape} / {down_scale.shape} do not fit "
                         f"gate_up {gate_up.shape} / down {down.shape}")
    itemsize = jnp.dtype(x.dtype).itemsize
    w_itemsize = 1 if int8 else itemsize
    bi = choose_block(I, H, M, itemsize, block_i, w_itemsize)
    n_i = I // bi
    M_pad = round_up(M, _SUBLANE[itemsize])
    x2 = x.reshape(M, H)
    if M_pad != M:
        x2 = jnp.pad(x2, ((0, M_pad - M), (0, 0)))                                # [M_pad, H]
    vmem = 2 * (3 * H * bi * w_itemsize + 2 * M_pad * H * itemsize) + 4 * M_pad * H + 2 * M_pad * bi * 4
    norm = norm_weight is not None
    extra_in, extra_args, extra_scratch = [], [], []
    if int8:
        vmem += 3 * H * bi * itemsize + 2 * (2 * bi + H) * 4
        gs = gate_up_scale.astype(jnp.float32).reshape(1, 2 * I)
        extra_in += [pl.BlockSpec((1, bi), lambda j: (0, j)), pl.BlockSpec((1, bi), lambda j: (0, n_i + j)),
                     pl.BlockSpec((1, H), lambda j: (0, 0))]
        extra_args += [gs, gs, down_scale.astype(jnp.float32).reshape(1, H)]
    if norm:
        extra_in += [pl.BlockSpec((1, H), lambda j: (0, 0))]
        extra_args += [norm_weight.reshape(1, H)]
        extra_scratch += [pltpu.VMEM((M_pad, H), x.dtype)]
        vmem += M_pad * H * itemsize
    scale = row_scale_eps is not None
    out_shape = [jax.ShapeDtypeStruct((M_pad, H), x.dtype)]
    out_specs = [pl.BlockSpec((M_pad, H), lambda j: (0, 0))]
    if scale:
        out_shape.append(jax.ShapeDtypeStruct((M_pad, 1), jnp.float32))
        out_specs.append(pl.BlockSpec((M_pad, 1), lambda j: (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, norm=norm, eps=float(eps),
                          scale_eps=float(row_scale_eps) if scale else None, int8=int8),
        out_shape=tuple(out_shape),
        grid=(n_i,),
        in_specs=[
            pl.BlockSpec((M_pad, H), lambda j: (0, 0)),
            pl.BlockSpec((H, bi), lambda j: (0, j)),                 # gate columns
            pl.BlockSpec((H, bi), lambda j: (0, n_i + j)),           # up columns
            pl.BlockSpec((bi, H), lambda j: (j, 0)),
            *extra_in,
        ],
        out_specs=tuple(out_specs),
        scratch_shapes=[pltpu.VMEM((M_pad, H), jnp.float32), *extra_scratch],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=max(32 << 20, vmem + (8 << 20))),
        cost_estimate=pl.CostEstimate(
            flops=6 * M_pad * H * I, transcendentals=M_pad * I,
            bytes_accessed=w_itemsize * 3 * H * I + itemsize * 2 * M_pad * H + (4 * M_pad if scale else 0)
            + (4 * (2 * I + H) if int8 else 0)),
        interpret=interpret,
        name="dflash_mlp_tpu_int8" if int8 else "dflash_mlp_tpu",
    )(x2, gate_up, gate_up, down, *extra_args)
    y = out[0][:M].reshape(*lead, H)
    if scale:
        return y, out[1][:M].reshape(*lead, 1)
    return y
