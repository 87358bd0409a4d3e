"""The Llama-3.x family against transformers' LlamaForCausalLM and the reference `dflash_generate`
with a Llama target (float32, tiny random configs whose llama3 RoPE scaling changes the angles at
the positions used), its config reading (bias flags, tied or untied head, eos lists, the z-lab
Llama draft's config), presets, and a 2x2 mesh = one device. Issue 34."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

CHILD = os.environ.get("DFLASH_LLAMA_MESH_CHILD") == "1"

# original_max_position_embeddings 16 with head_dim 16, theta 1e4: wavelength 2π lies in the
# smoothed band (between 16/4 and 16/1), every longer one is divided by `factor`.
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def write_llama(path: str, *, tie: bool, bias: bool, seed: int = 0, num_layers: int = 3) -> str:
    """A random LlamaForCausalLM saved with save_pretrained: noisy norms and random biases (HF
    initialises biases to zero, which would hide a dropped one). No dflash_jax import here."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, initializer_range=0.1, rope_parameters=dict(ROPE),
                      attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tie, hidden_act="silu",
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_llama_draft(path: str, target_path: str, *, block_size: int = 8, taps=(0, 2), seed: int = 5) -> str:
    """A reference DFlashDraftModel (a Qwen3-style stack with q/k norms) for a Llama target, its RoPE
    the target's llama3 one, in z-lab format (tensor names as tests/checkpoints.py writes them)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config
    from tests.checkpoints import _noisy_norms, _save_draft, _seeded
    t = json.load(open(os.path.join(target_path, "config.json")))
    cfg = Qwen3Config(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                      num_hidden_layers=2, num_attention_heads=t["num_attention_heads"],
                      num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                      rms_norm_eps=t["rms_norm_eps"], rope_parameters=dict(ROPE),
                      max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=False,
                      initializer_range=0.1, hidden_act="silu", attention_bias=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = t["num_hidden_layers"]
    cfg.block_size = 4          # the top-level field; dflash_config's wins (the reference's _draft_value)
    cfg.dflash_config = {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": list(taps), "block_size": block_size}
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg).eval()
    _noisy_norms(draft, _seeded(seed + 1))
    return _save_draft(draft, path)


def _hf(path):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


if not CHILD:
    import jax
    import jax.numpy as jnp

    from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
    from tests.checkpoints import hf_greedy, random_prompts, reference_generate
    from tests.doubles import truth_proposer
    from tests.pairs import assert_width_result, widths

    from dflash_jax import ConfigError, DraftConfig, TargetConfig, generate, init_draft, init_target, load_draft, load_target

    # the default run checks the tied head with biases; `.ci/run` the untied one without
    @pytest.mark.parametrize("tie,bias", [(True, True), pytest.param(False, False, marks=pytest.mark.slow)],
                             ids=["tied-bias", "untied-nobias"])
    def test_logits_taps_and_greedy_match_transformers(tmp_path, tie, bias):
        path = write_llama(str(tmp_path / "t"), tie=tie, bias=bias, seed=int(tie) + 2 * int(bias))
        hf, target = _hf(path), load_target(path, dtype="float32")
        assert target.config.model_type == "llama" and target.config.rope_scaling.factor == 4.0
        assert (target.lm_head is None) == tie and target.config.rms_norm_eps == 1e-5
        ids = np.random.RandomState(0).randint(0, 128, (2, 24))
        with torch.no_grad():
            out = hf(torch.as_tensor(ids), output_hidden_states=True)
        pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
        h, feats, _ = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1, taps=(0, 2))
        np.testing.assert_allclose(np.asarray(target.logits(h)), out.logits.numpy(), atol=1e-4, rtol=0)
        for n, layer in enumerate((0, 2)):
            np.testing.assert_allclose(np.asarray(feats[..., n * 64:(n + 1) * 64]),
                                       out.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=0)
        prompts = [ids[0, :9].tolist(), ids[1, :14].tolist()]
        res = generate(target, None, prompts, max_new_tokens=12)
        assert res.tokens == [hf_greedy(hf, p, 12) for p in prompts]

    def test_llama3_scaling_matters_at_these_positions(tmp_path):
        """The same weights read without rope scaling give other logits: the tests above see it."""
        path = write_llama(str(tmp_path / "t"), tie=False, bias=False, seed=7, num_layers=1)
        plain = tmp_path / "plain"
        shutil.copytree(path, plain)
        cfg = json.load(open(plain / "config.json"))
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE["rope_theta"]}
        json.dump(cfg, open(plain / "config.json", "w"))
        ids = jnp.asarray(np.random.RandomState(1).randint(0, 128, (1, 24)))
        pos = jnp.arange(24, dtype=jnp.int32)[None]
        a, b = (m(ids, pos, m.new_cache(1, 32), pos + 1)[0] for m in (load_target(path, dtype="float32"),
                                                                      load_target(str(plain), dtype="float32")))
        assert float(jnp.abs(a - b).max()) > 1e-2

    @pytest.fixture(scope="module")
    def llama_pair(tmp_path_factory):
        root = tmp_path_factory.mktemp("llama_pair")
        tp = write_llama(str(root / "target"), tie=False, bias=True, seed=11, num_layers=4)
        dp = write_llama_draft(str(root / "draft"), tp, block_size=8, taps=(0, 2))
        from dflash.model import DFlashDraftModel
        target = load_target(tp, dtype="float32")
        return dict(hf=_hf(tp), ref_draft=DFlashDraftModel.from_pretrained(dp, dtype=torch.float32).eval(),
                    target=target, draft=load_draft(dp, target=target, dtype="float32"))

    @pytest.mark.parametrize("verify_width", widths(3))
    def test_dflash_with_a_llama_target_is_the_reference(llama_pair, verify_width):
        """Tokens = dflash_generate's at every width (the block, "auto", W = 3); its acceptance
        lengths at the block, at most W + 1 otherwise."""
        draft = llama_pair["draft"]
        assert (draft.config.block_size, draft.config.target_layer_ids) == (8, (0, 2))
        assert draft.config.rope_scaling is not None and draft.layers[0].q_norm is not None
        prompts = random_prompts(3, 127, min_len=3, max_len=21, seed=4)
        res = generate(llama_pair["target"], draft, prompts, max_new_tokens=23, verify_width=verify_width)
        assert res.tokens == generate(llama_pair["target"], None, prompts, max_new_tokens=23).tokens
        if "ref" not in llama_pair:
            llama_pair["ref"] = [reference_generate(llama_pair["ref_draft"], llama_pair["hf"], p, 23, block_size=8)
                                 for p in prompts]
        ref = llama_pair["ref"]
        assert_width_result(res, [r.output_ids[0, len(p):].tolist() for r, p in zip(ref, prompts)],
                            [list(r.acceptance_lengths) for r in ref], verify_width, 8)

    @pytest.mark.slow
    def test_blocks_cut_mid_way_keep_transformers_greedy_tokens(llama_pair):
        """The random draft above has its blocks rejected early (acceptance 1 or 2): here the truth
        proposer (transformers' greedy continuation) cut after its 3rd draft, so every iteration
        accepts 4 tokens of the block of 8 and the loop commits mid-block: transformers' tokens."""
        prompts, n = random_prompts(2, 127, min_len=3, max_len=12, seed=5), 20
        expected = [hf_greedy(llama_pair["hf"], p, n) for p in prompts]
        truth = np.zeros((2, 64), np.int32)
        for i, (p, e) in enumerate(zip(prompts, expected)):
            truth[i, :len(p) + n] = p + e
        res = generate(llama_pair["target"], truth_proposer(llama_pair["draft"], truth, 3, 128), prompts,
                       max_new_tokens=n, verify_width="block")
        assert res.tokens == expected
        assert all(a == 4 for row in res.acceptance_lengths for a in row[:-1]), res.acceptance_lengths

    def test_unsupported_model_type_is_one_line_naming_the_supported(tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8}))
        with pytest.raises(ConfigError) as e:
            load_target(str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and "'gpt2'" in msg and "llama" in msg and "qwen3" in msg

    def test_presets_and_the_zlab_llama_draft_config():
        p = TargetConfig.preset("llama3.1-8b")
        assert (p.model_type, p.num_layers, p.hidden_size, p.intermediate_size, p.vocab_size, p.rms_norm_eps,
                p.rope_theta, p.tie_word_embeddings, p.rope_scaling.factor) == \
            ("llama", 32, 4096, 14336, 128256, 1e-5, 500000.0, False, 8.0)
        small = TargetConfig.preset("llama3.2-1b")
        assert small.tie_word_embeddings and small.head_dim == 64 and small.rope_scaling.factor == 32.0
        abstract = jax.eval_shape(lambda: init_target("llama3.1-8b", dtype="bfloat16"))
        assert abstract.layers[0].q_norm is None and abstract.lm_head.shape == (4096, 128256)
        # the fields z-lab's LLaMA3.1-8B-Instruct-DFlash-UltraChat config carries, as published code reads them
        d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
             "max_position_embeddings": 131072, "num_target_layers": 32, "block_size": 10,
             "layer_types": ["full_attention"] * 5,
             "dflash_config": {"mask_token_id": 128002, "target_layer_ids": [1, 8, 15, 22, 29]}}
        dc = DraftConfig.from_dict(d)
        assert (dc.block_size, dc.target_layer_ids, dc.mask_token_id, dc.rope_scaling.factor) == \
            (10, (1, 8, 15, 22, 29), 128002, 8.0)
        dc.check_fits(p)
        draft = jax.eval_shape(lambda: init_draft(dc, dtype="bfloat16"))
        assert draft.layers[0].q_norm is not None and len(draft.layers) == 5

    def _llama_style_tokenizer():
        """A word-level tokenizer that adds <|begin_of_text|> on encode, as Llama-3's does, with a chat
        template that writes it too (Llama-3's starts with {{ bos_token }})."""
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast
        words = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "user",
                 "assistant", "hi", "[UNK]"]
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        t.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                         special_tokens=[("<|begin_of_text|>", 0)])
        tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                      unk_token="[UNK]")
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
        tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} "
                             "<|end_header_id|> {{ m['content'] }} <|eot_id|> {% endfor %}"
                             "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}")
        return tok

    def test_chat_template_gives_one_bos_and_eos_lists_are_kept():
        from dflash_jax.data import apply_chat_template
        from dflash_jax.text import eos_token_ids
        tok = _llama_style_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert tok.encode(text)[:2] == [0, 0]          # what a plain encode would give: a double BOS
        ids = apply_chat_template(tok, "hi")
        assert ids[0] == 0 and ids.count(0) == 1
        # Llama-3 Instruct's generation_config.eos_token_id is a list: every id stops, the tokenizer's too
        assert eos_token_ids(tok, [128001, 128008, 128009]) == [128001, 128008, 128009, 1]

    @pytest.mark.slow
    def test_llama_gpu_path_without_qk_norm_matches_xla():
        """The fused GPU prologue with norm=False (RoPE only, llama3 scaling) and biases, in the
        interpreter, against the XLA path: a verify block's and a decode step's hidden states and
        caches (the loop around the layers is the one test_fused_kernels checks)."""
        from dflash_jax import KernelConfig
        from dflash_jax.config import RopeScaling
        kernels = KernelConfig(attention="pallas_gpu_interpret", fused_layer=True)
        cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, model_type="llama",
                           rope_scaling=RopeScaling(4.0, 1.0, 4.0, 16), attention_bias=True, mlp_bias=True)
        target = init_target(cfg, seed=3, dtype="float32")
        keys = iter(jax.random.split(jax.random.key(9), 16))
        for layer in target.layers:
            for b in (layer.qkv_bias, layer.o_bias, layer.mlp.gate_up_bias, layer.mlp.down_bias):
                b[...] = 0.1 * jax.random.normal(next(keys), b[...].shape)
        B, C = 2, 64
        prompt = jax.random.randint(jax.random.key(0), (B, 16), 0, 128)
        pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
        _, _, cache = target(prompt, pos, target.new_cache(B, C), pos + 1)
        for T in (16, 1):
            toks = jax.random.randint(jax.random.key(T), (B, T), 0, 128)
            p = jnp.asarray([[16], [20]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)
            (h0, _, c0), (h1, _, c1) = [jax.jit(lambda t, q, c, k=k: target(t, q, c, q + 1, kernels=k))(toks, p, cache)
                                        for k in ("xla", kernels)]
            np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-4, rtol=1e-4)
            for a, b in zip(c1.k + c1.v, c0.k + c0.v):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

