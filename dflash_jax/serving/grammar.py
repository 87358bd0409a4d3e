"""Structured output on the host: OpenAI's `response_format` (json_object, json_schema) and forced tool
calls (`tools` with `tool_choice` "required" or a named function) compiled to token masks with
llguidance (a Rust grammar engine with no runtime dependencies; its masks cost tens of microseconds
on a 150k vocabulary, see scripts/bench_grammar.py).

    grammars = Grammars(tokenizer, vocab_size)          # once per server
    spec = grammars.compile(response_format=..., tools=..., tool_choice=...)   # cached; None: free text
    c = spec.new()                                      # one per request
    masks = c.walk(drafts)      # [S, words]: the verifier's mask at each slot of a speculative block
    c.consume(emitted)          # the tokens the block committed

Speculative decoding stays on: the target's slot j must be masked by the grammar state after the
block's drafts before j, so `walk` steps the matcher through the drafts, writing one mask per slot,
and rolls it back. Slots past a draft the grammar refuses get no mask (all ones): the verifier rejects
that draft first, so those slots are never sampled from.

Masks are bitmasks of int32 words (bit t % 32 of word t // 32), as wide as the model's logits; ids
past the tokenizer's are never allowed. The tokenizer's EOS is allowed wherever the grammar accepts,
and it is the only token allowed once the grammar is complete, so a finished object ends the row.

Choices:
- JSON whitespace is bounded (WHITESPACE): llguidance's default allows any run of whitespace between
  tokens, and a model that starts emitting newlines may never stop (a known failure of guided JSON).
- `strict: true` (OpenAI's flag, per schema and per tool) refuses keywords llguidance cannot enforce;
  without it they are ignored (llguidance's `lenient`), so common schemas compile.
- A forced tool call wins over `response_format`: the reply is the call, not message content.
- Tool calls use Qwen3's format: "<tool_call>\\n" {"name": ..., "arguments": {...}} "\\n</tool_call>".
"""

from __future__ import annotations

import functools
import json
import re
from typing import Sequence

import llguidance
import llguidance.hf
import numpy as np

__all__ = ["GrammarError", "Grammars", "Spec", "Constraint", "parse_tool_calls", "WHITESPACE", "CACHE_SIZE"]

# Between JSON tokens: up to a newline and deep indentation, not an unbounded run.
WHITESPACE = r"[\x20\x0A\x0D\x09]{1,48}"
CACHE_SIZE = 256              # compiled grammars kept, keyed by their canonical JSON
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_ALL = np.int32(-1)
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


class GrammarError(ValueError):
    """A request's structured-output fields the server must refuse (HTTP 400), naming the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _first_line(msg: str) -> str:
    return next((ln.strip() for ln in msg.splitlines() if ln.strip()), "refused")


def _json_options(strict) -> dict:
    return {"whitespace_pattern": WHITESPACE, "lenient": strict is not True}


def _schema_grammar(schema: dict, strict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(strict))


class Grammars:
    """One per server: the llguidance tokenizer, built once from a HF fast tokenizer (its EOS is the
    grammar's stop), an LRU of compiled grammars, and the threads of walk(). vocab_size is the
    model's (logits width); it may exceed the tokenizer's. threads: None is llguidance's default
    (80% of the cores, at most 32)."""

    def __init__(self, tokenizer, vocab_size: int, threads: int | None = None):
        n = len(tokenizer)
        if vocab_size < n:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {n} tokens")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.eos = self.tokenizer.eos_token
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._build)

    def compile(self, *, response_format=None, tools=None, tool_choice=None, regex=None, choice=None,
                field: str = "structured_outputs") -> Spec | None:
        """The grammar a request's fields ask for, or None when nothing constrains the output.
        regex (a regular expression the whole output matches) and choice (a list of strings, one of
        which is the output): vLLM's structured_outputs / guided_regex / guided_choice, `field`
        named when they are refused."""
        if regex is not None or choice is not None:
            return self._compile(json.dumps(_pattern_key(regex, choice, field), ensure_ascii=False))
        key = _request_key(response_format, tools, tool_choice)
        return None if key is None else self._compile(json.dumps(key, ensure_ascii=False))

    def walk(self, rows: Sequence[Constraint], drafts) -> np.ndarray:
        """[B, S, words] int32: Constraint.walk of every row (drafts [B, S - 1]), the rows in parallel
        on llguidance's threads, the GIL released."""
        return _walk(self._executor, rows, drafts, self.words)

    def _build(self, key: str) -> Spec:
        kind, field, payload = json.loads(key)
        if kind == "tools":
            funcs, several = payload
            grammar = _tools_grammar(funcs, several)
            matcher = self._matcher(grammar)
            if matcher.is_error():   # blame the first tool whose parameters are refused on their own
                field = next((f"tools[{i}].function.parameters" for i, _, params, strict in funcs
                              if self._matcher(_schema_grammar(params, strict)).is_error()), field)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(payload)
            matcher = self._matcher(grammar)
        else:
            grammar = _schema_grammar(*payload)
            matcher = self._matcher(grammar)
        if matcher.is_error():
            raise GrammarError(field, _first_line(matcher.get_error()))
        return Spec(grammar, self)

    def _matcher(self, grammar: str):
        # A fresh matcher per request, not a deep_copy of one: copies share a lock, so the rows of
        # one schema would walk one at a time instead of on walk()'s threads.
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)


