"""Structured output through the server (issue 59): `response_format` (json_schema, json_object) and
forced tool calls (`tools` + `tool_choice` required / named), decoded with speculation on.

One real server: test_serve.py's tiny float32 Qwen3 target + DFlash draft + byte-level BPE on the
slot engine (4 slots). The oracle is independent of our loop: transformers' Qwen3ForCausalLM decoding
greedily on the host, each step's argmax taken over the tokens the grammar allows (the same
llguidance grammar, walked one token at a time): plain constrained greedy decoding. Constrained and
free requests share the engine's batch; the free one must still equal one-shot `generate`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from dflash_jax.serving.engine import SimpleEngine, SlotEngine  # noqa: E402
from dflash_jax.serving.grammar import Grammars  # noqa: E402
from dflash_jax.serving.server import build_app  # noqa: E402
from tests.test_cli import ENDOFTEXT, IM_END  # noqa: E402
from tests.test_serve import CAPACITY, NAME, client, oracle, serving, sse  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["city"],
                                                          "properties": {"city": {"type": "string", "maxLength": 8}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                            "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}]
PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def srv(cli_models):
    import dflash_jax as dj
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tp, dp = cli_models
    target = dj.load_target(tp, dtype="float32")
    draft = dj.load_draft(dp, target=target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tp)
    hf = Qwen3ForCausalLM.from_pretrained(tp, dtype=torch.float32).eval().requires_grad_(False)
    engine = SlotEngine(target, draft, slots=4, capacity=512, max_queue=16, eos_token_ids=[IM_END, ENDOFTEXT],
                        attention_impl="xla")
    with serving(build_app(engine, tok, model_name=NAME)) as url:
        yield types.SimpleNamespace(url=url, engine=engine, target=target, draft=draft, tok=tok, hf=hf,
                                    eos=[IM_END, ENDOFTEXT], grammars=Grammars(tok, target.config.vocab_size))
    engine.shutdown(timeout=5)


def constrained_greedy(m, ids, spec, max_tokens) -> list[int]:
    """The oracle: HF greedy decoding, each token the argmax over what the grammar allows."""
    c, seq, out = spec.new(), list(ids), []
    V = m.target.config.vocab_size
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = m.hf(torch.tensor([seq])).logits[0, -1].numpy()
        allowed = ((c.mask()[:, None] >> np.arange(32)) & 1).reshape(-1)[:V].astype(bool)
        t = int(np.where(allowed, logits, -np.inf).argmax())
        out.append(t)
        if t in m.eos:
            break
        c.consume([t])
        seq.append(t)
    return out


def post(m, path, body):
    return httpx.post(m.url + path, json=body, timeout=120)


def test_json_schema_greedy_equals_plain_constrained_decoding_beside_a_free_request(srv):
    ids = list(srv.tok.encode(PROMPT))
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = dict(model=NAME, prompt=PROMPT, max_tokens=160, temperature=0, return_token_ids=True)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:        # one batch: constrained and free rows
        con = ex.submit(post, srv, "/v1/completions", dict(body, response_format=rf))
        free = ex.submit(post, srv, "/v1/completions", dict(body, max_tokens=40))
        con, free = con.result(), free.result()
    assert con.status_code == 200, con.text
    got = con.json()["choices"][0]
    want = constrained_greedy(srv, ids, srv.grammars.compile(response_format=rf), 160)
    assert got["token_ids"] == want
    assert got["finish_reason"] == "stop"
    obj = json.loads(got["text"])
    assert set(obj) >= {"name", "age", "ok"} and len(obj["name"]) <= 6 and 0 <= obj["age"] <= 99
    assert free.json()["choices"][0]["token_ids"] == oracle(srv, ids, 40)


def test_json_object_and_sampled_choices_parse(srv):
    r = post(srv, "/v1/completions", dict(model=NAME, prompt=PROMPT, max_tokens=200, temperature=1.0, seed=3, n=2,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": PERSON}}))
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop", ch
        assert isinstance(json.loads(ch["text"])["ok"], bool)
    r = client(srv.url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=400, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":   # an object the random model closes within the budget
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_a_forced_tool_call_is_parsed_by_the_openai_client(srv):
    # the random model would fill every gap of the JSON with whitespace (48 characters a gap): a
    # logit_bias against it (a penalties program with grammar: both adjust the same logits) keeps the
    # calls short; where the grammar allows only a newline it is still the one token allowed
    quiet = {str(srv.tok.encode(ch)[0]): -100 for ch in " \t\r\n"}
    c = client(srv.url)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "add two numbers"}],
                                  tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0,
                                  logit_bias=quiet)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "add")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"a", "b"})
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                  max_tokens=400, temperature=0, logit_bias=quiet)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) <= 8
    # streamed: the call arrives as one tool_calls delta, finish_reason tool_calls
    events = sse(srv.url, "/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "sum"}],
                                                        tools=TOOLS, tool_choice={"type": "function",
                                                                                  "function": {"name": "add"}},
                                                        max_tokens=400, temperature=0, stream=True,
                                                        logit_bias=quiet))
    deltas = [e["choices"][0] for e in events if e != "[DONE]" and e.get("choices")]
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"a", "b"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("body, field", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    # OpenAI allows a function without parameters (no arguments); parameters that are not a schema: 400
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}], tool_choice="required"),
     "tools[0].function.parameters"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function"}]), "tools"),
])
def test_bad_grammars_are_a_400_naming_the_field(srv, body, field):
    r = post(srv, "/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, **body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field), r.json()


def test_tools_on_completions_and_grammars_on_the_simple_engine_are_refused(srv, cli_models):
    r = post(srv, "/v1/completions", dict(model=NAME, prompt="hi", max_tokens=4, tools=TOOLS, tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    engine = SimpleEngine(srv.target, srv.draft, capacity=CAPACITY, eos_token_ids=srv.eos, attention_impl="xla")
    try:
        with serving(build_app(engine, srv.tok, model_name=NAME)) as url:
            r = httpx.post(url + "/v1/completions", json=dict(model=NAME, prompt="hi", max_tokens=4,
                                                              response_format={"type": "json_object"}), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
            assert "--slots" in r.json()["error"]["message"]
    finally:
        engine.shutdown(timeout=5)


def test_vllm_guided_fields_choice_regex_and_json(srv):
    """vLLM's clients send structured_outputs (or the older guided_*): the output is one of the
    choices, matches the regex, parses under the schema."""
    import re

    base = dict(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    r = post(srv, "/v1/completions", dict(base, structured_outputs={"choice": ["yes - sure", "no (never)", "maybe"]}))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes - sure", "no (never)", "maybe"), r.text
    r = post(srv, "/v1/completions", dict(base, guided_regex=r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"]), r.text
    quiet = {str(srv.tok.encode(ch)[0]): -100 for ch in " \t\r\n"}     # (see the tool-call test)
    r = post(srv, "/v1/chat/completions", dict(base, prompt=None, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=200, guided_json=PERSON, logit_bias=quiet))
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"], bool)
    for body, field in ((dict(structured_outputs={"regex": "("}), "structured_outputs"),
                        (dict(structured_outputs={"grammar": "start: x"}), "structured_outputs.grammar"),
                        (dict(guided_choice=[]), "guided_choice"),
                        (dict(guided_regex="a", guided_choice=["b"]), "guided_choice")):
        r = post(srv, "/v1/completions", dict(base, **body))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_sampled_constrained_rows_draw_the_masked_distribution_through_accepted_drafts(srv):
    """Sampling stays exact under a grammar when drafts are accepted: the first three tokens of rows
    constrained to binary digits, sampled at T = 1 with drafts the host chose (so the verify accepts
    some: the rejection rule runs over masked probabilities), are distributed as the product of the
    target's masked softmaxes (enumerated with HF over the 8 outcomes; chi-square)."""
    from scipy.stats import chisquare

    from dflash_jax.serving.slots import RowRequest, Slots

    zero, one = srv.tok.encode("0")[0], srv.tok.encode("1")[0]
    spec = srv.grammars.compile(regex="[01]{6}")
    prompt = tuple(srv.tok.encode(PROMPT))
    sl = Slots(srv.target, srv.draft, slots=8, capacity=256, steps=1)
    counts, accepted, N = {}, 0, 800
    for base in range(0, N, 8):
        rows = [RowRequest(prompt=prompt, max_new=3, temperature=1.0, seed=base + i, grammar=spec.new())
                for i in range(8)]
        first = sl.insert(list(enumerate(rows)))
        seqs = [[first[i][0]] for i in range(8)]
        while any(len(q) < 3 for q in seqs):
            for i, r in enumerate(rows):
                r.grammar.consume(seqs[i][r.grammar.consumed:])
                sl.note_drafts(i, [one, zero] + [zero] * (sl.block_size - 3))   # drafts to accept or reject
            commits, produced, _, _ = (np.asarray(x) for x in sl.step_async(list(range(8))))
            for i in range(8):
                seqs[i] += commits[0, i, :produced[0, i]].tolist()
                accepted += produced[0, i] > 1
        for i in range(8):
            counts[tuple(seqs[i])] = counts.get(tuple(seqs[i]), 0) + 1
            sl.release(i)
    # the exact distribution: each token of three drawn from the target's softmax over {0, 1}
    probs = {}
    for a in (zero, one):
        for b in (zero, one):
            for c in (zero, one):
                p, seq = 1.0, list(prompt)
                for t in (a, b, c):
                    with torch.no_grad():
                        lg = srv.hf(torch.tensor([seq])).logits[0, -1, [zero, one]].double()
                    p *= float(torch.softmax(lg, 0)[0 if t == zero else 1])
                    seq.append(t)
                probs[(a, b, c)] = p
    assert set(counts) <= set(probs)
    keys = sorted(probs)
    obs = np.array([counts.get(k, 0) for k in keys], float)
    assert accepted > N // 10                          # the acceptance path ran, not only corrections
    assert chisquare(obs, np.array([probs[k] for k in keys]) * N).pvalue > 1e-3, (obs, probs)


def test_paged_engine_constrained_greedy_equals_plain_constrained_decoding(srv):
    """The paged slot engine (pools + page table, the prefill's first drafts from the paged insert)
    decodes a constrained row as the dense one does: plain constrained greedy decoding's tokens."""
    from dflash_jax.serving.engine import Request

    ids = list(srv.tok.encode(PROMPT))
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    spec = srv.grammars.compile(response_format=rf)
    engine = SlotEngine(srv.target, srv.draft, slots=2, capacity=512, eos_token_ids=srv.eos, attention_impl="xla",
                        kv_pages=48, page_size=16)
    try:
        h = engine.submit(Request(prompt=tuple(ids), max_tokens=160, grammar=spec.new()))
        free = engine.submit(Request(prompt=tuple(ids), max_tokens=24))
        fin = [ev for ev in h.events() if not hasattr(ev, "ids")][0]
        fin_free = [ev for ev in free.events() if not hasattr(ev, "ids")][0]
    finally:
        engine.shutdown(timeout=5)
    assert fin.tokens == constrained_greedy(srv, ids, spec, 160)
    assert fin_free.tokens == oracle(srv, ids, 24)
