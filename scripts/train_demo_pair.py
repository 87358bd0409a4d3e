"""Train the embedded demo pair: tokenizer → Qwen3 target → regenerated responses → DFlash draft →
evaluation → shipped files. One command, seeded, resumable per stage, everything under --out.

    python scripts/train_demo_pair.py --size gpu --out out/demo_pair --deliver $OUT   # one H200 call, < 10 min
    python scripts/train_demo_pair.py --size cpu --out out/demo_cpu        # minutes on 2 CPU cores
    python scripts/train_demo_pair.py --size ci --out out/demo_ci          # the test suite's: cpu, fewer steps
    # a DFlash2 draft for the shipped pair's target, compared with its DFlash-1 draft (one H200 call)
    python scripts/train_demo_pair.py --size gpu --arch dflash2 --target-from dflash_jax/assets/pair/target \
        --out out/dflash2_pair --deliver $OUT

Stages (each writes its outputs and a `stages/<name>.json`; a rerun skips finished stages unless
--force names them): tokenizer, target, regen, draft, eval, ship. `manifest.json` records exactly
which data went in (every file with its sha256, the held-out modules, the GSM8K rows), the shapes,
the steps and the timings. The ship stage writes the pair as `ship/pair/{target,draft,README.md}`
and as `pair.tar.NN` pieces of at most 15 MiB (the device tool returns files up to 16 MiB); install
them with `--install` (copies ship/pair into dflash_jax/assets/pair) or
`cat pair.tar.* | tar x -C dflash_jax/assets/`.

Data: the running interpreter's own standard library sources (tests excluded, some modules held out
for evaluation) and the GSM8K train split bundled in dflash_jax/datasets; never HumanEval or the
GSM8K test split (the evaluation prompts).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import string
import sys
import sysconfig
import tarfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

STAGES = ("tokenizer", "target", "regen", "draft", "eval", "ship")

# Special tokens, in id order (ids 0..3). <|im_end|> ends a turn and is the eos; <|endoftext|> pads
# and separates packed documents; <|mask|> fills the draft block's slots 1..S-1.
PAD, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen2/3's pre-tokenizer split: single digits (arithmetic), letters, punctuation runs, newlines.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# The evaluation prompt wordings (dflash_jax.data, the paper's): training chat turns use the same.
HUMANEVAL_WORDING = "Write a solution to the following problem and make sure that it passes the tests:\n"
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# Modules held out of every training set (tokenizer included); the stdlib evaluation reads them.
# All exist from Python 3.9 to 3.13.
HELDOUT_MODULES = ("bisect.py", "calendar.py", "colorsys.py", "difflib.py", "fractions.py", "heapq.py",
                   "shlex.py", "statistics.py", "textwrap.py")
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

# The draft's regeneration prompts by kind (shares of regen_prompts). "self-*" prompts are the
# target's own T = 1 samples (a HumanEval-worded problem it invents, a GSM8K-style question, code
# after a stdlib cut point), cut or closed into a chat turn: novel to the target, as the evaluation
# prompts are, where prompts it trained on make it recite its training text.
REGEN_MIX = {"self-humaneval": 0.30, "self-gsm8k": 0.12, "self-code": 0.20, "function0": 0.07,
             "function1": 0.05, "gsm8k": 0.08, "code": 0.18}

SIZES = {
    # ~1 M parameters, a ~1 MB corpus: the whole pipeline in a few minutes on 2 CPU cores.
    "cpu": dict(
        vocab_size=4096, stdlib_bytes=1_000_000, gsm8k_rows=1500, max_functions=1500,
        target=dict(hidden_size=96, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=24),
        seq_len=128, batch=8, epochs=1.0, max_steps=150, lr=3e-3, warmup=20, train_budget_s=150,
        dtype="float32", eval_dtype="float32",
        regen_prompts=32, regen_new_tokens=48, regen_batch=16, regen_prompt_tokens=96, regen_budget_s=None,
        regen_mix=REGEN_MIX, self_new_tokens=24, heldout_rows=8, regen_t1_share=0.25,
        draft=dict(num_layers=1, block_size=16, steps=120, batch=8, num_anchors=32, lr=6e-4, budget_s=240),
        eval_prompts=4, eval_new_tokens=48, timing_prompts=1, timing_sets=("humaneval",),
        heldout_prompt_tokens=96, eval_reserve_s=110, ship_dtype="bfloat16", deadline_s=None,
        dflash2=dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=16,
                     sliding_window=None, eval_reserve_s=110)),
    # ~14 M parameters (untied head): target + draft ≈ 35 MB in bf16, one H200 call.
    "gpu": dict(
        vocab_size=6144, stdlib_bytes=None, gsm8k_rows=None, max_functions=12000,
        # 8 q / 2 kv heads: a GQA group of 4 (Qwen3-8B's), a power of two as the GPU attention kernel
        # needs; 6 / 2 (group 3) ran every attention on the XLA path
        target=dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=8, num_kv_heads=2,
                    head_dim=64),
        # 3 epochs, not 6: at 6 the target recited its training functions (train loss 1.28, held-out
        # 3.69), so its continuations of training prompts taught the draft recitation, not the target
        seq_len=512, batch=64, epochs=3.0, max_steps=4000, lr=2e-3, warmup=100, train_budget_s=90,
        dtype="bfloat16", eval_dtype="bfloat16",
        # 48k prompts, most of them novel to the target (its own T = 1 samples): the regenerated
        # responses are cheap (the loop is launch-bound at this size; compiles dominate)
        regen_prompts=49152, regen_new_tokens=256, regen_batch=1024, regen_prompt_tokens=256,
        regen_budget_s=130, regen_mix=REGEN_MIX, self_new_tokens=160, heldout_rows=128,
        # a share of the prompts is continued at T = 1 instead of greedily, so that the draft also
        # learns the target's sampled continuations (at T = 1 the greedy-only draft reached τ 1.28)
        regen_t1_share=0.3,
        draft=dict(num_layers=2, block_size=16, steps=20000, batch=64, num_anchors=128, lr=6e-4, budget_s=290),
        eval_prompts=64, eval_new_tokens=256, timing_prompts=3, timing_sets=("humaneval",),
        heldout_prompt_tokens=192, eval_reserve_s=115, ship_dtype="bfloat16", deadline_s=540,
        # --arch dflash2 (a DFlash2 draft for an existing pair's target, --target-from): the published
        # DFlash2 drafts' block 8 and conv (2 taps, 16-channel groups) and top-16, a rank scaled to
        # this 384-wide draft, no window (the rows are under 2048 tokens: it would never bind); the
        # evaluation runs both drafts, so it keeps more time
        dflash2=dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=64, selector_top_k=16,
                     sliding_window=None, eval_reserve_s=160)),
}
# The test suite's run (tests/test_demo_pair.py): the cpu size's shapes, stages and evaluation with a
# smaller corpus and fewer training steps, so the whole pipeline stays a couple of minutes of a 2-core
# CI run, where compiles are most of the time: 20 regeneration prompts (the T = 1 seeds in one batch)
# of at most 64 tokens (regen_code_tokens: the raw code cuts' lengths; every draft row then fits one
# trimmed length, one compiled training step), evaluation prompts cut to their last 128 tokens (one
# prompt bucket: 6 generate programs, not 9). Its draft still beats τ 1 (the weak target repeats
# itself); the pair is not one to ship.
SIZES["ci"] = dict(SIZES["cpu"], stdlib_bytes=400_000, gsm8k_rows=600, max_functions=600, max_steps=60, warmup=10,
                   regen_prompts=20, regen_prompt_tokens=64, regen_code_tokens=(32, 64),
                   draft=dict(SIZES["cpu"]["draft"], steps=40, num_anchors=16), eval_prompt_tokens=128)
SHIP_LIMIT_MB = 40.0
EVAL_RESERVE_S = 25  # kept for the ship stage when a deadline is set
TAR_PIECE = 15 * 2 ** 20


# ----------------------------------------------------------------------------------------- helpers
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return sha256_bytes(f.read())


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------- corpus
def stdlib_files(root: str | None = None) -> tuple[list[str], list[str], str]:
    """(training files, held-out files, root): the stdlib's *.py, tests excluded, sorted, relative."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        for f in sorted(files):
            if not f.endswith(".py") or f.startswith("test_") or f == "__phello__.py":
                continue
            rel = os.path.relpath(os.path.join(d, f), root)
            (held if rel in HELDOUT_MODULES else train).append(rel)
    return sorted(train), sorted(held), root


def read_sources(root: str, rels: list[str]) -> list[tuple[str, str]]:
    out = []
    for rel in rels:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def subset_by_bytes(sources: list[tuple[str, str]], budget: int | None) -> list[tuple[str, str]]:
    """Every k-th file (k chosen so the total is near `budget` bytes): a spread over the library."""
    if budget is None:
        return sources
    total = sum(len(t) for _, t in sources)
    k = max(1, math.ceil(total / budget))
    picked, size = [], 0
    for rel, t in sources[::k]:
        if size >= budget:
            break
        picked.append((rel, t))
        size += len(t)
    return picked


def chat(user: str, assistant: str | None = None) -> str:
    """The chat template's text (CHAT_TEMPLATE renders the same; a test checks it)."""
    s = f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
    return s if assistant is None else s + f"{assistant}{IM_END}\n"


