"""Block-attention kernels against the reference oracle, on CPU.

- Pallas TPU kernel in the TPU interpreter (pltpu.InterpretParams: DMAs, NaN-filled scratch).
- Pallas GPU (Triton) kernel in the generic interpreter (interpret=True).
- Both kernels through the real compilers: Mosaic via ahead-of-time TPU compilation (libtpu, no TPU)
  and the Triton lowering via jax.export(platforms=["cuda"]).
Shapes are small for the interpreters; the compile tests use the Qwen3-8B shapes.
"""

from __future__ import annotations

from tests import tpu_aot  # noqa: F401  (first: sets libtpu's env before JAX initialises its backends)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from dflash_jax.attention import attend
from dflash_jax.kernel_config import ATTENTION_BACKENDS, KernelConfig, resolved
from pallas_kernels.attention import gpu, merge, reference, tpu
from tests.tpu_aot import abstract, bytes_accessed, compile_for_tpu, memory_report, requires_libtpu, tpu_device

F32_ATOL = 1e-5
BF16_RTOL = 2e-2
SLOW = pytest.mark.slow


def _default_only(params, keep):
    """The parametrization with every case but the ids in `keep` marked slow: the interpreters take
    seconds a case, so a plain `pytest` runs a representative few and `.ci/run` all of them."""
    out = []
    for p in params:
        if not hasattr(p, "values"):
            p = pytest.param(*p, id="-".join(map(str, p)))
        out.append(p if p.id in keep else pytest.param(*p.values, id=p.id, marks=[*p.marks, SLOW]))
    return out


def _inputs(B, T, Hq, Hkv, C, D, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)      # [B, T, Hq, D]
    k = jax.random.normal(kk, (B, Hkv, C, D), jnp.float32).astype(dtype)     # [B, Hkv, C, D]
    v = jax.random.normal(kv, (B, Hkv, C, D), jnp.float32).astype(dtype)     # [B, Hkv, C, D]
    return q, k, v


def _k_end(pattern, B, T, C, seed=0):
    """[B, T] int32 for the named pattern; row lengths are ragged across the batch."""
    rng = np.random.default_rng(seed)
    t = np.arange(T)[None, :]
    if pattern == "verify":             # causal inside the block: len + t + 1
        lens = rng.integers(0, C - T + 1, size=(B, 1))
        lens[0] = C - T                 # one row ends exactly at capacity
        e = lens + t + 1
    elif pattern == "draft":            # non-causal: len + T for every row
        lens = rng.integers(0, C - T + 1, size=(B, 1))
        e = np.broadcast_to(lens + T, (B, T))
    elif pattern == "prefill":          # causal from position 0
        e = np.broadcast_to(t + 1, (B, T))
    elif pattern == "ragged":           # anything: 0 (output 0), 1, capacity, mid-tile values
        e = rng.integers(0, C + 1, size=(B, T))
        e.flat[0] = 1
        e.flat[-1] = C
        if e.size > 2:
            e.flat[1] = 0
    elif pattern == "decode":
        e = rng.integers(1, C + 1, size=(B, T))
        e[0] = 1
        e[-1] = C
    else:
        raise ValueError(pattern)
    return jnp.asarray(e, jnp.int32)


def _oracle(q, k, v, k_end):
    """The reference on float32 copies of the inputs: exact attention of the (bf16-valued) inputs.

    Also sidesteps an XLA:CPU gap: reference.py's bf16 x bf16 -> f32 "->btkgd" einsum has no CPU
    DotThunk when B > 1 (jax 0.10.2).
    """
    f32 = lambda x: x.astype(jnp.float32)
    return reference.block_attention(f32(q), f32(k), f32(v), k_end)


def _check(out, ref, dtype):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref).max()
    if dtype == jnp.float32:
        assert err <= F32_ATOL, f"max abs err {err:.3g} > {F32_ATOL}"
    else:
        rel = err / max(np.abs(ref).max(), 1e-6)
        assert rel <= BF16_RTOL, f"max rel err {rel:.3g} > {BF16_RTOL}"


