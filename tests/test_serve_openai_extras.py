"""The server's OpenAI extras (issue 59): `n` > 1, batched prompts, `logprobs` / `top_logprobs`,
`echo` (with `max_tokens: 0`, as lm-evaluation-harness's loglikelihood requests).

One real server: test_serve.py's tiny float32 Qwen3 target + DFlash draft + byte-level BPE, through
the simple engine (and, in the slow run, the slot engine with 4 slots). Tokens are checked against
one-shot `generate`; log-probabilities against an independent oracle, transformers'
Qwen3ForCausalLM (float32) log_softmax over the same tokens. All prompts sit in one prompt bucket
(33..64 tokens) so the engine compiles once per sampling mode.
"""

from __future__ import annotations

import os
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from dflash_jax.serving.engine import SimpleEngine, SlotEngine  # noqa: E402
from dflash_jax.serving.server import build_app  # noqa: E402
from tests.test_cli import ENDOFTEXT, IM_END  # noqa: E402
from tests.test_serve import CAPACITY, NAME, client, oracle, serving, sse  # noqa: E402

TOL = 1e-5
# 33..64 tokens each under the test tokenizer: the shared prompt bucket
PROMPTS = ["the quick brown fox jumps over the lazy dog and then",
           "a slow green turtle walks under the busy bridge at noon"]


# The simple engine by default; the slot engine (n choices decoded side by side) in the slow run.
@pytest.fixture(scope="module", params=["simple", pytest.param("slots4", marks=pytest.mark.slow)])
def srv(cli_models, request):
    import dflash_jax as dj
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tp, dp = cli_models
    target = dj.load_target(tp, dtype="float32")
    draft = dj.load_draft(dp, target=target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tp)
    hf = Qwen3ForCausalLM.from_pretrained(tp, dtype=torch.float32).eval().requires_grad_(False)
    if request.param == "slots4":
        engine = SlotEngine(target, draft, slots=4, capacity=CAPACITY, max_queue=64, eos_token_ids=[IM_END, ENDOFTEXT],
                            attention_impl="xla")
    else:
        engine = SimpleEngine(target, draft, capacity=CAPACITY, max_queue=64, eos_token_ids=[IM_END, ENDOFTEXT],
                              attention_impl="xla")
    with serving(build_app(engine, tok, model_name=NAME)) as url:
        yield types.SimpleNamespace(url=url, engine=engine, target=target, draft=draft, tok=tok, hf=hf,
                                    eos=[IM_END, ENDOFTEXT], ids=[list(tok.encode(p)) for p in PROMPTS])
    engine.shutdown(timeout=5)


def hf_logprobs(m, seq: list[int]) -> np.ndarray:
    """[len(seq) - 1, V]: the oracle's log p(. | seq[:i + 1]) for i < len(seq) - 1."""
    with torch.no_grad():
        logits = m.hf(torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).numpy()


