"""One jitted training step: the frozen target's forward gives the tap features online, then the
draft's forward and backward over the packed anchor blocks, AdamW with a clipped global norm.

Master weights and optimiser state are float32; the draft runs in the compute dtype (bf16 by
default) by casting the master weights inside the step, so gradients arrive in float32. Data
parallelism: the batch is sharded over the mesh axis 'data' (NamedSharding), parameters and optimiser
state replicated; the loss is Σ w·CE / Σ w over the global batch, which jit computes across devices,
so 1 and 8 devices give the same update. The same code runs on one device (a mesh of one)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.drafts.dflash import DFlashDraft
from dflash_jax.models.stack import CausalLM
from dflash_jax.train.anchors import anchor_key, sample_anchors
from dflash_jax.train.loss import block_labels, block_loss_sums, default_gamma
from dflash_jax.train.packed import TRAIN_ATTENTION, block_tokens, draft_forward

__all__ = ["StepConfig", "TrainState", "make_optimizer", "init_state", "make_mesh", "Trainer", "build_step",
           "step_shardings", "split_draft", "loss_and_metrics", "trim_batch"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the compiled step specialises on (hashable; part of the run's contract where marked)."""
    block_size: int                      # contract
    mask_token_id: int                   # contract
    target_layer_ids: tuple[int, ...]    # contract
    num_anchors: int = 512               # contract
    gamma: float | None = None           # contract; None: default_gamma(block_size)
    total_steps: int = 1000
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    compute_dtype: str = "bfloat16"
    attention_impl: str = "xla"          # the target's forward (auto: Pallas / cuDNN on accelerators)
    train_attention: str = "auto"        # the draft's context attention: "auto" | "xla" | "pallas_gpu" (packed.py)
    chunk_blocks: int = 32               # blocks per attention chunk
    head_chunk: int = 2048               # block slots per LM-head chunk
    anchor_seed: int = 0                 # contract
    anchor_draw_len: int | None = None   # anchors' random draw covers this many positions (None: the
                                         # batch's length); the data's row length, so a batch trimmed
                                         # to its longest row draws the same anchors as a padded one
    selector_weight: float = 1.0         # contract for a draft with a selector: loss = block + α·selector

    def __post_init__(self):
        if not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor; slots 1.. are predicted), "
                             f"got {self.block_size!r}")
        if not (isinstance(self.num_anchors, int) and self.num_anchors >= 1):
            raise ValueError(f"num_anchors must be an integer >= 1, got {self.num_anchors!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma!r}")
        if not self.selector_weight >= 0:
            raise ValueError(f"selector_weight must be >= 0, got {self.selector_weight!r}")
        if self.train_attention not in TRAIN_ATTENTION:
            raise ValueError(f"train_attention {self.train_attention!r} is not one of {TRAIN_ATTENTION}")

    @property
    def gamma_value(self) -> float:
        return float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)

    def contract(self) -> dict:
        """The fields a resumed run must share with the checkpoint."""
        return dict(block_size=self.block_size, mask_token_id=self.mask_token_id,
                    target_layer_ids=list(self.target_layer_ids), num_anchors=self.num_anchors,
                    gamma=self.gamma_value, anchor_seed=self.anchor_seed)


@struct.dataclass
class TrainState:
    params: Any          # the draft's nnx.Param state, float32
    opt_state: Any
    step: jax.Array      # [] int32


def lr_schedule(cfg: StepConfig):
    """Cosine decay to 0 after a linear warm-up over warmup_frac of the run (from 0)."""
    warmup = max(1, int(round(cfg.warmup_frac * cfg.total_steps)))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.total_steps, warmup + 1), 0.0)


