"""Session 35 (ran at commit 6aa41d4; the chunked form and its `form` / `_diag` arguments were removed after it): the chunked GDN kernel's dot precision (H200, 9B shapes, kernel alone): us per kernel
(24 distinct inputs in one jitted program) and the largest difference from the walk (float32 math
throughout) of its output o and its deltas, per precision and warps."""
import time
import numpy as np
import jax
import jax.numpy as jnp
from pallas_kernels.gated_delta.gpu import gdn_block

HK, HV, d, T, L = 16, 32, 128, 16, 24
C = 2 * HK * d + HV * d
F = C + HV * d + 2 * HV
r = np.random.RandomState(0)
bf = jnp.bfloat16
VARIANTS = [("walk", 0, "tf32x3"), ("chunk", 4, "tf32x3"), ("chunk", 8, "tf32x3"), ("chunk", 4, "bf16x6"),
            ("chunk", 4, "default"), ("chunk", 8, "highest")]
for B, bv in ((1, 32), (32, 32)):
    ps = [jnp.asarray(r.randn(B, T, F), bf) for _ in range(L)]
    win = jnp.asarray(r.randn(B, 3, C), bf)
    cw = jnp.asarray(r.randn(C, 4) * 0.5, bf)
    alog = jnp.asarray(r.randn(HV) * 0.3, bf)
    dtb = jnp.asarray(r.randn(HV) * 0.3, bf)
    nw = jnp.asarray(1 + 0.1 * r.randn(d), bf)
    st = jnp.asarray(r.randn(B, HV, d, d) * 0.05, jnp.float32)
    ref = None
    for form, nwarps, prec in VARIANTS:
        def many(ps, win, cw, alog, dtb, nw, st, form=form, nwarps=nwarps, prec=prec):
            return [gdn_block(p, win, cw, alog, dtb, nw, st, num_k_heads=HK, key_dim=d, value_dim=d, norm_eps=1e-6,
                              block_v=bv, form=form, num_warps=nwarps,
                              _diag=(("prec", prec),) if form == "chunk" else ()) for p in ps]
        fn = jax.jit(many)
        try:
            out = jax.block_until_ready(fn(ps, win, cw, alog, dtb, nw, st))
        except Exception as e:  # noqa: BLE001
            print(f"B={B} bv={bv} {form} warps {nwarps} {prec}: failed {type(e).__name__}: {str(e)[:200]}")
            continue
        o, dl = out[0][0].astype(jnp.float32), out[0][1][2]
        if ref is None:
            ref = (o, dl)
        eo = float(jnp.max(jnp.abs(o - ref[0])) / jnp.max(jnp.abs(ref[0])))
        ed = float(jnp.max(jnp.abs(dl - ref[1])) / jnp.max(jnp.abs(ref[1])))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                y = fn(ps, win, cw, alog, dtb, nw, st)
            jax.block_until_ready(y)
            ts.append((time.perf_counter() - t0) / 10 / L * 1e6)
        print(f"B={B} bv={bv} {form:5s} warps {nwarps} {prec:8s} {min(ts):7.1f} us/kernel; max diff / max: "
              f"o {eo:.2e}, delta {ed:.2e}", flush=True)
