"""The training loss and its gradient (dflash_jax.train.step.loss_and_metrics) against a PyTorch
restatement on the reference `dflash` draft (tests/checkpoints.py `torch_block_loss`), on the same
anchors: the packed block layout, the context cut strictly before each anchor, the slot weights
exp(-(k-1)/γ), the loss mask, blocks cut by the end of the sequence and padded (dropped) anchors.
Issue 55 ("Tests that can fail"): the other training tests compare the JAX loss with itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.checkpoints import load_torch_pair, torch_block_loss, write_draft, write_target

from dflash_jax import load_draft, load_target
from dflash_jax.train.anchors import anchor_key, sample_anchors
from dflash_jax.train.export import draft_tensors
from dflash_jax.train.step import StepConfig, loss_and_metrics, split_draft


@pytest.mark.slow          # ~12 CPU s, most of it compiling the value-and-gradient program
def test_loss_and_gradient_equal_the_torch_loss_on_the_same_anchors(tmp_path):
    tp = write_target(str(tmp_path / "t"), num_layers=3, seed=21)
    dp = write_draft(str(tmp_path / "d"), tp, num_layers=1, block_size=4, target_layer_ids=[0, 2], seed=22)
    hf, ref = load_torch_pair(tp, dp)
    target = load_target(tp, dtype="float32")
    draft = load_draft(dp, target=target, dtype="float32")
    S, mask = 4, draft.config.mask_token_id
    gd, params = split_draft(draft, "float32")
    B, T = 2, 32
    tok = np.random.default_rng(0).integers(0, mask, (B, T)).astype(np.int32)
    lm = np.zeros((B, T), np.int32)
    lm[0, 5:29] = 1        # 23 valid anchors for 12 draws
    lm[1, 25:32] = 1       # 6 valid anchors (6 padded, keep False); blocks cut by the sequence's end
    cfg = StepConfig(block_size=S, mask_token_id=mask, target_layer_ids=tuple(draft.config.target_layer_ids),
                     num_anchors=12, compute_dtype="float32", chunk_blocks=4, head_chunk=16, train_attention="xla")
    ids, epoch = jnp.arange(B), jnp.int32(3)
    (loss, sums), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
        params, gd, target, jnp.asarray(tok), jnp.asarray(lm), ids, epoch, cfg)
    anchors, keep = sample_anchors(anchor_key(cfg.anchor_seed, epoch, ids), jnp.asarray(lm), cfg.num_anchors)
    anchors, keep = np.asarray(anchors), np.asarray(keep)
    assert keep[0].all() and keep[1].sum() == 6 and anchors[1][keep[1]].max() == 30      # the cases above occur
    assert float(sums["blocks"]) == keep.sum()

    ref.train().requires_grad_(True)         # load_torch_pair freezes it
    want = torch_block_loss(ref, hf, tok, lm, anchors, keep, S, mask, cfg.gamma_value)
    want.backward()
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    got = draft_tensors(nnx.merge(gd, grads), "float32")          # the gradients under the z-lab names
    tgrads = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(tgrads)
    for name, g in tgrads.items():
        scale = float(np.abs(g).max())
        assert scale > 0, name                                    # every tensor gets a gradient
        np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