def _pattern_key(regex, choice, field: str):
    """[kind "regex", field, the pattern] of a regex or a choice among strings (escaped alternation)."""
    if choice is not None:
        if (not isinstance(choice, list) or not choice
                or not all(isinstance(c, str) for c in choice)):
            raise GrammarError(f"{field}.choice" if field == "structured_outputs" else field,
                               "must be a non-empty list of strings")
        return ["regex", field, "(" + "|".join(re.escape(c) for c in choice) + ")"]
    if not isinstance(regex, str) or not regex:
        raise GrammarError(f"{field}.regex" if field == "structured_outputs" else field,
                           "must be a non-empty regular expression")
    return ["regex", field, regex]


def _request_key(response_format, tools, tool_choice):
    """[kind, field blamed for a refusal, payload] of what constrains the request, or None: every
    check that needs no compiler, so that the key is the canonical JSON of what is compiled."""
    calls = _forced_tools(tools, tool_choice)
    if calls is not None:
        return ["tools", "tools", calls]
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format", "must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ["schema", "response_format", [{"type": "object"}, False]]
    if kind != "json_schema":
        raise GrammarError("response_format.type", f"must be text, json_object or json_schema, got {kind!r:.40}")
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        raise GrammarError("response_format.json_schema", "must be an object with a schema")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema", "must be a JSON schema object")
    return ["schema", "response_format.json_schema.schema", [schema, js.get("strict")]]


def _forced_tools(tools, tool_choice):
    """[[(index, name, parameters, strict)] a reply must call, whether it may call several] or None.
    The tools' shapes are checked even when no call is forced (the chat template renders them)."""
    funcs = _functions(tools)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        named = None
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        named = tool_choice["function"]["name"]
    else:
        raise GrammarError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                          '"function": {"name": ...}}')
    if not funcs:
        raise GrammarError("tool_choice", f"{tool_choice!r:.60} needs tools")
    if named is None:
        return [funcs, True]
    funcs = [f for f in funcs if f[1] == named]
    if not funcs:
        raise GrammarError("tool_choice", f"names {named!r:.60}, which is not among the tools")
    return [funcs, False]


def _functions(tools) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise GrammarError("tools", "must be a list")
    funcs, names = [], set()
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(f, dict):
            raise GrammarError(f"tools[{i}].function", "must be an object")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{i}].function.name", "must be a non-empty string")
        if name in names:
            raise GrammarError(f"tools[{i}].function.name", f"{name!r:.60} is repeated")
        names.add(name)
        params = f.get("parameters", _NO_ARGUMENTS)
        if not isinstance(params, dict):
            raise GrammarError(f"tools[{i}].function.parameters", "must be a JSON schema object")
        funcs.append([i, name, params, f.get("strict")])
    return funcs


