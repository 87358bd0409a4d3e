"""`python -m dflash_jax.train {regenerate,train,export}`: see docs/training.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import numpy as np

# z-lab's Qwen3 drafts use this id (a reserved row of the Qwen3 embedding) as the block's MASK.
QWEN3_MASK_TOKEN_ID = 151669
QWEN3_VOCAB = 151936
# --quantize's choices: dflash_jax.quantize.QUANTIZE (spelled here so `--help` does not import JAX)
QUANTIZE = ("int8", "int8+head")


class UsageError(ValueError):
    """A command-line input the trainer cannot use (one line, exit 2)."""


def _jsonl_rows(path: str):
    """(line number, dict) of a JSONL file; a line that is not a JSON object is refused as FILE:LINE."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            yield n, row


def _prompt_ids(path: str, n: int, ids, vocab: int | None) -> list[int]:
    """A row's prompt_ids checked: a non-empty list of integers in [0, vocab)."""
    if not isinstance(ids, list) or not ids:
        raise UsageError(f"{path}:{n}: prompt_ids must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise UsageError(f"{path}:{n}: prompt_ids holds {t!r}, not an integer token id")
        if t < 0 or (vocab is not None and t >= vocab):
            raise UsageError(f"{path}:{n}: token id {t} is outside the target's vocabulary [0, {vocab})")
    return ids


def _read_prompts(path: str, tokenizer, thinking: bool, max_samples: int | None, vocab: int | None = None,
                  ids_only: bool = False) -> list[list[int]]:
    """Token-id prompts from JSONL rows: {"prompt_ids": [...]}, chat {"messages": [...]} or ShareGPT
    {"conversations": [{"from", "value"}]} (the first user turn, with its system turn), or plain
    {"prompt"} / {"text"} / {"question"}. Text is rendered with the chat template (thinking off).
    Ids are checked against `vocab`; a bad row is refused as FILE:LINE."""
    from dflash_jax.data import apply_chat_template
    out = []
    for n, row in _jsonl_rows(path):
        if "prompt_ids" in row:
            out.append(_prompt_ids(path, n, row["prompt_ids"], vocab))
        elif ids_only:
            raise UsageError(f"{path}:{n}: --prompts-are-ids needs prompt_ids in every row")
        else:
            if tokenizer is None:
                raise UsageError(f"{path}:{n}: a text prompt needs a tokenizer (--model or --tokenizer)")
            turns = row.get("messages") or row.get("conversations")
            system, user = None, None
            if turns:
                for t in turns:
                    if not isinstance(t, dict):
                        continue
                    role = t.get("role", t.get("from"))
                    text = t.get("content", t.get("value"))
                    if role == "system":
                        system = text
                    elif role in ("user", "human") and user is None:
                        user = text
            else:
                user = row.get("prompt", row.get("text", row.get("question")))
            if not user or not isinstance(user, str):
                raise UsageError(f"{path}:{n}: no user turn (expected prompt_ids, messages, conversations, prompt or text)")
            out.append(apply_chat_template(tokenizer, user, system=system, thinking=thinking))
        if max_samples and len(out) >= max_samples:
            break
    if not out:
        raise UsageError(f"{path}: no prompts")
    return out


def _model_dir(args) -> str:
    from dflash_jax.weights import resolve_model_dir
    return resolve_model_dir(args.model)


def _checkpoint_dtype(model_dir: str) -> str:
    """The target checkpoint's own dtype (config.json torch_dtype / dtype): float32 stays float32, so
    regenerated data and the trained draft match the target's float32 outputs; anything else bfloat16."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return "bfloat16"
    dt = cfg.get("torch_dtype") or cfg.get("dtype") if isinstance(cfg, dict) else None
    return "float32" if dt in ("float32", "fp32") else "bfloat16"


def _target(args):
    import dflash_jax as dj
    d = _model_dir(args)
    if args.dtype is None:
        args.dtype = _checkpoint_dtype(d)
    return dj.load_target(d, dtype=args.dtype, quantize=args.quantize)


def _tokenizer(source: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001  no tokenizer files, offline, ...: one line
        raise UsageError(f"cannot load a tokenizer from {source!r} ({type(e).__name__}); "
                         "give --tokenizer, or token ids with --prompts-are-ids") from None


def _interruptible() -> None:
    """From here Ctrl-C is a KeyboardInterrupt that the run's own code sees (its files are closed on
    the way out; main says "interrupted", exit 130); until here it ended the process at once."""
    from dflash_jax import startup
    startup.interrupt_as_exception()


def cmd_regenerate(args) -> int:
    from dflash_jax.config import TargetConfig
    from dflash_jax.train.data import regenerate
    if not (args.prompts or args.dataset):
        raise UsageError("regenerate: give --prompts FILE.jsonl or --dataset NAME")
    if args.prompts and args.dataset:
        raise UsageError("regenerate: give --prompts FILE.jsonl or --dataset NAME, not both")
    if args.dataset and args.prompts_are_ids:
        raise UsageError("regenerate: --prompts-are-ids reads --prompts FILE.jsonl, not a --dataset")
    vocab = TargetConfig.from_pretrained(_model_dir(args)).vocab_size
    tok = None
    if args.tokenizer or not args.prompts_are_ids:
        tok = _tokenizer(args.tokenizer or args.model)
    if args.dataset:
        from dflash_jax.data import apply_chat_template, load_prompts
        rows = load_prompts(args.dataset, None, args.max_samples)
        prompts = [apply_chat_template(tok, r["turns"][0], thinking=args.thinking == "on") for r in rows]
    else:
        prompts = _read_prompts(args.prompts, tok, args.thinking == "on", args.max_samples, vocab=vocab,
                                ids_only=args.prompts_are_ids)
    target = _target(args)
    from dflash_jax.cli.generate import stop_token_ids
    # the model's generation_config.json eos (and the tokenizer's when there is one), ids or text
    stops = [t for t in stop_token_ids(args.model, tok) if 0 <= t < vocab] or None
    _interruptible()
    data = regenerate(target, prompts, args.out, max_len=args.max_len, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, stop_token_ids=stops, batch_size=args.batch_size,
                      shard_rows=args.shard_rows, seed=args.seed, attention_impl=args.attention,
                      source=dict(model=args.model, prompts=args.prompts, dataset=args.dataset,
                                  thinking=args.thinking))
    with open(os.path.join(args.out, "manifest.json")) as f:
        m = json.load(f)
    print(f"{len(data)} rows of up to {data.max_len} tokens in {args.out}; dropped: "
          f"{m.get('dropped_long', 0)} prompts longer than --max-len - 2 = {args.max_len - 2} tokens, "
          f"{m.get('dropped', 0)} responses under 2 tokens")
    return 0


SHAPE_FLAGS = (("draft_layers", "--draft-layers", "num_layers"), ("block_size", "--block-size", "block_size"),
               ("taps", "--taps", "target_layer_ids"), ("mask_token_id", "--mask-token-id", "mask_token_id"))


def _taps(text: str | None):
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--taps {text!r}: expected target layer ids separated by commas, e.g. 1,9,17") from None


DFLASH2_DEFAULTS = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                       selector_weight=1.0)


def _dflash2_flags(args) -> None:
    """DFlash2's flags: refused with --arch dflash (a DFlash-1 draft has no convs or selector, so they
    would do nothing), else their defaults where not given."""
    given = [k for k in DFLASH2_DEFAULTS if getattr(args, k) is not None]
    if args.arch == "dflash" and given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} is a DFlash2 setting and --arch dflash trains a DFlash-1 draft, which has no "
                         f"convs or selector; give --arch dflash2 or leave {flag} out")
    for k, v in DFLASH2_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _dflash2_fields(args, target_config) -> dict:
    """The DraftConfig fields of --arch dflash2 (conv, selector, window), checked: one line each."""
    H, V = target_config.hidden_size, target_config.vocab_size
    if args.conv_group_size < 1 or H % args.conv_group_size:
        raise UsageError(f"--conv-group-size {args.conv_group_size} does not divide the target's hidden size {H}")
    if args.selector_top_k > V:
        raise UsageError(f"--selector-top-k {args.selector_top_k} is above the target's vocabulary of {V}")
    return dict(architecture="DFlash2DraftModel", conv_kernel_size=args.conv_kernel_size,
                conv_group_size=args.conv_group_size, selector_rank=args.selector_rank,
                selector_top_k=args.selector_top_k)


# Bytes per trained parameter: float32 weights, gradients and AdamW's two moments.
TRAIN_BYTES_PER_PARAM = 16


def _check_draft_fits_memory(cfg, args) -> None:
    """The draft these flags make, counted without allocating it (its parameters' shapes), with its
    gradients and AdamW state, must fit the device's free memory: a flag that sizes parameters
    (--selector-rank, --draft-layers, ...) past it is one line at start, not a kill by the kernel."""
    import dataclasses

    import jax
    from flax import nnx

    from dflash_jax import drafts
    from dflash_jax.validation import free_memory

    model = drafts.variant_of_config(cfg).model

    def count(layers: int) -> int:  # the shapes of a 1- and a 2-layer draft: cheap to trace at any depth
        c = dataclasses.replace(cfg, num_layers=layers, layer_types=tuple(cfg.layer_types)[:layers])
        shapes = nnx.eval_shape(lambda: model(c, jax.numpy.float32, rngs=nnx.Rngs(0)))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shapes)))

    one = count(1)
    n = one + (cfg.num_layers - 1) * (count(2) - one)
    need = n * TRAIN_BYTES_PER_PARAM
    free, where = free_memory()
    if free is None or need <= free:
        return
    selector = (2 * cfg.vocab_size + cfg.hidden_size) * cfg.selector_rank if cfg.selector_top_k else 0
    why = (f"{selector / 1e9:.2f} B of them the selector's codebooks, (2 x vocab {cfg.vocab_size} + hidden "
           f"{cfg.hidden_size}) x --selector-rank {cfg.selector_rank}; " if selector * 2 > n else "")
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    raise UsageError(f"the draft these flags make has {size} parameters ({why}{cfg.num_layers} layers): "
                     f"training needs {need / 1e9:.1f} GB for them with their gradients and AdamW state, and the "
                     f"{where} has {free / 1e9:.1f} GB free; lower --selector-rank or --draft-layers")


def _window_fields(args, num_layers: int) -> dict:
    if args.sliding_window is None:
        return {}
    return dict(layer_types=("sliding_attention",) * num_layers, sliding_window=args.sliding_window, is_causal=False)


def cmd_train(args) -> int:
    import dataclasses

    import dflash_jax as dj
    from dflash_jax.drafts.dflash2 import DFlash2Draft
    from dflash_jax.train.data import TokenData
    from dflash_jax.train.run import RunConfig, train
    _dflash2_flags(args)
    target = _target(args)
    if args.init_draft:
        draft = dj.load_draft(args.init_draft, target=target, dtype="float32")
        given = dict(draft_layers=args.draft_layers, block_size=args.block_size, taps=_taps(args.taps),
                     mask_token_id=args.mask_token_id)
        for dest, flag, field in SHAPE_FLAGS:
            have = getattr(draft.config, field)
            if dest == "block_size" and args.arch == "dflash2" and not draft.config.is_dflash2:
                continue   # a DFlash-1 draft's weights do not depend on the block size
            if given[dest] is not None and tuple(np.atleast_1d(given[dest])) != tuple(np.atleast_1d(have)):
                raise UsageError(f"{flag} {args.taps if dest == 'taps' else given[dest]} disagrees with --init-draft "
                                 f"{args.init_draft} ({field} {have}); leave it out or start a new draft")
        if args.arch == "dflash2" and not draft.config.is_dflash2:
            # a DFlash-1 draft grows identity convs and a no-op selector: it starts as itself
            cfg = dataclasses.replace(draft.config, block_size=args.block_size or draft.config.block_size,
                                      **_dflash2_fields(args, target.config),
                                      **_window_fields(args, draft.config.num_layers))
            _check_draft_fits_memory(cfg, args)
            draft = DFlash2Draft.for_training(cfg, seed=args.seed, init=draft)
        elif args.arch == "dflash" and draft.config.is_dflash2:
            raise UsageError(f"--init-draft {args.init_draft} is a DFlash2 draft; give --arch dflash2 to train it")
    else:
        V = target.config.vocab_size
        mask = args.mask_token_id if args.mask_token_id is not None else (
            QWEN3_MASK_TOKEN_ID if V == QWEN3_VOCAB else V - 1)
        layers = args.draft_layers or 5
        cfg = dj.DraftConfig.for_target(target.config, num_layers=layers,
                                        block_size=args.block_size or (8 if args.arch == "dflash2" else 16),
                                        mask_token_id=mask, target_layer_ids=_taps(args.taps))
        if args.arch == "dflash2":
            cfg = dataclasses.replace(cfg, **_dflash2_fields(args, target.config), **_window_fields(args, layers))
            _check_draft_fits_memory(cfg, args)
            draft = DFlash2Draft.for_training(cfg, seed=args.seed)
        else:
            if args.sliding_window is not None:
                cfg = dataclasses.replace(cfg, **_window_fields(args, layers))
            _check_draft_fits_memory(cfg, args)
            draft = dj.init_draft(cfg, seed=args.seed, dtype="float32", target=target)
    draft.config.check_fits(target.config)
    data = TokenData.from_dir(args.data)
    eval_prompts = []
    if args.eval_prompts:
        tok = None
        try:
            tok = _tokenizer(args.tokenizer or args.model)
        except UsageError:
            pass
        eval_prompts = _read_prompts(args.eval_prompts, tok, False, args.eval_samples, vocab=target.config.vocab_size)
    run = RunConfig(out_dir=args.out, batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
                    seed=args.seed, save_every=args.save_every, log_every=args.log_every,
                    eval_every=args.eval_every, eval_prompts=eval_prompts,
                    eval_max_new_tokens=args.eval_max_new_tokens, eval_attention_impl=args.attention,
                    model_path=args.model, data_path=args.data)
    kw = dict(num_anchors=args.num_anchors, lr=args.lr, compute_dtype=args.compute_dtype,
              attention_impl=args.attention, warmup_frac=args.warmup,
              train_attention=args.train_attention)
    if args.gamma is not None:
        kw["gamma"] = args.gamma
    if draft.config.selector_top_k:
        kw["selector_weight"] = args.selector_weight
    _interruptible()
    res = train(target, draft, data, run=run, **kw)
    print(f"{res.status} at step {res.step} (epoch {res.epoch}); checkpoints in {os.path.join(args.out, 'checkpoints')}")
    return 0


def cmd_export(args) -> int:
    from dflash_jax.train.export import export_draft
    from dflash_jax.train.run import load_run_draft
    if os.path.exists(args.out):
        raise SystemExit(f"export: {args.out} already exists; export writes a new directory")
    draft, meta = load_run_draft(args.run, args.step)
    export_draft(draft, args.out, dtype=args.dtype)
    print(f"exported step {meta['step']} of {args.run} to {args.out}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown for every flag that has one (a None default is explained in its help)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _number(kind, low=None, high=None, low_open=False, name="value"):
    """An argparse type: `kind` within [low, high] (low excluded when low_open)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or (low is not None and (v <= low if low_open else v < low)) or (high is not None and v > high):
            rng = f"> {low}" if low_open else f">= {low}"
            if high is not None:
                rng += f" and <= {high}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {rng}")
        return v
    parse.__name__ = kind.__name__
    return parse


