"""`python -m dflash_jax.generate` (this module: dflash_jax.cli.generate): prompts through DFlash (or plain decoding), streamed.

    python -m dflash_jax.generate --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 "Why is the sky blue?"
    echo "Hello" | python -m dflash_jax.generate --model ./qwen3 --draft none
    python -m dflash_jax.generate --model ./qwen3 --draft none --prompt-file prompts.jsonl --json
    python -m dflash_jax.generate --random-init qwen3-8b --prompt-len 512 --max-new-tokens 256 --json

The completion goes to stdout as the compiled loop commits tokens; progress and one summary line go
to stderr. Ctrl-C stops the generation after the current loop iteration, prints what was generated
and exits with 130. This module also holds the argument helpers that `dflash_jax.benchmark` and
`dflash_jax.serve` share, so that the commands accept the same flags with the same checks; the
loading of sources, models, tokenizer and stop ids is dflash_jax.loading's (re-exported here).
"""

from __future__ import annotations

import os

# transformers prints "PyTorch was not found ..." at import when torch is absent; we never need torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

from dflash_jax import validation  # noqa: E402
from dflash_jax.decode import generate as _generate  # noqa: E402  (the library function; this module is its CLI)
from dflash_jax.quantize import QUANTIZE, W8A8_SCHEMES  # noqa: E402
# the loading of sources, models and tokenizer (shared with benchmark and serve), under this module's names too
from dflash_jax.loading import (  # noqa: E402,F401
    RANDOM_DRAFT_BLOCK, RANDOM_DRAFT_LAYERS, check_eos, default_dtype, effective_block_size,
    flag_message as _flag_message, get_mesh, go_offline_if_unreachable, init_distributed, is_main_process,
    load_models, load_tokenizer, one_line as _one_line, progress, resolve_sources, stop_token_ids)

__all__ = ["main", "build_parser", "StreamDecoder", "stop_token_ids", "skip_absent_tpu"]

DTYPES = validation.DTYPES
ATTENTION = ("auto", "xla", "pallas")
# After Ctrl-C, how long the generation may take to reach its next iteration before the process
# exits without its result (e.g. while compiling, which cannot be interrupted).
INTERRUPT_GRACE_S = 5.0
EXIT_INTERRUPTED = 130


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, and the epilog's line breaks kept."""

    def _fill_text(self, text, width, indent):
        return "".join(indent + line for line in text.splitlines(keepends=True))

    def _get_help_string(self, action):
        if action.default in (None, False, []):  # "(default: None)" says nothing
            return action.help
        return super()._get_help_string(action)


# Device nodes of an attached accelerator: TPU chips (/dev/accel*: v4, v5e; VFIO: v5p, v6e),
# NVIDIA (/dev/nvidia0, /dev/nvidiactl in containers, /dev/dxg under WSL2) and AMD (/dev/kfd) GPUs.
_ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
_GOOGLE_PCI_VENDOR = "0x1ae0"