def _tools_grammar(funcs: list, several: bool) -> str:
    """Lark: one call (or, if several, calls separated by newlines), each call's JSON checked against
    its function's parameters."""
    rules = []
    for k, (_, name, params, strict) in enumerate(funcs):
        call = {"x-guidance": _json_options(strict), "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"f{k}: %json {json.dumps(call)}")
    bodies = " | ".join(f"f{k}" for k in range(len(funcs)))
    return llguidance.LLMatcher.grammar_from_lark("\n".join([
        "start: call" + (' ("\\n" call)*' if several else ""),
        f"call: {json.dumps(CALL_OPEN)} ({bodies}) {json.dumps(CALL_CLOSE)}",
        *rules]))


class Spec:
    """A compiled (and validated) grammar, shared by the requests that ask for it: new() gives each
    its own state."""

    def __init__(self, grammar: str, grammars: Grammars):
        self.grammar = grammar
        self._grammars = grammars
        bits = np.zeros(grammars.words, np.uint32)
        bits[grammars.eos >> 5] = 1 << (grammars.eos & 31)
        self.eos_mask = bits.view(np.int32)   # [words]: all a row may emit once its output is invalid

    def new(self) -> Constraint:
        return Constraint(self, self._grammars._matcher(self.grammar))


class Constraint:
    """One request's grammar state. After a refused token (.error) the grammar no longer follows the
    output: it allows only EOS, so the row ends."""

    @property
    def grammars(self) -> Grammars:
        """The Grammars it was compiled by (its walk() steps many rows at once)."""
        return self._grammars

    def __init__(self, spec: Spec, matcher):
        self._m = matcher
        self._spec = spec
        self._grammars = spec._grammars
        self._eos = self._grammars.eos
        self.consumed = 0
        self.error: str | None = None

    def mask(self) -> np.ndarray:
        """[words] int32: the tokens allowed next."""
        if self.error is not None:
            return self._spec.eos_mask.copy()
        row = np.empty(self._grammars.words, np.int32)
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row

    def walk(self, drafts: Sequence[int]) -> np.ndarray:
        """[S, words] int32 for S - 1 drafts: row i is the mask after drafts[:i], while drafts[:i] are
        all allowed; rows after a refused draft or an EOS are all ones. The state is left as it was."""
        return _walk(self._grammars._executor, [self], [drafts], self._grammars.words)[0]

    def _walked(self, drafts: Sequence[int]) -> list[int]:
        """The drafts llguidance steps through: up to the first EOS (the row ends there: no mask after
        it is needed) or the first id outside the vocabulary (refused anyway)."""
        out = []
        for t in drafts:
            t = int(t)
            if t == self._eos or not 0 <= t < self._grammars.vocab_size:
                break
            out.append(t)
        return out

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance by the tokens the row committed. Tokens after completion (an EOS) are ignored; a
        refused token sets .error and the rest are ignored."""
        for t in tokens:
            if self.error is not None or self._m.is_stopped():
                return
            t = int(t)
            if t == self._eos and self._m.is_accepting():
                self._m.consume_token(t)
                return
            if not self._m.consume_token(t):
                self.error = (f"token {t} {self._grammars.tokenizer.dbg_tokens([t])} after {self.consumed} "
                              f"tokens is outside the grammar: {_first_line(self._m.get_error())}")
                return
            self.consumed += 1

    def done(self) -> bool:
        """Complete: only EOS is allowed now (also after an error)."""
        return self.error is not None or self._m.is_stopped()


def _walk(executor, rows: Sequence[Constraint], drafts, words: int) -> np.ndarray:
    """[B, S, words]: llguidance's draft walk (mask, consume a draft, mask, ..., roll back; it stops at
    the first draft the mask refuses) into rows prefilled with all ones."""
    S = len(drafts[0]) + 1 if len(rows) else 1
    out = np.full((len(rows), S, words), _ALL, np.int32)
    walks, masks = [], []     # llguidance's walk refuses an empty draft list: those rows get a mask
    for b, (c, d) in enumerate(zip(rows, drafts)):
        assert len(d) == S - 1, "every row drafts the same number of tokens"
        if c.error is not None:
            out[b, 0] = c._spec.eos_mask
        elif walked := c._walked(d):
            walks.append((c._m, b * S, walked))
        else:
            masks.append((c._m, b * S))
    if walks:
        executor.unsafe_compute_mask_ptr_with_draft_token(walks, out.ctypes.data, words * 4, len(rows) * S)
    if masks:
        executor.unsafe_compute_mask_ptr(masks, out.ctypes.data, words * 4, len(rows) * S)
    return out


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(text outside the calls, stripped; [{"name", "arguments": JSON string}]) from Qwen3's
    "<tool_call>\\n{...}\\n</tool_call>" blocks. A block that isn't a call stays in the text."""
    calls, kept, pos = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, (dict, str)):
            continue
        calls.append({"name": obj["name"],
                      "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls
