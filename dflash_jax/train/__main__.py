"""`python -m dflash_jax.train {regenerate,train,export}`: see docs/training.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

# z-lab's Qwen3 drafts use this id (a reserved row of the Qwen3 embedding) as the block's MASK.
QWEN3_MASK_TOKEN_ID = 151669
QWEN3_VOCAB = 151936


def _read_prompts(path: str, tokenizer, thinking: bool, max_samples: int | None) -> list[list[int]]:
    """Token-id prompts from JSONL rows: {"prompt_ids": [...]}, chat {"messages": [...]} or ShareGPT
    {"conversations": [{"from", "value"}]} (the first user turn, with its system turn), or plain
    {"prompt"} / {"text"} / {"question"}. Text is rendered with the chat template (thinking off)."""
    from dflash_jax.data import apply_chat_template
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_ids" in row:
                out.append([int(t) for t in row["prompt_ids"]])
            else:
                if tokenizer is None:
                    raise SystemExit(f"{path}:{n}: a text prompt needs a tokenizer (--model or --tokenizer)")
                turns = row.get("messages") or row.get("conversations")
                system, user = None, None
                if turns:
                    for t in turns:
                        role = t.get("role", t.get("from"))
                        text = t.get("content", t.get("value"))
                        if role == "system":
                            system = text
                        elif role in ("user", "human") and user is None:
                            user = text
                else:
                    user = row.get("prompt", row.get("text", row.get("question")))
                if not user:
                    raise SystemExit(f"{path}:{n}: no user turn (expected prompt_ids, messages, conversations, prompt or text)")
                out.append(apply_chat_template(tokenizer, user, system=system, thinking=thinking))
            if max_samples and len(out) >= max_samples:
                break
    if not out:
        raise SystemExit(f"{path}: no prompts")
    return out


def _target(args):
    import dflash_jax as dj
    return dj.load_target(args.model, dtype=args.dtype)


def cmd_regenerate(args) -> int:
    from dflash_jax.train.data import regenerate
    if not (args.prompts or args.dataset):
        raise SystemExit("regenerate: give --prompts FILE.jsonl or --dataset NAME")
    tok = None
    if args.tokenizer or not args.prompts_are_ids:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.dataset:
        from dflash_jax.data import apply_chat_template, load_prompts
        rows = load_prompts(args.dataset, args.prompts, args.max_samples)
        prompts = [apply_chat_template(tok, r["turns"][0], thinking=args.thinking == "on") for r in rows]
    else:
        prompts = _read_prompts(args.prompts, tok, args.thinking == "on", args.max_samples)
    target = _target(args)
    stops = None
    if tok is not None:
        from dflash_jax.cli.generate import stop_token_ids
        stops = stop_token_ids(args.model, tok)
    data = regenerate(target, prompts, args.out, max_len=args.max_len, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, stop_token_ids=stops, batch_size=args.batch_size,
                      shard_rows=args.shard_rows, seed=args.seed, attention_impl=args.attention,
                      source=dict(model=args.model, prompts=args.prompts, dataset=args.dataset,
                                  thinking=args.thinking))
    print(f"{len(data)} rows of up to {data.max_len} tokens in {args.out}")
    return 0


def cmd_train(args) -> int:
    import dflash_jax as dj
    from dflash_jax.train.data import TokenData
    from dflash_jax.train.run import RunConfig, train
    target = _target(args)
    if args.init_draft:
        draft = dj.load_draft(args.init_draft, target=target, dtype="float32")
    else:
        V = target.config.vocab_size
        mask = args.mask_token_id if args.mask_token_id is not None else (
            QWEN3_MASK_TOKEN_ID if V == QWEN3_VOCAB else V - 1)
        taps = tuple(int(t) for t in args.taps.split(",")) if args.taps else None
        cfg = dj.DraftConfig.for_target(target.config, num_layers=args.draft_layers, block_size=args.block_size,
                                        mask_token_id=mask, target_layer_ids=taps)
        draft = dj.init_draft(cfg, seed=args.seed, dtype="float32", target=target)
    data = TokenData.from_dir(args.data)
    eval_prompts = []
    if args.eval_prompts:
        tok = None
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        except Exception:
            pass
        eval_prompts = _read_prompts(args.eval_prompts, tok, False, args.eval_samples)
    run = RunConfig(out_dir=args.out, batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
                    seed=args.seed, save_every=args.save_every, log_every=args.log_every,
                    eval_every=args.eval_every, eval_prompts=eval_prompts,
                    eval_max_new_tokens=args.eval_max_new_tokens, eval_attention_impl=args.attention)
    kw = dict(num_anchors=args.num_anchors, lr=args.lr, compute_dtype=args.compute_dtype,
              attention_impl=args.attention, warmup_frac=args.warmup,
              train_attention=args.train_attention)
    if args.gamma is not None:
        kw["gamma"] = args.gamma
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.train", description="Train a DFlash draft.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_args(q):
        q.add_argument("--model", required=True, help="target: a hub id or a local HF directory")
        q.add_argument("--tokenizer", help="tokenizer source when it is not the --model's")
        q.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="target dtype")
        q.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"))
        q.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("regenerate", help="prompts -> the target's responses, sharded .npy + manifest")
    model_args(r)
    r.add_argument("--prompts", help="JSONL of prompts (prompt_ids, messages, conversations, prompt or text)")
    r.add_argument("--dataset", help="a named prompt set of dflash_jax.data (gsm8k, humaneval, mt-bench, ...)")
    r.add_argument("--prompts-are-ids", action="store_true", help="every row has prompt_ids: no tokenizer")
    r.add_argument("--out", required=True)
    r.add_argument("--max-samples", type=int)
    r.add_argument("--max-len", type=int, default=3072)
    r.add_argument("--max-new-tokens", type=int, default=2048)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--thinking", choices=("on", "off"), default="off")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--shard-rows", type=int, default=1024)

    t = sub.add_parser("train", help="train a draft (resumes from --out/checkpoints)")
    model_args(t)
    t.add_argument("--data", required=True, help="a directory written by `regenerate`")
    t.add_argument("--out", required=True, help="run directory: checkpoints/, metrics.jsonl, curves.png")
    t.add_argument("--init-draft", help="start from this draft (hub id or directory) instead of random weights")
    t.add_argument("--draft-layers", type=int, default=5)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--taps", help="target layer ids, comma separated (default: z-lab's spread)")
    t.add_argument("--mask-token-id", type=int)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--epochs", type=int, default=6)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04)
    t.add_argument("--num-anchors", type=int, default=512)
    t.add_argument("--gamma", type=float)
    t.add_argument("--train-attention", default="auto", choices=("auto", "xla", "pallas_gpu"),
                   help="the draft's context attention (auto: the Pallas kernel pair on a GPU, XLA elsewhere)")
    t.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    t.add_argument("--save-every", type=int, default=500)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--eval-prompts", help="JSONL of held-out prompts for the real-τ eval hook")
    t.add_argument("--eval-samples", type=int, default=16)
    t.add_argument("--eval-max-new-tokens", type=int, default=128)

    e = sub.add_parser("export", help="a run's checkpoint -> a z-lab format draft directory")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--step", type=int)
    e.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_jax.cli.generate import skip_absent_tpu
    skip_absent_tpu()  # libtpu's noise off a TPU VM
    from dflash_jax.config import ConfigError
    from dflash_jax.train.checkpoint import ContractError
    from dflash_jax.train.data import DataError
    from dflash_jax.train.run import TrainingDiverged
    try:
        return {"regenerate": cmd_regenerate, "train": cmd_train, "export": cmd_export}[args.cmd](args)
    except (ConfigError, ContractError, DataError, TrainingDiverged, FileExistsError, FileNotFoundError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
