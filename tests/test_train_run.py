"""Training runs end to end on CPU: export round trip against the reference package, resume, bad
input, and (slow) learning on a grammar-trained tiny target."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_jax import ConfigError, DraftConfig, TargetConfig, generate, init_draft, init_target, load_draft, load_target
from dflash_jax.train import packed
from dflash_jax.train.checkpoint import ContractError
from dflash_jax.train.data import DataError, TokenData
from dflash_jax.train.export import export_draft
from dflash_jax.train.run import RunConfig, train
from dflash_jax.train.step import StepConfig
from tests import checkpoints as ck


def _perturbed(draft, seed=0, scale=0.05):
    """The draft with every parameter moved (so an export of unchanged loaded weights proves nothing less)."""
    gd, st = nnx.split(draft)
    leaves, tdef = jax.tree.flatten(st)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(gd, jax.tree.unflatten(tdef, leaves))


@pytest.mark.slow
def test_export_round_trip_reference_and_ours(tiny_pair, tmp_path):
    target = load_target(tiny_pair["target_path"], dtype="float32")
    draft = _perturbed(load_draft(tiny_pair["draft_path"], dtype="float32"))
    out = export_draft(draft, str(tmp_path / "exported"), dtype="float32")
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["target_layer_ids"] == list(draft.config.target_layer_ids)
    assert ck.saved_tensor_names(out) == ck.draft_tensor_names(draft.config.num_layers)
    ours = load_draft(out, target=target, dtype="float32")
    ref = ck.load_torch_pair(tiny_pair["target_path"], out)[1]
    S, T = 8, 20
    tokens = jax.random.randint(jax.random.key(3), (1, T), 0, 126)
    pos = jnp.arange(T)[None]
    _, feats, _ = target(tokens, pos, target.new_cache(1, T), pos + 1, taps=tuple(draft.config.target_layer_ids),
                         prefill=True)
    block = jnp.concatenate([tokens[:, -1:], jnp.full((1, S - 1), 127)], axis=1)
    emb = target.embed_tokens(block)
    j = jnp.arange(S)[None]
    outs = []
    for d in (draft, ours):   # the inference path: context of all T, block at T..T+S-1
        cache = d.write_context(feats, pos, d.new_cache(1, 64))
        h, _ = d(emb, T + j, jnp.zeros((1, S, feats.shape[-1])), T + j, cache, jnp.full((1, S), T + S),
                 kernels="xla")
        outs.append(np.asarray(h))
    with torch.no_grad():
        r = ref(position_ids=torch.arange(T + S)[None], noise_embedding=torch.tensor(np.asarray(emb)),
                target_hidden=torch.tensor(np.asarray(feats))).numpy()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[1], r, atol=1e-4, rtol=1e-4)
    # the packed training forward against the reference with its dense packed mask (tests/checkpoints)
    anchors = np.array([[2, 6, 11]])
    blk, _, position_ids, visible = ck.pack_blocks(torch.tensor(np.asarray(tokens)), torch.tensor(anchors), S, 127)
    with torch.no_grad():
        rp = ref(position_ids=position_ids, attention_mask=visible[:, None],
                 noise_embedding=torch.tensor(np.asarray(target.embed_tokens(jnp.asarray(blk.numpy())))),
                 target_hidden=torch.tensor(np.asarray(feats))).numpy()
    hp = packed.draft_forward(ours, target.embed_tokens(jnp.asarray(blk.numpy())), feats, jnp.asarray(anchors),
                              chunk_blocks=2)
    np.testing.assert_allclose(np.asarray(hp), rp, atol=1e-4, rtol=1e-4)
    with pytest.raises(FileExistsError, match="already exists"):
        export_draft(draft, out)


TINY = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=8, rope_theta=1e4)


def _random_data(rows=16, T=32, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 63, (rows, T)).astype(np.int32)
    lm = np.zeros((rows, T), np.uint8)
    for r in range(rows):
        p, e = rng.integers(2, 10), rng.integers(T - 8, T + 1)   # uneven responses
        lm[r, p:e] = 1
    return TokenData(tok, lm)


@pytest.mark.slow
def test_bad_input_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no row with two consecutive response tokens"):
        TokenData(np.zeros((4, 16), np.int32), np.zeros((4, 16), np.uint8))
    target = init_target(TINY, dtype="float32")
    other = DraftConfig.for_target(dataclass_replace(TINY, hidden_size=48, head_dim=12), num_layers=1, block_size=4)
    with pytest.raises(ConfigError, match="draft does not fit the target"):
        train(target, other, _random_data(), run=RunConfig(out_dir=str(tmp_path / "r"), batch_size=4))
    with pytest.raises(DataError, match="fewer than one batch"):
        train(target, DraftConfig.for_target(TINY, num_layers=1, block_size=4), _random_data(rows=2),
              run=RunConfig(out_dir=str(tmp_path / "r2"), batch_size=4))


def dataclass_replace(c, **kw):
    import dataclasses
    return dataclasses.replace(c, **kw)


@pytest.mark.slow
def test_resume_is_exact_and_contract_checked(tmp_path):
    target = init_target(TINY, dtype="float32")
    dcfg = DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    data = _random_data()
    kw = dict(batch_size=4, epochs=2, log_every=1, save_every=1000, progress=False)   # 8 steps, 2 epochs
    sk = dict(num_anchors=6, compute_dtype="float32", chunk_blocks=4)
    full = train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(out_dir=str(tmp_path / "a"), **kw), **sk)
    assert full.step == 8 and full.status == "done"
    part = train(target, init_draft(dcfg, seed=1, dtype="float32"), data,
                 run=RunConfig(out_dir=str(tmp_path / "b"), stop_after=3, **kw), **sk)
    assert part.status == "stopped" and part.step == 3
    rest = train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(out_dir=str(tmp_path / "b"), **kw), **sk)
    assert rest.step == 8 and rest.epoch == full.epoch == 1
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(rest.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(full.state.opt_state), jax.tree.leaves(rest.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lines = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert os.path.isfile(tmp_path / "b" / "curves.png")
    with pytest.raises(ContractError, match="num_anchors"):
        train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(out_dir=str(tmp_path / "b"), **kw),
              **dict(sk, num_anchors=5))


def _mean_tau(target, draft, prompts, n):
    res = generate(target, draft, prompts, max_new_tokens=n, attention_impl="xla", verify_width="block")
    lengths = [x for row in res.acceptance_lengths for x in row]
    return float(np.mean(lengths))


@pytest.mark.slow
def test_learning_raises_real_tau_and_overfit_gate(tmp_path):
    """A tiny Qwen3 target trained (torch, seconds) on a deterministic grammar; its own greedy answers
    regenerated with our loop; a draft trained on them a few hundred steps with our trainer: our real
    speculative τ on held-out prompts far above the untrained draft's. Overfit gate: ~10 samples,
    then the real loop accepts (almost) whole blocks on those prompts."""
    from dflash_jax.train.data import regenerate
    tstats = ck.train_target(str(tmp_path / "target"), vocab_size=64, steps=150, p_jump=0.0)
    target = load_target(tstats["path"], dtype="float32")
    S, mask = 8, 63
    dcfg = DraftConfig.for_target(target.config, num_layers=1, block_size=S, mask_token_id=mask,
                                  target_layer_ids=(1, 2))
    prompts = ck.random_prompts(96, 63, min_len=4, max_len=8, seed=1)
    data = regenerate(target, prompts, str(tmp_path / "data"), max_len=48, max_new_tokens=40, batch_size=32,
                      shard_rows=64, attention_impl="xla", progress=False)
    assert len(data) == 96 and len(os.listdir(tmp_path / "data")) == 5       # 2 shards x 2 + manifest
    held_out = ck.random_prompts(8, 63, min_len=4, max_len=8, seed=2)
    untrained = _mean_tau(target, init_draft(dcfg, seed=0, dtype="float32"), held_out, 40)
    sk = dict(num_anchors=16, compute_dtype="float32", lr=3e-3, chunk_blocks=8)
    res = train(target, init_draft(dcfg, seed=0, dtype="float32"), data,
                run=RunConfig(out_dir=str(tmp_path / "run"), batch_size=16, epochs=50, max_steps=200,
                              log_every=50, save_every=10_000, progress=False, eval_every=100,
                              eval_prompts=held_out[:2], eval_max_new_tokens=24), **sk)
    trained = _mean_tau(target, res.draft(), held_out, 40)
    print(f"untrained tau {untrained:.2f}, trained tau {trained:.2f}, final loss {res.metrics[-1]}")
    assert untrained < 1.5 and trained > 3.5 * untrained, (untrained, trained)
    assert any("eval_tau" in r for r in res.metrics)

    few = TokenData(data.tokens[:10], data.loss_mask[:10])
    fit = train(target, init_draft(dcfg, seed=0, dtype="float32"), few,
                run=RunConfig(out_dir=str(tmp_path / "overfit"), batch_size=10, epochs=300, max_steps=100,
                              log_every=100, save_every=10_000, progress=False), **dict(sk, num_anchors=40))
    # 100 steps: tau 7.80 of 8, as at 150 and 300 (CI time; the gate asks 6.8); the run above: 200 steps
    # give tau 4.52 against the untrained 1.04 (300 gave 4.95; the test asks 3.5x)
    gate = _mean_tau(target, fit.draft(), [prompts[i] for i in range(10)], 40)
    print(f"overfit gate: tau {gate:.2f} of {S} on the 10 training prompts")
    assert gate >= 0.85 * S, gate


@pytest.mark.slow
def test_sigterm_saves_and_nan_names_the_step(tmp_path, monkeypatch):
    import signal

    from dflash_jax.train import step as step_mod
    from dflash_jax.train.run import TrainingDiverged
    target = init_target(TINY, dtype="float32")
    dcfg = DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    data = _random_data()
    kw = dict(batch_size=4, epochs=2, log_every=1, save_every=1000, progress=False)
    sk = dict(num_anchors=6, compute_dtype="float32", chunk_blocks=4)
    real, calls = step_mod.Trainer.step, []

    def preempt_on_second(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # a preempted VM: the handler flags, the loop saves
        return real(self, *a, **k)

    monkeypatch.setattr(step_mod.Trainer, "step", preempt_on_second)
    res = train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(out_dir=str(tmp_path / "p"), **kw), **sk)
    assert res.status == "preempted" and res.step == 2
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints")) == ["2"]
    monkeypatch.setattr(step_mod.Trainer, "step", real)
    with pytest.raises(TrainingDiverged, match=r"at step 2 .*checkpoint \(step 1\)"):
        train(target, init_draft(dcfg, seed=1, dtype="float32"), data,
              run=RunConfig(out_dir=str(tmp_path / "n"), **dict(kw, save_every=1)), **dict(sk, lr=float("inf")))


def test_int8_target_trains_and_train_logits_equal_inference_logits(tmp_path):
    """A frozen int8 target (--quantize int8): a tiny run trains against it, the trained draft's
    training-time logits of each block equal the inference draft's on the same int8 target (the
    context written over x[:a], then the block pass at a), and a resume with the float target is
    refused naming --quantize."""
    from dflash_jax.quantize import Int8Weight
    target = init_target(TINY, dtype="float32", quantize="int8")
    assert isinstance(target.layers[0].qkv[...], Int8Weight)
    dcfg = DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    data = _random_data()
    kw = dict(batch_size=4, max_steps=2, log_every=1, save_every=1000, progress=False)
    sk = dict(num_anchors=6, compute_dtype="float32", chunk_blocks=4)
    out = str(tmp_path / "run")
    res = train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(out_dir=out, **kw), **sk)
    assert res.step == 2 and all(np.isfinite(r["loss"]) for r in res.metrics)
    draft = res.draft("float32")
    S, T = 4, 24
    tokens = jnp.asarray(data.tokens[:1, :T])
    pos = jnp.arange(T)[None]
    _, feats, _ = target(tokens, pos, target.new_cache(1, T), pos + 1, taps=(1, 2), prefill=True)
    anchors = jnp.array([[2, 9, 21]])
    blk = packed.block_tokens(tokens, anchors, S, dcfg.mask_token_id)
    hidden = jax.jit(lambda e, f, a: packed.draft_forward(draft, e, f, a, chunk_blocks=2))(
        target.embed_tokens(blk), feats, anchors)
    train_logits = target.logits(hidden).reshape(1, 3, S, -1)[0, :, 1:]
    j = jnp.arange(S)[None]
    pend = jnp.zeros((1, S, feats.shape[-1]), feats.dtype)
    for n, a in enumerate(np.asarray(anchors[0]).tolist()):
        cut = draft.write_context(feats[:, :a], pos[:, :a], draft.new_cache(1, 32))
        h, _ = draft(target.embed_tokens(blk[:, n * S:(n + 1) * S]), a + j, pend, a + j, cut,
                     jnp.full((1, S), a + S), kernels="xla")
        np.testing.assert_allclose(train_logits[n], target.logits(h[:, 1:])[0], atol=2e-4, rtol=1e-4,
                                   err_msg=f"block at anchor {a}")
    with pytest.raises(ContractError, match=r"--quantize: checkpoint 'int8' vs this run None") as e:
        train(init_target(TINY, dtype="float32"), init_draft(dcfg, seed=1, dtype="float32"), data,
              run=RunConfig(out_dir=out, **kw), **sk)
    assert "\n" not in str(e.value)
