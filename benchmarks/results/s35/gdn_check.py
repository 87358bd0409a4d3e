"""Session 35 (ran at commit 6aa41d4; the chunked form and its `form` / `_diag` arguments were removed after it): the GDN block kernel's chunked form against its walk on the GPU at Qwen3.5-9B
shapes (bf16 inputs, random, non-zero state): the largest difference of each output, and each
form's device time alone (a jitted call of 24 layers' distinct states, profiler-free wall)."""
import time
import numpy as np
import jax
import jax.numpy as jnp
from pallas_kernels.gated_delta.gpu import gdn_block

HK, HV, d, T = 16, 32, 128, 16
C = 2 * HK * d + HV * d
F = C + HV * d + 2 * HV
r = np.random.RandomState(0)
bf = jnp.bfloat16
for B in (1, 32):
    p = jnp.asarray(r.randn(B, T, F), bf)
    win = jnp.asarray(r.randn(B, 3, C), bf)
    cw = jnp.asarray(r.randn(C, 4) * 0.5, bf)
    alog = jnp.asarray(r.randn(HV) * 0.3, bf)
    dtb = jnp.asarray(r.randn(HV) * 0.3, bf)
    nw = jnp.asarray(1 + 0.1 * r.randn(d), bf)
    st = jnp.asarray(r.randn(B, HV, d, d) * 0.05, jnp.float32)
    for bv in (32, 0):
        outs, times = {}, {}
        for form in ("walk", "chunk"):
            fn = jax.jit(lambda *a, form=form: gdn_block(*a, num_k_heads=HK, key_dim=d, value_dim=d,
                                                         norm_eps=1e-6, block_v=bv, form=form))
            outs[form] = jax.block_until_ready(fn(p, win, cw, alog, dtb, nw, st))
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(50):
                    y = fn(p, win, cw, alog, dtb, nw, st)
                jax.block_until_ready(y)
                ts.append((time.perf_counter() - t0) / 50 * 1e6)
            times[form] = min(ts)
        errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(outs["walk"]), jax.tree.leaves(outs["chunk"]))]
        mags = [float(jnp.max(jnp.abs(a.astype(jnp.float32)))) for a in jax.tree.leaves(outs["walk"])]
        print(f"B={B} bv={bv}: max |walk - chunk| (o, k, G, delta) {['%.2e of %.2f' % em for em in zip(errs, mags)]}; "
              f"us per call (dispatch included) walk {times['walk']:.1f}, chunk {times['chunk']:.1f}", flush=True)
