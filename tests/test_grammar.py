"""The host-side grammar (dflash_jax.serving.grammar): masks, draft walks, tool calls and refusals.

The oracle is the schema itself: a random-logits "model" decodes under Constraint.mask() until EOS,
and the text must parse and validate against its schema (a validator for the subset the generator
emits, written here). walk() is checked against the same constraint stepped token by token.
Test tokenizer: tests/test_cli.py's byte-level BPE (320 ids, EOS <|im_end|>), with a model vocab of
352 so that ids past the tokenizer's are checked never allowed.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("llguidance")

from tests.test_cli import IM_END, VOCAB, write_tokenizer  # noqa: E402

from dflash_jax.serving.grammar import Constraint, GrammarError, Grammars, parse_tool_calls  # noqa: E402

MODEL_VOCAB = 352


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, MODEL_VOCAB)


def _bits(mask: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] bool from a [words] int32 bitmask."""
    return ((mask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).ravel()[:vocab]


def _decode(c: Constraint, tok, rng: np.random.Generator, bias: np.ndarray | None = None, limit: int = 3000):
    """Sample from random logits under the grammar until EOS: (text, tokens). Every mask must leave
    ids past the tokenizer's unset and allow something."""
    out = []
    for _ in range(limit):
        mask = c.mask()
        allowed = _bits(mask, 32 * len(mask))
        assert not allowed[VOCAB:].any() and allowed.any()
        logits = rng.standard_normal(len(allowed))
        if bias is not None:
            logits[:len(bias)] += bias
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        c.consume([t])
        assert c.error is None
        if t == IM_END:
            assert c.done()
            return tok.decode(out), out
        out.append(t)
    raise AssertionError(f"no EOS after {limit} tokens: {tok.decode(out)[:200]!r}")


# ---- a random schema generator and a validator for what it emits

NAMES = ["id", "name", "tags", "score", "ok", "items", "meta", "x", "y", "kind"]


def _schema(r: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum"] + ["object", "array"] * (depth < 3)
    kind = "object" if depth == 0 and r.random() < 0.7 else r.choice(kinds)
    if kind == "object":
        names = r.sample(NAMES, r.randint(1, 4))
        props = {n: _schema(r, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": [n for n in names if r.random() < 0.6],
                "additionalProperties": False}
    if kind == "array":
        lo = r.randint(0, 2)
        s = {"type": "array", "items": _schema(r, depth + 1), "maxItems": lo + r.randint(0, 3)}
        return s | ({"minItems": lo} if lo else {})
    if kind == "string":
        n = r.randint(0, 8)
        return {"type": "string", "maxLength": n} | ({"minLength": 1} if n and r.random() < 0.3 else {})
    if kind == "integer":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 1000)} if r.random() < 0.7 \
            else {"type": "integer"}
    if kind == "number":
        return {"type": "number", "minimum": -1.5, "maximum": 2.25} if r.random() < 0.5 else {"type": "number"}
    if kind == "enum":
        return {"enum": r.sample(["red", "green", "blue", 7, -3, "a b", 'q"t'], r.randint(1, 4))}
    return {"type": "boolean"}


def _valid(v, s: dict) -> bool:
    if "enum" in s:
        return any(v == e and type(v) is type(e) for e in s["enum"])
    t = s["type"]
    if t == "object":
        return isinstance(v, dict) and set(v) <= set(s["properties"]) and set(s["required"]) <= set(v) \
            and all(_valid(x, s["properties"][k]) for k, x in v.items())
    if t == "array":
        return isinstance(v, list) and s.get("minItems", 0) <= len(v) <= s["maxItems"] \
            and all(_valid(x, s["items"]) for x in v)
    if t == "string":
        return isinstance(v, str) and s.get("minLength", 0) <= len(v) <= s["maxLength"]
    if t == "boolean":
        return isinstance(v, bool)
    number = (int,) if t == "integer" else (int, float)
    return isinstance(v, number) and not isinstance(v, bool) \
        and s.get("minimum", -np.inf) <= v <= s.get("maximum", np.inf)


def _rf(schema: dict, strict: bool | None = None) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def test_random_schemas_decode_to_valid_json(grammars, tok):
    r, rng = random.Random(0), np.random.default_rng(0)
    for i in range(200):
        schema = {"type": "object", "properties": {"v": _schema(r)}, "required": ["v"],
                  "additionalProperties": False} if i % 4 == 0 else _schema(r)
        text, _ = _decode(grammars.compile(response_format=_rf(schema, strict=i % 2 == 0)).new(), tok, rng)
        assert _valid(json.loads(text), schema), (schema, text)


def _walk_reference(spec, consumed: list[int], drafts: list[int]) -> np.ndarray:
    """walk() written out: a fresh state stepped through the drafts while its mask allows them."""
    c = spec.new()
    c.consume(consumed)
    rows = [c.mask()]
    for t in drafts:
        if t == IM_END or not _bits(rows[-1], MODEL_VOCAB)[t]:
            break
        c.consume([t])
        rows.append(c.mask())
    return np.concatenate([np.stack(rows), np.full((len(drafts) + 1 - len(rows), len(rows[0])), -1, np.int32)])


def test_walk_equals_stepping(grammars, tok):
    """walk() over a valid prefix, a refused token, then random ids: the masks of the state stepped
    token by token, then all ones; the state is unchanged afterwards."""
    r, rng = random.Random(1), np.random.default_rng(1)
    for _ in range(10):
        spec = grammars.compile(response_format=_rf(_schema(r)))
        _, tokens = _decode(spec.new(), tok, rng)
        c = spec.new()
        for start in range(0, len(tokens), 3):
            valid = tokens[start:start + rng.integers(0, 15)]
            step = spec.new()
            step.consume(tokens[:start] + valid)
            bad = next(t for t in range(VOCAB) if not _bits(step.mask(), VOCAB)[t])
            drafts = valid + [bad] + [int(x) for x in rng.integers(0, MODEL_VOCAB, 14 - len(valid))]
            before = c.mask()
            rows = c.walk(drafts)
            assert rows.shape == (16, grammars.words) and rows.dtype == np.int32
            np.testing.assert_array_equal(rows, _walk_reference(spec, tokens[:start], drafts))
            assert (rows[len(valid) + 1:] == -1).all() and not (rows[:len(valid) + 1] == -1).all(axis=1).any()
            np.testing.assert_array_equal(c.mask(), before)
            c.consume(tokens[start:start + 3])


def test_walk_batch(grammars, tok):
    """Grammars.walk over rows in every state (fresh, mid-object, complete, errored; drafts valid,
    random, with an EOS) equals each row's own walk and the reference."""
    rng = np.random.default_rng(4)
    spec = grammars.compile(response_format={"type": "json_object"})
    text = tok.encode('{"a": [1, 2], "bc": {"d": "efg"}}')
    rows, drafts, consumed = [], [], []
    for k in [0, 3, 9, len(text) - 4, len(text), len(text)]:
        c = spec.new()
        c.consume(text[:k])
        tail = text[k:k + 7] + [IM_END] + [int(x) for x in rng.integers(0, MODEL_VOCAB, 7)]
        rows.append(c)
        drafts.append(tail[:7])
        consumed.append(text[:k])
        rows.append(spec.new())
        rows[-1].consume(text[:k])
        drafts.append([int(x) for x in rng.integers(0, MODEL_VOCAB, 7)] if k % 2 else tail[:7])
        consumed.append(text[:k])
    rows[-1].consume(tok.encode("x"))                 # after completion: ignored
    bad = spec.new()
    bad.consume(tok.encode("[1]"))
    assert bad.error
    rows.append(bad)
    drafts.append(list(range(7)))
    out = grammars.walk(rows, np.array(drafts))
    assert out.shape == (len(rows), 8, grammars.words)
    for b, (c, d) in enumerate(zip(rows, drafts)):
        np.testing.assert_array_equal(out[b], c.walk(d))
        if c.error is None:
            np.testing.assert_array_equal(out[b], _walk_reference(spec, consumed[b], d))
    assert np.flatnonzero(_bits(out[-1, 0], MODEL_VOCAB)).tolist() == [IM_END] and (out[-1, 1:] == -1).all()


def test_walk_at_the_end(grammars, tok):
    """A completed object forces EOS; drafts past an EOS and after an error get all ones."""
    c = grammars.compile(response_format={"type": "json_object"}).new()
    ids = tok.encode('{"a": [1, 2]}')
    rows = c.walk(ids + [IM_END, 5, 6])
    eos_only = np.flatnonzero(_bits(rows[len(ids)], MODEL_VOCAB))
    assert eos_only.tolist() == [IM_END] and (rows[len(ids) + 1:] == -1).all()
    c.consume(ids)
    assert c.done() and np.flatnonzero(_bits(c.mask(), MODEL_VOCAB)).tolist() == [IM_END]
    c.consume([IM_END, 7, 8])          # after the stop: ignored
    assert c.error is None and c.done()
    bad = grammars.compile(response_format={"type": "json_object"}).new()
    bad.consume(tok.encode('{"a": 1') + [IM_END, 5])
    assert bad.error and "\n" not in bad.error and bad.done()
    rows = bad.walk([5, 6])
    assert np.flatnonzero(_bits(rows[0], MODEL_VOCAB)).tolist() == [IM_END] and (rows[1:] == -1).all()


@pytest.mark.parametrize("vocab", [VOCAB, 337])
def test_mask_width(tok, vocab):
    g = Grammars(tok, vocab)
    m = g.compile(response_format={"type": "json_object"}).new().mask()
    assert g.words == -(-vocab // 32) and m.shape == (g.words,)
    assert not _bits(m, 32 * g.words)[VOCAB:].any() and _bits(m, vocab)[tok.encode("{")[0]]
    with pytest.raises(ValueError):
        Grammars(tok, VOCAB - 1)


def test_json_object_and_cache(grammars, tok):
    spec = grammars.compile(response_format={"type": "json_object"})
    assert grammars.compile(response_format={"type": "json_object"}) is spec
    assert grammars.compile(response_format={"type": "text"}) is None and grammars.compile() is None
    assert grammars.compile(tools=TOOLS, tool_choice="auto") is None
    assert grammars.compile(tools=TOOLS, tool_choice="none") is None
    bias = np.zeros(VOCAB)
    bias[tok.convert_tokens_to_ids(['"', "}", "]"])] = 2.0    # short strings and shallow nesting
    rng = np.random.default_rng(2)
    for _ in range(10):
        text, _ = _decode(spec.new(), tok, rng, bias)
        assert isinstance(json.loads(text), dict)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


def test_tool_calls(grammars, tok):
    rng, names = np.random.default_rng(3), set()
    required = grammars.compile(tools=TOOLS, tool_choice="required")
    for _ in range(10):
        text, _ = _decode(required.new(), tok, rng)
        content, calls = parse_tool_calls(text)
        assert content == "" and calls, text
        for call in calls:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
            assert _valid(json.loads(call["arguments"]), fn["parameters"]), call
            names.add(call["name"])
    assert names == {"get_weather", "add"}
    named = grammars.compile(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    for _ in range(5):
        _, calls = parse_tool_calls(_decode(named.new(), tok, rng)[0])
        assert [c["name"] for c in calls] == ["add"]
    no_params = [{"type": "function", "function": {"name": "now"}}]
    _, calls = parse_tool_calls(_decode(grammars.compile(tools=no_params, tool_choice="required").new(), tok, rng)[0])
    assert {c["arguments"] for c in calls} == {"{}"}


def test_parse_tool_calls():
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'},
                     {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert content == "Sure.\n\n<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls("  plain  ") == ("plain", [])


BAD = [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format="json"), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format=_rf("not a schema")), "response_format.json_schema.schema"),
    (dict(response_format=_rf({"type": "nope"})), "response_format.json_schema.schema"),
    (dict(response_format=_rf({"type": "integer", "minimum": 5, "maximum": 1})), "response_format.json_schema.schema"),
    (dict(response_format=_rf({"type": "array", "uniqueItems": True}, strict=True)),
     "response_format.json_schema.schema"),
    (dict(response_format=_rf({"$ref": "#/$defs/missing"})), "response_format.json_schema.schema"),
    (dict(tools=[{"type": "function"}], tool_choice="required"), "tools[0].function"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"parameters": {}}}], tool_choice="required"),
     "tools[1].function.name"),
    (dict(tools=[TOOLS[0], TOOLS[0]], tool_choice="required"), "tools[1].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}], tool_choice="required"),
     "tools[0].function.parameters"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          tool_choice="required"), "tools[1].function.parameters"),
    (dict(tools="get_weather", tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}], tool_choice="auto"), "tools[0].function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[], tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_bad_input(grammars, kwargs, field):
    with pytest.raises(GrammarError) as e:
        grammars.compile(**kwargs)
    assert e.value.field == field and str(e.value).startswith(field + ": ") and e.value.message
    assert isinstance(e.value, ValueError)


def test_whitespace_is_bounded(grammars, tok):
    for n, ok in ((48, True), (49, False)):
        c = grammars.compile(response_format={"type": "json_object"}).new()
        c.consume(tok.encode("{" + " " * n + "}"))
        assert (c.error is None) == ok and c.done()


def test_unknown_keywords_pass_unless_strict(grammars):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}
    assert grammars.compile(response_format=_rf(schema)) is not None


def test_bench_script_smoke(tmp_path):
    """scripts/bench_grammar.py --smoke: llguidance's rows are measured (other engines may be absent)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_grammar.py")
    spec = importlib.util.spec_from_file_location("bench_grammar", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--out", str(tmp_path / "t.txt")])
    rows = [ln for ln in (tmp_path / "t.txt").read_text().splitlines() if ln.startswith("llguidance")]
    assert len(rows) == 2 and all(len(r.split()) > 8 for r in rows), rows
