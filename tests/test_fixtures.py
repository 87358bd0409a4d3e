"""The fixtures are what they claim: HF / z-lab safetensors checkpoints with the expected tensor names,
configs that round-trip, non-unit norms, and a trained pair whose acceptance (measured with the
reference dflash_generate) covers one-token, partial and full blocks. `pytest -s` prints the numbers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from tests import checkpoints as ck

ALLOWED_TARGET_FILES = {"config.json", "generation_config.json", "model.safetensors"}


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _check_norms_not_unit(tensors: dict[str, torch.Tensor]):
    norms = {k: v for k, v in tensors.items() if k.endswith("norm.weight")}
    assert norms
    for k, v in norms.items():
        assert (v - 1).abs().mean() > 0.05, k


def test_target_variant_files_and_config(target_variant):
    path, kw = target_variant["path"], target_variant["kwargs"]
    assert set(os.listdir(path)) <= ALLOWED_TARGET_FILES and "model.safetensors" in os.listdir(path)
    cfg = _config(path)
    tied = kw.get("tie_word_embeddings", False)
    want = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=kw.get("num_heads", 4), num_key_value_heads=kw.get("num_kv_heads", 2),
                head_dim=kw.get("head_dim", 16), tie_word_embeddings=tied, max_position_embeddings=4096)
    assert {k: cfg[k] for k in want} == want
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    t = _tensors(path)
    L, Hq, Hkv, D = 4, want["num_attention_heads"], want["num_key_value_heads"], want["head_dim"]
    assert ("lm_head.weight" in t) == (not tied)
    assert t["model.embed_tokens.weight"].shape == (128, 64)
    assert t["model.layers.3.self_attn.q_proj.weight"].shape == (Hq * D, 64)
    assert t["model.layers.3.self_attn.k_proj.weight"].shape == (Hkv * D, 64)
    assert t["model.layers.3.self_attn.o_proj.weight"].shape == (64, Hq * D)
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (D,)
    assert len(t) == 2 + (not tied) + 11 * L
    _check_norms_not_unit(t)
    # transformers reads back exactly these tensors (nothing missing, nothing re-initialised)
    hf, _ = ck.load_torch_pair(path)
    sd = hf.state_dict()
    for k, v in t.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    # logits are not degenerate (a random 64-wide model with the HF init is ~uniform)
    with torch.no_grad():
        logits = hf(torch.arange(20)[None] % 127).logits
    assert logits.std(-1).mean() > 0.3


def test_tiny_target_default_shapes(tiny_target):
    cfg = _config(tiny_target)
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]) == (128, 64, 4, 4, 2, 16, False)


def test_tiny_pair_draft_is_zlab_format(tiny_pair):
    from dflash.model import DFlashDraftModel

    path = tiny_pair["draft_path"]
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    t = _tensors(path)
    assert set(t) == ck.draft_tensor_names(2)
    assert t["fc.weight"].shape == (64, 2 * 64)
    _check_norms_not_unit(t)
    cfg = _config(path)
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {"mask_token_id": 127}  # no target_layer_ids: the default formula applies
    draft = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    assert draft.target_layer_ids == tiny_pair["target_layer_ids"] == [1, 3]
    assert draft.mask_token_id == tiny_pair["mask_token_id"] and draft.block_size == 8
    sd = draft.state_dict()
    for k, v in t.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)


def test_write_draft_explicit_fields(tmp_path, tiny_target):
    path = ck.write_draft(str(tmp_path / "d"), tiny_target, num_layers=3, block_size=16, mask_token_id=5,
                          target_layer_ids=[0, 2, 3])
    cfg = _config(path)
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 2, 3]}
    assert cfg["block_size"] == 16 and cfg["num_hidden_layers"] == 3 and cfg["num_target_layers"] == 4
    assert set(_tensors(path)) == ck.draft_tensor_names(3)
    assert _tensors(path)["fc.weight"].shape == (64, 3 * 64)


@pytest.mark.slow
def test_random_pair_accepts_almost_nothing(tiny_pair):
    target, draft = ck.load_torch_pair(tiny_pair["target_path"], tiny_pair["draft_path"])
    prompts = ck.random_prompts(2, 127, seed=5)
    lengths = [n for p in prompts for n in ck.reference_generate(draft, target, p, 24).acceptance_lengths]
    print(f"\nrandom pair: tau={sum(lengths) / len(lengths):.2f} histogram={ck.acceptance_histogram(lengths)}")
    assert sum(lengths) / len(lengths) < 1.5


@pytest.mark.slow
def test_packed_training_blocks_match_inference_blocks(tiny_pair):
    """One packed training forward (K blocks after the full context) gives, for every block, the draft
    output of dflash_generate's own call: context [0, anchor), positions [0, anchor + S)."""
    _, draft = ck.load_torch_pair(tiny_pair["target_path"], tiny_pair["draft_path"])
    S, T = 8, 40
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(127, (2, T), generator=g)
    feats = torch.randn(2, T, 2 * 64, generator=g)
    anchors = torch.tensor([[3, 4, 30], [17, 0, 32]])
    block, labels, pos, visible = ck.pack_blocks(seqs, anchors, S, 127)
    noise = torch.randn(2, 3 * S, 64, generator=g)
    with torch.no_grad():
        packed = draft(position_ids=pos, attention_mask=visible[:, None], noise_embedding=noise, target_hidden=feats)
        for r in range(2):
            for k in range(3):
                a = int(anchors[r, k])
                assert block[r, k * S] == seqs[r, a] and (block[r, k * S + 1:(k + 1) * S] == 127).all()
                assert labels[r, k].tolist() == seqs[r, a + 1:a + S].tolist()
                one = draft(position_ids=torch.arange(a + S)[None], noise_embedding=noise[r:r + 1, k * S:(k + 1) * S],
                            target_hidden=feats[r:r + 1, :a])
                torch.testing.assert_close(packed[r:r + 1, k * S:(k + 1) * S], one, atol=1e-5, rtol=1e-5)