def gsm8k_answer(answer: str) -> str:
    """Calculator annotations <<...>> removed; `#### x` written as the \\boxed{x} the prompt asks for."""
    answer = re.sub(r"<<[^>]*>>", "", answer)
    body, _, final = answer.rpartition("####")
    return f"{body.strip()}\nThe final answer is \\boxed{{{final.strip()}}}." if body else answer.strip()


def functions(rel: str, text: str) -> list[dict]:
    """Functions with a docstring and a body in one file: their signature (+ docstring) and source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                and isinstance(doc.value.value, str)):
            continue
        n_lines = node.end_lineno - node.lineno + 1
        if n_lines > 60:
            continue
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        head = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.end_lineno]))
        sig = textwrap.dedent("\n".join(lines[node.lineno - 1:max(doc.lineno - 1, node.lineno)]))
        out.append(dict(file=rel, name=node.name, lineno=node.lineno, source=src, head=head, signature=sig))
    return out


def function_turns(fn: dict, variant: int) -> tuple[str, str]:
    """(user, assistant) of one function: HumanEval's wording with signature + docstring, or the
    signature alone (what `generate "def fibonacci(n):"` sends)."""
    answer = f"```python\n{fn['source']}\n```"
    if variant == 0:
        return f"{HUMANEVAL_WORDING}```python\n{fn['head']}\n```", answer
    return fn["signature"], answer


def build_corpus(size: dict, seed: int) -> dict:
    """The documents (code files, function chat turns, GSM8K chat turns) and what they came from."""
    rng = random.Random(seed)
    train_rel, held_rel, root = stdlib_files()
    sources = subset_by_bytes(read_sources(root, train_rel), size["stdlib_bytes"])
    gsm_path = os.path.join(REPO, "dflash_jax", "datasets", "gsm8k_train.jsonl")
    gsm = read_jsonl(gsm_path)
    if size["gsm8k_rows"] is not None:
        gsm = gsm[:size["gsm8k_rows"]]
    fns = [f for rel, t in sources for f in functions(rel, t)]
    rng.shuffle(fns)
    fns = fns[:size["max_functions"]]
    docs = [t for _, t in sources]
    docs += [chat(*function_turns(f, i % 2)) for i, f in enumerate(fns)]
    docs += [chat(r["question"] + BOXED, gsm8k_answer(r["answer"])) for r in gsm]
    rng.shuffle(docs)
    return dict(docs=docs, sources=sources, functions=fns, gsm8k=gsm, gsm8k_path=gsm_path, stdlib=root,
                heldout=held_rel)


def corpus_manifest(c: dict) -> dict:
    return dict(
        python_version=platform.python_version(), python_implementation=platform.python_implementation(),
        stdlib=c["stdlib"], excluded_dirs=sorted(EXCLUDED_DIRS), excluded_files="test_*.py",
        heldout_modules=c["heldout"],
        stdlib_files=[dict(path=rel, bytes=len(t.encode()), sha256=sha256_bytes(t.encode()))
                      for rel, t in c["sources"]],
        functions_as_chat=len(c["functions"]),
        gsm8k_train=dict(file="dflash_jax/datasets/gsm8k_train.jsonl", sha256=sha256_file(c["gsm8k_path"]),
                         rows_used=len(c["gsm8k"]), first_rows=True),
        never_used=["dflash_jax/datasets/humaneval.jsonl", "dflash_jax/datasets/gsm8k_test.jsonl"],
        documents=len(c["docs"]), characters=sum(len(d) for d in c["docs"]))


# ----------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size: int, out_dir: str):
    """Byte-level BPE over `texts`, saved in HF format (tokenizer.json + tokenizer_config.json with
    the chat template); returns the transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, mask_token=MASK,
                                 additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False,
                                 model_max_length=40960)
    hf.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    # transformers 5 writes its own class name and list key; 4.x (>= 4.51 is supported) reads these
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = read_json(cfg_path)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
               additional_special_tokens=[IM_START])
    cfg.pop("extra_special_tokens", None)
    write_json(cfg_path, cfg)
    return load_tokenizer(out_dir)


def load_tokenizer(d: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(d)


def special_ids(tok) -> dict:
    return {name: tok.convert_tokens_to_ids(t) for name, t in
            (("pad", PAD), ("im_start", IM_START), ("im_end", IM_END), ("mask", MASK))}


# ----------------------------------------------------------------------------------------- stages
class Run:
    """The --out directory: stage results, the manifest, resumption."""

    def __init__(self, out: str, size_name: str, seed: int, force: set[str]):
        self.out, self.size_name, self.seed, self.force = out, size_name, seed, force
        self.size = dict(SIZES[size_name])
        os.makedirs(os.path.join(out, "stages"), exist_ok=True)
        self.manifest_path = os.path.join(out, "manifest.json")
        self.manifest = read_json(self.manifest_path) if os.path.isfile(self.manifest_path) else {}
        if self.manifest and (self.manifest.get("size"), self.manifest.get("seed")) != (size_name, seed):
            raise SystemExit(f"{out} holds a run of --size {self.manifest.get('size')} --seed "
                             f"{self.manifest.get('seed')}; use another --out or the same settings")
        self.manifest.update(size=size_name, seed=seed, settings=self.size)
        self._corpus = None
        self.deadline_s = self.size["deadline_s"]
        self.reference = "auto"
        self.arch, self.target_from, self.v1_draft, self.init_draft = "dflash", None, None, None

    def use_dflash2(self, target_from: str, v1_draft: str | None, init_draft: str | None, block_size: int | None):
        """--arch dflash2: the draft is a DFlash2 draft for the existing target `target_from` (its
        tokenizer too); the tokenizer and target stages copy it instead of training one."""
        d2 = self.size["dflash2"] = dict(self.size["dflash2"])
        if block_size:
            d2["block_size"] = block_size
        self.arch, self.target_from, self.v1_draft, self.init_draft = "dflash2", target_from, v1_draft, init_draft
        self.size["draft"] = dict(self.size["draft"], block_size=d2["block_size"])
        self.size["eval_reserve_s"] = d2["eval_reserve_s"]
        self.manifest.update(arch="dflash2", target_from=target_from, v1_draft=v1_draft, init_draft=init_draft,
                             settings=self.size)

    def remaining(self) -> float:
        """Seconds left before --deadline-s (inf without one): eval drops work past it, ship still runs."""
        d = self.deadline_s
        return math.inf if not d else d - (time.perf_counter() - T0)

    def path(self, *p) -> str:
        return os.path.join(self.out, *p)

    def done(self, stage: str):
        f = self.path("stages", f"{stage}.json")
        return None if stage in self.force or not os.path.isfile(f) else read_json(f)

    def finish(self, stage: str, result: dict) -> dict:
        write_json(self.path("stages", f"{stage}.json"), result)
        self.manifest.setdefault("stages", {})[stage] = result
        write_json(self.manifest_path, self.manifest)
        return result

    def corpus(self) -> dict:
        if self._corpus is None:
            t = time.perf_counter()
            self._corpus = build_corpus(self.size, self.seed)
            self.manifest["data"] = corpus_manifest(self._corpus)
            write_json(self.manifest_path, self.manifest)
            log(f"corpus: {len(self._corpus['sources'])} stdlib files, {len(self._corpus['functions'])} functions "
                f"as chat, {len(self._corpus['gsm8k'])} GSM8K rows, {self.manifest['data']['characters'] / 1e6:.1f} M "
                f"characters ({time.perf_counter() - t:.1f} s); held out: {', '.join(self._corpus['heldout'])}")
        return self._corpus


def dflash2_fields(run: Run) -> dict:
    """The DraftConfig fields of the DFlash2 draft (--arch dflash2)."""
    d2 = run.size["dflash2"]
    out = dict(architecture="DFlash2DraftModel", conv_kernel_size=d2["conv_kernel_size"],
               conv_group_size=d2["conv_group_size"], selector_rank=d2["selector_rank"],
               selector_top_k=d2["selector_top_k"])
    if d2.get("sliding_window"):
        out.update(layer_types=("sliding_attention",) * run.size["draft"]["num_layers"],
                   sliding_window=d2["sliding_window"], is_causal=False)
    return out


def _shipped_stage(run: Run, name: str) -> dict:
    """A stage record of the pair that --target-from comes from (its manifest.json), or {}."""
    m = os.path.join(os.path.dirname(os.path.abspath(run.target_from)), "manifest.json")
    return dict(read_json(m).get("stages", {}).get(name, {})) if os.path.isfile(m) else {}


def stage_target_from(run: Run, name: str) -> dict:
    """--target-from: the tokenizer and target stages copy the existing target (and the tokenizer
    that travels with it) instead of training them."""
    d = run.path("target")
    if name == "target":
        if os.path.isdir(d):
            shutil.rmtree(d)
        shutil.copytree(run.target_from, d)
    tok = load_tokenizer(run.target_from)
    rec = _shipped_stage(run, name)
    rec.update(source=os.path.abspath(run.target_from), copied=True,
               target_sha256=sha256_file(os.path.join(run.target_from, "model.safetensors")))
    if name == "tokenizer":
        rec.update(vocab_size=len(tok), special_ids=special_ids(tok))
    log(f"{name}: from {run.target_from}")
    return rec


def stage_tokenizer(run: Run) -> dict:
    c = run.corpus()
    t = time.perf_counter()
    texts = [t_ for _, t_ in c["sources"]] + [r["question"] + "\n" + r["answer"] for r in c["gsm8k"]]
    tok = train_tokenizer(texts, run.size["vocab_size"], run.path("tokenizer"))
    ids = special_ids(tok)
    return dict(vocab_size=len(tok), special_ids=ids, time_s=round(time.perf_counter() - t, 1),
                tokenizer_json_sha256=sha256_file(run.path("tokenizer", "tokenizer.json")))


def encode_stream(tok, docs: list[str], pad_id: int) -> np.ndarray:
    """Documents as one token stream, each followed by <|endoftext|>."""
    enc = tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, np.int32))
        parts.append(np.asarray([pad_id], np.int32))
    return np.concatenate(parts)


