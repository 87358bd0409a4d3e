"""Training DFlash2 drafts (issue 35): the packed attention's window / causal masks against the
dense mask, train / inference parity of the draft's hidden rows, unary logits and selector scores,
a DFlash2 draft grown from a DFlash-1 draft starting as it, the selector's loss, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import DraftConfig, TargetConfig, init_target
from dflash_jax.drafts.dflash import DFlashDraft
from dflash_jax.drafts.dflash2 import DFlash2Draft, walk
from dflash_jax.train.packed import block_tokens, dense_attention, draft_forward, split_attention
from dflash_jax.train.step import StepConfig, loss_and_metrics, split_draft

TC = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8)
S = 4


@pytest.fixture(scope="module")
def target():
    return init_target(TC, seed=1, dtype="float32")


def _v2_config(window=None, causal=None, top_k=6, layers=2):
    c = DraftConfig.for_target(TC, num_layers=layers, block_size=S, target_layer_ids=(0, 2))
    extra = {} if window is None else dict(layer_types=("sliding_attention", "full_attention")[:layers],
                                           sliding_window=window, is_causal=causal)
    return dataclasses.replace(c, architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16,
                               selector_rank=8, selector_top_k=top_k, **extra)


def _randomised(draft, seed=0, scale=0.3):
    """Every parameter perturbed (convs off identity, the successor codebook non-zero)."""
    params = nnx.state(draft, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(draft, jax.tree.unflatten(tree, new))
    return draft


@pytest.mark.parametrize("window,causal", [(3, False), (3, True), pytest.param(None, True, marks=pytest.mark.slow),
                                           pytest.param(6, False, marks=pytest.mark.slow)])
def test_split_attention_masks_equal_the_dense_mask(window, causal):
    B, T, N, Hq, Hkv, D = 2, 20, 3, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, N * S, Hq, D))
    kc, vc = jax.random.normal(ks[1], (B, T, Hkv, D)), jax.random.normal(ks[2], (B, T, Hkv, D))
    kb, vb = jax.random.normal(ks[3], (B, N * S, Hkv, D)), jax.random.normal(ks[4], (B, N * S, Hkv, D))
    anchors = jnp.array([[0, 5, 11], [2, 9, 16]], jnp.int32)
    want = dense_attention(q, kc, vc, kb, vb, anchors, S, window, causal)
    got = split_attention(q, kc, vc, kb, vb, anchors, S, chunk_blocks=2, attention="xla", window=window,
                          causal=causal)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("window,causal", [(3, False), pytest.param(None, None, marks=pytest.mark.slow),
                                           pytest.param(3, True, marks=pytest.mark.slow)])
def test_training_rows_equal_the_inference_draft_pass(target, window, causal):
    """A packed block's hidden rows, unary logits and selector scores = the inference draft's on
    that block with the context cut at its anchor (convs, windows, selector all non-trivial)."""
    cfg = _v2_config(window, causal)
    draft = _randomised(DFlash2Draft(cfg, jnp.float32, rngs=nnx.Rngs(0)))
    T = 18
    tokens = jax.random.randint(jax.random.key(2), (1, T), 0, TC.vocab_size - 1)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    _, feats, _ = target(tokens, pos, target.new_cache(1, T), pos + 1, taps=cfg.target_layer_ids, kernels="xla",
                         prefill=True)
    anchors = jnp.array([[4, 9, 13]], jnp.int32)
    embeds = target.embed_tokens(block_tokens(tokens, anchors, S, cfg.mask_token_id))
    hidden = draft_forward(draft, embeds, feats, anchors, chunk_blocks=2, attention="xla")   # [1, 3·S, H]
    for j, a in enumerate(np.asarray(anchors[0])):
        cache = draft.new_cache(1, 32)
        cache = draft.write_context(feats[:, :a], pos[:, :a], cache)
        bpos = a + jnp.arange(S, dtype=jnp.int32)[None]
        pend = jnp.zeros((1, S, feats.shape[-1]), feats.dtype)    # lands on the block's rows: overwritten
        h, _ = draft(embeds[:, j * S:(j + 1) * S], bpos, pend, bpos, cache, jnp.array([a + S]), kernels="xla")
        got = hidden[:, j * S:(j + 1) * S]
        np.testing.assert_allclose(np.asarray(got), np.asarray(h), atol=2e-5)
        lt, li = draft.unary_logits(target, got[:, 1:]), draft.unary_logits(target, h[:, 1:])
        np.testing.assert_allclose(np.asarray(lt), np.asarray(li), atol=5e-5)
        # the teacher-forced scores after predecessor a = row a of the inference lattice
        lattice, cand = draft.candidate_selector.lattice(h[:, 1:], li, tokens[:, a])
        sel = draft.candidate_selector
        for t in range(1, S - 1):
            prev = cand[0, t - 1]
            tf, tf_cand = sel.teacher_forced(got[0, t + 1][None].repeat(len(prev), 0), lt[0, t][None].repeat(
                len(prev), 0), prev)
            np.testing.assert_array_equal(np.asarray(tf_cand[0]), np.asarray(cand[0, t]))
            np.testing.assert_allclose(np.asarray(tf), np.asarray(lattice[0, t]), atol=1e-4)
        tf0, _ = sel.teacher_forced(got[0, 1][None], lt[0, 0][None], tokens[0, a][None])
        np.testing.assert_allclose(np.asarray(tf0[0]), np.asarray(lattice[0, 0, 0]), atol=1e-4)


def _grown():
    v1cfg = DraftConfig.for_target(TC, num_layers=2, block_size=S, target_layer_ids=(0, 2))
    v1 = _randomised(DFlashDraft(v1cfg, jnp.float32, rngs=nnx.Rngs(3)), seed=3, scale=0.1)
    return v1, DFlash2Draft.for_training(_v2_config(), init=v1)


def test_a_dflash2_draft_grown_from_v1_starts_as_v1(target):
    v1, d2 = _grown()
    v1cfg = v1.config
    tokens = jax.random.randint(jax.random.key(5), (2, 24), 0, TC.vocab_size - 1)
    lm = jnp.ones((2, 24), jnp.int32).at[:, :4].set(0)
    sc = StepConfig(block_size=S, mask_token_id=v1cfg.mask_token_id, target_layer_ids=(0, 2), num_anchors=8,
                    compute_dtype="float32", attention_impl="xla", train_attention="xla")
    l1, s1 = loss_and_metrics(split_draft(v1, "float32")[1], split_draft(v1, "float32")[0], target, tokens, lm,
                              jnp.arange(2), 0, sc)
    g2, p2 = split_draft(d2, "float32")
    l2, s2 = loss_and_metrics(p2, g2, target, tokens, lm, jnp.arange(2), 0, sc)
    np.testing.assert_allclose(float(s2["loss_sum"]), float(s1["loss_sum"]), rtol=1e-5)
    # the zero successor codebook: the selector's path is the argmax, so its τ is the argmax's
    np.testing.assert_array_equal(np.asarray(s2["sel_correct"]), np.asarray(s1["slot_correct"]))
    assert float(s2["sel_tau_sum"]) == float(s1["tau_sum"])
    # and the total loss adds the selector's CE over the slots whose label is a candidate
    sel = float(s2["sel_loss_sum"]) / float(s2["sel_weight_sum"])
    np.testing.assert_allclose(float(l2), float(l1) + sel, rtol=1e-5)


@pytest.mark.slow
def test_a_dflash2_draft_grown_from_v1_generates_as_v1(target):
    """The generation loop: the same proposals, hence the same tokens and acceptance lengths."""
    from dflash_jax import generate
    v1, d2 = _grown()
    prompts = [[5, 17, 3, 40, 2], [9, 1, 33]]
    r1, r2 = (generate(target, d, prompts, max_new_tokens=12, block_size=S, attention_impl="xla", verify_width="block") for d in (v1, d2))
    assert r1.tokens == r2.tokens and r1.acceptance_lengths == r2.acceptance_lengths


def test_selector_loss_against_a_numpy_oracle(target):
    """The teacher-forced K-way CE recomputed in numpy from the draft's own hidden rows: top-K of
    the unary logits, the gold predecessor's pair scores, slots whose label is no candidate left out."""
    from dflash_jax.train.anchors import anchor_key, sample_anchors
    from dflash_jax.train.loss import block_labels
    from dflash_jax.train.step import target_features
    cfg = _v2_config(top_k=48)      # half the vocabulary: most labels are candidates, some are not
    draft = _randomised(DFlash2Draft(cfg, jnp.float32, rngs=nnx.Rngs(0)), seed=9)
    tokens = jax.random.randint(jax.random.key(7), (1, 20), 0, TC.vocab_size - 1)
    lm = jnp.ones((1, 20), jnp.int32)
    sc = StepConfig(block_size=S, mask_token_id=cfg.mask_token_id, target_layer_ids=(0, 2), num_anchors=5,
                    compute_dtype="float32", attention_impl="xla", train_attention="xla")
    gd, params = split_draft(draft, "float32")
    _, sums = loss_and_metrics(params, gd, target, tokens, lm, jnp.arange(1), 0, sc)
    anchors, keep = sample_anchors(anchor_key(0, 0, jnp.arange(1)), lm, 5)
    feats = target_features(target, tokens, sc)
    embeds = target.embed_tokens(block_tokens(tokens, anchors, S, cfg.mask_token_id))
    hidden = np.asarray(draft_forward(draft, embeds, feats, anchors, attention="xla")).reshape(5, S, -1)
    labels, weights, valid = (np.asarray(x)[0] for x in block_labels(tokens, lm, anchors, keep, S, sc.gamma_value))
    head = np.asarray(target.logits(jnp.asarray(hidden[:, 1:])))              # [N, S-1, V]
    P, Q = (np.asarray(getattr(draft.candidate_selector, n)[...]) for n in ("predecessor_codebook", "successor_codebook"))
    W = np.asarray(draft.candidate_selector.hidden_projection[...])
    tok = np.asarray(tokens[0])
    num = den = 0.0
    for j, a in enumerate(np.asarray(anchors[0])):
        for k in range(S - 1):
            if not valid[j, k]:
                continue
            cand = np.argsort(-head[j, k], kind="stable")[:48]
            y, prev = labels[j, k], tok[a + k]
            if y not in cand:
                continue
            s = head[j, k][cand] + ((P[prev] * (hidden[j, k + 1] @ W)) * Q[cand]).sum(-1)
            ce = np.log(np.exp(s - s.max()).sum()) + s.max() - s[list(cand).index(y)]
            num, den = num + weights[j, k] * ce, den + weights[j, k]
    assert den > 0 and float(sums["sel_hits"]) < float(np.sum(valid))   # both kinds of slot occur
    np.testing.assert_allclose(float(sums["sel_loss_sum"]), num, rtol=1e-4)
    np.testing.assert_allclose(float(sums["sel_weight_sum"]), den, rtol=1e-6)


