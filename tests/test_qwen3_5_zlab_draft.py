"""A z-lab-format DFlash draft for a Qwen3.5 target (DFlashDraftModel, model_type qwen3, sliding
window layers through `layer_types` / `sliding_window`, taps through dflash_config) on a tiny
hybrid target: the config reconstructed as z-lab writes its Qwen3.5 drafts, the weights written by
the reference `dflash` package. Checked against the reference: the context features (HF
hidden_states[id + 1] of a GDN and a full-attention layer, the reference's
extract_context_feature) and the draft's block hidden states with a window (3) shorter than the
context; then DFlash greedy with it = transformers' greedy. Issue 38."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.checkpoints import hf_greedy
from tests.test_qwen3_5 import TINY, write_qwen3_5

from dflash_jax import generate, load_draft, load_target

transformers = pytest.importorskip("transformers")

WINDOW, S, TAPS = 3, 4, [0, 1]      # layer 0 is GDN, layer 1 full attention (interval 2)


def zlab_config() -> dict:
    """config.json of a z-lab Qwen3.5 DFlash draft, at the tiny target's shapes: a Qwen3 stack
    (architectures DFlashDraftModel), sliding layers with a window and a last full layer,
    dflash_config with the mask token and the taps, num_target_layers and block_size at top level."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": TINY["vocab_size"],
        "hidden_size": TINY["hidden_size"], "intermediate_size": TINY["intermediate_size"],
        "num_hidden_layers": 2, "num_attention_heads": TINY["num_attention_heads"],
        "num_key_value_heads": TINY["num_key_value_heads"], "head_dim": TINY["head_dim"], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": True,
        "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
        "max_window_layers": 2, "num_target_layers": TINY["num_hidden_layers"], "block_size": S,
        "dflash_config": {"mask_token_id": TINY["vocab_size"] - 1, "target_layer_ids": TAPS},
        "torch_dtype": "float32",
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dflash.model import DFlashDraftModel
    root = tmp_path_factory.mktemp("zlab")
    tp = write_qwen3_5(str(root / "target"), full_attention_interval=2)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tp, attn_implementation="eager").float().eval()
    cfg = transformers.Qwen3Config(**zlab_config())
    cfg.layer_types, cfg.sliding_window = zlab_config()["layer_types"], WINDOW     # kept as z-lab writes them
    cfg.dflash_config, cfg.block_size = zlab_config()["dflash_config"], S
    torch.manual_seed(5)
    ref = DFlashDraftModel(cfg).float().eval()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    dp = str(root / "draft")
    ref.save_pretrained(dp, safe_serialization=True)
    with open(os.path.join(dp, "config.json"), "w") as f:     # the reconstructed file, exactly
        json.dump(zlab_config(), f)
    ref = DFlashDraftModel.from_pretrained(dp, dtype=torch.float32).eval()
    target = load_target(tp, dtype="float32")
    return hf, ref, target, load_draft(dp, target=target, dtype="float32")


def test_config_reads_window_and_taps(setup):
    _, ref, _, draft = setup
    c = draft.config
    assert c.target_layer_ids == tuple(TAPS) and c.block_size == S
    assert [c.layer_window(i) for i in range(2)] == [WINDOW, None]
    assert ref.config.sliding_window == WINDOW and ref.config.layer_types == ["sliding_attention", "full_attention"]


def test_taps_and_windowed_block_match_the_reference(setup):
    from dflash.model import extract_context_feature
    hf, ref, target, draft = setup
    T = 10                                        # context longer than the window
    ids = np.random.RandomState(0).randint(0, 127, (1, T))
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_hidden_states=True)
    ctx = extract_context_feature(out.hidden_states, TAPS).numpy()
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    _, feats, _ = target(jnp.asarray(ids), pos, target.new_cache(1, 32), pos + 1, taps=tuple(TAPS), prefill=True)
    np.testing.assert_allclose(np.asarray(feats), ctx, atol=1e-4)
    block = np.array([[int(ids[0, -1])] + [draft.config.mask_token_id] * (S - 1)])
    with torch.no_grad():
        want = ref(target_hidden=torch.tensor(ctx), noise_embedding=hf.model.embed_tokens(torch.tensor(block)),
                   position_ids=torch.arange(T + S)[None]).numpy()
    cache = draft.write_context(jnp.asarray(ctx[:, :6]), jnp.arange(6, dtype=jnp.int32)[None], draft.new_cache(1, 32))
    pending = np.zeros((1, S, ctx.shape[-1]), np.float32)
    pending[:, :4] = ctx[:, 6:]
    got, _ = draft(target.embed_tokens(jnp.asarray(block)), jnp.arange(T, T + S, dtype=jnp.int32)[None],
                   jnp.asarray(pending), jnp.arange(6, 6 + S, dtype=jnp.int32)[None], cache,
                   jnp.array([T + S], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_dflash_greedy_with_the_zlab_draft_matches_transformers(setup):
    hf, _, target, draft = setup
    prompts = [[5, 9, 77, 3, 21, 8, 60], [11, 2, 4, 90]]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    assert generate(target, draft, prompts, max_new_tokens=16, verify_width="block").tokens == expected
