"""The TPU path's cache row-write kernel (pallas_kernels/attention/tpu_cache_write.py).

Oracle: dynamic_update_slice per batch row (dflash_jax.cache.write_rows, the XLA path). The kernel
runs in the TPU interpreter on CPU (slow), and compiles ahead of time for v6e / v5e inside the
speculative loop, where the caches must stay in HBM: no whole-cache eviction from VMEM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tpu_aot  # first: sets libtpu's env before JAX initialises its backends

from dflash_jax import KernelConfig
from dflash_jax.cache import write_kv_rows, write_rows
from pallas_kernels import Unsupported
from pallas_kernels.attention import tpu_cache_write


def _inputs(B, Hkv, C, D, T, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    kc = jax.random.normal(ks[0], (B, Hkv, C, D), jnp.float32).astype(dtype)    # [B, Hkv, C, D]
    vc = jax.random.normal(ks[1], (B, Hkv, C, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[2], (B, T, Hkv, D), jnp.float32).astype(dtype)     # [B, T, Hkv, D]
    v = jax.random.normal(ks[3], (B, T, Hkv, D), jnp.float32).astype(dtype)
    return kc, vc, k, v


def _starts(B, C, T, seed):
    """Random starts with the edge cases first: 0, the last legal row C - T, just past a tile."""
    rng = np.random.default_rng(seed)
    edge = [0, C - T, min(C - T, 9), max(0, C - T - 1)]
    return jnp.asarray((edge + list(rng.integers(0, C - T + 1, B)))[:B], jnp.int32)   # [B]


def test_window_covers_any_start():
    for T in (1, 7, 8, 9, 16, 17):
        W = tpu_cache_write.window_rows(T)
        assert W % tpu_cache_write.ROW_TILE == 0
        assert all(s % 8 + T <= W for s in range(8))


@pytest.mark.slow
def test_untileable_shapes_raise_unsupported_and_the_dispatch_falls_back():
    kc, vc, k, v = _inputs(2, 1, 12, 64, 8, jnp.float32)        # C=12: not whole row tiles
    start = jnp.array([0, 4], jnp.int32)
    with pytest.raises(Unsupported):
        tpu_cache_write.write_kv_rows(kc, vc, k, v, start)
    got = write_kv_rows(kc, vc, k, v, start, KernelConfig(attention="pallas_interpret"))
    np.testing.assert_array_equal(got[0], write_rows(kc, k, start))
    np.testing.assert_array_equal(got[1], write_rows(vc, v, start))


def test_bad_shapes_raise_one_line_errors():
    kc, vc, k, v = _inputs(2, 1, 64, 64, 8, jnp.float32)
    with pytest.raises(ValueError, match="start must be"):
        tpu_cache_write.write_kv_rows(kc, vc, k, v, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="new rows"):
        tpu_cache_write.write_kv_rows(kc, vc, k[:, :, :, :32], v, jnp.zeros((2,), jnp.int32))


def test_xla_and_gpu_paths_keep_dynamic_update_slice():
    """Only the TPU attention paths call the kernel: the others' programs have no pallas_call."""
    kc, vc, k, v = _inputs(2, 1, 64, 64, 8, jnp.float32)
    start = jnp.array([3, 50], jnp.int32)
    for kernels in (None, KernelConfig(attention="xla").resolve("cpu"),
                    KernelConfig(attention="pallas_gpu").resolve("gpu")):
        text = str(jax.make_jaxpr(lambda *a: write_kv_rows(*a, kernels))(kc, vc, k, v, start))
        assert "pallas_call" not in text
    text = str(jax.make_jaxpr(lambda *a: write_kv_rows(*a, KernelConfig(attention="pallas_tpu")))(
        kc, vc, k, v, start))
    assert "dflash_kv_write_tpu" in text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B,Hkv,C,D,T", [(5, 2, 64, 128, 16), (3, 1, 32, 64, 1), (4, 2, 128, 128, 5),
                                         (2, 2, 24, 64, 17)])
def test_kernel_equals_dynamic_update_slice(B, Hkv, C, D, T, dtype):
    from jax.experimental.pallas import tpu as pltpu
    kc, vc, k, v = _inputs(B, Hkv, C, D, T, dtype, seed=T)
    start = _starts(B, C, T, seed=B)
    gk, gv = tpu_cache_write.write_kv_rows(kc, vc, k, v, start, interpret=pltpu.InterpretParams())
    assert gk.dtype == kc.dtype and gk.shape == kc.shape
    np.testing.assert_array_equal(np.asarray(gk, np.float32), np.asarray(write_rows(kc, k, start), np.float32))
    np.testing.assert_array_equal(np.asarray(gv, np.float32), np.asarray(write_rows(vc, v, start), np.float32))


