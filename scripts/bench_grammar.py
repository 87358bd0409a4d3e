#!/usr/bin/env python
"""Grammar engines on the host (dflash_jax.serving.grammar's choice): compile ms of a mid-size JSON schema, ms
per token mask, ms per walk of a 15-token draft (a speculative block's masks: mask, consume, ...,
roll back), for llguidance (through dflash_jax.serving.grammar: one row, and 8 rows at once), xgrammar
and outlines-core, on the test tokenizer (320 ids) and a synthetic Qwen-sized byte-level BPE.

    python scripts/bench_grammar.py [--out FILE]
    python scripts/bench_grammar.py --smoke       # the test tokenizer only: proves it runs

xgrammar and outlines-core are measured where they import (a library that can't be imported or
run gets a row saying why); --site adds a scratch venv's site-packages after the project's, so they
need not be installed in the project venv (xgrammar imports torch; the project's CPU torch serves):

    python -m venv /tmp/gv && /tmp/gv/bin/pip install --no-deps xgrammar outlines-core apache-tvm-ffi
    python scripts/bench_grammar.py --site /tmp/gv/lib/python3.11/site-packages --out FILE

Mask and walk figures are means over every position of one valid document (DOC) of the schema,
consumed token by token; a walk drafts the document's next 15 tokens (all valid: the worst case).
The large tokenizer is synthetic (no Qwen tokenizer.json on disk): 151,643 byte-level BPE tokens
grown from words, punctuation, whitespace runs and CJK characters, plus Qwen3's 26 added tokens,
masks as wide as Qwen3's logits (151,936).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_VOCAB, QWEN_BPE = 151936, 151643
QWEN_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
              "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
              "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN_SPECIAL = 14   # the first 14 added tokens are special; tool-call and think tags are text

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["order_id", "customer", "items", "status", "total"],
    "properties": {
        "order_id": {"type": "string", "maxLength": 24},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email"],
                     "properties": {"name": {"type": "string", "maxLength": 60},
                                    "email": {"type": "string", "maxLength": 80},
                                    "tier": {"enum": ["free", "plus", "pro", "enterprise"]},
                                    "address": {"type": "object", "additionalProperties": False,
                                                "required": ["city", "country"],
                                                "properties": {"street": {"type": "string"},
                                                               "city": {"type": "string"},
                                                               "zip": {"type": "string", "maxLength": 10},
                                                               "country": {"type": "string", "maxLength": 2}}}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 20,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                            "properties": {"sku": {"type": "string", "maxLength": 16},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "price": {"type": "number", "minimum": 0},
                                           "gift": {"type": "boolean"}}}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "total": {"type": "number", "minimum": 0},
        "notes": {"type": "string", "maxLength": 200},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    },
}
DOC = json.dumps({
    "order_id": "A-2024-00017",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro",
                 "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y", "country": "GB"}},
    "items": [{"sku": "KB-101", "qty": 2, "price": 49.5, "gift": False},
              {"sku": "MS-7", "qty": 1, "price": 19.99}],
    "status": "shipped", "total": 118.99, "notes": "Leave with the concierge, ring twice.",
    "tags": ["priority", "fragile"]})
DRAFT = 15
PASSES = 3


# ---- tokenizers

def small_tokenizer(path: str):
    from tests.test_cli import write_tokenizer
    return write_tokenizer(path), 320


def synthetic_tokenizer(path: str, seed: int = 0):
    """A byte-level BPE of QWEN_BPE tokens (every token the merge of two earlier ones) + Qwen3's added
    tokens: ~300 whitespace runs, ~2.5k punctuation pairs, ~20k CJK characters, words for the rest."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []

    def add(a: str, b: str) -> str | None:
        if a + b in vocab or len(vocab) >= QWEN_BPE:
            return None
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        return a + b

    sp, nl, tab = byte_char[32], byte_char[10], byte_char[9]
    for ch in (sp, nl, tab):
        run = ch
        for _ in range(99):
            run = add(run, ch) or run + ch
    punct = [byte_char[ord(c)] for c in "{}[]:,\"'.;()<>/\\-_=+*&%$#@!?|`~^"]
    for a in punct + [sp, nl]:
        for b in punct:
            add(a, b)
    r = random.Random(seed)
    for cp in r.sample(range(0x4E00, 0x9FFF), 20000):
        x, y, z = (byte_char[b] for b in chr(cp).encode())
        add(x, y)
        add(x + y, z)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0,
               1.9, 1.5, 1.0, .8, .15, .15, .1, .07]
    words = []
    for c in letters:
        words += [c, add(sp, c) or sp + c, add(sp, c.upper()) or sp + c.upper()]
    while len(vocab) < QWEN_BPE:
        w = words[min(int(r.expovariate(1 / 3000)), len(words) - 1)] if r.random() < .5 else r.choice(words)
        if len(w) < 14 and (new := add(w, r.choices(letters, weights)[0])):
            words.append(new)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=i < QWEN_SPECIAL, normalized=False) for i, t in enumerate(QWEN_ADDED)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast, QWEN_VOCAB


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# ---- engines: each gives compile(schema) -> grammar, new(grammar) -> state, mask(state, row),
# consume(state, token), walk(state, drafts, rows)

