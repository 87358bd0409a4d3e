"""Block attention over a paged KV cache: the paged kernel against today's gather + dense kernel.

    python scripts/bench_paged_attention.py              # on a GPU (or a TPU: --impl tpu), ~1-2 minutes
    python scripts/bench_paged_attention.py --smoke      # tiny sizes on CPU (kernels in interpret mode;
                                                         # the times mean nothing, the checks do)

Qwen3-8B attention (32 q / 8 kv heads, head_dim 128, bf16), B = 32 rows of capacity C = 4096, a block
of T = 16 (the draft pattern k_end = len + T, the verify pattern k_end = len + t + 1), the rows' lengths
either all full (len = C - T) or ragged (uniform on [C/8, C - T], seeded). Pages of 16 / 64 / 128 rows,
each row's pages scattered over the pool at random (a pool of B*P + 1 pages, page 0 the dummy page).
Per case, one call's time of:
  dense        the dense kernel on a dense cache [B, Hkv, C, D] (what the contiguous slots cost)
  gather+dense today's paged path: PagedKVCache.layer_kv's gather into the dense view, then the kernel
  paged        pallas_kernels.block_attention_paged (the kernel reads the pages)
each checked against the XLA gather reference on the device first. Time: bench_attention.py's method
(a jitted chain over rotated K/V buffers, the one-pass and three-pass programs' difference).
Prints a table and writes $OUT/bench_paged_attention.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from bench_attention import chained, per_call_time, warm_up_device  # noqa: E402
from pallas_kernels.attention import gather_pages  # noqa: E402


def lengths(kind: str, B: int, C: int, T: int, seed: int) -> np.ndarray:
    if kind == "full":
        return np.full((B,), C, np.int64)
    rng = np.random.default_rng(seed)
    return rng.integers(C // 8, C - T + 1, size=B) + T       # rows hold len + T keys after the block


def k_end_for(pattern: str, lens: np.ndarray, T: int) -> jnp.ndarray:
    """[B, T]: the block is each row's last T keys."""
    t = np.arange(T)[None, :]
    e = lens[:, None] - T + t + 1 if pattern == "verify" else np.broadcast_to(lens[:, None], (len(lens), T))
    return jnp.asarray(e, jnp.int32)


def scattered_table(B: int, P: int, seed: int) -> jnp.ndarray:
    """[B, P]: every page of every row a distinct pool page in random order (pages 1..B*P)."""
    ids = np.random.default_rng(seed).permutation(np.arange(1, B * P + 1))
    return jnp.asarray(ids.reshape(B, P), jnp.int32)


def to_pools(k, table, page):
    """The dense caches [B, Hkv, C, D] laid out as pools [B*P + 1, Hkv, page, D] through `table`."""
    B, Hkv, C, D = k.shape
    P = C // page
    pages = k.reshape(B, Hkv, P, page, D).swapaxes(1, 2).reshape(B * P, Hkv, page, D)
    pool = jnp.zeros((B * P + 1, Hkv, page, D), k.dtype)
    return pool.at[table.reshape(-1)].set(pages)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--impl", default=None, help="gpu or tpu (default: the backend's kernel)")
    ap.add_argument("--pages", default="16,64,128")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    smoke = args.smoke
    impl = args.impl or ("tpu" if jax.default_backend() == "tpu" else "gpu")
    interpret = smoke
    if smoke:
        B, T, Hq, Hkv, D, C, pages = 2, 8, 4, 2, 64, 128, (16, 32)
        opts = dict(min_reps=1, max_reps=2, target_s=0.0)
    else:
        B, T, Hq, Hkv, D, C = 32, 16, 32, 8, 128, 4096
        pages = tuple(int(p) for p in args.pages.split(","))
        opts = dict(min_reps=5, max_reps=50, target_s=1.0)
        warm_up_device(2.0)
    dtype = jnp.bfloat16
    n_buf = 2
    keys = jax.random.split(jax.random.key(0), 2 * n_buf + 1)
    ks = [jax.random.normal(keys[2 * i], (B, Hkv, C, D), dtype) for i in range(n_buf)]      # [B,Hkv,C,D]
    vs = [jax.random.normal(keys[2 * i + 1], (B, Hkv, C, D), dtype) for i in range(n_buf)]
    q = jax.random.normal(keys[-1], (B, T, Hq, D), dtype)                                   # [B,T,Hq,D]
    kern = dict(impl=impl, interpret=interpret)
    rows = []
    print(f"{jax.devices()[0].device_kind}: B={B} T={T} Hq={Hq} Hkv={Hkv} D={D} C={C} {jnp.dtype(dtype).name} "
          f"impl={impl}", flush=True)
    for lens_kind in ("full", "ragged"):
        lens = lengths(lens_kind, B, C, T, seed=1)
        for pattern in ("draft", "verify"):
            e = k_end_for(pattern, lens, T)
            want = pallas_kernels.xla_block_attention(q, ks[0], vs[0], e)

            def timed(name, op, kb, vb, page=None):
                out = jax.jit(op)(q, kb[0], vb[0], e)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
                t, _ = per_call_time(chained(op, 1), chained(op, 3), (q, e, kb, vb), n_buf, opts)
                row = dict(lens=lens_kind, pattern=pattern, op=name, page=page, us=t * 1e6, max_err=err)
                rows.append(row)
                print(f"  {lens_kind:6s} {pattern:6s} {name:13s} page={page!s:4s} {t * 1e6:9.1f} us  "
                      f"max|err|={err:.3g}", flush=True)

            timed("dense", lambda q_, k, v, e_: pallas_kernels.block_attention(q_, k, v, e_, **kern), ks, vs)
            for page in pages:
                table = scattered_table(B, C // page, seed=page)
                kp = [to_pools(k, table, page) for k in ks]
                vp = [to_pools(v, table, page) for v in vs]
                timed("gather+dense", lambda q_, k, v, e_, t_=table: pallas_kernels.block_attention(
                    q_, gather_pages(k, t_), gather_pages(v, t_), e_, **kern), kp, vp, page)
                timed("paged", lambda q_, k, v, e_, t_=table: pallas_kernels.block_attention_paged(
                    q_, k, v, t_, e_, **kern), kp, vp, page)
                del kp, vp
    out_dir = Path(os.environ.get("OUT", "."))
    path = Path(args.json) if args.json else out_dir / "bench_paged_attention.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, C=C,
                                    impl=impl, smoke=smoke, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
