"""A hybrid (Qwen3.5) target on a ('data', 'model') mesh of virtual CPU devices: generate (plain
and DFlash, with rejected blocks) on a 2x2 mesh gives the one-device tokens, for the dense and the
MoE variant. Rows go on 'data' (HybridCache.specs), parameters are replicated but the experts
(qwen3_5.RULES). Issue 38.

The cases need XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX starts, so they run in
a child pytest: the 4-device child of tests/test_quantize.py::test_int8_and_fp8_on_a_2x2_mesh_equal_one_device
(one process for every 4-device case); run them directly with
    DFLASH_HYBRID_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/test_qwen3_5_mesh.py
"""

from __future__ import annotations

import os

import pytest

CHILD = os.environ.get("DFLASH_HYBRID_CHILD") == "1"
child = pytest.mark.skipif(not CHILD, reason="runs in the 4-device child (tests/test_quantize.py's mesh parent)")


# The MoE variant only: its layers are the dense variant's plus the experts on 'model' (the dense
# case added ~2 minutes of CI for no path the MoE case does not run; tests/test_qwen3_5.py keeps the
# dense model's one-device oracles)
@child
@pytest.mark.parametrize("moe", [True])
def test_2x2_mesh_generates_the_one_device_tokens(tmp_path, moe):
    from dflash_jax import DraftConfig, generate, init_draft, load_target
    from dflash_jax import sharding as sh
    from tests.checkpoints import random_prompts
    if moe:
        from tests.test_qwen3_5_moe import write_qwen3_5_moe as write
    else:
        from tests.test_qwen3_5 import write_qwen3_5 as write
    path = write(str(tmp_path)) if moe else write(str(tmp_path), full_attention_interval=2)
    one = load_target(path, dtype="float32")
    on_mesh = load_target(path, dtype="float32", mesh="data=2,model=2")
    draft = init_draft(DraftConfig.for_target(one.config, num_layers=1, block_size=4, target_layer_ids=(1, 2)),
                       seed=1, dtype="float32")
    mesh = sh.mesh_of(on_mesh)
    draft_on_mesh = sh.shard_model(init_draft(draft.config, seed=1, dtype="float32"), mesh)
    prompts = random_prompts(3, 128, min_len=3, max_len=10, seed=11)
    for d1, dm in ((None, None), (draft, draft_on_mesh)):
        want = generate(one, d1, prompts, max_new_tokens=12, capacity=64, verify_width="block")
        got = generate(on_mesh, dm, prompts, max_new_tokens=12, capacity=64, verify_width="block")
        assert got.tokens == want.tokens
        assert got.acceptance_lengths == want.acceptance_lengths