class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        from dflash_jax.serving import grammar
        self.grammars = grammar.Grammars(tok, vocab)
        self.note = f"v{llguidance.__version__}; whitespace {grammar.WHITESPACE}"
        self._n = 0

    def compile(self, schema):
        self._n += 1      # a new title each time: no cache hit
        return self.grammars.compile(response_format={"type": "json_schema", "json_schema": {
            "name": "order", "schema": dict(schema, title=f"t{self._n}")}})

    def new(self, spec):
        return spec.new()

    def mask(self, c, row):
        row[:] = c.mask()

    def consume(self, c, t):
        c.consume([t])

    def walk(self, c, drafts, rows):
        rows[:] = c.walk(drafts)


class LlguidanceBatch(Llguidance):
    """The same, 8 rows at once (Grammars.walk on a thread per core); ms per row."""
    name = "llguidance, 8 rows"
    ROWS = 8

    def __init__(self, tok, vocab: int):
        from dflash_jax.serving import grammar
        self.grammars = grammar.Grammars(tok, vocab, threads=os.cpu_count())
        self._n = 0
        self.note = f"Grammars.walk of {self.ROWS} rows at once, {os.cpu_count()} threads; ms / row"

    def new(self, spec):
        return [spec.new() for _ in range(self.ROWS)]

    def mask(self, cs, row):
        row[:] = cs[0].mask()

    def consume(self, cs, t):
        for c in cs:
            c.consume([t])

    def walk(self, cs, drafts, rows):
        rows[:] = self.grammars.walk(cs, [drafts] * self.ROWS)[0]

    def per_row(self, seconds: float) -> float:
        return seconds / self.ROWS


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.eos = tok.eos_token_id
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab),
                                            cache_enabled=False)
        import importlib.metadata as md
        self.note = f"v{md.version('xgrammar')}; any_whitespace, max_whitespace_cnt 48"

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=48)

    def new(self, grammar):
        return self.xgr.GrammarMatcher(grammar, max_rollback_tokens=DRAFT + 1)

    def mask(self, m, row):
        m.fill_next_token_bitmask(row[None])

    def consume(self, m, t):
        assert m.accept_token(t)

    def walk(self, m, drafts, rows):
        rows.fill(-1)
        m.fill_next_token_bitmask(rows, 0)
        n = 0
        for i, t in enumerate(drafts):
            if t == self.eos or not m.accept_token(t):
                break
            n += 1
            m.fill_next_token_bitmask(rows, i + 1)
        m.rollback(n)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab: int):
        import importlib.metadata as md
        import outlines_core as oc
        self.oc = oc
        self.eos = tok.eos_token_id
        self.words = -(-vocab // 32)
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tok.all_special_ids)
        table: dict[bytes, list[int]] = {}
        for s, i in tok.get_vocab().items():
            if i not in special:
                raw = bytes(inv[c] for c in s) if all(c in inv for c in s) else s.encode()
                table.setdefault(raw, []).append(i)
        self.vocabulary = oc.Vocabulary(tok.eos_token_id, table)
        self.note = f"v{md.version('outlines_core')}; regex whitespace {oc.json_schema.WHITESPACE}"

    def compile(self, schema):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def new(self, index):
        return self.oc.Guide(index, max_rollback=DRAFT + 1)

    def mask(self, g, row):
        g.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, g, t):
        g.advance(t, return_tokens=False)

    def walk(self, g, drafts, rows):
        rows.fill(-1)
        g.write_mask_into(rows[0].ctypes.data, rows.shape[1], 4)
        n = 0
        for i, t in enumerate(drafts):
            if t == self.eos or not g.accepts_tokens([t]):
                break
            g.advance(t, return_tokens=False)
            n += 1
            g.write_mask_into(rows[i + 1].ctypes.data, rows.shape[1], 4)
        g.rollback_state(n)


