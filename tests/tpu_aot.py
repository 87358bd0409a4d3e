"""Ahead-of-time compilation for real TPU generations on a CPU-only machine (libtpu needed, no TPU).

    from tests.tpu_aot import requires_libtpu, tpu_device, abstract, compile_for_tpu
    dev = tpu_device("v6e:2x2")
    compiled = compile_for_tpu(f, abstract((B, T, H), jnp.bfloat16, dev), ...)
    compiled.memory_analysis()

Import this module before anything initialises JAX's backends: libtpu probes the host for TPU
workers when it loads, and these variables keep it from doing so (and from logging errors).
"""

from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")

import jax  # noqa: E402
import pytest  # noqa: E402

# Topologies must cover whole hosts: "v5e:1x1" is refused, "v5e:2x2" works.
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
requires_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]'): "
                                     "cannot compile for TPU ahead of time")


@functools.cache
def tpu_topology(topology_name: str = "v5e:2x2"):
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="tpu", topology_name=topology_name)


def tpu_device(topology_name: str = "v5e:2x2"):
    """The first device of a TPU topology (no TPU needed)."""
    return tpu_topology(topology_name).devices[0]


def abstract(shape, dtype, device) -> jax.ShapeDtypeStruct:
    """An argument placed on `device` for `jax.jit(f).trace(...)`."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                sharding=jax.sharding.SingleDeviceSharding(device))


def compile_for_tpu(f, *args, **jit_kwargs):
    """Trace, lower and compile `f` with the real TPU compiler (Mosaic included) for the args' device."""
    return jax.jit(f, **jit_kwargs).trace(*args).lower().compile()


def memory_report(compiled) -> dict:
    """The compiler's memory analysis as plain ints (bytes)."""
    ma = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
    return {k: int(getattr(ma, k)) for k in keys if hasattr(ma, k)}


def bytes_accessed(compiled) -> float | None:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):      # older jax returned a list of one dict
        ca = ca[0] if ca else {}
    return ca.get("bytes accessed") if ca else None