def test_cli_refuses_bad_dflash2_settings_in_one_line(tmp_path, capsys):
    from dflash_jax.train.__main__ import main
    from tests import checkpoints as ck
    tp = ck.write_target(str(tmp_path / "target"), vocab_size=64, num_layers=2, seed=0)
    capsys.readouterr()   # the checkpoint writer's progress bar
    common = ["train", "--model", tp, "--dtype", "float32", "--data", str(tmp_path / "none"), "--out",
              str(tmp_path / "run"), "--arch", "dflash2", "--draft-layers", "1"]
    for flags, word in ((["--selector-top-k", "65"], "--selector-top-k 65 is above the target's vocabulary"),
                        (["--conv-group-size", "7"], "--conv-group-size 7 does not divide")):
        assert main(common + flags) == 2
        err = capsys.readouterr().err
        assert word in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_cli_trains_exports_and_the_reference_loads_it(tmp_path):
    """`train --arch dflash2 --init-draft <v1>` → export (float32) → the reference DFlash2DraftModel
    loads it and dflash_generate gives our tokens and acceptance lengths."""
    import torch
    from dflash.model import DFlash2DraftModel

    from dflash_jax import generate, load_draft, load_target
    from dflash_jax.train.__main__ import main
    from tests import checkpoints as ck
    tp = ck.write_target(str(tmp_path / "target"), vocab_size=64, num_layers=4, seed=0)
    with open(tmp_path / "p.jsonl", "w") as f:
        for p in ck.random_prompts(8, 63, min_len=3, max_len=6, seed=0):
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    common = ["--model", tp, "--dtype", "float32", "--attention", "xla"]
    data = str(tmp_path / "data")
    assert main(["regenerate", *common, "--prompts", str(tmp_path / "p.jsonl"), "--prompts-are-ids", "--out", data,
                 "--max-len", "32", "--max-new-tokens", "20", "--batch-size", "4"]) == 0
    args = ["--data", data, "--batch-size", "4", "--max-steps", "4", "--num-anchors", "8", "--compute-dtype",
            "float32", "--log-every", "1"]
    assert main(["train", *common, *args, "--out", str(tmp_path / "v1"), "--draft-layers", "1", "--block-size", "4",
                 "--taps", "1,2"]) == 0
    assert main(["export", "--run", str(tmp_path / "v1"), "--out", str(tmp_path / "v1d"), "--dtype", "float32"]) == 0
    assert main(["train", *common, *args, "--out", str(tmp_path / "v2"), "--arch", "dflash2", "--init-draft",
                 str(tmp_path / "v1d"), "--selector-rank", "8", "--selector-top-k", "4", "--conv-group-size", "16",
                 "--sliding-window", "6"]) == 0
    recs = [json.loads(l) for l in open(tmp_path / "v2" / "metrics.jsonl")]
    assert all(np.isfinite(r["sel_loss"]) and 0 <= r["topk_recall"] <= 1 for r in recs)
    out = str(tmp_path / "v2d")
    assert main(["export", "--run", str(tmp_path / "v2"), "--out", out, "--dtype", "float32"]) == 0
    target = load_target(tp, dtype="float32")
    draft = load_draft(out, target=target, dtype="float32")
    assert isinstance(draft, DFlash2Draft) and draft.config.sliding_window == 6 and draft.config.block_size == 4
    hf, _ = ck.load_torch_pair(tp)
    ref = DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval().requires_grad_(False)
    prompts = ck.random_prompts(2, 63, min_len=7, max_len=10, seed=3)
    res = generate(target, draft, prompts, max_new_tokens=16, verify_width="block")
    for i, p in enumerate(prompts):
        r = ck.reference_generate(ref, hf, p, 16)
        assert res.tokens[i] == r.output_ids[0, len(p):].tolist()
        assert res.acceptance_lengths[i] == list(r.acceptance_lengths)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_slot_engine_runs_a_dflash2_draft_as_generate(target, temperature):
    """Continuous batching (2 slots, 3 requests) gives one generate's tokens and acceptance lengths
    for a DFlash2 draft with a non-trivial conv, selector and window, greedy and sampled."""
    from dflash_jax import generate
    draft = _randomised(DFlash2Draft(_v2_config(3, False), jnp.float32, rngs=nnx.Rngs(0)), seed=4)
    prompts = [[5, 17, 3, 40, 2, 8], [9, 1, 33, 4, 4, 12, 60], [7, 7, 21]]
    kw = dict(max_new_tokens=14, temperature=temperature, seed=3, attention_impl="xla")
    one = generate(target, draft, prompts, **kw, verify_width="block")
    eng = generate(target, draft, prompts, slots=2, **kw, verify_width="block")
    assert eng.tokens == one.tokens and eng.acceptance_lengths == one.acceptance_lengths
