"""Loading what a command runs: sources (hub id or local directory, the hub's reachability), the
target's and draft's configs, the models (random or from a checkpoint, on a --mesh), the tokenizer
and the stop ids, from parsed flags. User mistakes end in `parser.error` with one line naming the
flag. The CLIs (dflash_jax.cli.generate, .benchmark) and the server (dflash_jax.serve) all load
through this module; their flags are dflash_jax.cli.generate's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from typing import Sequence
from urllib.parse import urlparse

# transformers prints "PyTorch was not found ..." at import when torch is absent; we never need torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from dflash_jax import validation  # noqa: E402

__all__ = ["RANDOM_DRAFT_LAYERS", "RANDOM_DRAFT_BLOCK", "LOAD_ERRORS", "TOKENIZER_FILES", "progress", "one_line",
           "check_eos", "flag_message", "go_offline_if_unreachable", "resolve_sources", "init_distributed",
           "is_main_process", "get_mesh", "load_models", "default_dtype", "effective_block_size", "load_tokenizer",
           "stop_token_ids"]

# The public drafts are 5 layers at block size 16 for every Qwen3 size (z-lab/Qwen3-*-DFlash-b16).
RANDOM_DRAFT_LAYERS = 5
RANDOM_DRAFT_BLOCK = 16


def progress(msg: str) -> None:
    print(f"[dflash] {msg}", file=sys.stderr, flush=True)


LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError)
try:  # not an OSError subclass in huggingface_hub 0.2x-2.x
    from huggingface_hub.errors import EntryNotFoundError as _EntryNotFound
    LOAD_ERRORS += (_EntryNotFound,)
except ImportError:  # pragma: no cover
    pass


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


# ----------------------------------------------------------------------------------------- the hub
def _hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint within `timeout` (DNS included, in a thread)."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    ok = [False]

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok[0] = True
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return ok[0]


def _offline() -> bool:
    v = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return v in ("1", "true", "yes", "on")


def go_offline_if_unreachable(sources: Sequence[str | None]) -> bool:
    """With hub ids among `sources` and the hub unreachable, switch huggingface_hub to offline mode
    (the local cache only) instead of letting each request retry for a minute. True when offline."""
    hub_ids = [s for s in sources if s and s.lower() != "none" and not os.path.isdir(s)]
    if not hub_ids:
        return _offline()
    if not _offline():
        if _hub_reachable():
            return False
        progress("the hub is unreachable: using the local cache only (HF_HUB_OFFLINE=1)")
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:  # huggingface_hub reads the variable once, at import
        import huggingface_hub.constants as hc
        hc.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover
        pass
    return _offline()


def resolve_sources(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Hub ids → local directories, the draft first (a typo in it must not wait for the target's
    download); then the configs, checked against each other and the length limits before any weight
    is read. Sets args.model_dir / args.draft_dir; returns the target's TargetConfig."""
    from dflash_jax import drafts, models
    from dflash_jax.config import TargetConfig, read_json
    from dflash_jax.checkpoint_io import is_hub_id, resolve_model_dir

    tok = getattr(args, "tokenizer", None)
    if tok is not None and not os.path.isdir(tok) and not is_hub_id(tok):
        parser.error(f"--tokenizer {tok}: no such directory (and not a hub id 'org/name')")
    offline = go_offline_if_unreachable([args.model, args.draft, args.tokenizer])
    hint = " (offline: only models in the local hub cache can be used)" if offline else ""
    args.model_dir = args.draft_dir = None
    if args.draft is not None and args.draft.lower() != "none":
        try:
            if not os.path.isdir(args.draft):
                progress(f"fetching draft {args.draft} from the hub (or its cache)")
            args.draft_dir = resolve_model_dir(args.draft)
            draft_cfg = drafts.read_config(read_json(args.draft_dir))
        except LOAD_ERRORS as e:
            parser.error(f"--draft {args.draft}: {one_line(e)}{'' if 'offline' in one_line(e) else hint}")
    try:
        if args.random_init is not None:
            cfg = TargetConfig.preset(args.random_init)
        else:
            if not os.path.isdir(args.model):
                progress(f"fetching model {args.model} from the hub (or its cache)")
            args.model_dir = resolve_model_dir(args.model)
            cfg = models.read_config(read_json(args.model_dir))
    except LOAD_ERRORS as e:
        parser.error(f"--{'random-init' if args.random_init else 'model'} {args.random_init or args.model}: "
                     f"{one_line(e)}{'' if 'offline' in one_line(e) else hint}")
    if args.draft_dir is not None:
        try:
            draft_cfg.check_fits(cfg)
        except ValueError as e:
            parser.error(f"--draft {args.draft}: {one_line(e)}")
        if args.block_size is not None and args.block_size > draft_cfg.block_size:
            parser.error(f"--block-size {args.block_size} is above the draft's block size {draft_cfg.block_size}")
    try:
        validation.check_max_new_tokens(args.max_new_tokens, cfg.max_position_embeddings)
        validation.check_top_k(args.top_k, cfg.vocab_size)
        validation.check_stop_ids(args.extra_stop_ids, cfg.vocab_size)
    except ValueError as e:
        parser.error(flag_message(e))
    return cfg


