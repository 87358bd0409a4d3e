"""A training run: epochs over a `TokenData`, the jitted step, Orbax checkpoints with exact resume,
SIGTERM → save and exit, NaN/inf → stop naming the step, metrics (tqdm, JSONL, PNG) and a real-τ eval
hook (our own speculative `generate` on held-out prompts)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import DraftConfig
from dflash_jax.drafts.dflash import DFlashDraft
from dflash_jax.models.stack import CausalLM
from dflash_jax.train.checkpoint import (RunCheckpoints, check_contract, check_draft, check_identity, check_settings,
                                         target_identity)
from dflash_jax.train.data import DataError, TokenData
from dflash_jax.train.step import StepConfig, Trainer, TrainState, init_state, make_mesh, split_draft, trim_batch

__all__ = ["RunConfig", "RunResult", "TrainingDiverged", "train", "draft_from_params", "epoch_order"]


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


@dataclasses.dataclass
class RunConfig:
    out_dir: str                          # checkpoints/, metrics.jsonl, curves.png
    batch_size: int = 8                   # sequences per step (global, a multiple of the devices)
    epochs: int = 6
    max_steps: int | None = None          # cap on steps (also the LR schedule's horizon)
    seed: int = 0                         # data order and anchors
    save_every: int = 500
    log_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0                   # 0: no eval hook
    eval_prompts: Sequence[Sequence[int]] = ()
    eval_max_new_tokens: int = 64
    eval_attention_impl: str = "auto"
    stop_after: int | None = None         # stop (with a checkpoint) after this many steps of this call
    progress: bool = True
    model_path: str | None = None         # recorded in checkpoints (a resume on another target is refused)
    data_path: str | None = None          # likewise for the data (by its manifest hash)

    def __post_init__(self):
        for name, low in (("batch_size", 1), ("epochs", 0), ("save_every", 1), ("log_every", 1), ("eval_every", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {getattr(self, name)!r}")
        for name in ("max_steps", "stop_after"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None), got {v!r}")


@dataclasses.dataclass
class RunResult:
    state: TrainState
    draft_def: object
    step: int
    epoch: int
    status: str                           # "done", "stopped" (stop_after), "preempted" (SIGTERM)
    metrics: list                         # the JSONL records written by this call

    def draft(self, dtype="float32") -> DFlashDraft:
        return draft_from_params(self.draft_def, self.state.params, dtype)


def _draft_class(cfg: DraftConfig):
    from dflash_jax.drafts import variant_of_config
    return variant_of_config(cfg).model


def draft_from_params(draft_def, params, dtype="float32") -> DFlashDraft:
    """A draft module (its config's variant: DFlash, DFlash2) of `dtype` from the run's float32
    master params."""
    cfg = nnx.merge(draft_def, params).config
    dt = jnp.dtype(dtype)
    shell = nnx.eval_shape(lambda: _draft_class(cfg)(cfg, dt, rngs=nnx.Rngs(0)))
    gd, _ = nnx.split(shell, nnx.Param)
    return nnx.merge(gd, jax.tree.map(lambda p: jnp.asarray(p, dt), params))


def epoch_order(seed: int, epoch: int, rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(rows)


def _plot(records: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional dependency
        print(f"curves.png skipped: matplotlib is not installed (pip install matplotlib); "
              f"the numbers are in {os.path.join(os.path.dirname(path), 'metrics.jsonl')}", file=sys.stderr)
        return
    tr = [r for r in records if "loss" in r]
    ev = [r for r in records if "eval_tau" in r]
    if not tr:
        return
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in tr]
    ax[0].plot(steps, [r["loss"] for r in tr]); ax[0].set_title("loss"); ax[0].set_yscale("log")
    ax[1].plot(steps, [r["tau_est"] for r in tr], label="teacher-forced τ")
    if ev:
        ax[1].plot([r["step"] for r in ev], [r["eval_tau"] for r in ev], "o-", label="real τ (eval)")
    ax[1].legend(); ax[1].set_title("τ")
    acc = np.asarray([r["slot_acc"] for r in tr])
    for k in range(acc.shape[1]):
        ax[2].plot(steps, acc[:, k], lw=0.8, label=f"slot {k + 1}" if k in (0, acc.shape[1] - 1) else None)
    ax[2].legend(); ax[2].set_title("per-slot accuracy")
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def eval_tau(target: CausalLM, draft: DFlashDraft, prompts, max_new_tokens: int, attention_impl: str = "auto") -> float:
    """Mean acceptance length of our real speculative loop (greedy) on `prompts`."""
    from dflash_jax.decode import generate
    res = generate(target, draft, [list(p) for p in prompts], max_new_tokens=max_new_tokens,
                   attention_impl=attention_impl, verify_width="block")   # tau over whole blocks, as the paper
    lengths = [x for row in res.acceptance_lengths for x in row]
    return float(np.mean(lengths)) if lengths else float("nan")


def train(target: CausalLM, draft: DFlashDraft | DraftConfig, data: TokenData, step_cfg: StepConfig | None = None,
          run: RunConfig | None = None, *, mesh=None, **step_kw) -> RunResult:
    """Train `draft` (a module: random or loaded, to fine-tune; or a DraftConfig: random init) against
    the frozen `target` on `data`. Resumes from run.out_dir/checkpoints when one exists (the contract
    must match). step_cfg defaults from the draft's config; `step_kw` overrides its fields. The target
    may be quantized (load_target(..., quantize="int8"), an FP8 checkpoint): its forward and the LM
    head the draft's logits read are then the quantized model's, as at inference; the draft's master
    weights stay float32. A resume refuses another quantization (--quantize)."""
    run = run or RunConfig(out_dir="dflash_train_run")
    if isinstance(draft, DraftConfig):
        cls = _draft_class(draft)
        draft = (cls.for_training(draft, jnp.float32, seed=run.seed) if hasattr(cls, "for_training")
                 else cls(draft, jnp.float32, rngs=nnx.Rngs(run.seed)))
    dcfg = draft.config
    dcfg.check_fits(target.config)
    if step_cfg is None:
        step_cfg = StepConfig(block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                              target_layer_ids=tuple(dcfg.target_layer_ids))
    mesh = mesh or make_mesh()
    ndev = mesh.shape["data"]
    if run.batch_size % ndev:
        raise ValueError(f"batch_size {run.batch_size} is not a multiple of the {ndev} devices")
    if len(data) < run.batch_size:
        raise DataError(f"the data set has {len(data)} rows, fewer than one batch of {run.batch_size}")
    if data.max_len < step_cfg.block_size + 1:
        raise DataError(f"max length {data.max_len} is shorter than one block ({step_cfg.block_size}) + 1")
    data.check_vocab(target.config.vocab_size)
    steps_per_epoch = len(data) // run.batch_size
    total = run.epochs * steps_per_epoch
    if run.max_steps is not None:
        total = min(total, run.max_steps) if run.epochs else run.max_steps
    if total < 1:
        raise DataError(f"the run has no step to take (epochs {run.epochs}, max_steps {run.max_steps})")
    step_cfg = dataclasses.replace(step_cfg, total_steps=int(total), anchor_draw_len=data.max_len, **step_kw)
    for field, have in (("block_size", dcfg.block_size), ("mask_token_id", dcfg.mask_token_id),
                        ("target_layer_ids", tuple(dcfg.target_layer_ids))):
        if getattr(step_cfg, field) != have:
            raise ValueError(f"step config {field}={getattr(step_cfg, field)!r} differs from the draft's {have!r}")

    draft_def, params = split_draft(draft, step_cfg.compute_dtype)
    trainer = Trainer(target, draft_def, step_cfg, mesh)
    os.makedirs(run.out_dir, exist_ok=True)
    ckpt = RunCheckpoints(os.path.join(run.out_dir, "checkpoints"), run.keep_checkpoints)
    contract = dict(step_cfg.contract(), max_len=data.max_len, batch_size=run.batch_size, seed=run.seed,
                    total_steps=step_cfg.total_steps)
    if dcfg.selector_top_k:
        contract["selector_weight"] = step_cfg.selector_weight
    identity = dict(target_identity(target, run.model_path), data_path=run.data_path, data=data.fingerprint())
    settings = dict(lr=step_cfg.lr, warmup_frac=step_cfg.warmup_frac, weight_decay=step_cfg.weight_decay,
                    clip_norm=step_cfg.clip_norm, b1=step_cfg.b1, b2=step_cfg.b2,
                    compute_dtype=step_cfg.compute_dtype, target_dtype=str(target.dtype),
                    target_quantize=getattr(target, "quantize", None))
    state = init_state(params, step_cfg)
    epoch, cursor = 0, 0

    def check(saved):
        check_draft(saved.get("draft_config"), dataclasses.asdict(dcfg), ckpt.directory)
        check_contract(saved["contract"], contract, ckpt.directory)
        # another quantization of the same target reads as that (--quantize), not as other weights
        check_settings({k: v for k, v in saved.get("settings", {}).items() if k == "target_quantize"}, settings,
                       ckpt.directory)
        check_identity(saved.get("identity", {}), identity, ckpt.directory)
        check_settings(saved.get("settings", {}), settings, ckpt.directory)

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=trainer.repl), state)
    try:
        found = ckpt.restore_latest(abstract, check)
    except BaseException:
        ckpt.close()
        raise
    if found is not None:
        _, state, saved = found
        epoch, cursor = saved["epoch"], saved["cursor"]
    state = trainer.place_state(state)
    step = int(state.step)

    def meta():
        return dict(step=step, epoch=epoch, cursor=cursor, seed=run.seed, contract=contract,
                    identity=identity, settings=settings, draft_config=dataclasses.asdict(dcfg))

    stop = {"sigterm": False}
    prev = None
    try:
        prev = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("sigterm", True))
    except ValueError:  # not the main thread: no handler, the caller owns signals
        pass
    records: list = []
    metrics_path = os.path.join(run.out_dir, "metrics.jsonl")
    from tqdm import tqdm
    bar = tqdm(total=total, initial=step, disable=not run.progress, desc="train", dynamic_ncols=True)
    status, done_here, last_save = "done", 0, step
    t_log, tok_log = time.perf_counter(), 0
    try:
        order = epoch_order(run.seed, epoch, len(data))
        while step < total:
            if cursor + run.batch_size > len(data):
                epoch, cursor = epoch + 1, 0
                order = epoch_order(run.seed, epoch, len(data))
            idx = np.sort(order[cursor: cursor + run.batch_size])
            tokens, lm, n_anchors = trim_batch(data.tokens[idx], data.loss_mask[idx], step_cfg.num_anchors)
            state, m = trainer.step(state, tokens, lm, idx, epoch, num_anchors=n_anchors)
            loss, gn = float(m["loss"]), float(m["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(gn)):
                raise TrainingDiverged(f"non-finite loss {loss} / grad norm {gn} at step {step + 1} (epoch {epoch}); "
                                       f"the last good checkpoint (step {ckpt.latest()}) is kept")
            step, cursor, done_here = step + 1, cursor + run.batch_size, done_here + 1
            tok_log += int(np.asarray(lm).sum())
            bar.update(1)
            if step % run.log_every == 0 or step == total:
                dt = time.perf_counter() - t_log
                rec = dict(step=step, epoch=epoch, loss=loss, grad_norm=gn, lr=float(m["lr"]),
                           tau_est=float(m["tau_est"]), slot_acc=np.asarray(m["slot_acc"]).round(4).tolist(),
                           tokens_per_s=tok_log / max(dt, 1e-9))
                if "sel_loss" in m:
                    rec.update(sel_loss=float(m["sel_loss"]), topk_recall=float(m["topk_recall"]),
                               sel_tau_est=float(m["sel_tau_est"]),
                               sel_acc=np.asarray(m["sel_acc"]).round(4).tolist())
                t_log, tok_log = time.perf_counter(), 0
                records.append(rec)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                bar.set_postfix(loss=f"{loss:.3f}", tau=f"{rec['tau_est']:.2f}")
            if run.eval_every and run.eval_prompts and (step % run.eval_every == 0 or step == total):
                d = draft_from_params(draft_def, state.params, step_cfg.compute_dtype)
                rec = dict(step=step, eval_tau=eval_tau(target, d, run.eval_prompts, run.eval_max_new_tokens,
                                                        run.eval_attention_impl))
                records.append(rec)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if step % run.save_every == 0:
                ckpt.save(step, state, meta()); last_save = step
            if stop["sigterm"]:
                status = "preempted"
                break
            if run.stop_after is not None and done_here >= run.stop_after:
                status = "stopped"
                break
        if last_save != step:
            ckpt.save(step, state, meta())
    finally:
        bar.close()
        ckpt.close()
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
        all_records = []
        if os.path.isfile(metrics_path):
            with open(metrics_path) as f:
                all_records = [json.loads(l) for l in f if l.strip()]
        _plot(all_records, os.path.join(run.out_dir, "curves.png"))
    return RunResult(state=state, draft_def=draft_def, step=step, epoch=epoch, status=status, metrics=records)


def load_run_draft(run_dir: str, step: int | None = None, dtype="float32") -> tuple[DFlashDraft, dict]:
    """(draft module, checkpoint meta) from a run directory's latest readable (or the given) checkpoint."""
    from dflash_jax.train.checkpoint import CheckpointError
    from dflash_jax.train.step import StepConfig as _SC
    cdir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(cdir):
        raise FileNotFoundError(f"{run_dir} has no checkpoint (checkpoints/ is missing)")
    ckpt = RunCheckpoints(cdir)
    holder = {}

    def abstract(meta):
        d = dict(meta["draft_config"])
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        d["layer_types"] = tuple(d.get("layer_types") or ())
        dcfg = DraftConfig(**d)
        c = meta["contract"]
        scfg = _SC(block_size=c["block_size"], mask_token_id=c["mask_token_id"],
                   target_layer_ids=tuple(c["target_layer_ids"]), total_steps=c["total_steps"])
        shell = nnx.eval_shape(lambda: _draft_class(dcfg)(dcfg, jnp.float32, rngs=nnx.Rngs(0)))
        holder["def"], params = nnx.split(shell, nnx.Param)
        return jax.eval_shape(lambda p: init_state(p, scfg), params)

    try:
        if step is None:
            found = ckpt.restore_latest(abstract, then="using")
            if found is None:
                raise FileNotFoundError(f"{run_dir} has no checkpoint (checkpoints/ is empty)")
            _, state, meta = found
        else:
            if step not in ckpt.manager.all_steps():
                raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step} "
                                        f"(steps: {sorted(ckpt.manager.all_steps())})")
            try:
                state, meta = ckpt.restore(step, abstract(ckpt.read_meta(step)))
            except Exception as e:   # noqa: BLE001  a damaged step: one line, not orbax's traceback
                raise CheckpointError(f"checkpoint step {step} of {run_dir} cannot be read back "
                                      f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    finally:
        ckpt.close()
    return draft_from_params(holder["def"], state.params, dtype), meta
