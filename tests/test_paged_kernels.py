"""Block attention over a paged KV cache (pallas_kernels.block_attention_paged) against the gather oracle.

Pools [N, Hkv, page, D] hold pages in shuffled order; each row's table names its pages and pads with
the dummy page 0, which is filled with large values so that a key read past k_end shows. The TPU
kernel runs in the TPU interpreter, the GPU one in the generic interpreter (both on CPU); the TPU
kernel is also compiled ahead of time for v5e at a Qwen3-8B shape, the GPU one lowered for CUDA.
"""

from __future__ import annotations

from tests import tpu_aot  # noqa: F401  (first: sets libtpu's env before JAX initialises its backends)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import Unsupported
from pallas_kernels.attention import gpu, paged, tpu
from tests.tpu_aot import abstract, bytes_accessed, compile_for_tpu, memory_report, requires_libtpu, tpu_device

SLOW = pytest.mark.slow
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _paged_inputs(lens, T, Hq, Hkv, D, page, P, dtype, seed=0):
    """q [B,T,Hq,D], pools [N,Hkv,page,D] and a table [B,P]: row b's ceil(lens[b] / page) pages are
    distinct shuffled pool pages, the rest of its row the dummy page 0 (filled with 50s)."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    used = [-(-n // page) for n in lens]
    N = 1 + sum(used) + 3                                          # 3 pages nobody owns
    ids = rng.permutation(np.arange(1, N))
    table = np.zeros((B, P), np.int32)
    at = 0
    for b, n in enumerate(used):
        table[b, :n] = ids[at:at + n]
        at += n
    k = rng.normal(size=(N, Hkv, page, D)).astype(np.float32)
    v = rng.normal(size=(N, Hkv, page, D)).astype(np.float32)
    k[0] = v[0] = 50.0
    q = rng.normal(size=(B, T, Hq, D)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table))


def _k_end(pattern, lens, T):
    """verify: causal inside the block (the block is the last T keys of each row); draft: every row
    of the block sees the whole row. A row of length 0 (an idle slot) gets k_end <= 0: zeros."""
    lens = np.asarray(lens)[:, None]
    t = np.arange(T)[None, :]
    e = lens - T + t + 1 if pattern == "verify" else np.broadcast_to(lens, (len(lens), T))
    return jnp.asarray(e, jnp.int32)


def _check(out, q, k, v, table, k_end, dtype, k_start=None):
    view_k, view_v = paged.gather_pages(k, table), paged.gather_pages(v, table)
    want = pallas_kernels.reference_block_attention(q.astype(jnp.float32), view_k.astype(jnp.float32),
                                                    view_v.astype(jnp.float32), k_end, k_start=k_start)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), **TOL[dtype])
    # the XLA gather path is the same function
    xla = pallas_kernels.xla_block_attention_paged(q, k, v, table, k_end, k_start=k_start)
    np.testing.assert_allclose(np.asarray(xla, np.float32), np.asarray(want), **TOL[dtype])


# (lens per row, T, Hq, Hkv, D, page, P, dtype, pattern, tuning)
TPU_CASES = [
    pytest.param([70, 33, 128, 0], 8, 4, 2, 64, 16, 8, jnp.float32, "verify", {}, id="verify-f32-p16"),
    pytest.param([70, 20], 8, 4, 2, 128, 32, 4, jnp.bfloat16, "draft", {}, id="draft-bf16-p32", marks=SLOW),
    pytest.param([47, 9], 8, 4, 2, 64, 8, 8, jnp.float32, "verify", {"pages_per_block": 1},
                 id="verify-f32-p8-one-page-tiles", marks=SLOW),
    pytest.param([50, 17], 1, 4, 2, 64, 16, 4, jnp.float32, "verify", {}, id="decode-folded", marks=SLOW),
]


@pytest.mark.parametrize("lens,T,Hq,Hkv,D,page,P,dtype,pattern,tuning", TPU_CASES)
def test_tpu_paged_kernel_interpret(lens, T, Hq, Hkv, D, page, P, dtype, pattern, tuning):
    q, k, v, table = _paged_inputs(lens, T, Hq, Hkv, D, page, P, dtype)
    e = _k_end(pattern, lens, T)
    out = pallas_kernels.block_attention_paged(q, k, v, table, e, impl="tpu", interpret=True, **tuning)
    _check(out, q, k, v, table, e, dtype)


GPU_CASES = [
    # 64-key tiles over pages of 16 (a gather load per tile)
    pytest.param([70, 33, 128, 0], 8, 4, 2, 64, 16, 8, jnp.float32, "verify", {}, id="verify-f32-p16"),
    # 16-key tiles inside pages of 32 (one page a tile)
    pytest.param([70, 20], 8, 4, 2, 128, 32, 4, jnp.bfloat16, "draft", {"block_k": 16, "kv_splits": 2},
                 id="draft-bf16-p32-two-tiles-a-page-split", marks=SLOW),
    pytest.param([50, 17], 1, 4, 2, 64, 16, 4, jnp.float32, "verify", {"kv_splits": 2}, id="decode-rows",
                 marks=SLOW),
]


@pytest.mark.parametrize("lens,T,Hq,Hkv,D,page,P,dtype,pattern,tuning", GPU_CASES)
def test_gpu_paged_kernel_interpret(lens, T, Hq, Hkv, D, page, P, dtype, pattern, tuning):
    q, k, v, table = _paged_inputs(lens, T, Hq, Hkv, D, page, P, dtype)
    e = _k_end(pattern, lens, T)
    out = gpu.block_attention_paged(q, k, v, table, e, interpret=True, **tuning)
    _check(out, q, k, v, table, e, dtype)


@SLOW
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_paged_sliding_window(impl):
    """k_start: each row of a draft block sees the last 24 keys (a sliding-window layer)."""
    lens, T = [70, 40], 8
    q, k, v, table = _paged_inputs(lens, T, 4, 2, 64, 16, 8, jnp.float32, seed=1)
    e = _k_end("draft", lens, T)
    ks = jnp.maximum(e - 24, 0)
    out = pallas_kernels.block_attention_paged(q, k, v, table, e, impl=impl, interpret=True, k_start=ks)
    _check(out, q, k, v, table, e, jnp.float32, k_start=ks)


@SLOW
@pytest.mark.parametrize("dtype,T,t0", [(jnp.float32, 8, 8), (jnp.bfloat16, 16, 0)])
def test_tpu_paged_qkv_prologue_equals_the_dense_view(dtype, T, t0):
    """block_attention_qkv_paged (q out of the projection, q_norm + RoPE in the kernel: the TPU
    layer's entry) = block_attention_qkv on the gathered view; the draft (t0 context rows) and the verify."""
    from jax.experimental.pallas import tpu as pltpu
    lens, Hq, Hkv, D, page, P = [70, 40], 4, 2, 128, 16, 8
    _, k, v, table = _paged_inputs(lens, T, Hq, Hkv, D, page, P, dtype)
    rng = np.random.default_rng(3)
    B = len(lens)
    qkv = jnp.asarray(rng.normal(size=(B, t0 + T, (Hq + 2 * Hkv) * D)), dtype)
    ang = rng.uniform(0, 6.3, size=(B, T, D // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.normal(size=(D,)), dtype)
    e = _k_end("verify" if t0 == 0 else "draft", lens, T)
    ip = pltpu.InterpretParams()
    got = tpu.block_attention_qkv_paged(qkv, cos, sin, w, 1e-6, k, v, table, e, num_heads=Hq, t0=t0,
                                        interpret=ip)
    want = tpu.block_attention_qkv(qkv, cos, sin, w, 1e-6, paged.gather_pages(k, table),
                                   paged.gather_pages(v, table), e, num_heads=Hq, t0=t0, interpret=ip)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])


def _page_writes_oracle(kp, k, start, table, page):
    """NumPy: each position p = start[b] + t of row b into table[b, p // page] at p % page (past the
    table: dropped)."""
    want = np.asarray(kp, np.float32).copy()
    B, T = k.shape[:2]
    for b in range(B):
        for t in range(T):
            p = int(start[b]) + t
            if p < table.shape[1] * page:
                want[table[b, p // page], :, p % page] = np.asarray(k[b, t], np.float32)
    return want


@pytest.mark.parametrize("impl, T, page, dtype", [
    ("tpu", 16, 16, jnp.float32), ("tpu", 5, 16, jnp.bfloat16), ("tpu", 40, 16, jnp.bfloat16), ("tpu", 16, 32, jnp.float32),
    ("gpu", 16, 16, jnp.bfloat16), ("gpu", 1, 16, jnp.float32), ("gpu", 40, 16, jnp.float32), ("gpu", 16, 64, jnp.bfloat16)])
def test_page_write_kernels_interpret(impl, T, page, dtype):
    """tpu_cache_write.write_kv_pages and gpu_cache_write.write_kv_pages (a layer's rows into their
    pages, pools aliased) against NumPy writing each position: writes that start inside a page, span
    pages, and run past the table (dropped by the TPU kernel, stored into the dummy page 0 by the GPU
    one: every page but 0 compared)."""
    from pallas_kernels.attention import gpu_cache_write, tpu_cache_write

    B, Hkv, D, P = 4, 2, 128, 6
    N = B * P + 1
    rng = np.random.default_rng(T + page)
    table = jnp.asarray(1 + rng.permutation(N - 1)[:B * P].reshape(B, P), jnp.int32)
    start = jnp.asarray([0, page - 3, page * P - T // 2 - 1, 2 * page + 1], jnp.int32)
    kp, vp = (jnp.asarray(rng.standard_normal((N, Hkv, page, D)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, T, Hkv, D)), dtype) for _ in range(2))
    if impl == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        got_k, got_v = tpu_cache_write.write_kv_pages(kp, vp, k, v, start, table, interpret=pltpu.InterpretParams())
    else:
        got_k, got_v = jax.jit(lambda *a: gpu_cache_write.write_kv_pages(*a, interpret=True))(kp, vp, k, v, start, table)
    for got, pool, new in ((got_k, kp, k), (got_v, vp, v)):
        want = _page_writes_oracle(pool, new, np.asarray(start), np.asarray(table), page)
        np.testing.assert_array_equal(np.asarray(got[1:], np.float32), want[1:])


def test_xla_page_writes_equal_a_position_by_position_oracle():
    """PagedKVCache.write_rows on the XLA path (whole pages gathered, updated and scattered back)
    against NumPy writing each position into
    table[b, p // page] at p % page: writes inside a page, across pages, and past the table (dropped)."""
    from dflash_jax import KernelConfig
    from dflash_jax.cache import PagedKVCache

    B, T, Hkv, D, P, page = 4, 20, 2, 8, 5, 8
    N = B * P + 1
    rng = np.random.default_rng(5)
    table = rng.permutation(np.arange(1, N))[:B * P].reshape(B, P).astype(np.int32)
    start = np.asarray([0, page - 3, page * P - T // 2, 2 * page + 1], np.int32)
    kp, vp = (rng.standard_normal((N, Hkv, page, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, Hkv, D)).astype(np.float32) for _ in range(2))
    want_k, want_v = _page_writes_oracle(kp, k, start, table, page), _page_writes_oracle(vp, v, start, table, page)
    cache = PagedKVCache(k=(jnp.asarray(kp),), v=(jnp.asarray(vp),), lens=jnp.asarray(start), table=jnp.asarray(table),
                         page_size=page)
    kernels = KernelConfig(attention="xla").resolve("cpu")
    got = jax.jit(lambda c, k, v, s: c.write_rows(0, k, v, s, kernels))(cache, jnp.asarray(k), jnp.asarray(v),
                                                                         jnp.asarray(start))
    np.testing.assert_array_equal(np.asarray(got.k[0]), want_k)
    np.testing.assert_array_equal(np.asarray(got.v[0]), want_v)


def test_unsupported_pages_fall_back_to_the_gather():
    q, k, v, table = _paged_inputs([30, 12], 8, 4, 2, 64, 12, 4, jnp.float32)
    e = _k_end("verify", [30, 12], 8)
    with pytest.raises(Unsupported):
        tpu.block_attention_paged(q, k, v, table, e, interpret=True)      # 12 rows: not whole sublanes
    out = pallas_kernels.block_attention_paged(q, k, v, table, e, impl="tpu", interpret=True)
    _check(out, q, k, v, table, e, jnp.float32)
    # the GPU kernel takes any page: 16-key tiles over pages of 12 (a gather load per tile)
    out = gpu.block_attention_paged(q, k, v, table, e, interpret=True)
    _check(out, q, k, v, table, e, jnp.float32)
    assert tpu.paged_supported(12, 64, jnp.float32) and tpu.paged_supported(8, 64, jnp.bfloat16)
    assert tpu.paged_supported(16, 128, jnp.bfloat16) is None


def test_paged_bad_shapes_raise():
    q, k, v, table = _paged_inputs([30, 12], 8, 4, 2, 64, 16, 4, jnp.float32)
    e = _k_end("verify", [30, 12], 8)
    with pytest.raises(ValueError, match="table"):
        pallas_kernels.block_attention_paged(q, k, v, table[:1], e, impl="xla")
    with pytest.raises(ValueError, match="differ"):
        pallas_kernels.block_attention_paged(q, k, v[:, :1], table, e, impl="xla")


# Qwen3-8B attention (32 q / 8 kv heads, head_dim 128), 8 rows of a 4096-token capacity, a 16-token block.
AOT_B, AOT_T, AOT_HQ, AOT_HKV, AOT_D, AOT_C = 8, 16, 32, 8, 128, 4096


@SLOW
@requires_libtpu
@pytest.mark.parametrize("page", [16, 64, 128])
def test_tpu_paged_kernel_compiles_for_tpu(page, capsys):
    """block_attention_paged (the verify: q [B, T, Hq, D]) and block_attention_qkv_paged (the draft
    block after T context rows, q out of the projection) through Mosaic for v5e."""
    dev = tpu_device("v5e:2x2")
    P = AOT_C // page
    N = AOT_B * P + 1
    dt = jnp.bfloat16
    pool, tab, ends = ((N, AOT_HKV, page, AOT_D), dt), ((AOT_B, P), jnp.int32), ((AOT_B, AOT_T), jnp.int32)
    plain = compile_for_tpu(lambda q, k, v, t, e: tpu.block_attention_paged(q, k, v, t, e),
                            abstract((AOT_B, AOT_T, AOT_HQ, AOT_D), dt, dev),
                            *(abstract(*a, dev) for a in (pool, pool, tab, ends)))
    rope = abstract((AOT_B, AOT_T, AOT_D // 2), jnp.float32, dev)
    fused = compile_for_tpu(
        lambda qkv, c, s, w, k, v, t, e: tpu.block_attention_qkv_paged(qkv, c, s, w, 1e-6, k, v, t, e,
                                                                      num_heads=AOT_HQ, t0=AOT_T),
        abstract((AOT_B, 2 * AOT_T, (AOT_HQ + 2 * AOT_HKV) * AOT_D), dt, dev), rope, rope,
        abstract((AOT_D,), dt, dev), *(abstract(*a, dev) for a in (pool, pool, tab, ends)))
    pool_bytes = 2 * N * AOT_HKV * page * AOT_D * jnp.dtype(dt).itemsize
    for name, compiled in (("paged", plain), ("qkv_paged", fused)):
        text = compiled.as_text()
        assert "tpu_custom_call" in text and "gather" not in text    # the kernel reads pages: no gathered view
        mem = memory_report(compiled)
        assert mem["temp_size_in_bytes"] < pool_bytes // 8, mem
        with capsys.disabled():
            print(f"\n[v5e {name} page={page}] {mem} bytes_accessed={bytes_accessed(compiled)}", end="")


@SLOW
@requires_libtpu
def test_paged_slot_step_compiles_for_tpu_near_the_dense_step(capsys):
    """The slot engine's whole paged step (decode.lower_slot_step: 2 Qwen3-8B layers + a 1-layer draft,
    8 rows x 4096, pages of 16, Pallas TPU attention and page writes) compiles for v6e, with bytes
    accessed within 1.05x the dense step's and no pool-sized temporaries (XLA's scatters of single
    positions copied whole pools between layouts: 1.59x; 0.925x now, docs/perf-log.md session 40),
    and its HBM traffic (scripts/tpu_bytes.py's per-op charging) within 1.02x what it must read
    (weights as stored + every row's K/V over its table; issue 56's measure: 1.005x now, the dense
    step's 1.003x, docs/perf-log.md session 41)."""
    import dataclasses
    import importlib.util
    import pathlib
    import sys

    import numpy as np

    from dflash_jax import KernelConfig
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.decode import lower_slot_step

    cfg = dataclasses.replace(TargetConfig.preset("qwen3-8b"), num_layers=2)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=16)
    kw = dict(slots=8, capacity=4096, steps=1, dtype="bfloat16", device=tpu_device("v6e:2x2"),
              kernels=KernelConfig(attention="pallas_tpu"))
    lowered = lower_slot_step(cfg, dcfg, page_size=16, **kw)
    dense = lower_slot_step(cfg, dcfg, **kw).compile()
    paged_ = lowered.compile()
    d, p = bytes_accessed(dense), bytes_accessed(paged_)
    mem = memory_report(paged_)
    spec = importlib.util.spec_from_file_location(
        "tpu_bytes", pathlib.Path(__file__).resolve().parent.parent / "scripts" / "tpu_bytes.py")
    tpu_bytes = sys.modules.get("tpu_bytes") or importlib.util.module_from_spec(spec)
    if "tpu_bytes" not in sys.modules:
        sys.modules["tpu_bytes"] = tpu_bytes
        spec.loader.exec_module(tpu_bytes)
    text = paged_.as_text()
    hbm_d, hbm_p = tpu_bytes.breakdown(dense.as_text())["hbm_total"], tpu_bytes.breakdown(text)["hbm_total"]
    args = lowered.args_info[0]
    weights = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves((args[0], args[1])))
    per_pos = 2 * 2 * (cfg.num_layers * cfg.num_kv_heads * cfg.head_dim + dcfg.num_layers * dcfg.num_kv_heads * dcfg.head_dim)
    must = weights + 8 * 4096 * per_pos
    with capsys.disabled():
        print(f"\n[v6e slot step] compiler: dense {d / 1e9:.2f} GB, paged {p / 1e9:.2f} GB ({p / d:.3f}x); HBM: must read "
              f"{must / 1e9:.3f} GB, dense {hbm_d / must:.4f}x, paged {hbm_p / must:.4f}x; paged {mem}", end="")
    assert "dflash_block_attention_paged_tpu" in text and "dflash_kv_write_pages_tpu" in text
    assert p <= 1.05 * d
    assert hbm_p <= 1.02 * must and hbm_p <= 1.01 * hbm_d, (hbm_p, hbm_d, must)
    assert mem["temp_size_in_bytes"] < 0.5e9


@pytest.mark.parametrize("page", [16, 64])     # 64-key tiles: a gather over 4 pages / one page each
def test_gpu_paged_kernel_lowers_for_cuda(page):
    from jax import export
    S = jax.ShapeDtypeStruct
    P = AOT_C // page
    N = AOT_B * P + 1
    exp = export.export(
        jax.jit(lambda q, k, v, t, e: gpu.block_attention_paged(q, k, v, t, e)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(S((AOT_B, AOT_T, AOT_HQ, AOT_D), jnp.bfloat16), S((N, AOT_HKV, page, AOT_D), jnp.bfloat16),
      S((N, AOT_HKV, page, AOT_D), jnp.bfloat16), S((AOT_B, P), jnp.int32), S((AOT_B, AOT_T), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    from pallas_kernels.attention import gpu_cache_write        # the page write, the pools aliased
    kv = S((N, AOT_HKV, page, AOT_D), jnp.bfloat16)
    exp = export.export(
        jax.jit(gpu_cache_write.write_kv_pages, donate_argnums=(0, 1)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(kv, kv, S((AOT_B, AOT_T, AOT_HKV, AOT_D), jnp.bfloat16), S((AOT_B, AOT_T, AOT_HKV, AOT_D), jnp.bfloat16),
      S((AOT_B,), jnp.int32), S((AOT_B, P), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module() and "dflash_write_kv_pages_gpu" in exp.mlir_module()