else:
    # A 2x2 mesh = one device: in the 4-device child of
    # tests/test_quantize.py::test_int8_and_fp8_on_a_2x2_mesh_equal_one_device (one process for every
    # 4-device case). Directly:
    #     DFLASH_LLAMA_MESH_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/test_llama.py
    def test_mesh_child(tmp_path):
        import jax
        from dflash_jax import generate, load_target
        from dflash_jax.config import DraftConfig
        from dflash_jax.weights import init_draft
        from tests.checkpoints import random_prompts
        assert len(jax.devices()) == 4
        path = write_llama(str(tmp_path / "t"), tie=True, bias=True, seed=13, num_layers=2)
        one = load_target(path, dtype="float32")
        draft = init_draft(DraftConfig.for_target(one.config, num_layers=1, block_size=4), seed=2, dtype="float32")
        prompts = random_prompts(2, 127, min_len=3, max_len=12, seed=1)
        want = generate(one, draft, prompts, max_new_tokens=10, verify_width="block")
        on_mesh = load_target(path, dtype="float32", mesh="2x2")
        assert on_mesh.layers[0].qkv_groups == 2
        from dflash_jax import sharding
        got = generate(on_mesh, sharding.shard_model(draft, sharding.as_mesh("2x2")), prompts, max_new_tokens=10, verify_width="block")
        assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
