"""Training's packed-block forward: the split attention against the dense-mask reference (values and
gradients), anchors, labels/weights, and train/inference parity with the draft's own inference path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import load_draft, load_target
from dflash_jax.train import anchors as an
from dflash_jax.train import loss as ls
from dflash_jax.train import packed


def _qkv(B, T, N, S, Hq=4, Hkv=2, D=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, N * S, Hq, D))
    kc, vc = (jax.random.normal(k, (B, T, Hkv, D)) for k in ks[1:3])
    kb, vb = (jax.random.normal(k, (B, N * S, Hkv, D)) for k in ks[3:5])
    return q, kc, vc, kb, vb


# row 0: anchors incl. 0 (empty context), one right at the end (T - 2); row 1: a shorter sequence
# whose blocks stop early, then two padded blocks (anchor 0)
ANCHORS = np.array([[0, 3, 7, 20, 22], [1, 2, 9, 0, 0]], np.int32)


@pytest.mark.parametrize("chunk", [pytest.param(2, marks=pytest.mark.slow), 8])
def test_split_attention_equals_dense_mask(chunk):
    B, T, N, S = 2, 24, 5, 4
    args = _qkv(B, T, N, S)
    anchors = jnp.asarray(ANCHORS)
    ct = jax.random.normal(jax.random.key(9), args[0].shape)

    @jax.jit
    def both(*a):
        split = lambda *x: packed.split_attention(*x, anchors, S, chunk_blocks=chunk)
        dense = lambda *x: packed.dense_attention(*x, anchors, S)
        grads = [jax.grad(lambda *x: jnp.sum(f(*x) * ct), argnums=range(5))(*a) for f in (split, dense)]
        return split(*a), dense(*a), grads[0], grads[1]

    split, dense, gs, gd = both(*args)
    np.testing.assert_allclose(split, dense, atol=2e-6, rtol=1e-5)
    for a, b in zip(gs, gd):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_dense_reference_mask_semantics():
    """Brute force: output of block j's row = softmax attention over exactly context keys t < a_j and
    its own S block keys."""
    B, T, N, S, D = 1, 12, 3, 3, 8
    q, kc, vc, kb, vb = _qkv(B, T, N, S, Hq=2, Hkv=2, D=D, seed=3)
    anchors = jnp.array([[0, 4, 9]])
    got = packed.dense_attention(q, kc, vc, kb, vb, anchors, S)
    for j, a in enumerate([0, 4, 9]):
        k = np.concatenate([np.asarray(kc[0, :a]), np.asarray(kb[0, j * S:(j + 1) * S])])  # [a+S, H, D]
        v = np.concatenate([np.asarray(vc[0, :a]), np.asarray(vb[0, j * S:(j + 1) * S])])
        for r in range(S):
            for h in range(2):
                s = k[:, h] @ np.asarray(q[0, j * S + r, h]) / np.sqrt(D)
                p = np.exp(s - s.max())
                np.testing.assert_allclose(got[0, j * S + r, h], (p / p.sum()) @ v[:, h], atol=1e-5)


def test_anchors_valid_unique_sorted_reproducible():
    T = 40
    lm = np.zeros((3, T), np.int32)
    lm[0, 10:30] = 1            # 19 valid positions (10..28)
    lm[1, 5:9] = 1; lm[1, 20:22] = 1; lm[1, 30] = 1   # 3 + 1 valid, an isolated token not
    lm[2, 35:40] = 1            # ends at the sequence end: 35..38 valid
    keys = an.anchor_key(7, 0, np.arange(3))
    a, keep = an.sample_anchors(keys, jnp.asarray(lm), 8)
    a, keep = np.asarray(a), np.asarray(keep)
    valid = {0: set(range(10, 29)), 1: {5, 6, 7, 20}, 2: {35, 36, 37, 38}}
    for r in range(3):
        kept = a[r][keep[r]]
        assert set(kept) <= valid[r] and len(set(kept)) == len(kept) == min(8, len(valid[r]))
        assert list(kept) == sorted(kept) and np.all(keep[r][:len(kept)]) and not np.any(keep[r][len(kept):])
        assert np.all(a[r][~keep[r]] == 0)
    a2, _ = an.sample_anchors(an.anchor_key(7, 0, np.arange(3)), jnp.asarray(lm), 8)
    np.testing.assert_array_equal(a, a2)
    a3, _ = an.sample_anchors(an.anchor_key(7, 1, np.arange(3)), jnp.asarray(lm), 8)
    assert not np.array_equal(a[0], np.asarray(a3)[0])     # a new epoch redraws
    a4, k4 = an.sample_anchors(an.anchor_key(7, 0, np.arange(3)), jnp.asarray(lm), 64)  # more than T
    assert np.asarray(k4).sum(1).tolist() == [19, 4, 4]


def test_labels_and_weights():
    T, S, gamma = 12, 4, 2.0
    tokens = jnp.arange(100, 100 + T)[None]
    lm = np.ones((1, T), np.int32); lm[0, 6] = 0
    anchors = jnp.array([[2, 4, 9, 0]]); keep = jnp.array([[True, True, True, False]])
    labels, w, valid = ls.block_labels(tokens, jnp.asarray(lm), anchors, keep, S, gamma)
    assert np.asarray(labels)[0, 0].tolist() == [103, 104, 105]            # slot k -> x[a + k]
    d = np.exp(-np.arange(3) / gamma)                                          # exp(-(k-1)/γ), k = 1..3
    np.testing.assert_allclose(w[0, 0], d)
    np.testing.assert_allclose(w[0, 1], d * [1, 0, 1])                         # x[6] outside the mask
    np.testing.assert_allclose(w[0, 2], d * [1, 1, 0])                         # a + 3 = 12 out of bounds
    np.testing.assert_allclose(w[0, 3], 0)                                     # padded block
    assert ls.default_gamma(16) == 7 and ls.default_gamma(10) == 5 and ls.default_gamma(8) == 4


@pytest.fixture(scope="module")
def pair32(tiny_pair):
    return (load_target(tiny_pair["target_path"], dtype="float32"),
            load_draft(tiny_pair["draft_path"], dtype="float32"), tiny_pair)


def test_train_inference_parity(pair32):
    """Training logits of block j = the inference draft's logits for that block with its context cut
    at a_j (write_context over x[:a_j], then the draft's block pass): rules out shifted labels,
    `<=` on the context, and any cross-block leak."""
    target, draft, pair = pair32
    S, T = pair["block_size"], 40
    taps = tuple(draft.config.target_layer_ids)
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, 126)
    pos = jnp.arange(T)[None]
    _, feats, _ = target(tokens, pos, target.new_cache(1, T), pos + 1, taps=taps, prefill=True)
    anchors = jnp.array([[1, 5, 17, 30, 38]])           # 38: the block runs past the sequence end
    N = anchors.shape[1]
    blk = packed.block_tokens(tokens, anchors, S, pair["mask_token_id"])
    hidden = jax.jit(lambda e, f, a: packed.draft_forward(draft, e, f, a, chunk_blocks=2))(
        target.embed_tokens(blk), feats, anchors)
    train_logits = target.logits(hidden).reshape(1, N, S, -1)[:, :, 1:]       # [1, N, S-1, V]
    j = jnp.arange(S)
    # the inference path: the context written into the draft cache, then the block pass at position a
    # with keys ending at a + S. Rows >= a of the cache are overwritten by the block's own K/V before
    # it attends (as in the decode loop), so the block sees exactly the context cut at a.
    cache = draft.write_context(feats, pos, draft.new_cache(1, 64))

    @jax.jit
    def infer(a, bt):
        pend = jnp.zeros((1, S, feats.shape[-1]), feats.dtype)                   # nothing pending
        h, _ = draft(target.embed_tokens(bt), a + j[None], pend, a + j[None], cache,
                     jnp.full((1, S), a + S), kernels="xla")
        return target.logits(h[:, 1:])[0]

    for n, a in enumerate(np.asarray(anchors[0]).tolist()):
        got = infer(jnp.int32(a), blk[:, n * S:(n + 1) * S])
        np.testing.assert_allclose(train_logits[0, n], got, atol=2e-4, rtol=1e-4, err_msg=f"block at anchor {a}")
    # and literally: a cache holding only x[:a]'s context, for one anchor
    a = 17
    cut = draft.write_context(feats[:, :a], pos[:, :a], draft.new_cache(1, 64))
    pend = jnp.zeros((1, S, feats.shape[-1]), feats.dtype)
    h, _ = draft(target.embed_tokens(blk[:, 2 * S:3 * S]), a + j[None], pend, a + j[None], cut,
                 jnp.full((1, S), a + S), kernels="xla")
    np.testing.assert_allclose(train_logits[0, 2], target.logits(h[:, 1:])[0], atol=2e-4, rtol=1e-4)


# The Pallas GPU context attention in interpret mode (tests/README: slow). Small tiles so the shapes
# exercise several query and key tiles, tails of both, and query tiles that straddle two blocks.
_TILES = dict(rows=16, block_k=16, bwd_rows=16, bwd_block_k=16)


@pytest.mark.slow
def test_pallas_context_attention_equals_reference():
    """context_attention alone: o and lse, and the gradients of q, kc, vc under cotangents on both
    (the lse cotangent is what the merge sends), against dense scores; rows with an empty context
    (k_end 0) give o = 0 and lse = MASK."""
    from pallas_kernels.attention import train_gpu as tg
    B, L, Hq, Hkv, D, T = 2, 24, 4, 2, 16, 40                                  # T: not a tile multiple
    ks = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(ks[0], (B, L, Hq, D))
    kc, vc = (jax.random.normal(k, (B, T, Hkv, D)) for k in ks[1:3])
    ke = jnp.asarray(np.repeat([[0, 3, 17, 33, 39, 0], [1, 2, 20, 0, 0, 0]], 4, axis=1))   # [B, L]
    ct, cl = jax.random.normal(ks[3], q.shape), jax.random.normal(ks[4], (B, L, Hq))
    live = (ke > 0)[:, :, None]

    def loss(f):
        def g(q, kc, vc):
            o, lse = f(q, kc, vc, ke)
            return jnp.sum(o * ct) + jnp.sum(jnp.where(live, lse, 0.0) * cl)
        return g

    pallas = lambda *a: tg.context_attention(*a, interpret=True, **_TILES)
    (o, lse), (ro, rl) = pallas(q, kc, vc, ke), tg.context_attention_reference(q, kc, vc, ke)
    np.testing.assert_allclose(o, ro, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse, rl, atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(o)[~np.asarray(ke > 0)] == 0)
    for a, b in zip(jax.grad(loss(pallas), argnums=(0, 1, 2))(q, kc, vc),
                    jax.grad(loss(tg.context_attention_reference), argnums=(0, 1, 2))(q, kc, vc)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("S,N,T", [(4, 5, 64), (8, 4, 128)])
def test_split_attention_pallas_equals_dense_and_xla(S, N, T):
    """split_attention with the Pallas context kernel = the dense-mask reference = the XLA split
    attention, values and gradients (float32, GQA group 2): anchors at 0 (empty context), near the
    end, a shorter row with padded blocks (anchor 0)."""
    B = 2
    args = _qkv(B, T, N, S, Hq=4, Hkv=2, D=16, seed=S)
    a0 = [0, 3, 9, T // 2, T - 2][:N]
    anchors = jnp.asarray(np.array([a0, [1, 2, T // 3] + [0] * (N - 3)], np.int32))
    ct = jax.random.normal(jax.random.key(9), args[0].shape)
    fns = dict(
        pallas=lambda *x: packed.split_attention(*x, anchors, S, chunk_blocks=2, attention="pallas_gpu",
                                                 interpret=True),
        xla=lambda *x: packed.split_attention(*x, anchors, S, chunk_blocks=2),
        dense=lambda *x: packed.dense_attention(*x, anchors, S))
    out = {k: (f(*args), jax.grad(lambda *x: jnp.sum(f(*x) * ct), argnums=range(5))(*args)) for k, f in fns.items()}
    for other in ("dense", "xla"):
        np.testing.assert_allclose(out["pallas"][0], out[other][0], atol=2e-6, rtol=1e-5)
        for a, b in zip(out["pallas"][1], out[other][1]):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_train_attention_choice_is_checked():
    from dflash_jax.train.step import StepConfig
    assert packed.resolve_train_attention("auto") == ("pallas_gpu" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(ValueError, match="train_attention 'cudnn' is not one of"):
        StepConfig(block_size=4, mask_token_id=1, target_layer_ids=(1,), train_attention="cudnn")
    with pytest.raises(ValueError, match="training attention 'flash' is not one of"):
        packed.split_attention(*_qkv(1, 8, 2, 4), jnp.zeros((1, 2), jnp.int32), 4, attention="flash")


def test_pallas_context_attention_lowers_for_cuda():
    """Forward and backward (three Triton kernels) lower for CUDA at the H200 benchmark's shapes
    (Qwen3-8B heads, T 3072, 512 anchors × 16, bf16), from this CPU host."""
    from jax import export
    from pallas_kernels.attention import train_gpu as tg
    B, L, Hq, Hkv, D, T = 4, 8192, 32, 8, 128, 3072
    SD = jax.ShapeDtypeStruct

    def f(q, kc, vc, ke, ct, cl):
        def g(q, kc, vc):
            o, lse = tg.context_attention(q, kc, vc, ke)
            return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(lse * cl)
        return jax.grad(g, argnums=(0, 1, 2))(q, kc, vc)

    exp = export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        SD((B, L, Hq, D), jnp.bfloat16), SD((B, T, Hkv, D), jnp.bfloat16), SD((B, T, Hkv, D), jnp.bfloat16),
        SD((B, L), jnp.int32), SD((B, L, Hq, D), jnp.float32), SD((B, L, Hq), jnp.float32))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 3


@pytest.mark.slow
def test_auto_attention_falls_back_where_the_kernel_cannot_tile(monkeypatch):
    """auto on a GPU picks the Pallas pair, but a GQA group of 3 (the demo pair's) cannot be tiled:
    auto must run the XLA chunks (equal to the dense reference), not raise."""
    monkeypatch.setattr(packed, "resolve_train_attention", lambda a: "pallas_gpu")
    q, kc, vc, kb, vb = _qkv(1, 16, 2, 4, Hq=6, Hkv=2, D=8)
    anchors = jnp.array([[0, 5]], jnp.int32)
    got = packed.split_attention(q, kc, vc, kb, vb, anchors, 4, attention="auto")
    want = packed.dense_attention(q, kc, vc, kb, vb, anchors, 4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