def flag_message(e: BaseException) -> str:
    """A library message in the CLI's terms (max_new_tokens → --max-new-tokens)."""
    text = one_line(e)
    for name in ("max_new_tokens", "top_k", "stop_token_ids", "top_p", "seed", "temperature"):
        text = text.replace(name, "--" + name.replace("_", "-"))
    return text


def init_distributed() -> None:
    """jax.distributed.initialize() when the environment names a multi-process run: a coordinator
    (JAX_COORDINATOR_ADDRESS, with JAX_NUM_PROCESSES / JAX_PROCESS_ID), the workers of a
    multi-host TPU slice (TPU_WORKER_HOSTNAMES with several hosts), or DFLASH_DISTRIBUTED=1 (set by
    scripts/tpu_vm_setup.sh on every worker; JAX finds the slice's workers itself). Then only
    process 0 prints: the others' stdout and stderr go to /dev/null (DFLASH_ALL_PROCESSES_PRINT=1
    keeps them)."""
    import jax
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if not (os.environ.get("JAX_COORDINATOR_ADDRESS") or "," in hosts or os.environ.get("DFLASH_DISTRIBUTED") == "1"):
        return
    if not jax.distributed.is_initialized():
        # JAX reads JAX_COORDINATOR_ADDRESS itself but not the process count and id (auto-detected
        # on TPU slices and clusters only), so a run named by the environment passes them on
        kw = {name: int(os.environ[var]) for name, var in (("num_processes", "JAX_NUM_PROCESSES"),
                                                           ("process_id", "JAX_PROCESS_ID")) if os.environ.get(var)}
        jax.distributed.initialize(**kw)
    if jax.process_index() != 0 and os.environ.get("DFLASH_ALL_PROCESSES_PRINT") != "1":
        sys.stdout = sys.stderr = open(os.devnull, "w")


def is_main_process() -> bool:
    """Process 0 of a multi-host run (always True on one host): the one that prints and writes."""
    import jax
    return jax.process_index() == 0


