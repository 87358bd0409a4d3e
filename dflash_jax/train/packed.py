"""The packed-block draft forward of training: all N anchor blocks of a sequence in one pass.

Block j = [x[a_j], MASK × (S-1)] at positions a_j .. a_j+S-1. Its queries see the context keys at
positions < a_j (strictly before the anchor: the anchor token's own taps are not known at inference)
and the S keys of their own block, nothing of other blocks: exactly what the inference draft sees for
that block with its context cut at a_j. The dense (N·S) × (T + N·S) mask is never built: attention is
split into (1) the block queries over the context K/V with a per-block key end k_end = a_j (the kernel
family's signature) and (2) a block-diagonal [N, S, S] attention, merged exactly by log-sum-exp. Both
run over chunks of blocks under `jax.checkpoint`, so only one chunk's scores live at a time (T 3072,
N 512, S 16 is 8192 queries). `dense_attention` is the mask-built reference the tests compare against.

The layers are the draft's own (`DFlashDraft.context`, `DecoderLayer.context_kv`, `input_layernorm`,
`qkv_heads`, `attn_mlp`, `draft.norm`): training and inference share every weight-touching op."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels._common import Unsupported
from pallas_kernels.attention.train_gpu import check_context_attention, context_attention

log = logging.getLogger(__name__)

__all__ = ["TRAIN_ATTENTION", "block_tokens", "block_positions", "split_attention", "dense_attention", "draft_forward"]

_NEG = -1e30  # a finite "minus infinity": a block with an empty context keeps finite gradients


def block_tokens(tokens, anchors, block_size: int, mask_token_id: int):
    """tokens [B, T], anchors [B, N] → block token ids [B, N·S]: [x[a_j], MASK × (S-1)] per block."""
    B, N = anchors.shape
    first = jnp.take_along_axis(tokens, anchors, axis=1)                       # [B, N]
    blk = jnp.full((B, N, block_size), mask_token_id, jnp.int32).at[:, :, 0].set(first)
    return blk.reshape(B, N * block_size)


def block_positions(anchors, block_size: int):
    """anchors [B, N] → positions [B, N·S] = a_j + k."""
    B, N = anchors.shape
    return (anchors[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)).reshape(B, N * block_size)


def _gqa(q, num_kv: int):
    """q [..., S, Hq, D] → [..., S, Hkv, G, D]."""
    *lead, S, Hq, D = q.shape
    return q.reshape(*lead, S, num_kv, Hq // num_kv, D)


def _context_part(q, kc, vc, k_end, scale, window: int | None = None):
    """q [B, n, S, Hkv, G, D] over context kc, vc [B, T, Hkv, D], block j seeing keys [0, k_end[b, j])
    (k_end = the anchor a_j); with a sliding `window` W, slot k (position a_j + k) sees only keys
    t > a_j + k - W. Returns (o [B, n, S, Hkv, G, D] f32 normalised, lse [B, n, Hkv, G, S] f32)."""
    s = jnp.einsum("bnshgd,bthd->bnhgst", q, kc, preferred_element_type=jnp.float32) * scale
    t = jnp.arange(kc.shape[1])
    if window is None:
        visible = (t[None, None, :] < k_end[:, :, None])[:, :, None, None, None, :]     # [B, n, 1, 1, 1, T]
    else:
        S = q.shape[2]
        start = k_end[:, :, None] + jnp.arange(S) - window + 1                  # [B, n, S]
        visible = (t < k_end[:, :, None, None]) & (t >= start[..., None])       # [B, n, S, T]
        visible = visible[:, :, None, None]                                     # [B, n, 1, 1, S, T]
    s = jnp.where(visible, s, _NEG)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bnhgst,bthd->bnshgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    return o, lse


def block_mask(block_size: int, window: int | None = None, causal: bool = False):
    """[S, S] bool: slot s of a block sees slot k of it (the inference draft's mask, drafts.dflash2
    `layer_key_range`): causal: k <= s; a window W: s - k < W, and k - s < W when not causal; neither:
    all (DFlash-1)."""
    s, k = jnp.arange(block_size)[:, None], jnp.arange(block_size)[None, :]
    m = jnp.ones((block_size, block_size), bool)
    if causal:
        m &= k <= s
    if window is not None:
        m &= (s - k < window) & (causal | (k - s < window))
    return m


def _block_part(q, kb, vb, scale, mask=None):
    """q [B, n, S, Hkv, G, D] over its own block's kb, vb [B, n, S, Hkv, D] (non-causal, or the
    [S, S] `mask` of block_mask)."""
    s = jnp.einsum("bnshgd,bnkhd->bnhgsk", q, kb, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bnhgsk,bnkhd->bnshgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return o, lse


def _merge(o1, lse1, o2, lse2):
    """Exact softmax over the union of two key sets from each part's normalised output and lse."""
    m = jnp.maximum(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)                              # [B, n, Hkv, G, S]
    w1, w2 = (jnp.moveaxis(w, -1, 2)[..., None] for w in (w1, w2))            # [B, n, S, Hkv, G, 1]
    return (o1 * w1 + o2 * w2) / (w1 + w2)


