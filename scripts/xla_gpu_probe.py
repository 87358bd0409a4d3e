#!/usr/bin/env python
"""What this GPU's XLA offers for launch overlap: flags and whether its kernels use PDL.

    python scripts/xla_gpu_probe.py                                  # default flags only
    python scripts/xla_gpu_probe.py "--xla_gpu_enable_pdl=true" ...  # and each flag set given

Prints (1) the XLA GPU flags compiled into the installed jaxlib / CUDA plugin whose names mention
PDL (programmatic dependent launch), command buffers or graphs; (2) for the default flags and for
each flag set given, in a fresh process: whether anything XLA dumps for a small layer-shaped chain
(GEMM, RMSNorm, GEMM, SwiGLU, GEMM, as in a decode step) mentions `griddepcontrol` (the PTX of PDL:
a kernel waits for its predecessor inside the kernel, so its launch can overlap the predecessor's
tail; XLA's dump may not include the Triton GEMMs' PTX, so 0 is not proof of absence), and the
chain's time per layer in a jitted 16-layer loop-free stack (one dispatch, host time included).

Call 16 (H200, jax 0.11.2; BENCHMARKS.md): both flags exist, the A/B in the whole loop showed PDL is
on by default and worth 0.13 ms per DFlash iteration; the dump held no PTX (0 files matched).

No model and no repository code: it answers "does XLA here chain its own kernels with PDL?", the
question behind the `XLA_FLAGS` A/B runs of `scripts/gpu_call.sh` (BENCHMARKS.md, call 16).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import glob, os, sys, time
import jax, jax.numpy as jnp
M, H, I, L = (int(v) for v in os.environ.get("PROBE_SHAPE", "16,2048,6144,16").split(","))
k = jax.random.split(jax.random.key(0), 4)
wq = (jax.random.normal(k[0], (L, H, H)) * 0.02).astype(jnp.bfloat16)
wg = (jax.random.normal(k[1], (L, H, 2 * I)) * 0.02).astype(jnp.bfloat16)
wd = (jax.random.normal(k[2], (L, I, H)) * 0.02).astype(jnp.bfloat16)
x0 = jax.random.normal(k[3], (M, H)).astype(jnp.bfloat16)

def norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

@jax.jit
def stack(x, wq, wg, wd):
    for l in range(L):            # unrolled, as the model's layers are
        h = x + norm(x) @ wq[l]
        gu = norm(h) @ wg[l]
        x = h + (jax.nn.silu(gu[:, :I]) * gu[:, I:]) @ wd[l]
    return x

y = stack(x0, wq, wg, wd).block_until_ready()
ts = []
for _ in range(5):
    t = time.perf_counter(); stack(x0, wq, wg, wd).block_until_ready(); ts.append(time.perf_counter() - t)
files = [p for p in glob.glob(os.path.join(os.environ["PROBE_DUMP"], "**", "*"), recursive=True)
         if os.path.isfile(p)]
n_gdc = sum(open(p, errors="ignore").read().count("griddepcontrol") for p in files)
print(f"RESULT dumped_files={len(files)} griddepcontrol={n_gdc} us_per_layer={min(ts) / L * 1e6:.1f}")
"""

FLAG_RE = re.compile(rb"xla_gpu_[a-z0-9_]*(?:pdl|command_buffer|graph)[a-z0-9_]*")


def flags_in_binaries() -> list[str]:
    roots = set()
    for mod in ("jaxlib", "jax_plugins"):
        try:
            m = __import__(mod)
            roots.update(getattr(m, "__path__", []))
        except Exception:
            pass
    found: set[str] = set()
    for root in roots:
        for so in glob.glob(os.path.join(root, "**", "*.so*"), recursive=True):
            try:
                data = open(so, "rb").read()
            except OSError:
                continue
            found.update(f.decode() for f in FLAG_RE.findall(data))
    return sorted(found)


def run_child(flags: str) -> str:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, PROBE_DUMP=dump,
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags} --xla_dump_to={dump}".strip())
        try:
            p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                               timeout=240)
        except subprocess.TimeoutExpired:
            return "timed out"
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        if lines:
            return lines[-1][len("RESULT "):]
        err = [ln for ln in p.stderr.splitlines() if ln.strip()][-3:]
        return f"failed (rc {p.returncode}): {' | '.join(err)}"


def main() -> None:
    print("XLA GPU flags in the installed binaries (pdl / command_buffer / graph):")
    for f in flags_in_binaries():
        print("  ", f)
    for flags in [""] + sys.argv[1:]:
        print(f"probe [{flags or 'default flags'}]: {run_child(flags)}", flush=True)


if __name__ == "__main__":
    main()