def get_mesh(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The --mesh as a jax Mesh (None without the flag, or on one device); errors end in parser.error."""
    from dflash_jax import sharding
    if getattr(args, "mesh", None) is None:
        return None
    try:
        return sharding.as_mesh(args.mesh)
    except ValueError as e:
        parser.error(f"--mesh {args.mesh}: {one_line(e)}")


def load_models(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(target, draft or None) from the parsed flags, on the --mesh when given; user mistakes end
    in parser.error."""
    import dflash_jax as dj
    from dflash_jax import sharding

    if not hasattr(args, "model_dir"):
        resolve_sources(parser, args)
    init_distributed()
    args.dtype = default_dtype(args)
    mesh = get_mesh(parser, args)
    quantize = getattr(args, "quantize", None)
    quantize_draft = getattr(args, "quantize_draft", None)
    if getattr(args, "w8a8", False) and args.random_init is not None:
        parser.error("--w8a8 needs an FP8 checkpoint (--model with quantization_config quant_method 'fp8'); "
                     "--random-init builds float weights")
    try:
        if args.random_init is not None:
            progress(f"building random {args.random_init} ({args.dtype})")
            target = dj.init_target(args.random_init.lower(), seed=args.seed, dtype=args.dtype, quantize=quantize)
            if mesh is not None:
                sharding.shard_model(target, mesh)
        else:
            progress(f"loading target {args.model} ({args.dtype})" + (f" on mesh {args.mesh}" if mesh else ""))
            target = dj.load_target(args.model_dir, dtype=args.dtype, mesh=mesh, quantize=quantize,
                                    w8a8=getattr(args, "w8a8", False))
    except LOAD_ERRORS as e:
        parser.error(f"--{'random-init' if args.random_init else 'model'} {args.random_init or args.model}: "
                     f"{one_line(e)}")
    draft = None
    if args.draft is None and args.random_init is not None:
        cfg = dj.DraftConfig.for_target(target.config, num_layers=RANDOM_DRAFT_LAYERS,
                                        block_size=RANDOM_DRAFT_BLOCK)
        draft = dj.init_draft(cfg, seed=(args.seed + 1) % validation.SEED_LIMIT, dtype=args.dtype,
                              quantize=quantize_draft)
        if mesh is not None:
            sharding.shard_model(draft, mesh)
    elif args.draft_dir is not None:
        try:
            progress(f"loading draft {args.draft}")
            draft = dj.load_draft(args.draft_dir, target=target, dtype=args.dtype, mesh=mesh,
                                  quantize=quantize_draft)
        except LOAD_ERRORS as e:
            parser.error(f"--draft {args.draft}: {one_line(e)}")
    if args.block_size is not None and draft is not None and args.block_size > draft.config.block_size:
        parser.error(f"--block-size {args.block_size} is above the draft's block size "
                     f"{draft.config.block_size}")
    return target, draft


def default_dtype(args: argparse.Namespace) -> str:
    """--dtype, or its default: float32 for the embedded demo pair on a CPU (bfloat16 buys no speed
    there, docs/perf-log.md, and in float32 the 16-row verify and the 1-row step round alike, so
    greedy DFlash equals plain decoding token for token), bfloat16 everywhere else."""
    if args.dtype is not None:
        return args.dtype
    import jax
    return "float32" if args.default_pair and jax.default_backend() == "cpu" else "bfloat16"


def effective_block_size(args: argparse.Namespace, draft) -> int:
    if draft is None:
        return 1
    return args.block_size if args.block_size is not None else draft.config.block_size


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def load_tokenizer(parser: argparse.ArgumentParser, args: argparse.Namespace, needed: bool = True,
                   hint: str = "pass --tokenizer DIR, or --prompt-ids to run without a tokenizer"):
    """The target's tokenizer (or --tokenizer's); None with --random-init and no --tokenizer, or when
    not `needed` (token-id prompts) and no --tokenizer was given: then no tokenizer is loaded at all.
    `hint` ends a refusal: what the user can do instead (the CLI's own flags)."""
    if args.tokenizer is None and (args.model is None or not needed):
        return None
    if not hasattr(args, "model_dir"):
        resolve_sources(parser, args)
    flag, source = ("--tokenizer", args.tokenizer) if args.tokenizer else ("--model", args.model_dir)
    shown = args.tokenizer or args.model
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
        parser.error(f"{flag} {shown} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}); {hint}")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # transformers' error would not name the file
        path = os.path.join(source, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (ValueError, OSError) as e:
                parser.error(f"{flag} {shown}: {path} is not a readable JSON file ({one_line(e)}); {hint}")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except LOAD_ERRORS as e:
        parser.error(f"tokenizer {shown}: {one_line(e)} ({hint})")
    if len(tok) == 0:
        parser.error(f"{flag} {shown}: the tokenizer loaded empty; {hint}")
    return tok


def check_eos(parser: argparse.ArgumentParser, args: argparse.Namespace, eos: Sequence[int],
              vocab: int) -> None:
    """The model's eos ids (stop_token_ids) must be token ids of its vocabulary: a bad
    generation_config.json is named (not blamed on --stop-token-ids, nor each server request's 400)."""
    bad = [t for t in eos if not 0 <= t < vocab]
    if not bad:
        return
    gen = []
    try:
        from transformers import GenerationConfig
        ids = GenerationConfig.from_pretrained(args.model_dir or args.model).eos_token_id
        gen = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    except Exception:  # noqa: BLE001  (no generation_config.json: the tokenizer's eos alone)
        pass
    in_gen = [t for t in bad if t in gen]
    if in_gen:
        parser.error(f"--model {args.model}: generation_config.json has eos_token_id {in_gen} outside the "
                     f"vocabulary [0, {vocab}) of its config.json; fix generation_config.json")
    parser.error(f"--model {args.model}: the tokenizer's eos token id {bad} is outside the model's vocabulary "
                 f"[0, {vocab}); pass a matching --tokenizer")


def stop_token_ids(model_source: str | None, tokenizer) -> list[int]:
    """eos ids from the model's generation_config.json (int or list) plus the tokenizer's eos.

    Qwen3 chat models stop on <|im_end|> (generation config) and <|endoftext|> (both); missing
    either would run chat turns on into the next turn.
    """
    from dflash_jax.text import eos_token_ids
    eos = None
    if model_source is not None:
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(model_source).eos_token_id
        except LOAD_ERRORS as e:
            eos = None  # no generation_config.json: the tokenizer's eos alone
            path = os.path.join(model_source, "generation_config.json")
            if os.path.isfile(path):  # there but unreadable: its eos ids are lost, say so
                print(f"warning: {path} cannot be read ({one_line(e)[:160]}); its eos_token_id is not used, "
                      f"only the tokenizer's eos token stops generation", file=sys.stderr, flush=True)
    return eos_token_ids(tokenizer, eos)