def post(m, path: str, body: dict) -> dict:
    r = httpx.post(m.url + path, json={"model": NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_logprobs(m, seq, first, token_logprobs, tops, k):
    """Logprobs of seq[first:] and the values of their top-k alternatives against the oracle."""
    want = hf_logprobs(m, seq)
    assert len(token_logprobs) == len(tops) == len(seq) - first
    for i, (lp, top) in enumerate(zip(token_logprobs, tops)):
        row = want[first + i - 1]
        assert abs(lp - row[seq[first + i]]) < TOL, (i, lp, row[seq[first + i]])
        np.testing.assert_allclose(top, np.sort(row)[::-1][:k], atol=TOL)


def test_n_greedy_choices_identical_and_usage(srv):
    ids = srv.ids[0]
    want = oracle(srv, ids, 12, temperature=0.0)
    r = post(srv, "/v1/completions", dict(prompt=ids, max_tokens=12, temperature=0, n=3, return_token_ids=True))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == want for c in r["choices"])
    assert len({c["text"] for c in r["choices"]}) == 1
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3 * len(want),
                          "total_tokens": len(ids) + 3 * len(want)}
    chat = client(srv.url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                   max_tokens=8, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_n_sampled_distinct_reproducible_and_batched_equals_separate(srv):
    body = dict(max_tokens=10, temperature=1.0, seed=7, n=3, return_token_ids=True)
    a = post(srv, "/v1/completions", dict(prompt=srv.ids[0], **body))
    toks = [c["token_ids"] for c in a["choices"]]
    assert len({tuple(t) for t in toks}) == 3, toks                      # distinct seeds per choice
    assert toks == [c["token_ids"] for c in post(srv, "/v1/completions", dict(prompt=srv.ids[0], **body))["choices"]]
    one = post(srv, "/v1/completions", dict(prompt=srv.ids[0], **{**body, "n": 1}))
    assert one["choices"][0]["token_ids"] == toks[0]                     # choice 0 keeps the request's seed
    assert toks[0] == oracle(srv, srv.ids[0], 10, temperature=1.0, seed=7)
    # a batch: prompt-major x n, each prompt's choices those of its own request
    b = post(srv, "/v1/completions", dict(prompt=PROMPTS, **{**body, "n": 2}))
    sep = [post(srv, "/v1/completions", dict(prompt=p, **{**body, "n": 2}))["choices"] for p in PROMPTS]
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert [(c["token_ids"], c["text"]) for c in b["choices"]] == [(c["token_ids"], c["text"]) for s in sep for c in s]
    assert b["usage"]["prompt_tokens"] == sum(len(i) for i in srv.ids)
    tok_batch = post(srv, "/v1/completions", dict(prompt=srv.ids, **{**body, "n": 2}))
    assert [c["token_ids"] for c in tok_batch["choices"]] == [c["token_ids"] for c in b["choices"]]


def test_stream_interleaves_choices_by_index(srv):
    body = dict(model=NAME, prompt=srv.ids, max_tokens=10, temperature=0, n=2, stream=True, return_token_ids=True,
                stream_options={"include_usage": True})
    lines = sse(srv.url, "/v1/completions", body)
    assert lines[-1] == "[DONE]" and lines[-2]["usage"]["completion_tokens"] > 0
    text, ids, reasons = {}, {}, {}
    for ev in lines[:-2]:
        (c,) = ev["choices"]
        text[c["index"]] = text.get(c["index"], "") + c["text"]
        ids[c["index"]] = ids.get(c["index"], []) + c.get("token_ids", [])
        if c["finish_reason"]:
            reasons[c["index"]] = c["finish_reason"]
    whole = post(srv, "/v1/completions", {**body, "stream": False, "stream_options": None})
    assert sorted(text) == [0, 1, 2, 3] and sorted(reasons) == [0, 1, 2, 3]
    assert [text[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert [ids[i] for i in range(4)] == [c["token_ids"] for c in whole["choices"]]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_completion_logprobs_equal_transformers(srv, temperature):
    ids = srv.ids[1]
    r = post(srv, "/v1/completions", dict(prompt=ids, max_tokens=12, temperature=temperature, seed=3, logprobs=5,
                                          return_token_ids=True))
    (c,) = r["choices"]
    lp, out = c["logprobs"], c["token_ids"]
    seq = ids + out
    assert lp["tokens"] == [srv.tok.decode([t]) for t in out]
    # top_logprobs is keyed by token string: tokens that decode alike share a key (as OpenAI's)
    best = [[max(t.values())] for t in lp["top_logprobs"]]
    check_logprobs(srv, seq, len(ids), lp["token_logprobs"], best, 1)
    assert all(1 <= len(t) <= 5 for t in lp["top_logprobs"])
    if temperature == 0:     # greedy: each token is the top alternative, the very same float (lm-eval's is_greedy)
        assert all(v == max(t.values()) for v, t in zip(lp["token_logprobs"], lp["top_logprobs"]))
    assert lp["text_offset"] == list(np.cumsum([0] + [len(s) for s in lp["tokens"]])[:-1])


def test_chat_logprobs_and_top_logprobs(srv):
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = client(srv.url).chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3,
                                                extra_body={"return_token_ids": True})
    ch = r.choices[0]
    prompt = srv.tok.encode(srv.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    out = ch.token_ids if hasattr(ch, "token_ids") else ch.model_extra["token_ids"]
    seq = prompt + out
    content = ch.logprobs.content
    assert len(content) == len(out)
    check_logprobs(srv, seq, len(prompt), [e.logprob for e in content], [[a.logprob for a in e.top_logprobs]
                                                                         for e in content], 3)
    assert all(e.token == srv.tok.decode([t]) and len(e.top_logprobs) == 3 for e, t in zip(content, out))
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)


def test_echo_prompt_logprobs_and_max_tokens_0(srv):
    ids = srv.ids[0]
    want = hf_logprobs(srv, ids)
    r = post(srv, "/v1/completions", dict(prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1, temperature=0))
    (c,) = r["choices"]
    lp = c["logprobs"]
    assert c["text"] == PROMPTS[0] and c["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [want[i - 1][ids[i]] for i in range(1, len(ids))], atol=TOL)
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    # echo with generated tokens: the prompt's logprobs, then the output's, one text
    r = post(srv, "/v1/completions", dict(prompt=ids, max_tokens=6, echo=True, logprobs=2, temperature=0,
                                          return_token_ids=True))
    (c,) = r["choices"]
    seq = ids + c["token_ids"]
    want = hf_logprobs(srv, seq)
    assert c["text"].startswith(srv.tok.decode(ids)) and len(c["logprobs"]["tokens"]) == len(seq)
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], [want[i - 1][seq[i]] for i in range(1, len(seq))],
                               atol=TOL)
    # the same streamed: the echo first, then the output, the same numbers
    lines = sse(srv.url, "/v1/completions", dict(model=NAME, prompt=ids, max_tokens=6, echo=True, logprobs=2,
                                                 temperature=0, stream=True))
    got = [x for ev in lines[:-1] for x in (ev["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert got[0] is None and np.allclose(got[1:], c["logprobs"]["token_logprobs"][1:], atol=TOL)
    assert "".join(ev["choices"][0]["text"] for ev in lines[:-1]) == c["text"]


def test_prompt_logprobs_equal_transformers_with_exact_ranks(srv):
    """vLLM's prompt_logprobs: per prompt position the token's log-probability and exact rank, and the
    k likeliest, equal to transformers' log_softmax; per choice on completions, top level on chat,
    on the first chunk of a stream."""
    ids = srv.ids[1]
    want = hf_logprobs(srv, ids)
    r = post(srv, "/v1/completions", dict(prompt=ids, max_tokens=2, temperature=0, prompt_logprobs=3, n=2))
    for c in r["choices"]:
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        for i in range(1, len(ids)):
            w = want[i - 1]
            got = pl[i][str(ids[i])]
            assert abs(got["logprob"] - w[ids[i]]) < TOL and got["rank"] == 1 + int(np.sum(w > w[ids[i]]))
            assert {int(t) for t, v in pl[i].items() if v["rank"] <= 3} == set(np.argsort(-w)[:3].tolist())
    r = post(srv, "/v1/chat/completions", dict(messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2,
                                                temperature=0, prompt_logprobs=0))
    assert r["prompt_logprobs"][0] is None and all(len(d) == 1 for d in r["prompt_logprobs"][1:])
    lines = sse(srv.url, "/v1/completions", dict(model=NAME, prompt=ids, max_tokens=2, temperature=0,
                                                 prompt_logprobs=1, stream=True))
    firsts = [ev["choices"][0].get("prompt_logprobs") for ev in lines[:-1]]
    assert firsts[0] == post(srv, "/v1/completions", dict(prompt=ids, max_tokens=1, temperature=0,
                                                          prompt_logprobs=1))["choices"][0]["prompt_logprobs"]
    assert all(f is None for f in firsts[1:])


def test_stream_chat_logprobs_match_whole(srv):
    body = dict(model=NAME, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=2)
    lines = sse(srv.url, "/v1/chat/completions", {**body, "stream": True})
    got = [e for ev in lines[:-1] for e in (ev["choices"][0]["logprobs"] or {"content": []})["content"]]
    whole = post(srv, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in whole]
    np.testing.assert_allclose([e["logprob"] for e in got], [e["logprob"] for e in whole], atol=TOL)


def test_extras_bad_values_are_400_naming_the_field(srv):
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    comp = dict(prompt=[1, 2, 3], max_tokens=2)
    cases = [("/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=21), "top_logprobs"),
             ("/v1/chat/completions", dict(chat, top_logprobs=2), "top_logprobs"),
             ("/v1/chat/completions", dict(chat, logprobs=3), "logprobs"),
             ("/v1/completions", dict(comp, logprobs=21), "logprobs"),
             ("/v1/completions", dict(comp, logprobs=True), "logprobs"),
             ("/v1/completions", dict(comp, top_logprobs=2), "top_logprobs"),
             ("/v1/completions", dict(comp, max_tokens=0), "max_tokens"),
             ("/v1/completions", dict(comp, n=129), "n"),
             ("/v1/completions", dict(comp, n=100), "n"),                 # more than queue + slots
             ("/v1/completions", dict(comp, prompt=[[1, 2], []]), "prompt"),
             ("/v1/completions", dict(comp, prompt=[[1, 2], [10 ** 6]]), "prompt"),
             ("/v1/completions", dict(comp, prompt_logprobs=21), "prompt_logprobs"),
             ("/v1/chat/completions", dict(chat, prompt_logprobs=True), "prompt_logprobs"),
             ("/v1/chat/completions", dict(chat, max_tokens=0), "max_tokens")]
    for path, body, field in cases:
        r = httpx.post(srv.url + path, json={"model": NAME, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (body, err)
    assert srv.engine.stats().queue_depth == 0 and srv.engine.stats().slots_busy == 0


def test_lm_eval_style_requests(srv):
    """scripts/lm_eval_smoke.py's lm-eval requests (echo + logprobs 1 + max_tokens 1 and 0, a batch of
    token-id prompts; generate_until) on this server: the two agree, greedy continuations are greedy."""
    import importlib.util
    import io
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "lm_eval_smoke.py"
    spec = importlib.util.spec_from_file_location("lm_eval_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    log = io.StringIO()
    assert smoke.run(srv.url, NAME, srv.tok, out=log), log.getvalue()
    ctx = srv.ids[0]
    cont = oracle(srv, ctx, 5, temperature=0.0)[:3]
    want = hf_logprobs(srv, ctx + cont)
    (lp, greedy), = smoke.loglikelihood(srv.url, NAME, [(ctx, cont)])["max_tokens=1"]
    assert greedy and abs(lp - sum(want[len(ctx) + i - 1][t] for i, t in enumerate(cont))) < 1e-4