# (B, T, Hq, Hkv, C, D, dtype, pattern, tuning): GQA 1/4/8, D 64/128/256, f32/bf16, decode T=1,
# the verify/draft patterns, a prefill-sized T, tiles that end mid-way (block_k < the lengths).
CASES = [
    pytest.param(2, 1, 8, 2, 256, 128, jnp.float32, "decode", {}, id="decode-g4-f32"),
    pytest.param(3, 1, 8, 1, 384, 64, jnp.bfloat16, "decode", {}, id="decode-g8-d64-bf16"),
    pytest.param(2, 16, 8, 2, 512, 128, jnp.float32, "verify", dict(block_k=128), id="verify-g4-f32"),
    pytest.param(2, 16, 8, 2, 512, 128, jnp.bfloat16, "verify", {}, id="verify-g4-bf16"),
    pytest.param(2, 16, 8, 1, 256, 64, jnp.float32, "draft", dict(block_k=128), id="draft-g8-d64-f32"),
    pytest.param(2, 16, 4, 1, 256, 256, jnp.bfloat16, "draft", {}, id="draft-g4-d256-bf16"),
    pytest.param(2, 8, 2, 2, 256, 256, jnp.float32, "ragged", dict(block_k=128), id="ragged-g1-d256-f32"),
    pytest.param(2, 8, 4, 1, 128, 128, jnp.bfloat16, "ragged", {}, id="ragged-g4-bf16"),
    pytest.param(1, 8, 4, 4, 96, 64, jnp.float32, "ragged", {}, id="ragged-g1-cap96-f32"),
    pytest.param(1, 128, 4, 1, 256, 128, jnp.float32, "prefill", dict(block_q=128, block_k=128),
                 id="prefill-g4-f32"),
    pytest.param(1, 128, 2, 2, 128, 64, jnp.bfloat16, "prefill", dict(block_q=64), id="prefill-g1-bf16"),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,C,D,dtype,pattern,tuning",
                         _default_only(CASES, {"verify-g4-f32"}))
def test_tpu_kernel_interpret(B, T, Hq, Hkv, C, D, dtype, pattern, tuning):
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, dtype)
    k_end = _k_end(pattern, B, T, C)
    out = tpu.block_attention(q, k, v, k_end, interpret=pltpu.InterpretParams(), **tuning)
    _check(out, _oracle(q, k, v, k_end), dtype)


def _gpu_tuning(tuning, T, Hq, Hkv):
    # GPU row tiles are block_t positions x G heads (>= 16 rows); keep the case's intent (several
    # row/KV tiles).
    t = {}
    if "block_k" in tuning:
        t["block_k"] = 64
    if "block_q" in tuning:
        t["block_t"] = max(1, 32 // (Hq // Hkv))
    return t


@pytest.mark.parametrize("B,T,Hq,Hkv,C,D,dtype,pattern,tuning",
                         _default_only(CASES, {"verify-g4-bf16", "prefill-g4-f32"}))
@pytest.mark.slow
def test_gpu_kernel_interpret(B, T, Hq, Hkv, C, D, dtype, pattern, tuning):
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, dtype)
    k_end = _k_end(pattern, B, T, C)
    out = gpu.block_attention(q, k, v, k_end, interpret=True, **_gpu_tuning(tuning, T, Hq, Hkv))
    _check(out, _oracle(q, k, v, k_end), dtype)


@pytest.mark.parametrize("kv_splits,merge_kernel,pattern", _default_only(
    [(s, m, p) for p in ("verify", "ragged") for s, m in [(2, False), (5, False), (3, False), (5, True), (1, False)]],
    {"5-True-ragged"}))
@pytest.mark.slow
def test_gpu_kernel_kv_splits(kv_splits, merge_kernel, pattern):
    """Split-KV with the log-sum-exp merge: rows with 0 keys, splits with no keys, mid-tile ends;
    the merge as XLA's fusion and as a Pallas kernel on the same rows."""
    B, T, Hq, Hkv, C, D = 2, 16, 8, 2, 512, 64
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, jnp.float32, seed=1)
    k_end = _k_end(pattern, B, T, C, seed=1)
    out = gpu.block_attention(q, k, v, k_end, interpret=True, kv_splits=kv_splits, block_k=32,
                              min_chunk=32, merge_kernel=merge_kernel)
    _check(out, _oracle(q, k, v, k_end), jnp.float32)


