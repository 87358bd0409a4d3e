"""Session 35 (ran at commit 6aa41d4; the chunked form and its `form` / `_diag` arguments were removed after it): where the chunked GDN kernel's time goes (H200, 9B shapes, kernel alone): variants of
warps, dot precision, without the conv's shift products, without the solve's factors; each a jitted
call timed over 24 distinct inputs in one program (dispatch amortised), us per kernel."""
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
VARIANTS = [("walk", 0, ()), ("chunk", 0, ()), ("chunk", 1, ()), ("chunk", 2, ()), ("chunk", 8, ()),
            ("chunk", 0, (("prec_hi", False),)), ("chunk", 0, (("do_conv", False),)),
            ("chunk", 0, (("do_solve", False),)),
            ("chunk", 0, (("do_conv", False), ("do_solve", False), ("prec_hi", False)))]
for B, bv in ((1, 32), (1, 0), (32, 32)):
    ps = [jnp.asarray(r.randn(B, T, F), bf) for _ in range(L)]
    win = jnp.asarray(r.randn(B, 3, C), bf)
    cw = jnp.asarray(r.randn(C, 4) * 0.5, bf)
    alog = jnp.asarray(r.randn(HV) * 0.3, bf)
    dtb = jnp.asarray(r.randn(HV) * 0.3, bf)
    nw = jnp.asarray(1 + 0.1 * r.randn(d), bf)
    st = jnp.asarray(r.randn(B, HV, d, d) * 0.05, jnp.float32)
    for form, nwarps, diag in VARIANTS:
        def many(ps, win, cw, alog, dtb, nw, st, form=form, nwarps=nwarps, diag=diag):
            return [gdn_block(p, win, cw, alog, dtb, nw, st, num_k_heads=HK, key_dim=d, value_dim=d, norm_eps=1e-6,
                              block_v=bv, form=form, num_warps=nwarps, _diag=diag)[1][2] for p in ps]
        fn = jax.jit(many)
        try:
            jax.block_until_ready(fn(ps, win, cw, alog, dtb, nw, st))
        except Exception as e:  # noqa: BLE001
            print(f"B={B} bv={bv} {form} warps {nwarps} {dict(diag)}: failed {type(e).__name__}: {str(e)[:150]}")
            continue
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                y = fn(ps, win, cw, alog, dtb, nw, st)
            jax.block_until_ready(y)
            ts.append((time.perf_counter() - t0) / 10 / L * 1e6)
        print(f"B={B} bv={bv} {form:5s} warps {nwarps} {str(dict(diag)):60s} {min(ts):7.1f} us/kernel", flush=True)