def make_optimizer(cfg: StepConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def split_draft(draft: DFlashDraft, compute_dtype):
    """(graphdef in the compute dtype, float32 master params) of a draft module of any dtype and
    variant (DFlash, DFlash2)."""
    dt = jnp.dtype(compute_dtype)
    shell = nnx.eval_shape(lambda: type(draft)(draft.config, dt, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(shell, nnx.Param)
    params = nnx.state(draft, nnx.Param)
    return graphdef, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def init_state(params, cfg: StepConfig) -> TrainState:
    return TrainState(params=params, opt_state=make_optimizer(cfg).init(params), step=jnp.zeros((), jnp.int32))


def make_mesh(devices=None) -> Mesh:
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), ("data",))


def target_features(target: CausalLM, tokens, cfg: StepConfig):
    """The frozen target's taps [B, T, n·H] of the whole sequence (no gradient): prefill from a fresh
    cache of capacity T, the same forward inference runs."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    _, feats, _ = target(tokens, positions, target.new_cache(B, T), positions + 1,
                         taps=cfg.target_layer_ids, kernels=cfg.attention_impl, prefill=True)
    return jax.lax.stop_gradient(feats)


def loss_and_metrics(params, draft_def, target: CausalLM, tokens, loss_mask, sample_ids, epoch, cfg: StepConfig,
                     dense: bool = False, feats=None):
    """(loss, metrics) of the draft with master `params` on a batch: tokens, loss_mask [B, T],
    sample_ids [B] (anchor keys), epoch [] int32; feats: the target's taps when computed already."""
    dt = jnp.dtype(cfg.compute_dtype)
    draft = nnx.merge(draft_def, jax.tree.map(lambda p: p.astype(dt), params))
    keys = anchor_key(cfg.anchor_seed, epoch, sample_ids)
    anchors, keep = sample_anchors(keys, loss_mask, cfg.num_anchors, draw_len=cfg.anchor_draw_len)  # [B, N]
    with jax.named_scope("target"):
        if feats is None:
            feats = target_features(target, tokens, cfg)                       # [B, T, n·H]
        embeds = jax.lax.stop_gradient(
            target.embed_tokens(block_tokens(tokens, anchors, cfg.block_size, cfg.mask_token_id)))
    with jax.named_scope("draft"):
        hidden = draft_forward(draft, embeds, feats, anchors, chunk_blocks=cfg.chunk_blocks, dense=dense,
                               attention=cfg.train_attention)
    labels, weights, valid = block_labels(tokens, loss_mask, anchors, keep, cfg.block_size, cfg.gamma_value)
    v2 = draft if hasattr(draft, "unary_logits") else None     # DFlash2: its unary logits and selector
    prev = None
    if getattr(draft, "candidate_selector", None) is not None:
        # each slot's gold predecessor: the anchor token for slot 1, else the previous slot's label
        first = jnp.take_along_axis(tokens, anchors, axis=1).astype(jnp.int32)          # [B, N]
        prev = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)            # [B, N, S-1]
    with jax.named_scope("lm_head"):
        sums = block_loss_sums(target, hidden, labels, weights, valid, head_chunk=cfg.head_chunk, draft=v2,
                               prev=prev)
    loss = sums["loss_sum"] / jnp.maximum(sums["weight_sum"], 1e-9)
    if prev is not None and cfg.selector_weight:
        loss = loss + cfg.selector_weight * sums["sel_loss_sum"] / jnp.maximum(sums["sel_weight_sum"], 1e-9)
    return loss, sums


def _metrics(loss, sums, grad_norm, lr):
    m = dict(loss=loss, grad_norm=grad_norm, lr=lr,
             slot_acc=sums["slot_correct"] / jnp.maximum(sums["slot_count"], 1.0),
             tau_est=sums["tau_sum"] / jnp.maximum(sums["blocks"], 1.0),
             blocks=sums["blocks"], weight_sum=sums["weight_sum"],
             finite=jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    if "sel_loss_sum" in sums:   # DFlash2's selector: its CE, top-K recall, path accuracy and τ
        m.update(sel_loss=sums["sel_loss_sum"] / jnp.maximum(sums["sel_weight_sum"], 1e-9),
                 topk_recall=sums["sel_hits"] / jnp.maximum(jnp.sum(sums["slot_count"]), 1.0),
                 sel_acc=sums["sel_correct"] / jnp.maximum(sums["slot_count"], 1.0),
                 sel_tau_est=sums["sel_tau_sum"] / jnp.maximum(sums["blocks"], 1.0))
    return m


def build_step(target_def, draft_def, cfg: StepConfig):
    """The pure training step (state, target_state, tokens, loss_mask, sample_ids, epoch) → (state,
    metrics), for `jax.jit` with the caller's shardings (Trainer; ahead-of-time compiles)."""
    opt = make_optimizer(cfg)
    sched = lr_schedule(cfg)
    norm = optax.tree.norm if hasattr(optax, "tree") else optax.global_norm

    def step(state: TrainState, target_state, tokens, loss_mask, sample_ids, epoch):
        target = nnx.merge(target_def, target_state)
        with jax.named_scope("target"):   # outside the differentiated function: no tangents at all
            feats = target_features(target, tokens, cfg)
        (loss, sums), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            state.params, draft_def, target, tokens, loss_mask, sample_ids, epoch, cfg, feats=feats)
        gnorm = norm(grads)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
        return new, _metrics(loss, sums, gnorm, sched(state.step))

    return step


