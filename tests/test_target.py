"""The Qwen3 target against HF transformers (the independent oracle), the loader, plain decoding and
its compile-once contract. Issue: foundation."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.checkpoints import hf_greedy, load_torch_pair, random_prompts, write_target

from dflash_jax import ConfigError, TargetConfig, generate, init_target, load_target
from dflash_jax import decode

VARIANTS = {
    "untied-gqa2-d16": dict(num_heads=4, num_kv_heads=2, head_dim=16),
    "tied-gqa1-d16": dict(num_heads=4, num_kv_heads=4, head_dim=16, tie_word_embeddings=True),
    "untied-gqa4-d32": dict(num_heads=8, num_kv_heads=2, head_dim=32),
    "tied-gqa4-d32": dict(num_heads=4, num_kv_heads=1, head_dim=32, tie_word_embeddings=True),
}


# The default run checks one variant against transformers (tied embeddings, GQA 4, head_dim 32 so q
# width differs from hidden); `.ci/run` checks all four.
DEFAULT_VARIANT = "tied-gqa4-d32"


@pytest.fixture(scope="module", params=[v if v == DEFAULT_VARIANT else pytest.param(v, marks=pytest.mark.slow)
                                        for v in VARIANTS])
def variant(request, tmp_path_factory):
    path = write_target(str(tmp_path_factory.mktemp(request.param)), seed=len(request.param),
                        **VARIANTS[request.param])
    hf, _ = load_torch_pair(path)
    return path, hf, load_target(path, dtype="float32")


def _hf(hf, ids, **kw):
    ids = torch.as_tensor(np.asarray(ids))
    with torch.no_grad():
        return hf(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, **kw)


def test_prefill_logits_and_taps_match_transformers(variant):
    path, hf, target = variant
    ids = np.random.RandomState(0).randint(0, 128, (2, 13))
    out = _hf(hf, ids)
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    taps = (0, 2, 3)
    h, feats, cache = target(jnp.asarray(ids), pos, target.new_cache(2, 32), pos + 1, taps=taps)
    np.testing.assert_allclose(np.asarray(target.logits(h)), out.logits.numpy(), atol=1e-4, rtol=0)
    H = target.config.hidden_size
    for n, layer in enumerate(taps):  # hidden states after layer `id` are HF hidden_states[id + 1]
        np.testing.assert_allclose(np.asarray(feats[..., n * H:(n + 1) * H]),
                                   out.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=0)
    assert cache.lens.tolist() == [13, 13]


def test_decode_through_cache_matches_transformers(variant):
    """Prefill 7 tokens, then feed 6 more one at a time through the cache; every step's logits match
    the full-sequence HF forward."""
    path, hf, target = variant
    ids = np.random.RandomState(1).randint(0, 128, (1, 13))
    ref = _hf(hf, ids).logits.numpy()
    step = jax.jit(lambda tok, pos, c: target(tok, pos, c, pos + 1))
    pos = jnp.arange(7, dtype=jnp.int32)[None]
    h, _, cache = step(jnp.asarray(ids[:, :7]), pos, target.new_cache(1, 16))
    np.testing.assert_allclose(np.asarray(target.logits(h)), ref[:, :7], atol=1e-4, rtol=0)
    for t in range(7, 13):
        h, _, cache = step(jnp.asarray(ids[:, t:t + 1]), jnp.full((1, 1), t, jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(target.logits(h))[:, 0], ref[:, t], atol=1e-4, rtol=0)




@pytest.mark.parametrize("with_stop", [pytest.param(False, marks=pytest.mark.slow), True])
def test_greedy_generate_matches_transformers(variant, with_stop):
    path, hf, target = variant
    prompts = random_prompts(3, 128, min_len=3, max_len=20, seed=7)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    stop = None
    if with_stop:  # a token that the first row emits mid-way: that row stops there, inclusive
        cut = next(i for i, t in enumerate(expected[0]) if i >= 2 and t not in expected[0][:i])
        stop = [expected[0][cut]]
        expected = [hf_greedy(hf, p, 24, eos=stop[0]) for p in prompts]
        assert len(expected[0]) == cut + 1
    res = generate(target, None, prompts, max_new_tokens=24, stop_token_ids=stop)
    assert res.tokens == expected
    assert all(set(a) == {1} for a in res.acceptance_lengths)
    assert [len(a) for a in res.acceptance_lengths] == [len(t) - 1 for t in res.tokens]


@pytest.mark.slow
def test_compiles_once_across_lengths_and_run_time_values(tmp_path):
    target = init_target(TargetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                                      num_heads=2, num_kv_heads=1, head_dim=16), seed=0, dtype="float32")
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    first = generate(target, None, [[1, 2, 3]], max_new_tokens=20)
    assert first.compile_time_s > 0
    before, n0 = decode.compile_count(), len(compiles)
    runs = [dict(prompts=[[5, 6, 7, 8, 9, 10, 11]], max_new_tokens=7),                 # same bucket (16)
            dict(prompts=[[1] * 16], max_new_tokens=30, stop_token_ids=[3, 4]),
            dict(prompts=[[2, 3]], max_new_tokens=11, temperature=0.7, top_p=0.9, top_k=5, seed=3),
            dict(prompts=[[2, 3]], max_new_tokens=11, temperature=1.3, top_p=0.5, top_k=9, seed=4)]
    for kw in runs:
        res = generate(target, None, **kw)
        assert len(res.tokens[0]) <= kw["max_new_tokens"]
    # the two sampled runs share one program (sampling mode "filtered" is the only new compile key)
    assert decode.compile_count() - before == 1
    assert len(compiles) - n0 == 1, compiles


@pytest.mark.slow
def test_max_new_tokens_counts_the_first_token_and_capacity_stops_rows():
    target = init_target(TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                      num_heads=2, num_kv_heads=2, head_dim=16), seed=1, dtype="float32")
    res = generate(target, None, [[1, 2], [3, 4, 5, 6]], max_new_tokens=1)
    assert [len(t) for t in res.tokens] == [1, 1] and res.acceptance_lengths == [[], []]
    res = generate(target, None, [[1, 2]], max_new_tokens=5000, capacity=64)
    assert 0 < len(res.tokens[0]) < 64


def test_bad_input_is_a_clear_error(tmp_path):
    target = init_target(TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                      num_heads=2, num_kv_heads=2, head_dim=16), seed=1, dtype="float32")
    cases = [
        (dict(prompts=[[]]), "empty"),
        (dict(prompts=[]), "non-empty"),
        (dict(prompts=[[1, 99]]), "outside"),
        (dict(prompts=[[1] * 100], capacity=64), "capacity"),
        (dict(prompts=[[1]], temperature=-1.0), "temperature"),
        (dict(prompts=[[1]], temperature=float("nan")), "temperature"),
        (dict(prompts=[[1]], top_p=0.0), "top_p"),
        (dict(prompts=[[1]], top_p=1.5), "top_p"),
        (dict(prompts=[[1]], top_k=-2), "top_k"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1]], stop_token_ids=[64]), "stop_token_ids"),
        (dict(prompts=[[1]], block_size=4), "draft"),
        (dict(prompts=[[1]], attention_impl="cuda-magic"), "attention_impl"),
    ]
    for kw, word in cases:
        prompts = kw.pop("prompts")
        with pytest.raises(ValueError, match=word):
            generate(target, None, prompts, **kw)


def test_loader_refuses_what_it_cannot_run(tmp_path):
    path = write_target(str(tmp_path / "t"), num_layers=1)
    cfg = json.load(open(os.path.join(path, "config.json")))
    # a model type no family serves (llama is a family now): the message names the field
    bad = tmp_path / "mamba"
    bad.mkdir()
    json.dump({**cfg, "model_type": "mamba"}, open(bad / "config.json", "w"))
    with pytest.raises(ConfigError, match="model_type"):
        load_target(str(bad))
    # pickle-only weights are never unpickled
    pk = tmp_path / "pickle"
    pk.mkdir()
    json.dump(cfg, open(pk / "config.json", "w"))
    torch.save({"w": torch.zeros(1)}, pk / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_target(str(pk))
    with pytest.raises(FileNotFoundError):
        load_target(str(tmp_path / "missing" / "dir"))
    with pytest.raises(ConfigError, match="rope"):
        TargetConfig.from_dict({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="preset"):
        TargetConfig.preset("qwen3-999b")
    with pytest.raises(ValueError, match="dtype"):
        load_target(path, dtype="int4")


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    path = write_target(str(tmp_path / "one"), num_layers=2)
    hf, _ = load_torch_pair(path)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB", safe_serialization=True)
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    a, b = load_target(path, dtype="float32"), load_target(str(tmp_path / "sharded"), dtype="float32")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_presets_have_the_real_shapes():
    p8 = TargetConfig.preset("qwen3-8b")
    assert (p8.num_layers, p8.hidden_size, p8.num_heads, p8.num_kv_heads, p8.head_dim, p8.intermediate_size,
            p8.vocab_size, p8.tie_word_embeddings) == (36, 4096, 32, 8, 128, 12288, 151936, False)
    abstract = jax.eval_shape(lambda: jax.tree.leaves(init_target("qwen3-8b", dtype="bfloat16")))
    assert 8.1e9 < sum(int(np.prod(x.shape)) for x in abstract) < 8.3e9


@pytest.mark.slow
@tpu_aot.requires_libtpu
@pytest.mark.parametrize("topology", tpu_aot.TOPOLOGIES)
def test_plain_loop_compiles_for_tpu(topology):
    cfg = TargetConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64)
    compiled = decode.lower_generate(cfg, None, batch=2, prompt_len=64, max_new_tokens=64, dtype="bfloat16",
                                     attention_impl="xla", device=tpu_aot.tpu_device(topology)).compile()
    mem = tpu_aot.memory_report(compiled)
    print(f"\n{topology} plain loop memory_analysis: {mem}")
    assert mem["argument_size_in_bytes"] > 0


@pytest.mark.slow
def test_run_time_argument_types_are_clear_errors_and_stop_ids_never_recompile():
    target = init_target(TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                      num_heads=2, num_kv_heads=2, head_dim=16), seed=2, dtype="float32")
    for kw, err, word in [(dict(capacity=256.0), ValueError, "capacity"), (dict(capacity=0), ValueError, "capacity"),
                          (dict(seed=None), ValueError, "seed"), (dict(seed=1.5), ValueError, "seed"),
                          (dict(stop_token_ids=[1.7]), ValueError, "stop_token_ids"),
                          (dict(stop_token_ids=list(range(17))), ValueError, "stop_token_ids")]:
        with pytest.raises(err, match=word):
            generate(target, None, [[1, 2]], **kw)
    with pytest.raises(TypeError, match="target"):
        generate("Qwen/Qwen3-8B", None, [[1, 2]])
    # numpy scalars and arrays are fine; a lone 0 is a stop id, not "no stop ids"
    a = generate(target, None, [[1, 2]], max_new_tokens=np.int64(6), temperature=np.float32(0.0),
                 stop_token_ids=np.array([5, 6]))
    b = generate(target, None, [[1, 2]], max_new_tokens=6, stop_token_ids=0)
    before = decode.compile_count()
    c = generate(target, None, [[1, 2]], max_new_tokens=6, stop_token_ids=list(range(3, 14)))  # 11 ids
    assert decode.compile_count() == before and len(a.tokens[0]) <= 6 and len(c.tokens[0]) <= 6
    for res in (a, b, c):
        assert res.finish_reasons[0] in ("stop", "length")
    assert generate(target, None, [[1, 2]], max_new_tokens=500, capacity=32).finish_reasons == ["capacity"]