def _accelerator_attached() -> bool:
    import glob
    if any(glob.glob(p) for p in _ACCELERATOR_NODES):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):  # a TPU whose /dev nodes are not visible
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def skip_absent_tpu() -> bool:
    """Where no accelerator is attached and JAX_PLATFORMS is not set, run JAX on "cpu" outright.

    With libtpu installed (the [tpu] extra, or [test], which needs it to compile for TPU ahead of
    time) JAX tries the TPU backend on every machine; off a TPU VM libtpu prints ~5 lines of errors
    about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES while it fails, and JAX then uses the CPU. On
    such a machine the CPU is the only backend there is, so naming it changes nothing but the noise.
    A TPU or GPU attached, JAX_PLATFORMS or JAX_FORCE_TPU_INIT set, or a backend already running
    leave JAX's own choice alone. Called by the CLIs before they touch a device; True if it set cpu."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ or _accelerator_attached():
        return False
    import jax
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # pragma: no cover - another jax: leave it alone
        return False
    if jax.config.jax_platforms:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


# ----------------------------------------------------------------------------------------- arguments
def _dtype_arg(value: str) -> str:
    try:
        return validation.dtype_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    g.add_argument("--dtype", default=None, type=_dtype_arg, metavar="{" + ",".join(DTYPES) + "}",
                   help="parameter and activation dtype (aliases: " + ", ".join(validation.DTYPE_ALIASES) + "); "
                        "default: bfloat16, but float32 for the embedded demo pair on CPU, where it is as "
                        "fast and greedy DFlash output is then identical to plain decoding's")
    g.add_argument("--quantize", default=None, choices=QUANTIZE,
                   help="quantize the target's layer weights at load: int8 weight-only, per-output-channel "
                        "scales (half the bf16 weight bytes; DFlash stays lossless relative to the quantized "
                        "target); int8+head: the untied LM head too (one scale per vocabulary entry); the "
                        "draft and embeddings stay as loaded")
    g.add_argument("--w8a8", nargs="?", const="block", default=None, choices=W8A8_SCHEMES,
                   help="an FP8 checkpoint's layer linears run W8A8: the activations quantized to fp8 per "
                        "128-column block at run time (the checkpoint's activation_scheme: dynamic) and "
                        "multiplied on fp8 tensor cores (CUDA; elsewhere XLA emulates it). Other numerics than "
                        "the default weight-only path, and not batch-invariant (like bf16: greedy DFlash may part from "
                        "plain greedy at near-tied tokens; BENCHMARKS.md). --w8a8 channel: "
                        "the weights requantized to one scale per output channel and the activations to one "
                        "per row (FP8-dynamic): one fp8 GEMM at every row count, faster than the block scheme "
                        "at B >= 8 on an H100; its own numerics")
    g.add_argument("--quantize-draft", default=None, choices=("int8",),
                   help="quantize the draft's layer weights at load too (default: off). Still lossless, but "
                        "an int8 draft may accept fewer tokens (BENCHMARKS.md, quantized targets)")
    g.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="attention backend: Pallas kernels on TPU/GPU (auto), or the XLA reference")
    g.add_argument("--block-size", type=int, help="draft block size (default: the draft's; 1 = no speculation)")
    g.add_argument("--mesh", metavar="SPEC",
                   help="run on many devices: 'data=N,model=M' (aliases dp/tp, or 'NxM'); model = tensor "
                        "parallel, data = batch rows; N*M must equal the device count (all hosts' together)")
    g.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="keep compiled programs in DIR (JAX's persistent compilation cache), so the next run of "
                        "the same shapes and flags skips their compile (a server's warm-up: minutes at 8B "
                        "shapes); off: compile every run. Default: $JAX_COMPILATION_CACHE_DIR when set, else "
                        f"{DEFAULT_COMPILE_CACHE} (at most {DEFAULT_COMPILE_CACHE_GIB} GiB, least recently "
                        "used entries dropped)")


def _verify_width_arg(text: str):
    t = text.strip().lower()
    if t in ("auto", "block"):
        return t
    try:
        v = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block, auto or a number of drafts, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be block, auto or >= 0, got {v}")
    return v


def add_width_args(p: argparse.ArgumentParser, default: str | None = "auto", default_help: str = "auto") -> None:
    """--verify-width (generate, benchmark, serve): drafts the target verifies per iteration.
    default None: the caller resolves it (serve: auto with the slot engine)."""
    p.add_argument("--verify-width", default=default, type=_verify_width_arg, metavar="{block,auto,0,1,3,7,15}",
                   help="drafts the target verifies per iteration: block (the whole block, one verify width "
                        "compiled), auto (chosen per iteration from measured costs and acceptance, "
                        "docs/adaptive-width.md; compiles widths 0, 3 and 15 at block 16, and 7 on CPU) or a fixed one of 0, 1, 3, 7, "
                        "... up to block size - 1 (0 = plain decoding, block size - 1 = the whole block); "
                        f"default: {default_help}")


def check_verify_width(parser, args: argparse.Namespace, draft) -> None:
    """--verify-width against the run's block size (exit 2 with the allowed widths)."""
    from dflash_jax import width
    block = effective_block_size(args, draft)
    if args.verify_width in ("auto", "block") or (block < 2 and args.verify_width == 0):
        return
    if block < 2:
        parser.error(f"--verify-width {args.verify_width} needs a draft and a block size above 1")
    try:
        width.width_index(width.widths_for(block), args.verify_width)
    except ValueError as e:
        parser.error("--" + str(e).replace("verify_width", "verify-width", 1))


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="new tokens per prompt (prompt + new must fit max_position_embeddings)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="0 = off; at most the vocabulary size")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2**32) (and random weights with --random-init)")
    g.add_argument("--thinking", choices=("on", "off"), default=None,
                   help="Qwen3 thinking mode in the chat template (enable_thinking); off when not given")
    g.add_argument("--ignore-eos", action="store_true",
                   help="run to --max-new-tokens regardless of the model's eos tokens (--stop-token-ids still apply)")
    g.add_argument("--stop-token-ids", metavar="IDS", help="comma-separated extra stop token ids")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad values before anything heavy is loaded."""
    args.default_pair = False
    if args.model is None and args.random_init is None:
        from dflash_jax.assets import default_pair
        pair = default_pair()
        if pair is None:
            parser.error("give --model (hub id or local path) or --random-init PRESET (this install ships "
                         "no embedded demo pair: see scripts/train_demo_pair.py)")
        # the embedded demo pair: its target directory carries the tokenizer and chat template
        args.model = pair[0]
        args.draft = pair[1] if args.draft is None else args.draft
        args.default_pair = True
    if args.model is not None and args.draft is None:
        parser.error("--draft is required with --model: a hub id, a local path, or 'none' for plain decoding")
    if args.random_init is not None:
        from dflash_jax.config import PRESETS
        if args.random_init.lower() not in PRESETS:
            parser.error(f"unknown preset {args.random_init!r} for --random-init; known: {', '.join(PRESETS)}")
    try:
        validation.check_max_new_tokens(args.max_new_tokens)
        validation.check_seed(args.seed)
    except ValueError as e:
        parser.error(_flag_message(e))
    if not args.temperature >= 0 or args.temperature == float("inf"):
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.block_size not in (None, 1) and args.draft is not None and args.draft.lower() == "none":
        parser.error(f"--block-size {args.block_size} needs a draft; --draft none decodes with block size 1")
    args.extra_stop_ids = []
    if args.stop_token_ids is not None:
        try:
            args.extra_stop_ids = [int(t) for t in args.stop_token_ids.replace(" ", "").split(",") if t]
        except ValueError:
            parser.error(f"--stop-token-ids must be comma-separated integers, got {args.stop_token_ids!r}")
        if not args.extra_stop_ids:
            parser.error("--stop-token-ids is empty")
    for flag in ("model", "draft", "tokenizer"):
        value = getattr(args, flag)
        if value is not None and not (flag == "draft" and value.lower() == "none"):
            setattr(args, flag, _resolve_source(parser, "--" + flag, value))
    args.compile_cache = use_compile_cache(parser, getattr(args, "compile_cache", None))


DEFAULT_COMPILE_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "dflash_jax",
                                     "xla")
DEFAULT_COMPILE_CACHE_GIB = 8


def use_compile_cache(parser: argparse.ArgumentParser, spec: str | None) -> str | None:
    """Point JAX's persistent compilation cache at --compile-cache's directory (None: off). Not part
    of any compiled program: a cached executable is the one the same program would compile to. With
    no flag, $JAX_COMPILATION_CACHE_DIR (JAX reads it itself) or the default directory, capped in
    size; a default directory that cannot be made is skipped with one line, a named one is an error."""
    import jax
    if spec is not None and spec.strip().lower() == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if spec is None and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = os.path.abspath(os.path.expanduser(spec if spec is not None else DEFAULT_COMPILE_CACHE))
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        if spec is not None:
            parser.error(f"--compile-cache {spec}: cannot use it as a directory ({e}); give a writable "
                         "directory or 'off'")
        print(f"[dflash] no compilation cache: {e}", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if spec is None:
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_COMPILE_CACHE_GIB << 30)
    return path


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


# ----------------------------------------------------------------------------------------- interrupts
def run_interruptible(work: Callable[[], Any], cancel: threading.Event) -> Any:
    """`work()` in a worker thread while the main thread waits interruptibly: Ctrl-C sets `cancel`
    (the generation's on_commit then stops the loop at its next iteration) and `work`'s result is
    still returned; a second Ctrl-C, or no result within INTERRUPT_GRACE_S, raises KeyboardInterrupt."""
    box: dict[str, Any] = {}
    # Waiting on an Event, not Thread.join: a KeyboardInterrupt inside join can leave the thread
    # reported as finished while it still runs (CPython before 3.13).
    finished = threading.Event()

    def body():
        try:
            box["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as is
            box["error"] = e
        finally:
            finished.set()

    from dflash_jax import startup
    startup.interrupt_as_exception()  # from here Ctrl-C stops the generation (until now: exit 130 at once)
    worker = threading.Thread(target=body, name="dflash-generate", daemon=True)
    worker.start()
    since = None
    while not finished.is_set():
        try:
            finished.wait(0.1)
        except KeyboardInterrupt:
            if cancel.is_set():
                raise
            cancel.set()
            since = time.monotonic()
            progress("interrupted: stopping after the current iteration (Ctrl-C again to quit now)")
        if since is not None and not finished.is_set() and time.monotonic() - since > INTERRUPT_GRACE_S:
            raise KeyboardInterrupt
    if "error" in box:
        raise box["error"]
    return box["result"]


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
    """Prints row 0's completion as the loop commits it, from the StopWatcher's trimmed tokens.

    With stop strings, the last (longest stop string - 1) characters are held back until they can no
    longer begin a stop string, so a stop string is never printed; `finish` prints the final text's
    rest, which is exactly the text of the result.
    """

    def __init__(self, tokenizer, watcher, out=None):
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.watcher = watcher
        self.hold = max((len(s) for s in watcher.stop_strings), default=1) - 1
        self.out = out
        self.n = 0  # tokens of row 0 pushed
        self.text = ""
        self.printed = 0

    def _write(self, text: str) -> None:
        if text:
            out = self.out or sys.stdout  # looked up late so that redirected stdout (tests) is honoured
            out.write(text)
            out.flush()

    def update(self) -> None:
        tokens = self.watcher.tokens[0]
        new, self.n = tokens[self.n:], len(tokens)
        if not new:
            return
        self.text += self.decoder.push(new) if self.decoder is not None else "".join(f"{t} " for t in new)
        cut = self.watcher.cut[0]
        visible = self.text[:cut[1]] if cut is not None else self.text[:max(0, len(self.text) - self.hold)]
        if len(visible) > self.printed:
            self._write(visible[self.printed:])
            self.printed = len(visible)

    def finish(self, final_text: str) -> None:
        shown = self.text[:self.printed]
        if final_text.startswith(shown):
            self._write(final_text[self.printed:])
        else:
            print("\nwarning: the streamed tokens differ from the final result; final text follows:",
                  file=sys.stderr)
            self._write(final_text)
        self._write("\n")


def render(tokenizer, tokens: Sequence[int]) -> str:
    if tokenizer is None:
        return "".join(f"{int(t)} " for t in tokens)
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.generate", formatter_class=HelpFormatter,
        description="Generate with a target (Qwen3, Llama-3.x, Qwen3-MoE, Qwen3.5) and a DFlash or DFlash2 "
                    "block-diffusion draft (one compiled loop). "
                    "Ctrl-C stops the generation, prints what was generated and exits with 130.",
        epilog="Examples:\n"
               "  python -m dflash_jax.generate --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 "
               "'Write a haiku about TPUs.'\n"
               "  python -m dflash_jax.generate --model ./qwen3 --draft none --prompt-file prompts.jsonl --json\n"
               "  python -m dflash_jax.generate --model ./qwen3 --draft ./draft --messages chat.json --stop '\\n\\n'\n")
    p.add_argument("prompt", nargs="?", help="user message (default: read stdin)")
    add_model_args(p)
    add_width_args(p)
    add_sampling_args(p, max_new_tokens=256)
    g = p.add_argument_group("prompt")
    g.add_argument("--system", help="system message")
    g.add_argument("--raw-prompt", action="store_true", help="tokenize the prompt as is, without the chat template")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids; no tokenizer is loaded unless "
                                        "--tokenizer is given (the output is then token ids)")
    g.add_argument("--prompt-len", type=int, default=None,
                   help=f"random prompt length with --random-init and no tokenizer (default {RANDOM_PROMPT_LEN})")
    g.add_argument("--prompt-file", help="prompts, one per line: JSONL (a string, {\"prompt\": text} or "
                                         "{\"messages\": [...]}) or plain text lines; run as a batch")
    g.add_argument("--messages", help="a JSON file holding one conversation: [{\"role\", \"content\"}, ...] "
                                      "(multi-turn), chat template applied")
    g.add_argument("--batch-size", type=int, default=16, help="prompts per compiled loop with --prompt-file")
    o = p.add_argument_group("output")
    o.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable): generation stops once it appears; the text is cut before it")
    o.add_argument("--no-stream", action="store_true", help="print the completion at the end")
    o.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout instead of the text (one line per prompt)")
    return p


# --prompt-len's default: the random prompt's length with --random-init and no tokenizer
RANDOM_PROMPT_LEN = 128


def _check_prompt_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that would be silently ignored together are refused."""
    given = [f for f, v in (("a positional prompt", args.prompt), ("--prompt-ids", args.prompt_ids),
                            ("--prompt-file", args.prompt_file), ("--messages", args.messages)) if v is not None]
    if len(given) > 1:
        parser.error(f"give one prompt source, got {' and '.join(given)}")
    if args.raw_prompt or args.prompt_ids is not None:
        what = "--raw-prompt" if args.raw_prompt else "--prompt-ids"
        for flag, value in (("--system", args.system), ("--thinking", args.thinking)):
            if value is not None:
                parser.error(f"{flag} applies to the chat template, which {what} skips")
        if args.raw_prompt and args.messages is not None:
            parser.error("--messages needs the chat template, which --raw-prompt skips")
        if args.raw_prompt and args.prompt_ids is not None:
            parser.error("--raw-prompt applies to text prompts, not --prompt-ids")
    if args.prompt_len is not None:
        if args.prompt_len < 1:
            parser.error(f"--prompt-len must be >= 1, got {args.prompt_len}")
        if args.random_init is None or args.tokenizer is not None or args.prompt_ids is not None:
            parser.error("--prompt-len sets the random prompt of --random-init without a tokenizer; here it would "
                         "be ignored (the prompt is " + ("--prompt-ids)" if args.prompt_ids is not None else
                                                         "text)" if args.random_init is not None else
                                                         "the model's tokenized text)"))
    else:
        args.prompt_len = RANDOM_PROMPT_LEN
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.random_init is not None and args.tokenizer is None:
        if args.prompt is not None or args.prompt_file is not None or args.messages is not None:
            parser.error("--random-init has no tokenizer: give --prompt-ids, --prompt-len or --tokenizer")
        if args.stop:
            parser.error("--stop needs a tokenizer: give --tokenizer with --random-init")
    if args.stop and args.prompt_ids is not None and args.tokenizer is None:
        parser.error("--stop needs a tokenizer: with --prompt-ids give --tokenizer")
    if any(not s for s in args.stop):
        parser.error("--stop must not be empty")


def _utf8(parser: argparse.ArgumentParser, text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
        parser.error(f"{where} is not valid UTF-8 text")
    return text


def _read_stdin(parser: argparse.ArgumentParser) -> str:
    if sys.stdin is None or sys.stdin.isatty():
        parser.error("no prompt: give it as an argument, with --prompt-file or --messages, or on stdin")
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:
        return sys.stdin.read()
    try:
        return buf.read().decode("utf-8")
    except UnicodeDecodeError as e:
        parser.error(f"the prompt on stdin is not valid UTF-8 ({e.reason} at byte {e.start})")


def _prompt_items(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """The text prompts: user turns (str) or conversations (lists of messages)."""
    from dflash_jax import data
    if args.prompt_file is not None:
        try:
            items = data.read_prompt_file(args.prompt_file)
        except (ValueError, OSError) as e:
            parser.error(f"--prompt-file: {_one_line(e)}")
    elif args.messages is not None:
        try:
            with open(args.messages, encoding="utf-8") as f:
                conv = json.load(f)
            if isinstance(conv, dict) and "messages" in conv:
                conv = conv["messages"]
            items = [data.check_messages(conv, args.messages)]
        except (ValueError, OSError) as e:
            parser.error(f"--messages {args.messages}: {_one_line(e)}")
    else:
        text = args.prompt if args.prompt is not None else _read_stdin(parser)
        items = [_utf8(parser, text, "the prompt")]
    for i, item in enumerate(items):
        if isinstance(item, str):
            _utf8(parser, item, f"prompt {i + 1}")
            if not item.strip():
                parser.error("the prompt is empty" if len(items) == 1 else f"prompt {i + 1} is empty")
    return items


def _encode(parser, args, tokenizer, items) -> list[list[int]]:
    from dflash_jax.data import apply_chat_template
    out = []
    for i, item in enumerate(items):
        try:
            ids = (list(tokenizer.encode(item, add_special_tokens=False)) if args.raw_prompt else
                   apply_chat_template(tokenizer, item, system=args.system, thinking=args.thinking == "on"))
        except ValueError as e:
            parser.error(_one_line(e))
        if not ids:
            parser.error("the prompt tokenizes to nothing" if len(items) == 1 else
                         f"prompt {i + 1} tokenizes to nothing")
        out.append(ids)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        for f in (sys.stdout, sys.stderr):
            f.flush()
        print("\n[dflash] interrupted", file=sys.stderr, flush=True)
        if any(t.name == "dflash-generate" for t in threading.enumerate()):
            os._exit(EXIT_INTERRUPTED)  # the generation thread is inside XLA (compiling) and cannot be joined
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    from dflash_jax.text import StopWatcher

    skip_absent_tpu()
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    _check_prompt_args(parser, args)
    cfg = resolve_sources(parser, args)
    vocab = cfg.vocab_size
    # The prompts are settled before the (slow) weight loading so that mistakes fail fast.
    tokenizer = load_tokenizer(parser, args, needed=args.prompt_ids is None)
    if args.prompt_ids is not None:
        prompts = [parse_prompt_ids(parser, args.prompt_ids, vocab)]
    elif args.random_init is not None and tokenizer is None:
        prompts = [random_prompt(vocab, args.prompt_len, args.seed)]
    else:
        prompts = _encode(parser, args, tokenizer, _prompt_items(parser, args))
    try:
        validation.check_lengths([len(p) for p in prompts], args.max_new_tokens, cfg.max_position_embeddings)
    except ValueError as e:
        parser.error(_flag_message(e))

    eos = [] if args.ignore_eos else stop_token_ids(args.model_dir, tokenizer)
    check_eos(parser, args, eos, vocab)  # a bad generation_config.json is named, not --stop-token-ids
    stops = list(dict.fromkeys(eos + args.extra_stop_ids))
    target, draft = load_models(parser, args)
    block = effective_block_size(args, draft)
    check_verify_width(parser, args, draft)
    stream = not (args.no_stream or args.json) and len(prompts) == 1
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, stop_token_ids=stops or None, block_size=block, seed=args.seed,
              attention_impl=args.attention, verify_width=args.verify_width if block > 1 else "auto")
    cancel = threading.Event()
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    done: list[tuple[Any, StopWatcher]] = []
    streamer = None

    def work():
        nonlocal streamer
        from dflash_jax.decode import precompile
        compile_s = 0.0
        for batch in batches:
            if cancel.is_set():
                break
            watcher = StopWatcher(len(batch), tokenizer, args.stop, stops, args.max_new_tokens, cancel.is_set)
            if stream:
                streamer = _Streamer(tokenizer, watcher)

            def on_commit(rows, watcher=watcher):
                stop = watcher(rows)
                if streamer is not None:
                    streamer.update()
                return stop

            if not done:
                progress("compiling the generation loop (once per process and shape)")
            compile_s += precompile(target, draft, batch, on_commit=on_commit, **kw)
            if not done:
                progress(f"generating {len(prompts)} prompt(s)" if len(prompts) > 1 else "generating")
            done.append((_generate(target, draft, batch, on_commit=on_commit, **kw), watcher))
        return compile_s

    try:
        compile_s = run_interruptible(work, cancel)
    except ValueError as e:  # the library's refusals are user errors
        parser.error(_flag_message(e))

    rows = []  # (prompt ids, tokens, text, finish reason, acceptance lengths)
    for res, watcher in done:
        for i in range(len(res.tokens)):
            tokens, text, reason = watcher.apply(list(map(int, res.tokens[i])), res.finish_reasons[i], i)
            if tokens and tokenizer is None:
                text = None
            rows.append((tokens, text, reason, list(res.acceptance_lengths[i])))
    prompt_lens = [len(p) for p in prompts]
    n_new = sum(len(r[0]) for r in rows)
    run_s = sum(res.run_time_s for res, _ in done)
    tps = n_new / run_s if run_s > 0 else float("nan")
    accs = [a for r in rows for a in r[3]]
    mean_tau = sum(accs) / len(accs) if accs else 0.0
    hist = [0] * block
    for a in accs:
        hist[min(max(a, 1), block) - 1] += 1
    if args.json:
        for i, (tokens, text, reason, acc) in enumerate(rows):
            summary: dict[str, Any] = dict(
                model=args.model or f"random-init:{args.random_init}",
                draft=None if draft is None else (args.draft or "random"), block_size=block,
                prompt_tokens=prompt_lens[i], new_tokens=len(tokens), text=text, tokens=tokens,
                finish_reason=reason, mean_tau=(sum(acc) / len(acc) if acc else 0.0) if len(rows) > 1 else mean_tau,
                tau_histogram=hist, acceptance_lengths=acc,
                num_iterations=sum(res.num_iterations for res, _ in done), tokens_per_s=tps,
                run_time_s=run_s, compile_time_s=compile_s, temperature=args.temperature, dtype=args.dtype,
                attention=args.attention, verify_width=args.verify_width if block > 1 else None)
            if len(prompts) > 1:
                summary["index"] = i
            print(json.dumps(summary))
    elif streamer is not None and rows:
        streamer.finish(rows[0][1] if rows[0][1] is not None else render(None, rows[0][0]))
    else:
        for i, (tokens, text, _, _) in enumerate(rows):
            if len(prompts) > 1:
                print(f"=== prompt {i + 1} of {len(prompts)} ===")
            print(text if text is not None else render(None, tokens))
    sys.stdout.flush()

    interrupted = cancel.is_set()
    if not args.json:
        widths = f", verify width {args.verify_width}" if block > 1 else ""
        print(f"[dflash] {n_new} new tokens | mean tau {mean_tau:.2f} (block size {block}{widths}) | "
              f"{tps:.1f} tok/s ({run_s:.3f} s) | compile {compile_s:.1f} s"
              + (" | interrupted" if interrupted else ""), file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