def _report(name, pair):
    print(f"\n{name}: vocab {pair['vocab_size']}, S={pair['block_size']}, mask {pair['mask_token_id']}, "
          f"taps {pair['target_layer_ids']}, built in {pair['total_seconds']:.1f}s "
          f"(target {pair['target_training']['seconds']:.1f}s, draft data {pair['data_seconds']:.1f}s, "
          f"draft train {pair['train_seconds']:.1f}s), final loss {pair['final_loss']:.3f}")
    for temp, tau in pair["tau"].items():
        print(f"  T={temp}: tau={tau:.2f} histogram={pair['histogram'][temp]}")


def _check_trained_files(pair):
    cfg = _config(pair["draft_path"])
    assert cfg["dflash_config"] == {"mask_token_id": pair["vocab_size"] - 1, "target_layer_ids": [1, 2]}
    assert set(_tensors(pair["draft_path"])) == ck.draft_tensor_names(2)
    assert set(os.listdir(pair["target_path"])) <= ALLOWED_TARGET_FILES
    assert _config(pair["target_path"])["architectures"] == ["Qwen3ForCausalLM"]
    _check_norms_not_unit(_tensors(pair["target_path"]))
    assert pair["target_training"]["greedy_follows_grammar"] > 0.95


@pytest.mark.slow
def test_trained_pair_accepts_full_partial_and_single(trained_pair):
    _report("trained pair", trained_pair)
    _check_trained_files(trained_pair)
    S, hist = trained_pair["block_size"], trained_pair["histogram"][0.0]
    assert trained_pair["tau"][0.0] >= 2.5
    assert hist.get(S, 0) > 0 and sum(c for n, c in hist.items() if 1 < n < S) > 0 and hist.get(1, 0) > 0
    assert 1 < trained_pair["tau"][1.0] < S
    # the saved files reproduce the measurement (greedy: deterministic), on the first eval prompts
    target, draft = ck.load_torch_pair(trained_pair["target_path"], trained_pair["draft_path"])
    n = trained_pair["eval_max_new_tokens"]
    lengths = [x for p in trained_pair["eval_prompts"][:3]
               for x in ck.reference_generate(draft, target, p, n, block_size=S).acceptance_lengths]
    assert sum(lengths) / len(lengths) >= 2.5 and S in lengths


def test_trained_small_vocab_pair_accepts_partially_at_t1(trained_small_vocab_pair):
    pair = trained_small_vocab_pair
    _report("trained small-vocab pair", pair)
    _check_trained_files(pair)
    S, hist1 = pair["block_size"], pair["histogram"][1.0]
    assert pair["vocab_size"] == 32 and pair["tau"][0.0] >= 2.5
    assert pair["tau"][1.0] >= 1.8
    assert sum(c for n, c in hist1.items() if 1 < n < S) > 0 and hist1.get(1, 0) > 0
