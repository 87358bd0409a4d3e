#!/usr/bin/env python
"""Does a Pallas kernel between two XLA kernels get launch overlap (PDL) inside a jitted loop?

    python scripts/pdl_chain_probe.py            # GPU (Hopper+, jax >= 0.11): the table
    python scripts/pdl_chain_probe.py --export   # any machine: lower every variant for CUDA only

The question behind the next step on the B=1 loop (BENCHMARKS.md, call 16): XLA chains its own
kernels with programmatic dependent launch, but our Pallas Triton kernels (attention, q/k-norm +
RoPE, add + RMSNorm) are launched by jaxlib's Triton launcher without it. Pallas Mosaic GPU kernels
that call `griddepcontrol_wait` are launched with the PDL attribute; whether XLA's CUDA graph keeps
that overlap around a custom call is what this measures.

Each variant is a `fori_loop` whose body is LINKS links of [an XLA elementwise kernel -> one small
Pallas kernel] on a [16, 4096] bf16 activation (a verify block's hidden state; the Pallas kernels
take it in 16 column blocks of 256, the most one TMA copy moves along a dimension). Time per
link = (time of N2 trips - time of N1 trips) / ((N2 - N1) * LINKS), median of 5, so dispatch and the
loop's own cost per trip cancel to first order. Variants:

  xla          the link's Pallas kernel replaced by XLA's own op (XLA fuses it with the sin: one
               XLA kernel per link, the floor of a link)
  triton       Pallas Triton kernel (pltriton.CompilerParams), as our kernels are today
  mgpu         Pallas Mosaic GPU kernel (`plgpu.kernel`), input copied GMEM -> SMEM inside it
  mgpu_pdl     the same with `griddepcontrol_wait()` before the copy (launched with PDL)

Call 19 (H200, jax 0.11.2, 3 alternating rounds; benchmarks/results/call19_pdl_chain_probe.log): µs
per link with XLA's PDL on (default) / off: xla 2.2-2.4 / 2.5-3.2, triton 3.6-4.1 / 3.7-4.1, mgpu
4.2-4.4 / 4.1-4.7, mgpu_pdl 4.5-4.6 / 4.2-4.7. The Mosaic GPU kernel gains nothing from PDL and
costs more per launch than the Triton one: porting our small kernels to it would not shorten the loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SHAPE, DTYPE = (16, 4096), jnp.bfloat16
LINKS, N1, N2 = 8, 16, 400


def _triton_kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, o_ref):
        o_ref[...] = (x_ref[...].astype(jnp.float32) * 0.5).astype(o_ref.dtype)

    def f(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            spec = pl.BlockSpec((SHAPE[0], 256), lambda i: (0, i))
            return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  grid=(SHAPE[1] // 256,), in_specs=[spec], out_specs=spec,
                                  compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
                                  name="probe_triton")(x)
    return f


def _mgpu_kernel(pdl: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    cols = 256                        # a TMA copy moves at most 256 elements along a dimension

    def body(x_gmem, o_gmem, x_smem, bar):
        if pdl:
            plgpu.griddepcontrol_wait()   # nothing of x is read before the predecessor is done
        c0 = jax.lax.axis_index("c") * cols
        plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(c0, cols)], x_smem, bar)
        plgpu.barrier_wait(bar)
        x_smem[...] = (x_smem[...].astype(jnp.float32) * 0.5).astype(x_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, o_gmem.at[:, pl.ds(c0, cols)])
        plgpu.wait_smem_to_gmem(0)

    def f(x):
        # plgpu.kernel, not pallas_call: jax 0.11.2 lowers Mosaic GPU only through the mesh API
        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                            scratch_types=[plgpu.SMEM((SHAPE[0], cols), DTYPE),
                                            plgpu.Barrier(num_arrivals=1)],
                            grid=(SHAPE[1] // cols,), grid_names=("c",))(x)
    return f


def _xla_op(x):
    return (x.astype(jnp.float32) * 0.5).astype(x.dtype)


VARIANTS = {"xla": lambda: _xla_op, "triton": _triton_kernel,
            "mgpu": lambda: _mgpu_kernel(False), "mgpu_pdl": lambda: _mgpu_kernel(True)}


def program(op):
    def body(_, x):
        for _ in range(LINKS):
            x = jnp.sin(x)            # an XLA kernel: the custom call bounds its fusion
            x = op(x)
        return x

    @jax.jit
    def run(x, trips):
        return jax.lax.fori_loop(0, trips, body, x)
    return run


def time_variant(name: str) -> str:
    run = program(VARIANTS[name]())
    x = jnp.ones(SHAPE, DTYPE)
    run(x, N1).block_until_ready()
    out = {}
    for n in (N1, N2):
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            run(x, n).block_until_ready()
            ts.append(time.perf_counter() - t)
        out[n] = statistics.median(ts)
    us = (out[N2] - out[N1]) / ((N2 - N1) * LINKS) * 1e6
    return f"{us:8.2f} us per link (sin + op)   [{N1} trips {out[N1] * 1e3:.2f} ms, {N2} trips {out[N2] * 1e3:.2f} ms]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="store_true", help="only lower each variant for CUDA (no GPU needed)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    x = jax.ShapeDtypeStruct(SHAPE, DTYPE)
    if args.export:
        for name in names:
            try:
                exp = jax.export.export(
                    program(VARIANTS[name]()), platforms=["cuda"],
                    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in
                                     ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi",
                                      "mosaic_gpu", "mosaic_gpu_v2")],
                )(x, jax.ShapeDtypeStruct((), jnp.int32))
                print(f"{name:9s} lowers for CUDA ({len(exp.mlir_module())} chars of StableHLO)")
            except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
                print(f"{name:9s} does not lower: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    print(f"# pdl_chain_probe on {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{LINKS} links per trip, [{SHAPE[0]}, {SHAPE[1]}] bf16", flush=True)
    for rnd in range(args.rounds):     # rounds alternate the variants: drifts hit all alike
        for name in names:
            try:
                print(f"{name:9s} {time_variant(name)}   (round {rnd + 1})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:9s} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