@pytest.mark.parametrize("S,N,D,dtype", _default_only([
    pytest.param(4, 512, 128, jnp.bfloat16, id="4-512-bf16"), pytest.param(3, 24, 64, jnp.float32, id="3-24-f32"),
    pytest.param(32, 40, 256, jnp.bfloat16, id="32-40-bf16")], {"3-24-f32"}))
@pytest.mark.slow
def test_gpu_merge_kernel_matches_the_xla_merge(S, N, D, dtype):
    """merge_splits (Pallas) against merge (XLA ops) on partials with empty splits (lse -inf, o NaN:
    never written by the kernel) and fully empty rows, N not a multiple of its 16-row tiles."""
    kq, kl = jax.random.split(jax.random.key(S * N))
    o = jax.random.normal(kq, (S, N, D), jnp.float32)
    lse = 3 * jax.random.normal(kl, (S, N), jnp.float32)
    lse = lse.at[1 % S].set(-jnp.inf)                     # an empty split ...
    o = o.at[1 % S].set(jnp.nan)                          # ... whose partial was never written
    lse = lse.at[:, 5].set(-jnp.inf)                      # a row with no keys at all
    o = o.astype(dtype)
    got = merge.merge_splits(o, lse, dtype, interpret=True)
    want = merge.merge(o, lse).astype(dtype)
    assert got.shape == (N, D) and got.dtype == dtype
    assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2, atol=1e-6)
    assert not np.asarray(got[5].astype(jnp.float32)).any()