TRAIN_ATTENTION = ("auto", "xla", "pallas_gpu")


def resolve_train_attention(attention: str) -> str:
    """"auto" → the Pallas kernel pair on a GPU backend (faster for the draft layers at Qwen3-8B
    shapes, docs/training.md), the XLA chunks elsewhere."""
    if attention not in TRAIN_ATTENTION:
        raise ValueError(f"training attention {attention!r} is not one of {TRAIN_ATTENTION}")
    if attention == "auto":
        return "pallas_gpu" if jax.default_backend() == "gpu" else "xla"
    return attention


def split_attention(q, kc, vc, kb, vb, anchors, block_size: int, *, chunk_blocks: int = 32,
                    attention: str = "auto", interpret: bool = False, window: int | None = None,
                    causal: bool = False):
    """q [B, N·S, Hq, D] block queries; kc, vc [B, T, Hkv, D] context K/V at positions 0..T-1;
    kb, vb [B, N·S, Hkv, D] block K/V; anchors [B, N]. Returns o [B, N·S, Hq, D] in q.dtype.

    attention: "auto" (pallas_gpu on a GPU, else xla), "xla" computes the context part per chunk of blocks as dense scores over all T keys
    (masked to t < a_j); "pallas_gpu" runs it as one flash-attention kernel pair over the whole
    sequence (pallas_kernels.attention.train_gpu: no scores in HBM, key tiles past a block's anchor
    skipped; `interpret` runs it in Pallas interpret mode, for tests on CPU). The block-diagonal
    part and the merge are the same jnp code for both.

    window / causal: a sliding layer's W (context keys and block keys within W of the query's
    position) and a causal block (drafts.dflash2's masks). A window runs the context part on the
    XLA path (the Pallas pair takes key ends only)."""
    requested, attention = attention, resolve_train_attention(attention)
    if window is not None and attention == "pallas_gpu":
        log.info("training context attention: a sliding window runs on the XLA path")
        attention = "xla"
    bmask = None if window is None and not causal else block_mask(block_size, window, causal)
    B, NS, Hq, D = q.shape
    S, Hkv = block_size, kb.shape[2]
    N = NS // S
    G = Hq // Hkv
    scale = D ** -0.5
    c = max(1, min(chunk_blocks, N))
    n = -(-N // c)
    pad = n * c - N
    qb = _gqa(q.reshape(B, N, S, Hq, D), Hkv)                                  # [B, N, S, Hkv, G, D]
    kbb, vbb = kb.reshape(B, N, S, Hkv, D), vb.reshape(B, N, S, Hkv, D)
    if attention == "pallas_gpu" and requested == "auto":
        try:
            check_context_attention(q, kc)
        except Unsupported as e:                      # auto picks what runs: the XLA chunks
            log.info("training context attention: %s; using the XLA path", e)
            attention = "xla"
    if attention == "pallas_gpu":
        ends = jnp.repeat(anchors, S, axis=1)                                  # [B, N·S]
        o1, l1 = context_attention(q, kc, vc, ends, scale=scale, interpret=interpret)
        ctx = (o1.reshape(B, N, S, Hkv, G, D),                                 # [B, N, S, Hkv, G, D]
               jnp.moveaxis(l1.reshape(B, N, S, Hkv, G), 2, -1))              # [B, N, Hkv, G, S]
    else:
        ctx = (anchors,)
    padn = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
    # chunks first for lax.map: [n, B, c, ...]
    chunked = lambda x: jnp.moveaxis(padn(x).reshape(B, n, c, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(args):
        qc, kbc, vbc, *ctx_c = args
        if attention == "pallas_gpu":
            o1, l1 = ctx_c
        else:
            o1, l1 = _context_part(qc, kc, vc, ctx_c[0], scale, window)
        o2, l2 = _block_part(qc, kbc, vbc, scale, bmask)
        return _merge(o1, l1, o2, l2).astype(q.dtype)                          # [B, c, S, Hkv, G, D]

    o = jax.lax.map(one, tuple(chunked(x) for x in (qb, kbb, vbb, *ctx)))
    o = jnp.moveaxis(o, 0, 1).reshape(B, n * c, S, Hq, D)[:, :N]
    return o.reshape(B, NS, Hq, D)


def dense_attention(q, kc, vc, kb, vb, anchors, block_size: int, window: int | None = None,
                    causal: bool = False):
    """The reference: one softmax over [context ; all block keys] with the full visibility mask
    (context key t visible iff t < a_j; block key visible iff in the query's own block; with
    `window` / `causal` also by position: key > p - W, key <= p when causal, key < p + W when
    not). Tests only."""
    B, NS, Hq, D = q.shape
    T, Hkv = kc.shape[1], kc.shape[2]
    S = block_size
    k = jnp.concatenate([kc, kb], axis=1)                                      # [B, T+NS, Hkv, D]
    v = jnp.concatenate([vc, vb], axis=1)
    qg = _gqa(q, Hkv)                                                          # [B, NS, Hkv, G, D]
    s = jnp.einsum("bshgd,bthd->bhgst", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    q_block = jnp.arange(NS) // S                                              # [NS]
    q_anchor = jnp.repeat(anchors, S, axis=1)                                  # [B, NS]
    key = jnp.arange(T + NS)
    ctx_vis = (key[None, None, :] < T) & (key[None, None, :] < q_anchor[:, :, None])
    blk_vis = (key[None, :] >= T) & ((key[None, :] - T) // S == q_block[:, None])
    visible = ctx_vis | blk_vis[None]                                          # [B, NS, T+NS]
    q_pos = q_anchor + (jnp.arange(NS) % S)                                    # [B, NS]
    k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(T), (B, T)),
                             jnp.repeat(anchors, S, axis=1) + (jnp.arange(NS) % S)], axis=1)   # [B, T+NS]
    d = q_pos[:, :, None] - k_pos[:, None, :]                                  # query - key
    if causal:
        visible &= d >= 0
    if window is not None:
        visible &= (d < window) & (causal | (-d < window))
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgst,bthd->bshgd", p, v.astype(jnp.float32))
    return o.reshape(B, NS, Hq, D).astype(q.dtype)


def draft_forward(draft, block_embeds, feats, anchors, *, chunk_blocks: int = 32, dense: bool = False,
                  attention: str = "auto", interpret: bool = False):
    """The draft over all packed blocks. block_embeds [B, N·S, H] (the target's embedding of
    `block_tokens`), feats [B, T, n·H] the target's taps of the whole sequence, anchors [B, N].
    Returns the final-normed hidden states [B, N·S, H] (slot k of block j at j·S + k).
    attention / interpret: the context part's implementation (`split_attention`).
    A DFlash2 draft's layers (drafts.dflash2) run their convs per block (`attention_input`,
    `attention_output`: the inference code) and each layer's window / causal mask."""
    S = draft.config.block_size
    B, T = feats.shape[:2]
    positions = block_positions(anchors, S)                                    # [B, N·S]
    ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = draft.context(feats)                                                 # [B, T, H]
    x = block_embeds.astype(draft.dtype)
    cfg = draft.config
    for i, layer in enumerate(draft.layers):
        v2 = hasattr(layer, "attention_input")
        window, causal = cfg.layer_window(i), cfg.layer_causal(i)
        with jax.named_scope(f"draft_layer{i}"):
            kc, vc = layer.context_kv(ctx, ctx_pos)                            # [B, T, Hkv, D]
            h, taps = layer.attention_input(x, S) if v2 else (layer.input_layernorm(x), None)
            q, kb, vb = layer.qkv_heads(h, positions)                          # [B, N·S, H*, D]
            if dense:
                o = dense_attention(q, kc, vc, kb, vb, anchors, S, window, causal)
            else:
                o = split_attention(q, kc, vc, kb, vb, anchors, S, chunk_blocks=chunk_blocks,
                                    attention=attention, interpret=interpret, window=window, causal=causal)
            x = layer.attention_output(x, o, taps, S) if v2 else layer.attn_mlp(x, o)
    return draft.norm(x)