ENGINES = [Llguidance, LlguidanceBatch, Xgrammar, OutlinesCore]


def measure(engine_cls, tok, vocab: int, repeats: int) -> dict:
    row = {"library": engine_cls.name, "vocab": vocab}
    try:
        engine = engine_cls(tok, vocab)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return row | {"note": f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:90]}"}
    row["note"] = engine.note
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        grammar = engine.compile(SCHEMA)
        times.append(time.perf_counter() - t0)
        if sum(times) > 10:     # outlines-core on a large vocabulary: one is enough
            break
    row["compile_ms"] = 1e3 * float(np.median(times))
    tokens = tok.encode(DOC)
    words = -(-vocab // 32)
    mask, rows = np.zeros(words, np.int32), np.zeros((DRAFT + 1, words), np.int32)
    per_row = getattr(engine, "per_row", lambda s: s)
    best = [np.inf] * 3
    for _ in range(PASSES):       # the best of a few passes, each with a fresh state: less noise
        t0 = time.perf_counter()
        state = engine.new(grammar)
        t_new = per_row(time.perf_counter() - t0)
        engine.mask(state, mask)                      # a first mask: lazy setup outside the timings
        t_mask = t_walk = 0.0
        for p, t in enumerate(tokens):
            t0 = time.perf_counter()
            engine.mask(state, mask)
            t1 = time.perf_counter()
            engine.walk(state, tokens[p:p + DRAFT] + [tok.eos_token_id] * max(0, p + DRAFT - len(tokens)), rows)
            t2 = time.perf_counter()
            t_mask, t_walk = t_mask + t1 - t0, t_walk + t2 - t1
            assert mask.view(np.uint32)[t >> 5] >> (t & 31) & 1, (engine_cls.name, p)
            engine.consume(state, t)
        best = [min(x, y) for x, y in zip(best, (t_new, t_mask, per_row(t_walk)))]
    row["new_ms"] = 1e3 * best[0]
    row["mask_ms"] = 1e3 * best[1] / len(tokens)
    row["walk_ms"] = 1e3 * best[2] / len(tokens)
    row["positions"] = len(tokens)
    return row


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--repeats", type=int, default=5, help="compiles timed per engine (median; fewer past 10 s)")
    ap.add_argument("--site", action="append", default=[], help="a site-packages searched after the project's")
    ap.add_argument("--smoke", action="store_true", help="the test tokenizer only, one compile, one pass")
    args = ap.parse_args(argv)
    global PASSES
    if args.smoke:
        args.repeats, PASSES = 1, 1
    sys.path[:0] = [ROOT]
    sys.path += args.site
    lines = [f"machine: {platform.processor() or platform.machine()} ({_cpu_model()}), {os.cpu_count()} cores "
             f"({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}",
             f"schema: {len(json.dumps(SCHEMA))} chars of JSON schema; document {len(DOC)} chars",
             "compile: schema -> checked grammar, no cache (llguidance: grammar + matcher build); new: one "
             "request's state; mask: one token mask (mean over the document's positions); walk15: the "
             f"masks of a {DRAFT}-token draft (+1 row) and the rollback, all drafts valid", ""]
    head = (f"{'library':<20} {'tokenizer':<16} {'vocab':>7} {'compile ms':>10} {'new ms':>7} {'mask ms':>8} "
            f"{'walk15 ms':>9}  note")
    lines += [head, "-" * len(head)]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as d:
        builds = (("test BPE", small_tokenizer), ("synthetic BPE", synthetic_tokenizer))
        for label, build in builds[:1] if args.smoke else builds:
            t0 = time.perf_counter()
            tok, vocab = build(os.path.join(d, label.split()[0]))
            lines.append(f"# {label}: {len(tok):,} ids, masks {vocab:,} wide, built in "
                         f"{time.perf_counter() - t0:.1f} s; document = {len(tok.encode(DOC))} tokens")
            print(lines[-1], flush=True)
            for cls in ENGINES:
                r = measure(cls, tok, vocab, args.repeats)
                num = (f"{r['compile_ms']:>10.2f} {r['new_ms']:>7.2f} {r['mask_ms']:>8.3f} {r['walk_ms']:>9.3f}"
                       if "mask_ms" in r else f"{'-':>10} {'-':>7} {'-':>8} {'-':>9}")
                line = f"{r['library']:<20} {label:<16} {vocab:>7} {num}  {r['note']}"
                print(line, flush=True)
                lines.append(line)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