def train_target_model(run: Run, tok, stream: np.ndarray, heldout: np.ndarray):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dflash_jax.config import TargetConfig
    from dflash_jax.models.qwen3 import Qwen3

    s = run.size
    cfg = TargetConfig(vocab_size=len(tok), rope_theta=1e4, max_position_embeddings=4096,
                       tie_word_embeddings=False, **s["target"])
    compute = jnp.dtype(s["dtype"])
    T, B = s["seq_len"], s["batch"]
    n_chunks = (len(stream) - 1) // T
    chunks = stream[:n_chunks * T + 1]
    steps = int(min(s["max_steps"], max(1, math.ceil(s["epochs"] * n_chunks / B))))
    log(f"target: {stream.size / 1e6:.2f} M tokens = {n_chunks} windows of {T}; {steps} steps of {B}x{T} "
        f"({steps * B / n_chunks:.2f} epochs), {compute.name} compute")

    master = Qwen3(cfg, jnp.float32, rngs=nnx.Rngs(run.seed))                 # f32 master weights
    params = nnx.state(master, nnx.Param)
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    compute_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3(cfg, compute, rngs=nnx.Rngs(0))))
    sched = optax.warmup_cosine_decay_schedule(0.0, s["lr"], s["warmup"], max(steps, s["warmup"] + 1),
                                               end_value=s["lr"] * 0.1)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)                  # no decay on norms
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt_state = opt.init(params)

    def loss_fn(p, batch):                                                     # batch [B, T + 1]
        model = nnx.merge(compute_def, jax.tree.map(lambda x: x.astype(compute), p))
        x, y = batch[:, :-1], batch[:, 1:]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)  # [B, T]
        # a fresh cache of capacity T + prefill: the causal forward over the window
        h, _, _ = model(x, pos, model.new_cache(x.shape[0], x.shape[1]), pos + 1, kernels="xla",
                        prefill=True)
        logits = model.logits(h)                                               # [B, T, V] f32
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, o, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        upd, o = opt.update(g, o, p)
        return optax.apply_updates(p, upd), o, loss, optax.global_norm(g)

    eval_loss = jax.jit(loss_fn)
    rng = np.random.default_rng(run.seed)
    order = np.concatenate([rng.permutation(n_chunks) for _ in range(math.ceil(steps * B / n_chunks) + 1)])
    starts = order * T

    def batch_at(i):
        idx = starts[i * B:(i + 1) * B, None] + np.arange(T + 1)[None]
        return jnp.asarray(chunks[idx])

    hb = None
    if heldout.size > T + 1:
        n = min(8, (heldout.size - 1) // T)
        hb = jnp.asarray(np.stack([heldout[j * T:j * T + T + 1] for j in range(n)]))   # [n, T + 1]
    t0, losses, held_curve, every = time.perf_counter(), [], [], max(1, steps // 20)
    t_compile = None
    for i in range(steps):
        params, opt_state, loss, gnorm = step(params, opt_state, batch_at(i))
        if i == 0:
            loss.block_until_ready()
            t_compile = time.perf_counter() - t0
        if (i + 1) % every == 0 or i + 1 == steps:
            loss = float(loss)
            if not math.isfinite(loss):
                raise SystemExit(f"target training diverged: loss {loss} at step {i + 1}")
            losses.append((i + 1, round(loss, 4)))
            held = ""
            if hb is not None and ((i + 1) % (4 * every) == 0 or i + 1 == steps):  # the overfitting watch
                held_curve.append((i + 1, round(float(eval_loss(params, hb)), 4)))
                held = f" held-out {held_curve[-1][1]:.3f}"
            el = time.perf_counter() - t0
            log(f"target step {i + 1}/{steps} loss {loss:.3f}{held} |g| {float(gnorm):.2f} lr {float(sched(i)):.2e} "
                f"{(i + 1) * B * T / max(el - t_compile, 1e-9) / 1e3:.0f} k tok/s")
            if el > s["train_budget_s"] and i + 1 < steps:
                log(f"target: time budget {s['train_budget_s']} s reached, stopping at step {i + 1}")
                steps = i + 1
                break
    train_time = time.perf_counter() - t0
    hl = [round(float(eval_loss(params, hb)), 4)] if hb is not None else []
    nnx.update(master, params)
    return master, dict(config=dataclasses.asdict(cfg), params=n_params, steps=steps, batch=B, seq_len=T,
                        tokens_seen=steps * B * T, epochs=round(steps * B / n_chunks, 2),
                        corpus_tokens=int(stream.size), loss_curve=losses, heldout_curve=held_curve,
                        final_loss=losses[-1][1],
                        heldout_loss=hl[0] if hl else None, compile_s=round(t_compile, 1),
                        train_s=round(train_time, 1), lr=s["lr"], warmup=s["warmup"], dtype=compute.name)


def write_generation_config(d: str, ids: dict) -> None:
    write_json(os.path.join(d, "generation_config.json"),
               dict(eos_token_id=[ids["im_end"], ids["pad"]], pad_token_id=ids["pad"], do_sample=False))


def stage_target(run: Run) -> dict:
    from dflash_jax.assets import save_target

    c = run.corpus()
    tok = load_tokenizer(run.path("tokenizer"))
    ids = special_ids(tok)
    t = time.perf_counter()
    stream = encode_stream(tok, c["docs"], ids["pad"])
    _, held_rel, root = stdlib_files()
    heldout = encode_stream(tok, [x for _, x in read_sources(root, held_rel)], ids["pad"])
    log(f"encoded {stream.size / 1e6:.2f} M training tokens ({time.perf_counter() - t:.1f} s)")
    model, res = train_target_model(run, tok, stream, heldout)
    d = run.path("target")
    if os.path.isdir(d):
        shutil.rmtree(d)
    save_target(model, d, run.size["ship_dtype"], eos_token_id=ids["im_end"], pad_token_id=ids["pad"])
    write_generation_config(d, ids)
    for f in os.listdir(run.path("tokenizer")):  # the tokenizer travels with the target (HF convention)
        shutil.copy(run.path("tokenizer", f), d)
    res["safetensors_mb"] = round(os.path.getsize(os.path.join(d, "model.safetensors")) / 2 ** 20, 2)
    log(f"target: {res['params'] / 1e6:.2f} M params, loss {res['final_loss']}, held-out {res['heldout_loss']}, "
        f"saved to {d} ({res['safetensors_mb']} MB)")
    return res


def mix_counts(mix: dict, n: int) -> dict:
    """Prompts per kind: the shares of `mix` over n, the rounding remainder to the largest kind."""
    counts = {k: int(n * f) for k, f in mix.items()}
    counts[max(mix, key=mix.get)] += n - sum(counts.values())
    return counts


def code_cuts(rng: random.Random, tok, files, n: int, lo: int, hi: int) -> list[list[int]]:
    """n cuts of lo..hi tokens from random points of training stdlib files (mid-line cuts
    included); the windows are encoded in batches (one encode per cut costs minutes at 48k)."""
    out = []
    while len(out) < n:
        wins = []
        for _ in range(max(16, n - len(out)) + 8):
            rel, text = files[rng.randrange(len(files))]
            a = rng.randrange(0, max(1, len(text) - 1500))
            wins.append(text[a:a + 1500])
        for e in tok.backend_tokenizer.encode_batch(wins, add_special_tokens=False):
            ids = e.ids
            if len(ids) < lo + 8 or len(out) >= n:
                continue
            a = rng.randrange(0, max(1, len(ids) - hi))
            out.append(list(ids[a:a + rng.randint(lo, hi)]))
    return out


def regen_prompts(run: Run, tok, n: int) -> tuple[list[dict], list[dict]]:
    """(prompts, seeds) for the draft's data (never evaluation prompts). Prompts: GSM8K train
    questions, function prompts of both chat forms, raw cuts of training stdlib files. Seeds: the
    starts the target samples from at T = 1 (`self_prompts` turns the samples into prompts)."""
    c = run.corpus()
    rng = random.Random(run.seed + 1)
    counts = mix_counts(run.size["regen_mix"], n)
    limit = run.size["regen_prompt_tokens"]
    out = []
    gsm = [c["gsm8k"][rng.randrange(len(c["gsm8k"]))] for _ in range(counts["gsm8k"])]
    out += [dict(kind="gsm8k", text=chat(r["question"] + BOXED)) for r in gsm]
    for v in (0, 1):
        fns = [c["functions"][rng.randrange(len(c["functions"]))] for _ in range(counts[f"function{v}"])]
        out += [dict(kind=f"function{v}", text=chat(function_turns(f, v)[0])) for f in fns]
    enc = tok.backend_tokenizer.encode_batch([p.pop("text") for p in out], add_special_tokens=False)
    for p, e in zip(out, enc):
        p["ids"] = list(e.ids)[-limit:]  # a long function head keeps its end (the docstring, the turn's close)
    lo, hi = run.size.get("regen_code_tokens", (32, 160))
    out += [dict(kind="code", ids=x) for x in code_cuts(rng, tok, c["sources"], counts["code"], lo, hi)]
    user = f"{IM_START}user\n"
    seeds = [dict(kind="self-humaneval", ids=tok.encode(f"{user}{HUMANEVAL_WORDING}```python\n",
                                                         add_special_tokens=False))
             for _ in range(counts["self-humaneval"])]
    seeds += [dict(kind="self-gsm8k", ids=tok.encode(user, add_special_tokens=False))
              for _ in range(counts["self-gsm8k"])]
    seeds += [dict(kind="self-code", ids=x) for x in code_cuts(rng, tok, c["sources"], counts["self-code"], 8, 48)]
    return out, seeds


def self_prompts(run: Run, tok, seeds: list[dict], samples: list[list[int]]) -> list[dict]:
    """The target's T = 1 samples as prompts: a user turn the target closed becomes a chat turn
    awaiting the assistant (the evaluation's form); code, or a turn left open, is cut at a random
    point (the greedy continuation then starts mid-text)."""
    rng = random.Random(run.seed + 3)
    ids = special_ids(tok)
    assistant = tok.encode(f"\n{IM_START}assistant\n", add_special_tokens=False)
    limit, out = run.size["regen_prompt_tokens"], []
    for sd, smp in zip(seeds, samples):
        smp = list(smp)
        if sd["kind"] != "self-code" and smp and smp[-1] == ids["im_end"]:
            p = list(sd["ids"]) + smp + assistant
        else:
            smp = [t for t in smp if t not in (ids["im_end"], ids["pad"])]
            p = list(sd["ids"]) + smp[:rng.randint(min(8, len(smp)), len(smp))] if smp else list(sd["ids"])
        out.append(dict(kind=sd["kind"], ids=p[-limit:]))
    return out


def _generate_batched(run: Run, target, prompts: list[list[int]], *, temperature: float, max_new_tokens: int,
                      stops: list[int], t0: float, what: str, budget_s: float | None,
                      seed_offset: int = 0) -> list[list[int]]:
    """`generate` over prompts in batches of regen_batch (one batch size: one program per prompt
    bucket); past budget_s (from t0) the remaining prompts get no continuation (None)."""
    import dflash_jax as dj

    bs, outs, n_new = run.size["regen_batch"], [], 0
    for b in range(0, len(prompts), bs):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            log(f"{what}: time budget {budget_s} s reached after {b}/{len(prompts)} prompts")
            outs += [None] * (len(prompts) - b)
            break
        chunk = prompts[b:b + bs]
        fill = chunk + [chunk[-1]] * (bs - len(chunk))  # a short last batch reuses the full batch's program
        res = dj.generate(target, None, fill if len(prompts) > bs else chunk, max_new_tokens=max_new_tokens,
                          temperature=temperature, stop_token_ids=stops, seed=run.seed + seed_offset + b)
        got = [list(r) for r in res.tokens[:len(chunk)]]
        outs += got
        n_new += sum(len(r) for r in got)
        log(f"{what} {min(b + bs, len(prompts))}/{len(prompts)} prompts, {n_new} tokens "
            f"({time.perf_counter() - t0:.1f} s)")
    return outs


def load_pair(run: Run, dtype: str, with_draft: bool):
    import dflash_jax as dj
    target = dj.load_target(run.path("target"), dtype=dtype)
    draft = None
    if with_draft and os.path.isfile(run.path("draft", "config.json")):
        draft = dj.load_draft(run.path("draft"), target=target, dtype=dtype)
    return target, draft


def stage_regen(run: Run) -> dict:
    """The target's own continuations of training prompts (our `generate`): the draft's data.
    First the target samples the "self-*" prompts at T = 1 from their seeds, then it continues the
    prompts greedily, and a random share of them (regen_t1_share of the batches; 0 with
    --no-sampled-continuations) at T = 1 instead, so the draft also learns what the target samples.
    With regen_budget_s, each pass stops taking new batches past its share."""
    s = run.size
    tok = load_tokenizer(run.path("target"))
    ids = special_ids(tok)
    target, _ = load_pair(run, s["eval_dtype"], with_draft=False)
    t = time.perf_counter()
    prompts, seeds = regen_prompts(run, tok, s["regen_prompts"])
    log(f"regen: {len(prompts)} prompts and {len(seeds)} T = 1 seeds built ({time.perf_counter() - t:.1f} s)")
    budget = s["regen_budget_s"]
    stops = [ids["im_end"], ids["pad"]]
    t_self = time.perf_counter()
    if seeds:
        samples = _generate_batched(run, target, [p["ids"] for p in seeds], temperature=1.0,
                                    max_new_tokens=s["self_new_tokens"], stops=stops, t0=t,
                                    what="regen T=1 seeds", budget_s=None if budget is None else budget * 0.25)
        done = [(sd, x) for sd, x in zip(seeds, samples) if x is not None]
        prompts += self_prompts(run, tok, [d for d, _ in done], [x for _, x in done])
    t_self = time.perf_counter() - t_self
    # similar lengths per batch (fewer prompt buckets), the batches in a seeded random order: a
    # budget cut drops a random share of every kind, not the longest prompts
    prompts.sort(key=lambda p: len(p["ids"]))
    bs = s["regen_batch"]
    blocks = [prompts[b:b + bs] for b in range(0, len(prompts), bs)]
    random.Random(run.seed + 5).shuffle(blocks)
    share = s.get("regen_t1_share", 0.0)
    n_t1 = min(len(blocks) - 1, max(1, round(len(blocks) * share))) if share > 0 and len(blocks) > 1 else 0
    greedy = [p for blk in blocks[:len(blocks) - n_t1] for p in blk]
    sampled = [p for blk in blocks[len(blocks) - n_t1:] for p in blk]
    outs = _generate_batched(run, target, [p["ids"] for p in greedy], temperature=0.0,
                             max_new_tokens=s["regen_new_tokens"], stops=stops, t0=t, what="regen",
                             budget_s=None if budget is None else budget * (1 - 0.75 * share))
    if sampled:
        outs += _generate_batched(run, target, [p["ids"] for p in sampled], temperature=1.0,
                                  max_new_tokens=s["regen_new_tokens"], stops=stops, t0=t, what="regen T=1",
                                  budget_s=budget, seed_offset=1 << 20)
    prompts = greedy + sampled
    temps = [0.0] * len(greedy) + [1.0] * len(sampled)
    seqs, masks, kinds, n_sampled = [], [], [], 0
    for p, r, temp in zip(prompts, outs, temps):
        if r is None or len(r) < 2:  # past the budget, or nothing to learn from
            continue
        seqs.append(list(p["ids"]) + r)
        masks.append([0] * len(p["ids"]) + [1] * len(r))
        kinds.append(p["kind"])
        n_sampled += temp > 0
    n_new = sum(sum(m) for m in masks)
    L = max(len(x) for x in seqs)
    input_ids = np.full((len(seqs), L), ids["pad"], np.int32)                 # [N, L]
    loss_mask = np.zeros((len(seqs), L), np.uint8)                            # [N, L]: 1 on responses
    for i, (x, m) in enumerate(zip(seqs, masks)):
        input_ids[i, :len(x)], loss_mask[i, :len(m)] = x, m
    os.makedirs(run.path("regen"), exist_ok=True)
    np.savez(run.path("regen", "data.npz"), input_ids=input_ids, loss_mask=loss_mask,
             lengths=np.asarray([len(x) for x in seqs], np.int32))
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    log(f"regen: {len(seqs)} sequences of at most {L} ({n_sampled} sampled at T = 1), {n_new} response tokens; "
        f"kinds {counts}")
    return dict(sequences=len(seqs), response_tokens=int(n_new), max_len=int(L), kinds=counts, temperature=0.0,
                sampled_sequences=n_sampled, sampled_temperature=1.0, t1_share=share,
                max_new_tokens=s["regen_new_tokens"], self_new_tokens=s["self_new_tokens"],
                self_temperature=1.0, mix=s["regen_mix"], self_s=round(t_self, 1),
                time_s=round(time.perf_counter() - t, 1))


# ===================================================================================== DRAFT
TF_BATCH = 32               # rows per teacher-forced evaluation batch (one compiled program)
CALIB_STEPS = 12            # timed steps of the calibration run that sizes the draft's schedule


def _draft_run(run: Run, target, cfg, data, out_dir: str, steps: int, log_every: int,
               stop_after: int | None = None):
    from dflash_jax.train.run import RunConfig, train

    s = run.size["draft"]
    rc = RunConfig(out_dir=out_dir, batch_size=s["batch"], epochs=10 ** 6, max_steps=steps, seed=run.seed,
                   save_every=10 ** 9, log_every=log_every, stop_after=stop_after, progress=False)
    return train(target, cfg, data, run=rc, num_anchors=s["num_anchors"], lr=s["lr"],
                 compute_dtype=run.size["dtype"], attention_impl="auto")


def _step_seconds(res, data, batch: int, seed: int) -> float:
    """Steady seconds per step of a log_every=1 run: each record's loss-mask tokens / its tokens/s
    (the first record carries the compile)."""
    from dflash_jax.train.run import epoch_order

    order = epoch_order(seed, 0, len(data))
    secs = []
    for i, rec in enumerate(res.metrics[1:], start=1):
        idx = np.sort(order[i * batch:(i + 1) * batch])
        secs.append(float(data.loss_mask[idx].sum()) / max(rec["tokens_per_s"], 1e-9))
    return float(np.median(secs)) if secs else math.nan


def train_draft_stage(run: Run) -> dict:
    """Train a DFlash draft, block 16, on the target's own greedy continuations (regen/data.npz:
    input_ids [N, L], loss_mask [N, L]) with dflash_jax.train (the paper's recipe: AdamW 6e-4, cosine
    after a 4% warm-up, clip 1, γ = 7) and export it in the z-lab format to `<out>/draft`.

    With a deadline, a short calibration run times the compiled step first, and the real run's
    step count (the cosine schedule's horizon) is what fits the time left minus the evaluation's
    share; a watchdog SIGTERM (the trainer saves and returns "preempted") guards the estimate."""
    import signal
    import threading

    import dflash_jax as dj
    from dflash_jax.train.data import TokenData

    s = run.size["draft"]
    tok = load_tokenizer(run.path("target"))
    target, _ = load_pair(run, run.size["dtype"], with_draft=False)
    cfg = dj.DraftConfig.for_target(target.config, num_layers=s["num_layers"], block_size=s["block_size"],
                                    mask_token_id=special_ids(tok)["mask"])
    init = None
    if run.arch == "dflash2":
        cfg = dataclasses.replace(cfg, **dflash2_fields(run))
        if run.init_draft:   # a DFlash-1 draft of this target: the DFlash2 draft starts as it
            from dflash_jax.drafts.dflash2 import DFlash2Draft
            v1 = dj.load_draft(run.init_draft, target=target, dtype="float32")
            init = DFlash2Draft.for_training(cfg, seed=run.seed, init=v1)
    npz = np.load(run.path("regen", "data.npz"))
    # a few sequences never trained on: the teacher-forced τ on them measures generalisation (on the
    # training rows it measures memorisation)
    perm = np.random.default_rng(run.seed + 4).permutation(len(npz["input_ids"]))
    n_held = min(run.size["heldout_rows"], len(perm) // 4)
    held_idx, train_idx = np.sort(perm[:n_held]), np.sort(perm[n_held:])
    tokens_all, mask_all = npz["input_ids"].astype(np.int32), npz["loss_mask"].astype(np.uint8)
    data = TokenData(tokens_all[train_idx], mask_all[train_idx])
    work = run.path("draft_run")
    if os.path.isdir(work):  # a stage that did not finish: start over (its contract may differ)
        shutil.rmtree(work)
    t = time.perf_counter()
    steps, calib = s["steps"], None
    budget = run.remaining() - run.size["eval_reserve_s"]
    if not math.isinf(budget):
        budget = min(budget, s["budget_s"])
        if budget < 30:
            raise SystemExit(f"draft: only {budget:.0f} s left before the deadline; rerun (stages resume) "
                             "with a larger --deadline-s")
        tc = time.perf_counter()
        cres = _draft_run(run, target, init or cfg, data, os.path.join(work, "calib"), steps, 1,
                          stop_after=CALIB_STEPS)
        call_s = time.perf_counter() - tc
        step_s = _step_seconds(cres, data, s["batch"], run.seed)
        overhead = call_s - step_s * CALIB_STEPS          # compile + checkpoint, paid again by the real run
        left = budget - (time.perf_counter() - t) - overhead
        steps = int(max(50, min(s["steps"], left / step_s * 0.92)))
        calib = dict(step_s=round(step_s, 4), overhead_s=round(overhead, 1), call_s=round(call_s, 1))
        log(f"draft: calibration {step_s * 1e3:.1f} ms/step, {overhead:.1f} s compile + save; "
            f"{left:.0f} s left for the run -> {steps} steps")
    log(f"draft: {len(data)} sequences of {data.max_len}, batch {s['batch']}, {s['num_anchors']} anchors, "
        f"{steps} steps ({steps * s['batch'] / len(data):.1f} epochs); taps {list(cfg.target_layer_ids)}")
    timer = None
    if not math.isinf(budget):  # the guard: past the budget the trainer checkpoints and returns
        timer = threading.Timer(max(1.0, budget - (time.perf_counter() - t)),
                                lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
    tr = time.perf_counter()
    try:
        res = _draft_run(run, target, init or cfg, data, os.path.join(work, "run"), steps, max(1, steps // 20))
    finally:
        if timer is not None:
            timer.cancel()
    train_s = time.perf_counter() - tr
    if res.status != "done":
        log(f"draft: stopped at step {res.step}/{steps} ({res.status}): the time budget ran out")
    if os.path.isdir(run.path("draft")):
        shutil.rmtree(run.path("draft"))
    from dflash_jax.train.export import export_draft
    export_draft(res.draft(), run.path("draft"), dtype=run.size["ship_dtype"])
    last = [r for r in res.metrics if "loss" in r]
    curve = [(r["step"], round(r["loss"], 4), round(r["tau_est"], 3)) for r in last]
    log(f"draft: {res.step} steps in {train_s:.1f} s, loss {curve[0][1] if curve else '?'} -> "
        f"{curve[-1][1] if curve else '?'}, teacher-forced τ {curve[-1][2] if curve else '?'}")
    tf = teacher_forced(run, target, res, TokenData(tokens_all[held_idx], mask_all[held_idx]),
                        TokenData(tokens_all[train_idx[:n_held]], mask_all[train_idx[:n_held]]))
    log(f"draft: teacher-forced τ (every anchor) on {n_held} held-out sequences {tf['heldout']['tau']}, "
        f"on {n_held} training sequences {tf['train']['tau']}")
    extra = {}
    if run.arch == "dflash2":
        extra = dict(arch="dflash2", init_draft=run.init_draft, dflash2=dflash2_fields(run),
                     selector_curve=[(r["step"], round(r["sel_loss"], 4), round(r["topk_recall"], 4),
                                      round(r["sel_tau_est"], 3)) for r in last if "sel_loss" in r])
    return dict(**extra, num_layers=s["num_layers"], block_size=s["block_size"], taps=list(cfg.target_layer_ids),
                mask_token_id=cfg.mask_token_id, steps=res.step, planned_steps=steps, status=res.status,
                batch=s["batch"], num_anchors=s["num_anchors"], lr=s["lr"], compute_dtype=run.size["dtype"],
                sequences=len(data), max_len=data.max_len, epochs=round(res.step * s["batch"] / len(data), 2),
                loss_curve=curve, final_loss=curve[-1][1] if curve else None,
                teacher_forced_tau=curve[-1][2] if curve else None, calibration=calib,
                heldout_sequences=int(n_held), teacher_forced=tf,
                heldout_teacher_forced_tau=tf["heldout"]["tau"],
                train_s=round(train_s, 1), time_s=round(time.perf_counter() - t, 1))


def teacher_forced(run: Run, target, res, heldout, train_rows) -> dict:
    """Teacher-forced loss and τ (dflash_jax.train's metrics, every response position an anchor) of
    the trained draft on held-out and on training sequences."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.train.step import StepConfig, loss_and_metrics

    d = res.draft()
    cfg = d.config
    L = heldout.max_len
    sc = StepConfig(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                    target_layer_ids=tuple(cfg.target_layer_ids), num_anchors=L,
                    compute_dtype=run.size["dtype"], attention_impl="auto")
    from flax import nnx

    tdef, tstate = nnx.split(target)
    jitted = jax.jit(lambda ts, p, t, m, i: loss_and_metrics(p, res.draft_def, nnx.merge(tdef, ts), t, m, i, 0, sc))
    fn = lambda p, t, m, i: jitted(tstate, p, t, m, i)  # noqa: E731 (the target's weights as arguments)
    # fewer rows than TF_BATCH (the cpu sizes' 8): a batch of that many, not 3/4 padding
    tf_batch = max(1, min(TF_BATCH, max(len(heldout), len(train_rows))))
    out = {}
    for name, data in (("heldout", heldout), ("train", train_rows)):
        tot = dict(loss_sum=0.0, weight_sum=0.0, tau_sum=0.0, blocks=0.0)
        if getattr(d, "candidate_selector", None) is not None:
            tot.update(sel_tau_sum=0.0, sel_hits=0.0)
        for b in range(0, len(data), tf_batch):
            idx = np.arange(b, min(b + tf_batch, len(data)))
            pad = tf_batch - len(idx)           # one batch shape: pad rows carry no loss mask
            t_ = np.pad(data.tokens[idx], ((0, pad), (0, 0)))
            m_ = np.pad(data.loss_mask[idx], ((0, pad), (0, 0)))
            _, sums = fn(res.state.params, jnp.asarray(t_), jnp.asarray(m_), jnp.arange(tf_batch))
            for k in tot:
                tot[k] += float(sums[k])
        out[name] = dict(rows=len(data), tau=round(tot["tau_sum"] / max(tot["blocks"], 1.0), 3),
                         loss=round(tot["loss_sum"] / max(tot["weight_sum"], 1e-9), 4))
        if "sel_tau_sum" in tot:   # the selector's path (DFlash2): its τ is what inference gets at T = 0
            out[name]["selector_tau"] = round(tot["sel_tau_sum"] / max(tot["blocks"], 1.0), 3)
    return out
# ================================================================================================


def stage_draft(run: Run) -> dict:
    return train_draft_stage(run)


def eval_sets(run: Run, tok) -> dict[str, list[list[int]]]:
    """HumanEval and GSM8K test prompts (the paper's chat format) and raw prefixes of held-out stdlib
    modules ending at a function's docstring."""
    from dflash_jax.data import apply_chat_template, load_prompts

    s = run.size
    n = s["eval_prompts"]
    sets = {name: [apply_chat_template(tok, p["turns"][0]) for p in load_prompts(name, max_samples=n)]
            for name in ("humaneval", "gsm8k")}
    _, held_rel, root = stdlib_files()
    cands = []
    for rel, text in read_sources(root, held_rel):
        lines = text.splitlines()
        for f in functions(rel, text):
            cands.append("\n".join(lines[:f["lineno"] - 1 + f["head"].count("\n") + 1]) + "\n")
    rng = random.Random(run.seed + 2)
    # the sampled prefixes only are encoded (each is a module up to a function: encoding all took seconds)
    sets["stdlib-heldout"] = [tok.encode(x, add_special_tokens=False)[-s["heldout_prompt_tokens"]:]
                              for x in rng.sample(cands, min(n, len(cands)))]
    cap = s.get("eval_prompt_tokens")      # ci: every prompt's last tokens, one prompt bucket (fewer compiles)
    return {k: [p[-cap:] for p in v] for k, v in sets.items()} if cap else sets


REFERENCE_PROMPTS, REFERENCE_NEW_TOKENS = 3, 48


def reference_check(run: Run, sets: dict) -> dict:
    """The reference implementation (`dflash.model.dflash_generate`, torch float32, transformers'
    Qwen3ForCausalLM reading our saved target) against ours in float32 on the shipped weights, greedy,
    block 16, no stop tokens: the same tokens and the same acceptance lengths (hence τ)."""
    try:
        import torch
        import dflash.model as ref
        from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
        from transformers import Qwen3ForCausalLM
    except ImportError as e:
        return dict(skipped=f"torch / the reference dflash package not importable ({e})")
    import dflash_jax as dj

    S = run.size["draft"]["block_size"]
    target, draft = load_pair(run, "float32", with_draft=True)
    hf = Qwen3ForCausalLM.from_pretrained(run.path("target"), dtype=torch.float32).eval().requires_grad_(False)
    cls = DFlash2DraftModel if run.arch == "dflash2" else DFlashDraftModel
    rd = cls.from_pretrained(run.path("draft"), dtype=torch.float32).eval().requires_grad_(False)
    prompts = [p for name in ("humaneval", "stdlib-heldout", "gsm8k") for p in sets[name][:1]][:REFERENCE_PROMPTS]
    saved = ref._cuda_time
    if not torch.cuda.is_available():  # return_stats times with torch.cuda.synchronize()
        ref._cuda_time = time.perf_counter
    rows = []
    try:
        for p in prompts:
            r = dflash_generate(rd, hf, torch.tensor([p], dtype=torch.long), REFERENCE_NEW_TOKENS, None,
                                temperature=0.0, block_size=S, return_stats=True)
            theirs, their_acc = r.output_ids[0, len(p):].tolist(), [int(a) for a in r.acceptance_lengths]
            o = dj.generate(target, draft, [p], max_new_tokens=REFERENCE_NEW_TOKENS, block_size=S, temperature=0.0, verify_width="block")
            ours, our_acc = list(o.tokens[0]), [int(a) for a in o.acceptance_lengths[0]]
            rows.append(dict(prompt_tokens=len(p), identical_tokens=ours == theirs,
                             identical_acceptance=our_acc == their_acc, tau_ours=round(float(np.mean(our_acc)), 3),
                             tau_reference=round(float(np.mean(their_acc)), 3)))
    finally:
        ref._cuda_time = saved
    ok = all(r["identical_tokens"] and r["identical_acceptance"] for r in rows)
    log(f"reference check (dflash_generate, float32, block {S}): {'identical' if ok else 'DIFFERENT'} {rows}")
    return dict(identical=ok, block_size=S, max_new_tokens=REFERENCE_NEW_TOKENS, prompts=rows)


def stage_eval(run: Run) -> dict:
    """τ at block 16 per prompt set, greedy and T = 1 (batched), and batch-1 tokens/s against plain
    decoding with the same target."""
    import dflash_jax as dj

    s = run.size
    tok = load_tokenizer(run.path("target"))
    ids = special_ids(tok)
    stops = [ids["im_end"], ids["pad"]]
    target, draft = load_pair(run, s["eval_dtype"], with_draft=True)
    sets = eval_sets(run, tok)
    import jax
    out = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), dtype=s["eval_dtype"],
               max_new_tokens=s["eval_new_tokens"], draft=draft is not None, sets={})
    for name, prompts in sets.items():
        row = dict(prompts=len(prompts))
        for temp in (0.0, 1.0):
            key = "greedy" if temp == 0 else "t1"
            if run.remaining() < EVAL_RESERVE_S:
                log(f"eval: deadline near, {name} {key} skipped")
                row[f"skipped_{key}"] = "deadline"
                continue
            kw = dict(max_new_tokens=s["eval_new_tokens"], temperature=temp, stop_token_ids=stops, seed=run.seed)
            if draft is not None:
                res = dj.generate(target, draft, prompts, **kw, verify_width="block")
                row[f"tau_{key}"] = round(res.mean_tau, 3)
            if name not in s["timing_sets"]:
                continue
            # batch-1 wall clock: plain vs DFlash on the same prompts (compiles excluded)
            timing = {}
            for mode, d in (("plain", None), ("dflash", draft)):
                if mode == "dflash" and draft is None:
                    continue
                toks, secs, outs = 0, 0.0, []
                for p in prompts[:s["timing_prompts"]]:
                    if run.remaining() < EVAL_RESERVE_S and outs:
                        break
                    dj.generate(target, d, [p], **kw, verify_width="block")  # compile (and warm) this prompt's program
                    r = dj.generate(target, d, [p], **kw, verify_width="block")
                    toks, secs = toks + r.num_new_tokens, secs + r.run_time_s
                    outs.append(r.tokens[0])
                timing[mode] = (toks / secs if secs else float("nan"), outs)
            row[f"plain_tok_s_{key}"] = round(timing["plain"][0], 1)
            row["timed_prompts"] = len(timing["plain"][1])
            if "dflash" in timing:
                row[f"dflash_tok_s_{key}"] = round(timing["dflash"][0], 1)
                row[f"speedup_{key}"] = round(timing["dflash"][0] / timing["plain"][0], 2)
                if temp == 0:  # losslessness: greedy DFlash equals the target's own greedy decoding
                    n = min(len(timing["dflash"][1]), len(timing["plain"][1]))
                    row["greedy_identical"] = timing["dflash"][1][:n] == timing["plain"][1][:n]
        out["sets"][name] = row
        log(f"eval {name}: {row}")
    if draft is not None and run.reference != "off" and run.remaining() > EVAL_RESERVE_S:
        out["reference"] = reference_check(run, sets)
        if run.reference == "on" and "skipped" in out["reference"]:
            raise SystemExit(f"--reference-check on: {out['reference']['skipped']}")
    if sets["humaneval"] and run.remaining() > EVAL_RESERVE_S:
        sample = dj.generate(target, draft, [sets["humaneval"][0]], max_new_tokens=s["eval_new_tokens"],
                             temperature=0.0, stop_token_ids=stops, verify_width="block")
        out["sample_humaneval_0"] = tok.decode(sample.tokens[0], skip_special_tokens=True)
    print(eval_table(out), flush=True)
    return out


def stage_eval_dflash2(run: Run) -> dict:
    """--arch dflash2: τ of the DFlash2 draft and of the pair's DFlash-1 draft (--v1-draft) on the
    same prompts, greedy and T = 1, per set (batched), then batch-1 tokens/s of plain decoding and
    both drafts on the timing set, and the greedy losslessness check of the DFlash2 draft."""
    import dflash_jax as dj

    s = run.size
    tok = load_tokenizer(run.path("target"))
    ids = special_ids(tok)
    stops = [ids["im_end"], ids["pad"]]
    target, draft = load_pair(run, s["eval_dtype"], with_draft=True)
    drafts = {"dflash2": draft}
    if run.v1_draft and os.path.isfile(os.path.join(run.v1_draft, "config.json")):
        drafts["v1"] = dj.load_draft(run.v1_draft, target=target, dtype=s["eval_dtype"])
    sets = eval_sets(run, tok)
    import jax
    out = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), dtype=s["eval_dtype"],
               max_new_tokens=s["eval_new_tokens"], block_size={k: d.config.block_size for k, d in drafts.items()},
               v1_draft=run.v1_draft, sets={})
    for name, prompts in sets.items():
        row = dict(prompts=len(prompts))
        for temp in (0.0, 1.0):
            key = "greedy" if temp == 0 else "t1"
            kw = dict(max_new_tokens=s["eval_new_tokens"], temperature=temp, stop_token_ids=stops, seed=run.seed)
            for dname, d in drafts.items():
                if run.remaining() < EVAL_RESERVE_S:
                    log(f"eval: deadline near, {name} {key} {dname} skipped")
                    row[f"skipped_{key}_{dname}"] = "deadline"
                    continue
                row[f"tau_{key}_{dname}"] = round(dj.generate(target, d, prompts, **kw, verify_width="block").mean_tau, 3)
        out["sets"][name] = row
        log(f"eval {name}: {row}")
    for name in s["timing_sets"]:
        prompts, row = sets[name], out["sets"][name]
        for temp in (0.0, 1.0):
            key = "greedy" if temp == 0 else "t1"
            kw = dict(max_new_tokens=s["eval_new_tokens"], temperature=temp, stop_token_ids=stops, seed=run.seed)
            timing = {}
            for mode, d in (("plain", None), *drafts.items()):
                toks, secs, outs = 0, 0.0, []
                for p in prompts[:s["timing_prompts"]]:
                    if run.remaining() < EVAL_RESERVE_S:
                        break
                    dj.generate(target, d, [p], **kw, verify_width="block")  # compile (and warm) this prompt's program
                    r = dj.generate(target, d, [p], **kw, verify_width="block")
                    toks, secs = toks + r.num_new_tokens, secs + r.run_time_s
                    outs.append(r.tokens[0])
                if outs:
                    timing[mode] = (toks / secs if secs else float("nan"), outs)
                    row[f"{mode}_tok_s_{key}"] = round(timing[mode][0], 1)
            for mode in drafts:
                if mode in timing and "plain" in timing:
                    row[f"speedup_{key}_{mode}"] = round(timing[mode][0] / timing["plain"][0], 2)
                    if temp == 0:   # losslessness: greedy speculative output = the target's own greedy
                        n = min(len(timing[mode][1]), len(timing["plain"][1]))
                        row[f"greedy_identical_{mode}"] = timing[mode][1][:n] == timing["plain"][1][:n]
        log(f"eval {name} timing: {row}")
    if run.reference != "off" and run.remaining() > EVAL_RESERVE_S:
        out["reference"] = reference_check(run, sets)
        if run.reference == "on" and "skipped" in out["reference"]:
            raise SystemExit(f"--reference-check on: {out['reference']['skipped']}")
    print(eval_table_dflash2(out), flush=True)
    return out


def eval_table_dflash2(ev: dict) -> str:
    cols = ["set", "prompts", "tau_greedy_v1", "tau_greedy_dflash2", "tau_t1_v1", "tau_t1_dflash2",
            "speedup_greedy_v1", "speedup_greedy_dflash2", "speedup_t1_v1", "speedup_t1_dflash2"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for name, row in ev["sets"].items():
        lines.append("| " + " | ".join([name] + [str(row.get(c, "-")) for c in cols[1:]]) + " |")
    return "\n".join(lines)


def eval_table(ev: dict) -> str:
    cols = ["set", "prompts", "tau_greedy", "tau_t1", "plain_tok_s_greedy", "dflash_tok_s_greedy",
            "speedup_greedy", "plain_tok_s_t1", "dflash_tok_s_t1", "speedup_t1"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for name, row in ev["sets"].items():
        lines.append("| " + " | ".join([name] + [str(row.get(c, "-")) for c in cols[1:]]) + " |")
    return "\n".join(lines)


def dir_mb(d: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 2 ** 20 if os.path.isdir(d) else 0.0


def reference_section(r: dict | None) -> str:
    if not r:
        return "Not run."
    if "skipped" in r:
        return f"Skipped: {r['skipped']}."
    taus = ", ".join(f"{x['tau_ours']} / {x['tau_reference']}" for x in r["prompts"])
    return (f"The reference `dflash.model.dflash_generate` (torch, float32; transformers' Qwen3ForCausalLM "
            f"reading these files) against ours (float32), greedy, block {r['block_size']}, "
            f"{r['max_new_tokens']} new tokens on {len(r['prompts'])} evaluation prompts: "
            f"{'identical tokens and acceptance lengths' if r['identical'] else 'NOT identical'} "
            f"(τ ours / reference: {taus}).")


REGEN_KINDS = {
    "self-humaneval": "a problem in HumanEval's wording the target itself wrote at T = 1",
    "self-gsm8k": "a GSM8K-style question the target itself wrote at T = 1",
    "self-code": "code the target itself wrote at T = 1 after a cut into a training stdlib file, cut again",
    "function0": "HumanEval's wording over a training stdlib function's signature and docstring",
    "function1": "a training stdlib function's signature alone", "gsm8k": "a GSM8K train question",
    "code": "a random cut into a training stdlib file"}


def continuations(regen: dict) -> str:
    n = regen.get("sampled_sequences", 0)
    if not n:
        return "greedy continuations"
    return f"continuations ({regen['sequences'] - n} greedy, {n} sampled at T = 1)"


def regen_note(regen: dict, draft: dict) -> str:
    """The regeneration prompts by kind and the held-out teacher-forced τ, for the model card."""
    kinds = regen.get("kinds") or {}
    parts = "; ".join(f"{n} × {REGEN_KINDS.get(k, k)}" for k, n in sorted(kinds.items(), key=lambda x: -x[1]))
    note = f" Prompts of the continuations: {parts}." if parts else ""
    tf = draft.get("teacher_forced")
    if tf:
        note += (f" Teacher-forced τ with every response position an anchor: {tf['heldout']['tau']} on "
                 f"{tf['heldout']['rows']} regenerated sequences held out of the draft's training, "
                 f"{tf['train']['tau']} on as many training sequences.")
    return note


def model_card(run: Run) -> str:
    m = run.manifest
    st, data = m["stages"], m["data"]
    tgt, draft, ev = st["target"], st.get("draft", {}), st.get("eval", {})
    c = tgt["config"]
    if not draft or draft.get("skipped"):
        draft_section = "Not trained in this run; the pair is not complete."
    else:
        stopped = "" if draft["status"] == "done" else f" (stopped at the time budget, of {draft['planned_steps']} planned)"
        draft_section = (f"DFlash, {draft['num_layers']} layer(s) of the target's width, block size "
                         f"{draft['block_size']}, taps {draft['taps']}, MASK id {draft['mask_token_id']}; trained "
                         f"with dflash_jax.train (the paper's recipe: AdamW lr {draft['lr']}, cosine after a 4% "
                         f"warm-up, clip 1, loss decay γ = 7; {draft['compute_dtype']} compute) for "
                         f"{draft['steps']} steps{stopped} of batch {draft['batch']} with {draft['num_anchors']} "
                         f"anchor blocks per sequence ({draft['epochs']} epochs) on {draft['sequences']} "
                         f"{continuations(st['regen'])} ({st['regen']['response_tokens']} response tokens, at most "
                         f"{st['regen']['max_new_tokens']} per prompt) regenerated by the target with our "
                         f"`generate`, in {draft['train_s']} s. Final loss {draft['final_loss']}, "
                         f"teacher-forced τ {draft['teacher_forced_tau']}.{regen_note(st['regen'], draft)}")
    note = (f"Measured on {ev.get('device', '?')} ({ev.get('backend', '?')}, {ev.get('dtype', '?')}), "
            f"{ev.get('max_new_tokens', '?')} new tokens; τ over all prompts of a set (batched), tokens/s at "
            f"batch 1 on the first {run.size['timing_prompts']} prompt(s) of {', '.join(run.size['timing_sets'])} "
            "(compile excluded). Held-out stdlib "
            "prompts are raw code prefixes ending at a function's docstring." if ev else "Not evaluated.")
    values = dict(
        size=run.size_name, seed=run.seed, target_params_m=f"{tgt['params'] / 1e6:.1f}",
        python_version=data["python_version"], stdlib=data["stdlib"], n_files=len(data["stdlib_files"]),
        heldout=", ".join(data["heldout_modules"]), n_gsm8k=data["gsm8k_train"]["rows_used"],
        vocab_size=st["tokenizer"]["vocab_size"],
        target_shape=(f"{c['num_layers']} layers, hidden {c['hidden_size']}, MLP {c['intermediate_size']}, "
                      f"{c['num_heads']} q / {c['num_kv_heads']} kv heads of {c['head_dim']}, RoPE θ "
                      f"{c['rope_theta']:g}"),
        target_params=f"{tgt['params']:,}", target_steps=tgt["steps"], target_batch=tgt["batch"],
        target_seq=tgt["seq_len"], target_tokens=f"{tgt['tokens_seen'] / 1e6:.1f} M", target_epochs=tgt["epochs"],
        target_time=f"{tgt['train_s']} s", target_loss=tgt["final_loss"], heldout_loss=tgt["heldout_loss"],
        draft_section=draft_section, block_size=run.size["draft"]["block_size"],
        eval_table=eval_table(ev) if ev else "(not evaluated)", eval_note=note,
        reference_section=reference_section(ev.get("reference")),
        target_mb=f"{dir_mb(run.path('target')):.1f}", draft_mb=f"{dir_mb(run.path('draft')):.1f}",
        dtype=run.size["ship_dtype"])
    from dflash_jax.assets import model_card_template
    return string.Template(model_card_template()).safe_substitute(values)


def stage_ship(run: Run) -> dict:
    ship = run.path("ship", "pair")
    if os.path.isdir(run.path("ship")):
        shutil.rmtree(run.path("ship"))
    shutil.copytree(run.path("target"), os.path.join(ship, "target"))
    has_draft = os.path.isfile(run.path("draft", "config.json"))
    if has_draft:
        shutil.copytree(run.path("draft"), os.path.join(ship, "draft"))
    with open(os.path.join(ship, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(run))
    shutil.copy(run.manifest_path, os.path.join(ship, "manifest.json"))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ship) for f in fs) / 2 ** 20
    for old in os.listdir(run.out):
        if old.startswith("pair.tar."):
            os.remove(run.path(old))
    tar_path = run.path("ship", "pair.tar")
    with tarfile.open(tar_path, "w") as tf:
        tf.add(ship, arcname="pair")
    pieces = []
    with open(tar_path, "rb") as f:
        while chunk := f.read(TAR_PIECE):
            name = f"pair.tar.{len(pieces):02d}"
            with open(run.path(name), "wb") as g:
                g.write(chunk)
            pieces.append(name)
    os.remove(tar_path)
    if total > SHIP_LIMIT_MB:
        log(f"WARNING: the shipped pair is {total:.1f} MB, over the {SHIP_LIMIT_MB} MB limit")
    log(f"ship: {ship} ({total:.1f} MB{'' if has_draft else ', no draft'}); pieces {', '.join(pieces)}")
    return dict(total_mb=round(total, 2), target_mb=round(dir_mb(os.path.join(ship, "target")), 2),
                draft_mb=round(dir_mb(os.path.join(ship, "draft")), 2), has_draft=has_draft, pieces=pieces)


def stage_ship_dflash2(run: Run) -> dict:
    """--arch dflash2: the DFlash2 draft's files (config.json, model.safetensors), its card and the
    run's manifest in ship/dflash2 (the --deliver files: 4, each under 16 MiB)."""
    ship = run.path("ship", "dflash2")
    if os.path.isdir(run.path("ship")):
        shutil.rmtree(run.path("ship"))
    shutil.copytree(run.path("draft"), ship)
    st = run.manifest.get("stages", {})
    dr, ev = st.get("draft", {}), st.get("eval", {})
    d2 = dr.get("dflash2", {})
    tf = dr.get("teacher_forced", {}).get("heldout", {})
    card = [f"# DFlash2 draft for the demo pair's target ({run.target_from})", "",
            f"DFlash2 (grouped dynamic conv {d2.get('conv_kernel_size')} taps x {d2.get('conv_group_size')}-channel "
            f"groups around every sublayer; candidate selector over the top {d2.get('selector_top_k')}, rank "
            f"{d2.get('selector_rank')}), {dr.get('num_layers')} layer(s), block {dr.get('block_size')}, trained by "
            f"`python -m dflash_jax.train`'s code (block loss + the selector's teacher-forced K-way CE) "
            f"{'from ' + run.init_draft if run.init_draft else 'from scratch'} for {dr.get('steps')} steps "
            f"({dr.get('status')}) of batch {dr.get('batch')} in {dr.get('train_s')} s on the same regenerated data "
            f"recipe and budget as the pair's DFlash-1 draft. Held-out teacher-forced τ: argmax "
            f"{tf.get('tau')}, selector path {tf.get('selector_tau')}.", "",
            f"Measured on {ev.get('device', '?')} ({ev.get('dtype', '?')}), {ev.get('max_new_tokens', '?')} new "
            f"tokens, against the pair's DFlash-1 draft ({run.v1_draft}) on the same prompts:", "",
            eval_table_dflash2(ev) if ev else "(not evaluated)", "",
            f"Reference check: {reference_section(ev.get('reference'))}", ""]
    with open(os.path.join(ship, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(card))
    shutil.copy(run.manifest_path, os.path.join(ship, "manifest.json"))
    files = sorted(os.listdir(ship))
    big = [f for f in files if os.path.getsize(os.path.join(ship, f)) > 16 * 2 ** 20]
    if big:
        log(f"WARNING: {big} over 16 MiB")
    log(f"ship: {ship} ({dir_mb(ship):.1f} MB): {', '.join(files)}")
    return dict(total_mb=round(dir_mb(ship), 2), files=files, pieces=[os.path.join("ship", "dflash2", f) for f in files])


def install(run: Run) -> None:
    dest = os.path.join(REPO, "dflash_jax", "assets", "pair")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    shutil.copytree(run.path("ship", "pair"), dest)
    log(f"installed the pair into {dest}")


STAGE_FNS = dict(tokenizer=stage_tokenizer, target=stage_target, regen=stage_regen, draft=stage_draft,
                 eval=stage_eval, ship=stage_ship)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="gpu",
                   help="gpu: the shipped pair (one H200 call); cpu: ~1 M parameters, minutes on 2 CPU cores; "
                        "ci: the test suite's, the cpu size with a smaller corpus and fewer steps")
    p.add_argument("--out", required=True, help="output directory (resumable: finished stages are skipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--force", default="", help="comma-separated stages to redo even if finished ('all')")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="wall-clock budget of the whole command (gpu default 540, cpu none): the draft gets "
                        "what is left minus the evaluation's share; evaluation drops work near it; ship runs")
    p.add_argument("--reference-check", choices=("auto", "on", "off"), default="auto",
                   help="eval: compare with the reference dflash.model.dflash_generate (torch, float32) on the "
                        "shipped weights; auto = when torch and dflash import")
    p.add_argument("--deliver", metavar="DIR",
                   help="after shipping, copy the pair.tar.NN pieces and manifest.json into DIR (e.g. the "
                        "device tool's $OUT, which returns at most 8 files of 16 MiB)")
    p.add_argument("--install", action="store_true",
                   help="after shipping, copy ship/pair into dflash_jax/assets/pair (the embedded default)")
    p.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                   help="dflash2: train a DFlash2 draft for the existing target of --target-from (its tokenizer "
                        "and weights; the tokenizer and target stages copy it) and evaluate it against --v1-draft")
    p.add_argument("--target-from", metavar="DIR", help="an existing pair's target directory (with its tokenizer), "
                                                        "e.g. dflash_jax/assets/pair/target")
    p.add_argument("--v1-draft", metavar="DIR", help="the DFlash-1 draft the evaluation compares with (default: "
                                                     "the draft/ beside --target-from)")
    p.add_argument("--init-draft", metavar="DIR", help="dflash2: start from this DFlash-1 draft (default: from "
                                                       "scratch, as the DFlash-1 draft was)")
    p.add_argument("--block-size", type=int, help="dflash2: the draft's block size (default: the size's, 8)")
    p.add_argument("--sampled-continuations", action=argparse.BooleanOptionalAction, default=True,
                   help="regen: continue a share of the prompts (the size's regen_t1_share) at T = 1 instead "
                        "of greedily, so the draft also learns the target's sampled text (τ at T = 1)")
    args = p.parse_args(argv)
    stages = [x for x in args.stages.split(",") if x]
    bad = [x for x in stages if x not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; known: {', '.join(STAGES)}")
    force = set(STAGES) if args.force == "all" else {x for x in args.force.split(",") if x}
    if args.arch == "dflash2" or args.target_from:
        if args.arch != "dflash2" or not args.target_from:
            p.error("--arch dflash2 and --target-from go together (a DFlash2 draft for an existing target)")
        if not os.path.isfile(os.path.join(args.target_from, "config.json")):
            p.error(f"--target-from {args.target_from}: no config.json there")
        if args.install:
            p.error("--install installs a whole pair; --arch dflash2 ships a draft only")
    run = Run(args.out, args.size, args.seed, force)
    if args.arch == "dflash2":
        v1 = args.v1_draft or os.path.join(os.path.dirname(os.path.abspath(args.target_from)), "draft")
        run.use_dflash2(args.target_from, v1 if os.path.isfile(os.path.join(v1, "config.json")) else None,
                        args.init_draft, args.block_size)
    fns = dict(STAGE_FNS)
    if run.arch == "dflash2":
        fns.update(tokenizer=lambda r: stage_target_from(r, "tokenizer"),
                   target=lambda r: stage_target_from(r, "target"), eval=stage_eval_dflash2, ship=stage_ship_dflash2)
    if not args.sampled_continuations:
        run.size["regen_t1_share"] = 0.0
        run.manifest["settings"] = run.size
    if args.deadline_s is not None:
        run.deadline_s = args.deadline_s or None
    run.manifest["deadline_s"] = run.deadline_s
    run.reference = args.reference_check
    log(f"train_demo_pair --size {args.size} --seed {args.seed} --out {args.out}; stages {','.join(stages)}")
    for name in STAGES:
        if name not in stages:
            continue
        prev = run.done(name)
        if prev is not None:
            log(f"stage {name}: done earlier, skipped")
            run.manifest.setdefault("stages", {})[name] = prev
            continue
        t = time.perf_counter()
        log(f"stage {name} ...")
        res = fns[name](run)
        res["stage_s"] = round(time.perf_counter() - t, 1)
        run.finish(name, res)
        log(f"stage {name}: {res['stage_s']} s")
    if args.deliver and os.path.isfile(run.path("stages", "ship.json")):
        os.makedirs(args.deliver, exist_ok=True)
        extra = [] if run.arch == "dflash2" else ["manifest.json"]   # dflash2: the manifest is a piece
        for f in read_json(run.path("stages", "ship.json"))["pieces"] + extra:
            shutil.copy(run.path(f), args.deliver)
        log(f"delivered {'the DFlash2 draft files' if run.arch == 'dflash2' else 'the pair pieces and manifest.json'} "
            f"to {args.deliver}")
    if args.install:
        install(run)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