def test_gpu_default_config_splits_small_batch():
    cfg = gpu.default_config(T=16, G=4, C=32768, D=128, B=1, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] > 1                     # 8 programs cannot fill 132 SMs
    cfg = gpu.default_config(T=16, G=4, C=8192, D=128, B=32, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 1                    # 256 programs already do
    cfg = gpu.default_config(T=16, G=4, C=32768, D=128, B=32, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 2                    # ... but at 32k two splits balance the waves
    cfg = gpu.default_config(T=16, G=4, C=32768, D=128, B=128, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 1
    # short caches, few programs: blocks split 8 ways of >= 64 keys while 8 x programs fit in one
    # wave of two per SM (batch <= 4 here), else 4 of >= 128; plain decode (T = 1) always 4
    cfg = gpu.default_config(T=16, G=4, C=1024, D=128, B=1, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 8 and cfg["min_chunk"] == 64
    cfg = gpu.default_config(T=1, G=4, C=1024, D=128, B=1, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 4 and cfg["min_chunk"] == 128
    assert gpu.default_config(T=16, G=4, C=1024, D=128, B=4, Hkv=8, n_sms=132)["kv_splits"] == 8    # 256 programs
    cfg = gpu.default_config(T=16, G=4, C=1024, D=128, B=8, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 4 and cfg["min_chunk"] == 128                           # 8 x 64 > 264
    assert gpu.default_config(T=16, G=4, C=96, D=128, B=1, Hkv=8, n_sms=132)["kv_splits"] == 1    # < 2 chunks
    cfg = gpu.default_config(T=512, G=4, C=1024, D=128, B=1, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 1                    # prefill: 256 programs already
    cfg = gpu.default_config(T=16, G=4, C=1024, D=128, B=32, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 1                    # many programs: no merge kernels
    # Batch 8: 64 programs; splits fill one wave of 2 programs per SM (4 -> 256 <= 264), never
    # spilling a small second wave (5 -> 320).
    cfg = gpu.default_config(T=16, G=4, C=32768, D=128, B=8, Hkv=8, n_sms=132)
    assert cfg["kv_splits"] == 4
    # From 16k keys on, batch 1 fills the wave exactly: 33 splits x 8 heads = 264 = 2 x 132 programs
    assert gpu.default_config(T=16, G=4, C=32768, D=128, B=1, Hkv=8, n_sms=132)["kv_splits"] == 33


def test_gpu_default_config_merge_kernel():
    """Long caches merge their splits in the Pallas merge kernel, with tiles small enough for >= 512
    programs at batch 1; short caches and unsplit calls keep XLA's merge (or none)."""
    cfg = gpu.default_config(T=16, G=4, C=32768, D=128, B=1, Hkv=8, n_sms=132)
    assert cfg["merge_kernel"] and (cfg["merge_rows"], cfg["merge_cols"]) == (4, 32)
    cfg = gpu.default_config(T=16, G=4, C=8192, D=128, B=8, Hkv=8, n_sms=132)
    assert cfg["merge_kernel"] and (cfg["merge_rows"], cfg["merge_cols"]) == (16, 64)
    assert not gpu.default_config(T=16, G=4, C=1024, D=128, B=1, Hkv=8, n_sms=132)["merge_kernel"]   # 8 short splits
    assert not gpu.default_config(T=16, G=4, C=8192, D=128, B=32, Hkv=8, n_sms=132)["merge_kernel"]  # no splits


@pytest.mark.parametrize("kv_splits,merge_kernel,G", _default_only(
    [(s, m, g) for g in (1, 4, 8) for s, m in [(1, False), (3, False), (3, True)]], {"3-True-4"}))
@pytest.mark.slow
def test_gpu_kernel_decode_rows(kv_splits, merge_kernel, G):
    """Plain decode (T == 1): the G rows of each kv head are a masked 16-row tile of the flat
    [B*Hq, D] view, the last program's tile reaching past the array's end."""
    B, Hkv, C, D = 3, 2, 256, 64
    q, k, v = _inputs(B, 1, Hkv * G, Hkv, C, D, jnp.float32, seed=2)
    k_end = jnp.asarray([[1], [0], [C]], jnp.int32)
    out = gpu.block_attention(q, k, v, k_end, interpret=True, kv_splits=kv_splits, block_k=32,
                              min_chunk=32, merge_kernel=merge_kernel)
    _check(out, _oracle(q, k, v, k_end), jnp.float32)


@pytest.mark.slow
def test_xla_path_chunks_queries():
    B, T, Hq, Hkv, C, D = 1, 100, 4, 2, 128, 64
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, jnp.float32)
    k_end = _k_end("prefill", B, T, C)
    ref = _oracle(q, k, v, k_end)
    _check(pallas_kernels.xla_block_attention(q, k, v, k_end, q_tile=32), ref, jnp.float32)
    # A 32k x 32k prefill must not build T x C scores: the traced program stays small.
    big_q = jax.ShapeDtypeStruct((1, 32768, 32, 128), jnp.bfloat16)
    big_kv = jax.ShapeDtypeStruct((1, 8, 32768, 128), jnp.bfloat16)
    big_e = jax.ShapeDtypeStruct((1, 32768), jnp.int32)
    jaxpr = jax.make_jaxpr(pallas_kernels.xla_block_attention)(big_q, big_kv, big_kv, big_e)
    largest = max(int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns for v in eqn.outvars
                  if hasattr(v.aval, "shape"))
    assert largest <= 1 << 27, largest


def test_xla_prefill_scores_only_the_prompt_rows():
    """attend_prefill on the XLA path reads cache rows [0, T) only: NaN past them never leaks, the
    result equals the oracle, and no [.., T, C] score tensor is built (a 256-row prompt over a
    1,024-row cache scored all 1,024 keys: half of a CPU prefill, perf-log session 32)."""
    from dflash_jax.attention import attend_prefill
    B, T, Hq, Hkv, C, D = 2, 96, 4, 2, 1024, 16
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, jnp.float32)
    k_end = _k_end("prefill", B, T, C)
    ref = _oracle(q, k[:, :, :T], v[:, :, :T], k_end)
    kn, vn = k.at[:, :, T:].set(jnp.nan), v.at[:, :, T:].set(jnp.nan)
    cfg = resolved("xla")
    fn = jax.jit(lambda q, k, v, e: attend_prefill(q, None, None, k, v, e, cfg))
    _check(fn(q, kn, vn, k_end), ref, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q, k, v, e: attend_prefill(q, None, None, k, v, e, cfg))(q, kn, vn, k_end)
    shapes = [tuple(x.aval.shape) for eqn in jaxpr.eqns for x in eqn.outvars if hasattr(x.aval, "shape")]
    assert not any(len(s) >= 2 and s[-1] == C and s[-2] == T for s in shapes), shapes


@pytest.mark.parametrize("impl", ["xla", "pallas", "auto", "pallas_tpu", "pallas_gpu"])
def test_attend_dispatch(impl):
    q, k, v = _inputs(2, 16, 8, 2, 256, 128, jnp.float32)
    k_end = _k_end("verify", 2, 16, 256)
    ref = _oracle(q, k, v, k_end)
    if impl in ("pallas_tpu", "pallas_gpu"):
        # Forced kernels are for AOT/export from a CPU host; on CPU they must refuse to run
        # (Pallas: "Only interpret mode is supported on CPU backend") rather than silently differ.
        with pytest.raises(Exception):
            jax.block_until_ready(attend(q, k, v, k_end, resolved(impl)))
        return
    out = jax.jit(attend, static_argnums=4)(q, k, v, k_end, resolved(impl))
    _check(out, ref, jnp.float32)


def test_kernel_config_resolves_on_cpu():
    assert set(ATTENTION_BACKENDS) == {"auto", "xla", "pallas", "pallas_tpu", "pallas_gpu"}
    attention = lambda name: KernelConfig(attention=name).resolve().attention
    assert attention("auto") == "xla"
    assert attention("pallas") == "pallas_interpret"
    assert attention("pallas_tpu") == "pallas_tpu"
    once = KernelConfig(attention="pallas").resolve()
    assert once.resolve() == once and hash(once.resolve()) == hash(once)            # idempotent
    # the GPU-only settings are off (one compile key) on the other paths
    assert KernelConfig("xla", fused_layer=True) .resolve() == KernelConfig("xla", fused_layer=False).resolve()
    # a GPU path from a host without a GPU takes its SM count from the tuning table
    on_gpu = KernelConfig(attention="pallas_gpu").resolve()
    assert on_gpu.fused and on_gpu.search_kernels and on_gpu.n_sms == 132
    assert KernelConfig(attention="pallas_gpu", n_sms=78).resolve().n_sms == 78
    with pytest.raises(ValueError, match="attention"):
        KernelConfig(attention="flash")
    with pytest.raises(ValueError, match="attention_tuning"):
        KernelConfig(attention_tuning=(("warps", 8),))


def test_while_graphs_are_a_cuda_compile_option_xla_accepts():
    """while_graphs resolves on for a GPU backend only (part of the compile key), and its compile
    option (XLA's default command-buffer types + WHILE, CONDITIONAL) is one XLA parses: a while
    loop compiled with it here runs (the option is a no-op off CUDA)."""
    assert KernelConfig().resolve("cpu").while_graphs is False
    assert KernelConfig(attention="pallas_tpu").resolve("tpu").while_graphs is False
    on = KernelConfig().resolve("gpu")
    assert on.while_graphs is True and KernelConfig(while_graphs=False).resolve("gpu").while_graphs is False
    assert on != KernelConfig(while_graphs=False).resolve("gpu")                       # two programs
    assert KernelConfig().resolve("cpu").compiler_options() == {}
    types = on.compiler_options()["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUBLAS", "WHILE", "CONDITIONAL"} <= set(types) and len(types) == len(set(types))
    loop = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (0, x)))
    out = loop.lower(jnp.ones(3)).compile(compiler_options=on.compiler_options())(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(out[1]), np.full(3, 32.0))
    with pytest.raises(ValueError, match="while_graphs"):
        KernelConfig(while_graphs="yes")


@pytest.mark.slow
def test_unsupported_shapes_fall_back():
    # head_dim 96 tiles on neither kernel; capacity 1100 is not a multiple of 128 and too big
    # for a single block: both go to the XLA path and still match the oracle.
    for (C, D) in [(128, 96), (1100, 64)]:
        q, k, v = _inputs(1, 4, 4, 2, C, D, jnp.float32)
        k_end = _k_end("ragged", 1, 4, C)
        ref = _oracle(q, k, v, k_end)
        for impl in ("tpu", "gpu"):
            out = pallas_kernels.block_attention(q, k, v, k_end, impl=impl, interpret=True)
            _check(out, ref, jnp.float32)
        with pytest.raises(tpu.Unsupported):
            tpu.block_attention(q, k, v, k_end, interpret=True)


@pytest.mark.slow
def test_bad_shapes_raise():
    q, k, v = _inputs(1, 4, 6, 4, 128, 64, jnp.float32)       # 6 q heads over 4 kv heads
    with pytest.raises(ValueError, match="multiple of Hkv"):
        pallas_kernels.block_attention(q, k, v, jnp.ones((1, 4), jnp.int32), impl="xla")
    q, k, v = _inputs(1, 4, 8, 4, 128, 64, jnp.float32)
    with pytest.raises(ValueError, match="k_end"):
        pallas_kernels.block_attention(q, k, v, jnp.ones((1, 5), jnp.int32), impl="tpu")
    with pytest.raises(ValueError, match="differ"):
        pallas_kernels.block_attention(q, k, v[:, :, :64], jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        pallas_kernels.block_attention(q, k, v, jnp.ones((1, 4), jnp.int32), impl="cuda")


# ---- the real compilers ---------------------------------------------------------------------

# Qwen3-8B attention: 32 q heads, 8 kv heads, head_dim 128, block S = 16.
QWEN3_8B = dict(Hq=32, Hkv=8, D=128)
AOT_SHAPES = [
    # (name, B, T, C, dtype, D)
    ("decode", 8, 1, 8192, jnp.bfloat16, 128),
    ("verify", 4, 16, 32768, jnp.bfloat16, 128),
    ("draft", 1, 16, 8192, jnp.bfloat16, 128),
    ("prefill", 1, 4096, 8192, jnp.bfloat16, 128),
    ("verify-f32", 2, 16, 4096, jnp.float32, 128),
    ("draft-d64", 2, 16, 4096, jnp.bfloat16, 64),
    ("verify-d256-f32", 2, 16, 2048, jnp.float32, 256),
]


@SLOW
@requires_libtpu
@pytest.mark.parametrize("topology", tpu_aot.TOPOLOGIES)
def test_tpu_kernel_compiles_for_tpu(topology, capsys):
    dev = tpu_device(topology)
    Hq, Hkv = QWEN3_8B["Hq"], QWEN3_8B["Hkv"]
    reports = []
    for name, B, T, C, dtype, D in AOT_SHAPES:
        args = (abstract((B, T, Hq, D), dtype, dev), abstract((B, Hkv, C, D), dtype, dev),
                abstract((B, Hkv, C, D), dtype, dev), abstract((B, T), jnp.int32, dev))
        compiled = compile_for_tpu(lambda q, k, v, e: tpu.block_attention(q, k, v, e), *args)
        assert "tpu_custom_call" in compiled.as_text()          # the Mosaic kernel, not a fallback
        mem = memory_report(compiled)
        kv_bytes = 2 * B * Hkv * C * D * jnp.dtype(dtype).itemsize
        # The kernel needs no HBM temporaries of cache size (no T x C scores, no K/V copies).
        assert mem["temp_size_in_bytes"] < kv_bytes // 4 + (1 << 20), (name, mem)
        reports.append((name, mem, bytes_accessed(compiled)))
    with capsys.disabled():
        for name, mem, ba in reports:
            print(f"\n[{topology}] {name}: {mem} bytes_accessed={ba}", end="")


@SLOW
@requires_libtpu
def test_attend_pallas_tpu_compiles_for_tpu():
    """The dispatch the models call, forced to the TPU kernel from this CPU host."""
    dev = tpu_device("v5e:2x2")
    args = (abstract((2, 16, 32, 128), jnp.bfloat16, dev), abstract((2, 8, 4096, 128), jnp.bfloat16, dev),
            abstract((2, 8, 4096, 128), jnp.bfloat16, dev), abstract((2, 16), jnp.int32, dev))
    compiled = compile_for_tpu(lambda q, k, v, e: attend(q, k, v, e, resolved("pallas_tpu")), *args)
    assert "tpu_custom_call" in compiled.as_text()


def _export_cuda(f, *shapes):
    from jax import export
    return export.export(
        jax.jit(f), platforms=["cuda"],
        # Triton custom calls carry no serialisation-compatibility guarantee; we only lower here.
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*shapes)


@pytest.mark.parametrize("name,B,T,C,dtype,D", _default_only([pytest.param(*c, id=c[0]) for c in AOT_SHAPES],
                                                          {"verify", "prefill"}))
def test_gpu_kernel_lowers_for_cuda(name, B, T, C, dtype, D):
    Hq, Hkv = QWEN3_8B["Hq"], QWEN3_8B["Hkv"]
    S = jax.ShapeDtypeStruct
    exp = _export_cuda(lambda q, k, v, e: attend(q, k, v, e, resolved("pallas_gpu")),
                       S((B, T, Hq, D), dtype), S((B, Hkv, C, D), dtype), S((B, Hkv, C, D), dtype),
                       S((B, T), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("T", _default_only([pytest.param(1, id="1"), pytest.param(16, id="16")], {"16"}))
def test_gpu_merge_kernel_lowers_for_cuda(T):
    """B=1 over a 32k cache (32 splits): the attention and its merge as two Triton kernels."""
    Hq, Hkv, D = QWEN3_8B["Hq"], QWEN3_8B["Hkv"], 128
    S = jax.ShapeDtypeStruct
    exp = _export_cuda(lambda q, k, v, e: gpu.block_attention(q, k, v, e, merge_kernel=True),
                       S((1, T, Hq, D), jnp.bfloat16), S((1, Hkv, 32768, D), jnp.bfloat16),
                       S((1, Hkv, 32768, D), jnp.bfloat16), S((1, T), jnp.int32))
    mlir = exp.mlir_module()
    assert "dflash_attention_merge" in mlir and "dflash_block_attention_gpu" in mlir


@pytest.mark.slow
def test_xla_path_bf16_batched():
    """The XLA path runs bf16 with B > 1 on CPU (see pallas_kernels._xla_dense) and matches."""
    q, k, v = _inputs(2, 16, 8, 2, 256, 64, jnp.bfloat16)
    k_end = _k_end("verify", 2, 16, 256)
    _check(jax.jit(attend, static_argnums=4)(q, k, v, k_end, resolved("xla")), _oracle(q, k, v, k_end),
           jnp.bfloat16)


# (B, T, Hq, Hkv, C, D, dtype, pattern, kv_chunk): the XLA path's KV-chunk loop for short query
# blocks. Capacities that are no multiple of the chunk (the tail chunk slides back and masks the
# overlap), GQA 1/4, f32/bf16, decode / verify / draft / ragged (k_end 0, 1, C) lengths.
XLA_CHUNK_CASES = [
    pytest.param(3, 1, 8, 2, 300, 32, jnp.float32, "decode", 128, id="decode-g4-tail-f32"),
    pytest.param(3, 16, 8, 2, 300, 32, jnp.float32, "verify", 128, id="verify-g4-tail-f32"),
    pytest.param(2, 16, 4, 4, 520, 64, jnp.float32, "draft", 256, id="draft-g1-tail-f32"),
    pytest.param(3, 8, 8, 2, 333, 32, jnp.float32, "ragged", 64, id="ragged-g4-tail-f32"),
    pytest.param(2, 16, 8, 2, 384, 64, jnp.bfloat16, "verify", 128, id="verify-g4-bf16"),
    pytest.param(3, 8, 4, 1, 300, 32, jnp.bfloat16, "ragged", 128, id="ragged-g4-tail-bf16"),
    pytest.param(2, 64, 4, 2, 200, 16, jnp.float32, "ragged", 64, id="ragged-T64-f32"),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,C,D,dtype,pattern,kv_chunk",
                         _default_only(XLA_CHUNK_CASES, {"verify-g4-tail-f32"}))
def test_xla_kv_chunks_match_the_reference(B, T, Hq, Hkv, C, D, dtype, pattern, kv_chunk):
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, dtype)
    k_end = _k_end(pattern, B, T, C)
    if pattern == "ragged":            # a whole row with no key (zeros), rows near 0 and at C
        k_end = k_end.at[-1].set(0).at[0, 1:3].set(jnp.asarray([2, C - 1], jnp.int32))
    out = jax.jit(pallas_kernels.xla_block_attention, static_argnames="kv_chunk")(
        q, k, v, k_end, kv_chunk=kv_chunk)
    _check(out, _oracle(q, k, v, k_end), dtype)
    if pattern == "ragged":
        assert not np.any(np.asarray(out[-1].astype(jnp.float32)))
    if dtype == jnp.float32:           # the dense path (kv_chunk=0) agrees to float32 rounding too
        dense = pallas_kernels.xla_block_attention(q, k, v, k_end, kv_chunk=0)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-6, rtol=0)


@pytest.mark.slow
def test_xla_kv_chunk_trip_count_follows_the_longest_row():
    """One compiled program; each call visits ceil(max(k_end) / chunk) chunks: keys past every row's
    end are never read (NaN there must not leak), all-zero k_end gives zeros without a chunk."""
    B, T, Hq, Hkv, C, D, K = 2, 16, 4, 2, 1024, 16, 128
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, jnp.float32)
    traces = []

    def attend_chunked(q, k, v, k_end):
        traces.append(k_end)
        return pallas_kernels.xla_block_attention(q, k, v, k_end, kv_chunk=K)

    fn = jax.jit(attend_chunked)
    for longest in (1, K - 1, K, K + 1, 700, C):
        k_end = jnp.asarray(np.minimum(np.arange(T)[None] + longest - T + 1, longest).clip(0)
                            .repeat(B, 0), jnp.int32).at[1].set(min(longest, 5))
        past = (-(-longest // K)) * K        # first key no chunk of this call reads
        k_nan = k.at[:, :, past:].set(jnp.nan)
        v_nan = v.at[:, :, past:].set(jnp.nan)
        out = fn(q, k_nan, v_nan, k_end)
        _check(out, _oracle(q, k, v, k_end), jnp.float32)
    zero = fn(q, k * jnp.nan, v * jnp.nan, jnp.zeros((B, T), jnp.int32))
    assert len(traces) == 1
    assert not np.any(np.asarray(zero))


def test_xla_kv_chunks_only_for_short_query_blocks():
    """The loop is for T <= 64 with C > chunk; prefill-length queries keep the query-tiled path (no
    while loop: it must stay reverse-differentiable) and kv_chunk=0 is the dense path."""
    def whiles(T, C, **kw):
        q = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, 2, C, 16), jnp.float32)
        e = jax.ShapeDtypeStruct((1, T), jnp.int32)
        text = str(jax.make_jaxpr(lambda *a: pallas_kernels.xla_block_attention(*a, **kw))(q, kv, kv, e))
        return text.count("while[")
    assert whiles(16, 4096) == 1 and whiles(1, 4096) == 1 and whiles(64, 4096) == 1
    assert whiles(16, 4096, kv_chunk=0) == 0
    assert whiles(16, 2048, kv_chunk=2048) == 0                           # one chunk: dense
    assert whiles(16, 128) == 0 and whiles(16, 256) == 1                  # the default chunk: 128 there
    assert whiles(65, 4096) == 0 and whiles(512, 4096) == 0
    with pytest.raises(ValueError, match="kv_chunk"):
        pallas_kernels.xla_block_attention(*_inputs(1, 1, 2, 1, 8, 16, jnp.float32),
                                           jnp.ones((1, 1), jnp.int32), kv_chunk=-1)


@pytest.mark.slow
def test_xla_kv_chunks_differentiate_like_the_reference():
    """Gradients through the chunk loop (a while loop, not transposable) come from the dense oracle."""
    B, T, Hq, Hkv, C, D = 2, 8, 4, 2, 300, 16
    q, k, v = _inputs(B, T, Hq, Hkv, C, D, jnp.float32)
    k_end = _k_end("ragged", B, T, C)
    w = jax.random.normal(jax.random.key(7), (B, T, Hq, D))
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
    got = jax.jit(jax.grad(loss(lambda *a: pallas_kernels.xla_block_attention(*a, k_end, kv_chunk=64)),
                           argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda *a: reference.block_attention(*a, k_end)), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=0)