def step_shardings(mesh: Mesh):
    """(in_shardings, out_shardings) of build_step's function: batch on 'data', the rest replicated."""
    repl, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return (repl, repl, batch, batch, batch, repl), (repl, repl)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def trim_batch(tokens: np.ndarray, loss_mask: np.ndarray, num_anchors: int, min_len: int = 128):
    """(tokens, loss_mask, anchors) of a host batch [B, T] cut to what its rows use: the length to the
    last response token of the longest row, and the anchor count to the most valid anchor positions
    of a row, each rounded up to a power of two (so a run compiles a few shapes, not one per batch)
    and capped at T / num_anchors. Nothing past a row's last response token is a label or context
    of an anchor, and the sampler keeps every valid position a row has up to num_anchors, so the
    loss and gradients are those of the padded batch (the padded blocks weigh 0)."""
    lm = np.asarray(loss_mask).astype(bool)
    T = lm.shape[1]
    used = lm.any(axis=0)
    last = int(np.nonzero(used)[0][-1]) + 1 if used.any() else 1
    length = min(T, max(min_len, _pow2_at_least(last)))
    valid = int((lm[:, :-1] & lm[:, 1:]).sum(axis=1).max()) if T > 1 else 0
    anchors = min(num_anchors, _pow2_at_least(max(1, valid)))
    return tokens[:, :length], loss_mask[:, :length], anchors


class Trainer:
    """The compiled step over a mesh. `step(state, tokens, loss_mask, sample_ids, epoch)` → (state,
    metrics); the state is donated. tokens / loss_mask [B, T] (B a multiple of the 'data' axis)."""

    def __init__(self, target: CausalLM, draft_def, cfg: StepConfig, mesh: Mesh | None = None):
        self.cfg, self.mesh = cfg, mesh or make_mesh()
        self.target_def, target_state = nnx.split(target)
        self.draft_def = draft_def
        self.repl = NamedSharding(self.mesh, P())
        self.target_state = jax.device_put(target_state, self.repl)
        self._steps = {}
        self._step = self._compiled(cfg.num_anchors)

    def _compiled(self, num_anchors: int):
        """The jitted step drawing `num_anchors` anchors per row (one per anchor bucket)."""
        if num_anchors not in self._steps:
            cfg = dataclasses.replace(self.cfg, num_anchors=num_anchors)
            ins, outs = step_shardings(self.mesh)
            self._steps[num_anchors] = jax.jit(build_step(self.target_def, self.draft_def, cfg), in_shardings=ins,
                                               out_shardings=outs, donate_argnums=(0,))
        return self._steps[num_anchors]

    def place_state(self, state: TrainState) -> TrainState:
        return jax.device_put(state, self.repl)

    def step(self, state: TrainState, tokens, loss_mask, sample_ids, epoch, *, num_anchors: int | None = None):
        """num_anchors: anchors drawn per row this step (≤ cfg.num_anchors; trim_batch's count), or
        cfg.num_anchors."""
        n = self.mesh.shape["data"]
        if tokens.shape[0] % n:
            raise ValueError(f"batch {tokens.shape[0]} is not a multiple of the {n} devices on the 'data' axis")
        args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(loss_mask, jnp.int32),
                jnp.asarray(sample_ids, jnp.int32), jnp.asarray(epoch, jnp.int32))
        fn = self._compiled(min(self.cfg.num_anchors, num_anchors or self.cfg.num_anchors))
        return fn(state, self.target_state, *args)

    def lower(self, state, tokens, loss_mask, sample_ids, epoch):
        """The step lowered (ahead-of-time compiles: memory_analysis, cost_analysis)."""
        return self._step.lower(state, self.target_state, tokens, loss_mask, sample_ids, epoch)
