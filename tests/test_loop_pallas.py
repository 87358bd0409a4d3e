"""The whole speculative loop on the Pallas attention path: on CPU the TPU kernel runs in interpret
mode and must give the XLA path's tokens; for TPU v5e / v6e the loop with the real Pallas kernels
compiles ahead of time (the program TPU users run); for CUDA the GPU kernel's loop exports."""

from __future__ import annotations

import numpy as np
import pytest

from tests import tpu_aot
from tests.doubles import truth_proposer
from tests.checkpoints import random_prompts, write_draft, write_target

from dflash_jax import DraftConfig, TargetConfig, decode, generate, load_draft, load_target


@pytest.fixture(scope="module")
def d64_pair(tmp_path_factory):
    """head_dim 64: a shape the TPU kernel tiles (head_dim 16 would fall back to XLA)."""
    root = tmp_path_factory.mktemp("d64")
    tp = write_target(str(root / "t"), hidden_size=128, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=64, seed=9)
    dp = write_draft(str(root / "d"), tp, num_layers=1, block_size=8, target_layer_ids=[0, 1], seed=10)
    target = load_target(tp, dtype="float32")
    return target, load_draft(dp, target=target, dtype="float32")


@pytest.mark.slow
def test_pallas_interpret_loop_gives_the_xla_tokens(d64_pair):
    target, draft = d64_pair
    prompts = random_prompts(2, 127, min_len=3, max_len=11, seed=2)
    n = 14
    plain = generate(target, None, prompts, max_new_tokens=n + 8, attention_impl="xla")
    truth = np.zeros((2, 1024), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
        truth[i, :len(p) + len(t)] = p + t
    proposer = truth_proposer(draft, truth, 2, 128)   # partial acceptance: 2 drafts + bonus per iteration
    xla = generate(target, proposer, prompts, max_new_tokens=n, attention_impl="xla", verify_width="block")
    pallas = generate(target, proposer, prompts, max_new_tokens=n, attention_impl="pallas", verify_width="block")
    assert pallas.tokens == xla.tokens == [t[:n] for t in plain.tokens]
    assert pallas.acceptance_lengths == xla.acceptance_lengths
    assert max(a for row in xla.acceptance_lengths for a in row) == 3


@pytest.mark.slow
@tpu_aot.requires_libtpu
@pytest.mark.parametrize("impl", ["pallas_tpu", "xla"])
@pytest.mark.parametrize("topology", tpu_aot.TOPOLOGIES)
def test_speculative_loop_compiles_for_tpu(topology, impl):
    """The TPU program users run (Mosaic kernels), and the XLA-attention fallback, for v5e and v6e."""
    cfg = TargetConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=128)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=16)
    compiled = decode.lower_generate(cfg, dcfg, batch=2, prompt_len=128, max_new_tokens=256, dtype="bfloat16",
                                     attention_impl=impl, device=tpu_aot.tpu_device(topology)).compile()
    print(f"\n{topology} speculative loop ({impl} attention) memory_analysis: {tpu_aot.memory_report(compiled)}")
    if impl == "pallas_tpu":
        assert "tpu_custom_call" in compiled.as_text()


def _export_gpu_loop(num_heads=4, block_size=8, prompt_len=32, **kw):
    """The small speculative loop on the Pallas GPU path, exported for CUDA from this CPU host."""
    cfg = TargetConfig(vocab_size=512, hidden_size=64 * num_heads, intermediate_size=256, num_layers=2,
                       num_heads=num_heads, num_kv_heads=2, head_dim=64)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=block_size)
    return decode.export_generate(cfg, dcfg, batch=1, prompt_len=prompt_len, max_new_tokens=64,
                                  dtype="bfloat16", platforms=("cuda",),
                                  **(kw or dict(attention_impl="pallas_gpu")))


def test_pallas_gpu_loop_exports_for_cuda():
    exported = _export_gpu_loop()
    assert exported.platforms == ("cuda",)
    mlir = exported.mlir_module()
    assert "dflash_block_attention_gpu" in mlir
    # the target layers' fused q/k norm + RoPE + cache writes in the loop (not in the prefill)
    assert "dflash_qk_norm_rope_write" in mlir and "dflash_add_rmsnorm" in mlir
    assert "mosaic_gpu" not in mlir


@pytest.mark.slow
def test_kernel_config_reaches_the_exported_cuda_program():
    """export_generate takes a KernelConfig: the fused layer kernels off leave the attention kernel
    alone in the loop; sampling_kernels off keeps top-k's search in XLA reductions."""
    from dflash_jax import KernelConfig
    mlir = _export_gpu_loop(kernels=KernelConfig(attention="pallas_gpu", fused_layer=False)).mlir_module()
    assert "dflash_block_attention_gpu" in mlir
    assert "dflash_qk_norm_rope_write" not in mlir and "dflash_add_rmsnorm" not in mlir
    on = _export_gpu_loop(kernels=KernelConfig(attention="pallas_gpu"), sampling_mode="topk").mlir_module()
    off = _export_gpu_loop(kernels=KernelConfig(attention="pallas_gpu", sampling_kernels=False),
                           sampling_mode="topk").mlir_module()
    assert "dflash_sampling_count" in on and "dflash_sampling_gather" in on
    assert "dflash_sampling_count" not in off and "dflash_qk_norm_rope_write" in off
