"""`python -m dflash_jax.generate`: one prompt through DFlash (or plain decoding), streamed.

    python -m dflash_jax.generate --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 "Why is the sky blue?"
    echo "Hello" | python -m dflash_jax.generate --model ./qwen3 --draft none
    python -m dflash_jax.generate --random-init qwen3-8b --prompt-len 512 --max-new-tokens 256 --json

The completion goes to stdout as the compiled loop commits tokens; one summary line goes to stderr.
This module also holds the argument, loading and stop-token helpers that `dflash_jax.benchmark` shares,
so that both commands accept the same flags with the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any, Sequence

import dflash_jax as _pkg

# This module's name is also the library's `generate` function, and importing it rebinds the
# package attribute `dflash_jax.generate` to the module. Keep the function (the package finished
# importing before this module runs, so the attribute is still the function here) and make the
# module callable below, so that `dflash_jax.generate(...)` works whether or not the CLI was imported.
_library_generate = getattr(_pkg, "generate", None)
if isinstance(_library_generate, types.ModuleType):  # pragma: no cover - a lazily built package
    _library_generate = None


def _generate(*args, **kwargs):
    fn = _library_generate
    if fn is None:  # pragma: no cover
        from dflash_jax import decode
        fn = decode.generate
    return fn(*args, **kwargs)

__all__ = ["main", "build_parser", "StreamDecoder", "stop_token_ids"]

DTYPES = ("bfloat16", "float32", "float16")
ATTENTION = ("auto", "xla", "pallas")
# The public drafts are 5 layers at block size 16 for every Qwen3 size (z-lab/Qwen3-*-DFlash-b16).
RANDOM_DRAFT_LAYERS = 5
RANDOM_DRAFT_BLOCK = 16


# ----------------------------------------------------------------------------------------- arguments
def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="target: a hub id (Qwen/Qwen3-8B) or a local HF directory")
    src.add_argument("--random-init", metavar="PRESET",
                     help="random weights of a real shape (qwen3-0.6b, qwen3-4b, qwen3-8b) for benchmarking "
                          "without weights; prompts are token ids and no tokenizer is used")
    g.add_argument("--draft", help="DFlash draft: a hub id (z-lab/Qwen3-8B-DFlash-b16), a local directory, or "
                                   "'none' for plain autoregressive decoding (with --random-init: a random draft "
                                   "of the z-lab shape unless 'none')")
    g.add_argument("--tokenizer", help="tokenizer source when it is not the --model's")
    g.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="parameter and activation dtype")
    g.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="attention backend: Pallas kernels on TPU/GPU (auto), or the XLA reference")
    g.add_argument("--block-size", type=int, help="draft block size (default: the draft's; 1 = no speculation)")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and random weights with --random-init)")
    g.add_argument("--thinking", choices=("on", "off"), default="off",
                   help="Qwen3 thinking mode in the chat template (enable_thinking)")
    g.add_argument("--ignore-eos", action="store_true", help="run to --max-new-tokens regardless of stop tokens")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad values before anything heavy is loaded."""
    if args.model is None and args.random_init is None:
        parser.error("give --model (hub id or local path) or --random-init PRESET")
    if args.model is not None and args.draft is None:
        parser.error("--draft is required with --model: a hub id, a local path, or 'none' for plain decoding")
    if args.random_init is not None:
        from dflash_jax.config import PRESETS
        if args.random_init.lower() not in PRESETS:
            parser.error(f"unknown preset {args.random_init!r} for --random-init; known: {', '.join(PRESETS)}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    for flag in ("model", "draft", "tokenizer"):
        value = getattr(args, flag)
        if value is not None and not (flag == "draft" and value.lower() == "none"):
            setattr(args, flag, _resolve_source(parser, "--" + flag, value))


def _resolve_source(parser: argparse.ArgumentParser, flag: str, value: str) -> str:
    """A local directory when one exists, else a hub id; an absent path-looking value is an error.

    A hub id `org/name` is also a valid relative path, so existence decides; only values that cannot
    be hub ids (absolute, ./, ~, more than one slash) are known to be meant as paths.
    """
    local = os.path.expanduser(value)
    if os.path.exists(local):
        if not os.path.isdir(local):
            parser.error(f"{flag} {value}: not a directory (expected an HF model directory with config.json)")
        return local
    if value.startswith(("/", ".", "~")) or value.count("/") > 1 or "\\" in value:
        parser.error(f"{flag} {value}: no such directory")
    return value


_LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError)
try:  # not an OSError subclass in huggingface_hub 0.2x-2.x
    from huggingface_hub.errors import EntryNotFoundError as _EntryNotFound
    _LOAD_ERRORS += (_EntryNotFound,)