POS = _number(int, 1)
NONNEG = _number(int, 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.train", description="Train a DFlash draft.",
                                formatter_class=_Help)
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_args(q):
        q.add_argument("--model", required=True, help="target: a hub id or a local HF directory")
        q.add_argument("--tokenizer", help="tokenizer source when it is not the --model's")
        q.add_argument("--dtype", choices=("bfloat16", "float32"),
                       help="target dtype (default: the checkpoint's own: float32 for a float32 checkpoint, "
                            "else bfloat16)")
        q.add_argument("--quantize", choices=QUANTIZE,
                       help="the frozen target's layer weights quantized at load (default: as loaded): int8 "
                            "weight-only, one scale per output column, about half the bf16 bytes, for a target "
                            "that only fits so; int8+head: its untied LM head too, which the draft's logits "
                            "read. The draft trains in float32 master weights and --compute-dtype either way; "
                            "serve the trained draft with the same --quantize target")
        q.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                       help="the target's attention (auto: the Pallas / cuDNN kernels on accelerators, XLA on CPU)")
        q.add_argument("--seed", type=NONNEG, default=0, help="seed of sampling (regenerate) or of init, data "
                                                              "order and anchors (train)")

    r = sub.add_parser("regenerate", help="prompts -> the target's responses, sharded .npy + manifest",
                       formatter_class=_Help)
    model_args(r)
    r.add_argument("--prompts", help="JSONL of prompts (prompt_ids, messages, conversations, prompt or text)")
    r.add_argument("--dataset", help="a named prompt set of dflash_jax.data (gsm8k, humaneval, mt-bench, ...), "
                                     "instead of --prompts")
    r.add_argument("--prompts-are-ids", action="store_true",
                   help="every row has prompt_ids: no tokenizer needed (stop ids come from the model's "
                        "generation_config.json, plus --tokenizer's eos when given)")
    r.add_argument("--out", required=True, help="data directory (shards + manifest.json); a rerun resumes")
    r.add_argument("--max-samples", type=POS, help="use the first N prompts (default: all)")
    r.add_argument("--max-len", type=_number(int, 3), default=3072,
                   help="row length: prompt + response tokens; longer prompts are dropped (counted), "
                        "longer responses cut")
    r.add_argument("--max-new-tokens", type=POS, default=2048, help="response tokens per prompt at most")
    r.add_argument("--temperature", type=_number(float, 0.0), default=0.0, help="0: greedy")
    r.add_argument("--thinking", choices=("on", "off"), default="off", help="the chat template's thinking mode")
    r.add_argument("--batch-size", type=POS, default=16, help="prompts generated together")
    r.add_argument("--shard-rows", type=POS, default=1024, help="rows per .npy shard (and per resume point)")

    t = sub.add_parser("train", help="train a draft (resumes from --out/checkpoints)", formatter_class=_Help)
    model_args(t)
    t.add_argument("--data", required=True, help="a directory written by `regenerate`")
    t.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, curves.png")
    t.add_argument("--init-draft", help="start from this draft (hub id or directory) instead of random weights; "
                                        "its shape wins (a shape flag that disagrees is an error)")
    t.add_argument("--draft-layers", type=POS, help="decoder layers of a new draft (default: 5)")
    t.add_argument("--block-size", type=_number(int, 2), help="block size S of a new draft: the anchor + S-1 "
                                                                "predicted tokens (default: 16; 8 for dflash2)")
    t.add_argument("--taps", help="target layer ids, comma separated (default: z-lab's spread)")
    t.add_argument("--mask-token-id", type=NONNEG, help="the block's MASK id (default: 151669 on the Qwen3 "
                                                        "vocabulary, else vocab - 1)")
    t.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                   help="dflash2: a DFlash2 draft (convs around every sublayer, candidate selector); from "
                        "--init-draft a DFlash-1 draft it starts as that draft (identity convs, no-op selector)")
    # DFlash2's flags default to None (given or not: --arch dflash refuses them) and to DFLASH2_DEFAULTS
    d2 = DFLASH2_DEFAULTS
    t.add_argument("--conv-kernel-size", type=POS,
                   help=f"dflash2: conv taps per channel (default: {d2['conv_kernel_size']})")
    t.add_argument("--conv-group-size", type=POS, help=f"dflash2: channels per dynamic-tap group (must divide the "
                                                       f"hidden size; default: {d2['conv_group_size']})")
    t.add_argument("--selector-rank", type=POS,
                   help=f"dflash2: the selector's codebook rank (default: {d2['selector_rank']})")
    t.add_argument("--selector-top-k", type=_number(int, 2),
                   help=f"dflash2: candidates per slot (default: {d2['selector_top_k']})")
    t.add_argument("--selector-weight", type=_number(float, 0.0),
                   help=f"dflash2: loss = block loss + this x the selector's K-way CE (default: "
                        f"{d2['selector_weight']})")
    t.add_argument("--sliding-window", type=POS, help="every draft layer a non-causal sliding-window layer "
                                                      "of this window (default: full attention)")
    t.add_argument("--batch-size", type=POS, default=8, help="sequences per step (global)")
    t.add_argument("--epochs", type=POS, default=6, help="passes over the data")
    t.add_argument("--max-steps", type=POS, help="cap on steps, also the LR schedule's horizon "
                                                 "(default: epochs x rows / batch)")
    t.add_argument("--lr", type=_number(float, 0.0, low_open=True), default=6e-4, help="peak AdamW learning rate")
    t.add_argument("--warmup", type=_number(float, 0.0, 0.99), default=0.04,
                   help="linear warm-up, as a fraction of the steps")
    t.add_argument("--num-anchors", type=POS, default=512,
                   help="anchor blocks per sequence at most (a step computes only as many as its rows have)")
    t.add_argument("--gamma", type=_number(float, 0.0, low_open=True),
                   help="loss decay over block slots (default: 7 / 5 / 4 for S = 16 / 10 / 8)")
    t.add_argument("--train-attention", default="auto", choices=("auto", "xla", "pallas_gpu"),
                   help="the draft's context attention (auto: the Pallas kernel pair on a GPU, XLA elsewhere)")
    t.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the draft's compute dtype (master weights stay float32)")
    t.add_argument("--save-every", type=POS, default=500, help="steps between checkpoints")
    t.add_argument("--log-every", type=POS, default=10, help="steps between metrics.jsonl records")
    t.add_argument("--eval-every", type=NONNEG, default=0, help="steps between real-τ evals (0: none)")
    t.add_argument("--eval-prompts", help="JSONL of held-out prompts for the real-τ eval hook")
    t.add_argument("--eval-samples", type=POS, default=16, help="eval prompts used")
    t.add_argument("--eval-max-new-tokens", type=POS, default=128, help="tokens generated per eval prompt")

    e = sub.add_parser("export", help="a run's checkpoint -> a z-lab format draft directory", formatter_class=_Help)
    e.add_argument("--run", required=True, help="run directory of `train`")
    e.add_argument("--out", required=True, help="new directory for config.json + model.safetensors")
    e.add_argument("--step", type=NONNEG, help="checkpoint step (default: the latest readable one)")
    e.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="weight dtype written")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_jax.cli.generate import skip_absent_tpu
    skip_absent_tpu()  # libtpu's noise off a TPU VM
    from dflash_jax.config import ConfigError
    from dflash_jax.train.checkpoint import CheckpointError, ContractError
    from dflash_jax.train.data import DataError
    from dflash_jax.train.run import TrainingDiverged
    try:
        return {"regenerate": cmd_regenerate, "train": cmd_train, "export": cmd_export}[args.cmd](args)
    except (ConfigError, ContractError, CheckpointError, DataError, TrainingDiverged, UsageError, FileExistsError,
            FileNotFoundError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from dflash_jax.startup import EXIT_INTERRUPTED
        print("\n[dflash] interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