@pytest.mark.slow
def test_kernel_in_batch_chunks(monkeypatch):
    """A batch whose windows exceed the VMEM budget runs as a grid of row chunks."""
    from jax.experimental.pallas import tpu as pltpu
    B, Hkv, C, D, T = 6, 1, 64, 64, 16
    monkeypatch.setattr(tpu_cache_write, "_CHUNK_BUDGET", 2 * 4 * Hkv * 24 * D * 4)   # 2 rows a chunk
    assert tpu_cache_write._chunk_rows(B, 4 * Hkv * 24 * D * 4) == 2
    kc, vc, k, v = _inputs(B, Hkv, C, D, T, jnp.float32, seed=3)
    start = _starts(B, C, T, seed=4)
    gk, gv = tpu_cache_write.write_kv_rows(kc, vc, k, v, start, interpret=pltpu.InterpretParams())
    np.testing.assert_array_equal(gk, write_rows(kc, k, start))
    np.testing.assert_array_equal(gv, write_rows(vc, v, start))


@pytest.mark.slow
@tpu_aot.requires_libtpu
@pytest.mark.parametrize("topology", tpu_aot.TOPOLOGIES)
def test_batched_iteration_keeps_the_caches_in_hbm(topology):
    """The B=32 DFlash iteration compiled for TPU: every cache write is the kernel, no cache is
    evicted whole from VMEM, and the cache write traffic is the kernel's windows."""
    import importlib.util
    import sys
    from pathlib import Path

    from dflash_jax import DraftConfig, TargetConfig, decode
    path = Path(__file__).resolve().parent.parent / "scripts" / "tpu_bytes.py"
    tpu_bytes = sys.modules.get("tpu_bytes")
    if tpu_bytes is None:
        spec = importlib.util.spec_from_file_location("tpu_bytes", path)
        tpu_bytes = importlib.util.module_from_spec(spec)
        sys.modules["tpu_bytes"] = tpu_bytes
        spec.loader.exec_module(tpu_bytes)
    tc = TargetConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=128)
    dc = DraftConfig.for_target(tc, num_layers=1, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=(0, 1))
    comp = decode.lower_iteration(tc, dc, batch=32, prompt_len=128, capacity=1024, attention_impl="pallas_tpu",
                                  device=tpu_aot.tpu_device(topology)).compile()
    text = comp.as_text()
    # target: one write per layer; draft: one per layer too (the context rows and the block's rows
    # in one call)
    assert text.count("custom_call_target=\"tpu_custom_call\"") >= 1
    s = tpu_bytes.breakdown(comp)
    writes = [r for r in s["records"] if r["what"].startswith("tpu_custom_call in place")]
    assert len(writes) == tc.num_layers + dc.num_layers, [r["what"] for r in writes]
    evicted = [r for r in s["records"] if r["what"].startswith("async copy of s.") and "VMEM->HBM" in r["what"]]
    assert not evicted, [r["what"] for r in evicted]
    ideal = tpu_bytes.ideal_bytes(tc, dc, draft=True, batch=32, capacity=1024)
    W = tpu_cache_write.window_rows(16)
    assert s["kinds_hbm"]["kv_write"] <= W / 16 * ideal["kv_write"] * 1.01, (s["kinds_hbm"], ideal)


# An iteration's cache write as the TPU compiler leaves it: the row-write kernel updating the
# donated cache in place (its cost estimate: the windows), the attention kernel reading its result.
_WRITE_HLO = """HloModule m, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }

ENTRY %main (c: bf16[2,1,64,128], n: bf16[2,1,24,128], s: s32[2]) -> bf16[2,1,64,128] {
  %c = bf16[2,1,64,128]{3,2,1,0} parameter(0), metadata={op_name="s.target_cache.k[0]"}
  %n = bf16[2,1,24,128]{3,2,1,0} parameter(1), metadata={op_name="rows"}
  %s = s32[2]{0} parameter(2), metadata={op_name="start"}
  %w = (bf16[2,1,64,128]{3,2,1,0}) custom-call(%s, %n, %c), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{0}: (2, {})}, backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"0","transcendentals":"0","bytes_accessed":"61448","remote_bytes_transferred":"0"}}}
  %g = bf16[2,1,64,128]{3,2,1,0} get-tuple-element(%w), index=0
  ROOT %a = bf16[2,1,64,128]{3,2,1,0} custom-call(%g), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/target_layer0/dflash_block_attention_tpu"}
}
"""


def test_tpu_bytes_charges_the_in_place_kernel_its_windows():
    import importlib.util
    import sys
    from pathlib import Path
    tpu_bytes = sys.modules.get("tpu_bytes")
    if tpu_bytes is None:
        spec = importlib.util.spec_from_file_location(
            "tpu_bytes", Path(__file__).resolve().parent.parent / "scripts" / "tpu_bytes.py")
        tpu_bytes = importlib.util.module_from_spec(spec)
        sys.modules["tpu_bytes"] = tpu_bytes
        spec.loader.exec_module(tpu_bytes)
    s = tpu_bytes.breakdown(_WRITE_HLO)
    w = next(r for r in s["records"] if r["what"].startswith("tpu_custom_call in place"))
    # the estimate (61448) = start (8) + rows (12288) + the cache windows read and written
    assert w["model"] == w["hbm"] == 61448
    window = 61448 - 8 - 12288
    parts = {k: b for k, b, _ in w["parts"]}
    assert parts["kv_read"] == parts["kv_write"] == window // 2
    # the attention kernel's operand is traced through the write kernel to the cache
    a = next(r for r in s["records"] if r["name"] == "a")
    assert "s.target_cache.k[0]" in a["what"]
    assert w["group"] == "target_layer0"