except ImportError:  # pragma: no cover
    pass


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def load_models(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(target, draft or None) from the parsed flags; user mistakes end in parser.error."""
    import dflash_jax as dj

    try:
        if args.random_init is not None:
            target = dj.init_target(args.random_init.lower(), seed=args.seed, dtype=args.dtype)
        else:
            target = dj.load_target(args.model, dtype=args.dtype)
    except _LOAD_ERRORS as e:
        parser.error(f"--{'random-init' if args.random_init else 'model'} {args.random_init or args.model}: "
                     f"{_one_line(e)}")
    draft = None
    if args.draft is None and args.random_init is not None:
        cfg = dj.DraftConfig.for_target(target.config, num_layers=RANDOM_DRAFT_LAYERS,
                                        block_size=RANDOM_DRAFT_BLOCK)
        draft = dj.init_draft(cfg, seed=args.seed + 1, dtype=args.dtype)
    elif args.draft is not None and args.draft.lower() != "none":
        try:
            draft = dj.load_draft(args.draft, target=target, dtype=args.dtype)
        except _LOAD_ERRORS as e:
            parser.error(f"--draft {args.draft}: {_one_line(e)}")
    if args.block_size is not None and draft is not None and args.block_size > draft.config.block_size:
        parser.error(f"--block-size {args.block_size} is above the draft's block size "
                     f"{draft.config.block_size}")
    return target, draft


def effective_block_size(args: argparse.Namespace, draft) -> int:
    if draft is None:
        return 1
    return args.block_size if args.block_size is not None else draft.config.block_size


def load_tokenizer(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The target's tokenizer, or None with --random-init and no --tokenizer."""
    source = args.tokenizer or args.model
    if source is None:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(source)
    except _LOAD_ERRORS as e:
        parser.error(f"tokenizer {source}: {_one_line(e)} (pass --tokenizer, or --prompt-ids to skip it)")


def stop_token_ids(model_source: str | None, tokenizer) -> list[int]:
    """eos ids from the model's generation_config.json (int or list) plus the tokenizer's eos.

    Qwen3 chat models stop on <|im_end|> (generation config) and <|endoftext|> (both); missing
    either would run chat turns on into the next turn.
    """
    ids: list[int] = []
    if model_source is not None:
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(model_source).eos_token_id
        except _LOAD_ERRORS:
            eos = None  # no generation_config.json: the tokenizer's eos alone
        if eos is not None:
            ids.extend([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, size=length)]


def parse_prompt_ids(parser: argparse.ArgumentParser, text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        parser.error(f"--prompt-ids must be comma-separated integers, got {text!r}")
    if not ids:
        parser.error("--prompt-ids is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        parser.error(f"--prompt-ids {bad[:5]} outside the vocabulary of {vocab_size}")
    return ids


# ----------------------------------------------------------------------------------------- streaming
class StreamDecoder:
    """Incremental detokenisation that never splits a character.

    Decodes a short window of the previous tokens together with the new ones and emits only the
    text past the window, so byte-level BPE pieces of one UTF-8 character and SentencePiece's
    leading-space rules come out exactly as a full decode would. Text ending in U+FFFD (an
    unfinished character) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip)

    def push(self, ids: Sequence[int]) -> str:
        self.tokens.extend(int(i) for i in ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """The held-back tail (e.g. a truncated character at max_new_tokens)."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix):]


class _Streamer:
    """on_commit target: prints row 0's tokens as the loop commits them.

    Committed blocks may run past a stop token or max_new_tokens (the loop commits whole accepted
    blocks; the result is trimmed afterwards), so the stream is cut at the same places here.
    """

    def __init__(self, tokenizer, stop_ids: Sequence[int], max_new_tokens: int, out=None):
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.stop = set(stop_ids)
        self.max_new = max_new_tokens
        self.out = out
        self.emitted: list[int] = []
        self.done = False

    def _write(self, text: str) -> None:
        if text:
            out = self.out or sys.stdout  # looked up late so that redirected stdout (tests) is honoured
            out.write(text)
            out.flush()

    def __call__(self, row_tokens) -> None:
        if self.done or not row_tokens:
            return
        new = []
        for t in row_tokens[0]:
            t = int(t)
            new.append(t)
            if t in self.stop or len(self.emitted) + len(new) >= self.max_new:
                self.done = True
                break
        self.emitted.extend(new)
        if self.decoder is not None:
            self._write(self.decoder.push(new))
        else:
            self._write("".join(f"{t} " for t in new))

    def finish(self, final_tokens: Sequence[int]) -> None:
        """Reconcile with the returned tokens: emit whatever the callbacks did not deliver."""
        final = [int(t) for t in final_tokens]
        if final[:len(self.emitted)] == self.emitted and len(final) > len(self.emitted):
            rest = final[len(self.emitted):]
            self.emitted.extend(rest)
            if self.decoder is not None:
                self._write(self.decoder.push(rest))
            else:
                self._write("".join(f"{t} " for t in rest))
        elif final[:len(self.emitted)] != self.emitted:
            print(f"\nwarning: the streamed tokens differ from the final result; final text follows:",
                  file=sys.stderr)
            self._write(render(self.decoder.tokenizer if self.decoder else None, final))
        if self.decoder is not None:
            self._write(self.decoder.flush())
        self._write("\n")


def render(tokenizer, tokens: Sequence[int]) -> str:
    if tokenizer is None:
        return "".join(f"{int(t)} " for t in tokens)
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.generate",
        description="Generate with a Qwen3 target and a DFlash block-diffusion draft (one compiled loop).",
        epilog="Example: python -m dflash_jax.generate --model Qwen/Qwen3-8B "
               "--draft z-lab/Qwen3-8B-DFlash-b16 'Write a haiku about TPUs.'")
    p.add_argument("prompt", nargs="?", help="user message (default: read stdin)")
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=256)
    g = p.add_argument_group("prompt")
    g.add_argument("--system", help="system message")
    g.add_argument("--raw-prompt", action="store_true", help="tokenize the prompt as is, without the chat template")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids (skips the tokenizer for the prompt)")
    g.add_argument("--prompt-len", type=int, default=128, help="random prompt length with --random-init")
    o = p.add_argument_group("output")
    o.add_argument("--no-stream", action="store_true", help="print the completion at the end")
    o.add_argument("--json", action="store_true", help="print a JSON summary on stdout instead of the text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.prompt_len < 1:
        parser.error(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.random_init is not None and args.prompt is not None and args.tokenizer is None:
        parser.error("--random-init has no tokenizer: give --prompt-ids, --prompt-len or --tokenizer")

    tokenizer = load_tokenizer(parser, args)
    # The prompt is settled before the (slow) weight loading so that mistakes fail fast.
    text = None
    if args.prompt_ids is None and tokenizer is not None:
        text = args.prompt
        if text is None:
            if sys.stdin.isatty():
                parser.error("no prompt: give it as an argument or on stdin")
            text = sys.stdin.read()
        if not text.strip():
            parser.error("the prompt is empty")

    target, draft = load_models(parser, args)
    vocab = target.config.vocab_size
    if args.prompt_ids is not None:
        prompt = parse_prompt_ids(parser, args.prompt_ids, vocab)
    elif tokenizer is None:
        prompt = random_prompt(vocab, args.prompt_len, args.seed)
    elif args.raw_prompt:
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        from dflash_jax.data import apply_chat_template
        try:
            prompt = apply_chat_template(tokenizer, text, system=args.system, thinking=args.thinking == "on")
        except ValueError as e:
            parser.error(str(e))
    if tokenizer is not None and len(prompt) == 0:
        parser.error("the prompt tokenizes to nothing")

    stops = [] if args.ignore_eos else stop_token_ids(args.model, tokenizer)
    block = effective_block_size(args, draft)
    stream = not (args.no_stream or args.json)
    streamer = _Streamer(tokenizer, stops, args.max_new_tokens) if stream else None

    try:
        res = _generate(target, draft, [prompt], max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          stop_token_ids=stops or None, block_size=block, seed=args.seed,
                          attention_impl=args.attention, on_commit=streamer)
    except ValueError as e:  # the library's refusals (prompt longer than the context, ...) are user errors
        parser.error(_one_line(e))

    tokens = res.tokens[0]
    n_new = len(tokens)
    tps = n_new / res.run_time_s if res.run_time_s > 0 else float("nan")
    if args.json:
        summary: dict[str, Any] = dict(
            model=args.model or f"random-init:{args.random_init}",
            draft=None if draft is None else (args.draft or "random"), block_size=res.block_size,
            prompt_tokens=len(prompt), new_tokens=n_new, text=render(tokenizer, tokens) if tokenizer else None,
            tokens=list(map(int, tokens)), mean_tau=res.mean_tau, tau_histogram=list(res.tau_histogram),
            acceptance_lengths=list(res.acceptance_lengths[0]), num_iterations=res.num_iterations,
            tokens_per_s=tps, run_time_s=res.run_time_s, compile_time_s=res.compile_time_s,
            temperature=args.temperature, dtype=args.dtype, attention=args.attention)
        print(json.dumps(summary))
    elif streamer is not None:
        streamer.finish(tokens)
    else:
        print(render(tokenizer, tokens))
        sys.stdout.flush()

    if not args.json:
        print(f"[dflash] {n_new} new tokens | mean tau {res.mean_tau:.2f} (block size {res.block_size}) | "
              f"{tps:.1f} tok/s ({res.run_time_s:.3f} s) | compile {res.compile_time_s:.1f} s",
              file=sys.stderr)
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
