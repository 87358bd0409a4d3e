"""Presence / frequency penalties, logit_bias and min_tokens (issue 59; dflash_jax.penalties).

Greedy: DFlash output equals plain decoding of the same adjusted target token for token, and both
equal an independent oracle, transformers' Qwen3ForCausalLM (float32) in a plain greedy loop with
the adjustments written out here. Sampled: the joint of the first three tokens under DFlash
sampling equals the exact penalised joint, enumerated with HF and the reference's processing
(tests/test_sampling.py's chi-square at p < 1e-4 on fixed seeds). The slot engine serves rows with
and without penalties in one step (the penalties program); the server parses the fields and a
logit_bias forces its token through the OpenAI client.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.checkpoints import load_torch_pair
from tests.test_sampling import _chi_square_p

from dflash_jax import generate, load_draft, load_target

CAPACITY = 96
N_NEW = 20


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    p = trained_small_vocab_pair
    hf, _ = load_torch_pair(p["target_path"])
    target = load_target(p["target_path"], dtype="float32")
    return dict(p, hf=hf, target=target, draft=load_draft(p["draft_path"], target=target, dtype="float32"))


def _adjusted(logits, generated: list[int], presence=0.0, frequency=0.0, logit_bias=None, min_tokens=0, stops=()):
    """The OpenAI / vLLM adjustments, written out: logits [V] torch float64."""
    out = logits.double().clone()
    counts = np.bincount(np.asarray(generated, np.int64), minlength=out.shape[0])
    out -= torch.tensor(presence * (counts > 0) + frequency * counts, dtype=torch.float64)
    for t, b in (logit_bias or {}).items():
        out[t] += b
    if len(generated) < min_tokens:
        out[list(stops)] = -float("inf")
    return out


def _hf_greedy(hf, prompt, n, stops=(), **adj) -> list[int]:
    """transformers' forward in a plain greedy loop over the adjusted logits (no cache: tiny model)."""
    out: list[int] = []
    while len(out) < n:
        ids = torch.tensor([list(prompt) + out])
        with torch.no_grad():
            logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
        out.append(int(torch.argmax(_adjusted(logits, out, stops=stops, **adj))))
        if out[-1] in stops:
            break
    return out


GREEDY = {
    "force": dict(logit_bias={5: 100.0}),
    "bias-and-penalties": dict(logit_bias={3: 2.0, 7: -100.0}, presence_penalty=0.8, frequency_penalty=0.4),
    "negative-frequency": dict(frequency_penalty=-0.5, presence_penalty=2.0),
}


def _run(pair, prompts, draft=True, **kw):
    return generate(pair["target"], pair["draft"] if draft else None, prompts, max_new_tokens=N_NEW,
                    capacity=CAPACITY, verify_width="block", **kw)


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_equals_plain_and_transformers(pair, name):
    kw = GREEDY[name]
    prompts = pair["eval_prompts"][:3]
    spec = _run(pair, prompts, **kw)
    plain = _run(pair, prompts, draft=False, **kw)
    assert spec.tokens == plain.tokens
    adj = dict(presence=kw.get("presence_penalty", 0.0), frequency=kw.get("frequency_penalty", 0.0),
               logit_bias=kw.get("logit_bias"))
    for prompt, got in zip(prompts, spec.tokens):
        assert got == _hf_greedy(pair["hf"], prompt, N_NEW, **adj)
    if name == "force":
        assert all(t == 5 for row in spec.tokens for t in row)
    else:   # the (adjusted) draft is still accepted
        assert spec.mean_tau > 1.2, spec.mean_tau
    if name == "bias-and-penalties":
        assert spec.tokens != _run(pair, prompts).tokens


def test_min_tokens_holds_the_stop_back(pair):
    prompts = pair["eval_prompts"][:3]
    free = _run(pair, prompts)
    stop = free.tokens[0][1]             # a token the first row emits early
    early = _run(pair, prompts, stop_token_ids=[stop])
    assert len(early.tokens[0]) == 2 and early.finish_reasons[0] == "stop"
    kw = dict(stop_token_ids=[stop], min_tokens=8)
    spec, plain = _run(pair, prompts, **kw), _run(pair, prompts, draft=False, **kw)
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    for prompt, got in zip(prompts, spec.tokens):
        assert stop not in got[:8] and len(got) > 8
        assert got == _hf_greedy(pair["hf"], prompt, N_NEW, stops=(stop,), min_tokens=8)


POSITIONS, ROWS, SEEDS = 3, 512, 6


def _exact_joint(hf, prompt, temperature, top_p, top_k, stops, **adj):
    """p(x1, x2, x3 | prompt) under plain sampling of the adjusted target, by enumeration; a row that
    stops (a stop id once allowed) ends its tuple there."""
    from dflash.model import _sampling_probs
    joint, done = {(): 1.0}, {}
    for _ in range(POSITIONS):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        with torch.no_grad():
            logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
        adjusted = torch.stack([_adjusted(lg, list(pre), stops=stops, **adj) for lg, pre in zip(logits, prefixes)])
        probs = _sampling_probs(adjusted.float(), temperature, top_p, top_k).double().numpy()
        nxt = {}
        for pre, row in zip(prefixes, probs):
            for tok in np.nonzero(row > 1e-12)[0]:
                (done if int(tok) in stops else nxt)[pre + (int(tok),)] = joint[pre] * row[tok]
        joint = nxt
    return {**joint, **done}


def test_sampled_distribution_is_the_penalised_one(pair):
    prompt = pair["eval_prompts"][0]
    hf = pair["hf"]
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1]
    stop = int(torch.argmax(first))      # the likeliest first token, held back by min_tokens
    adj = dict(presence=1.0, frequency=0.7, logit_bias={3: 1.5, 9: -2.0}, min_tokens=2)
    kw = dict(presence_penalty=1.0, frequency_penalty=0.7, logit_bias={3: 1.5, 9: -2.0}, min_tokens=2,
              stop_token_ids=[stop])
    expected = _exact_joint(hf, prompt, 1.0, 1.0, 0, (stop,), **adj)
    plain = _exact_joint(hf, prompt, 1.0, 1.0, 0, (stop,))
    tv = 0.5 * sum(abs(expected.get(k, 0.0) - plain.get(k, 0.0)) for k in set(expected) | set(plain))
    assert tv > 0.2, tv                  # the adjustments matter: a wrong rule would be seen
    counts, n, acc = {}, 0, []
    for seed in range(SEEDS):
        res = generate(pair["target"], pair["draft"], [prompt] * ROWS, max_new_tokens=POSITIONS, temperature=1.0,
                       seed=seed, capacity=64, verify_width="block", **kw)
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
            n += 1
        acc += [a for r in res.acceptance_lengths for a in r]
    assert max(acc) >= 2                 # acceptance chains happen
    assert _chi_square_p(counts, expected, n) > 1e-4


def test_slot_engine_mixes_rows_with_and_without_penalties(pair):
    from dflash_jax.serving.slots import RowRequest, Slots
    prompts = pair["eval_prompts"][:4]
    kw = GREEDY["bias-and-penalties"]
    eng = Slots(pair["target"], pair["draft"], slots=4, capacity=CAPACITY, attention_impl="xla", step_buckets=None)
    reqs = [RowRequest(prompt=tuple(p), max_new=N_NEW, rng_row=i,
                       **(dict(presence=kw["presence_penalty"], frequency=kw["frequency_penalty"],
                               logit_bias=tuple(kw["logit_bias"].items())) if i % 2 else {}))
            for i, p in enumerate(prompts)]
    out = eng.run(reqs)
    # one-shot runs of the same batch bucket as the greedy test's (compiled there)
    assert [o.tokens for o in out[1::2]] == _run(pair, prompts, **kw).tokens[1::2]
    assert [o.tokens for o in out[0::2]] == _run(pair, prompts).tokens[0::2]
    # a preempted row re-inserted: its first k tokens join the prompt and still count as generated
    # (negative penalties: what was generated is repeated, so a count missed would show)
    reqs = [RowRequest(prompt=tuple(p), max_new=N_NEW, presence=-2.0, frequency=-1.0) for p in prompts[:2]]
    out, k = eng.run(reqs), 6

    def resumed(n):
        return [o.tokens for o in eng.run([dataclasses.replace(r, prompt=r.prompt + tuple(o.tokens[:k]),
                                                               max_new=N_NEW - k, resumed=n)
                                           for r, o in zip(reqs, out)])]
    assert resumed(k) == [o.tokens[k:] for o in out] != resumed(0)


def test_bad_values_are_errors_naming_the_field(pair):
    bad = [(dict(presence_penalty=2.5), "presence_penalty"),
           (dict(frequency_penalty=float("nan")), "frequency_penalty"),
           (dict(logit_bias={32: 1.0}), "logit_bias"), (dict(logit_bias={1: 100.5}), "logit_bias"),
           (dict(logit_bias={-1: 0.0}), "logit_bias"), (dict(logit_bias={"3": 1.0}), "logit_bias"),
           (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=N_NEW + 1), "min_tokens")]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            _run(pair, [[1, 2]], **kw)
    from dflash_jax import penalties
    assert penalties.problem(0, 0, {i: 1.0 for i in range(301)}, 0, 1000)[0] == "logit_bias"


# ----------------------------------------------------------------------------------------- served
def test_served_logit_bias_forces_the_token_and_bad_fields_are_400s(cli_models):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import dflash_jax as dj
    from transformers import AutoTokenizer

    from dflash_jax.serving.engine import SimpleEngine
    from dflash_jax.serving.server import build_app
    from tests.test_cli import ENDOFTEXT, IM_END
    from tests.test_serve import CAPACITY as SERVE_CAPACITY, NAME, client, serving

    tp, dp = cli_models
    target = dj.load_target(tp, dtype="float32")
    draft = dj.load_draft(dp, target=target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tp)
    engine = SimpleEngine(target, draft, capacity=SERVE_CAPACITY, max_queue=8, eos_token_ids=[IM_END, ENDOFTEXT],
                          attention_impl="xla")
    forced = 70
    try:
        with serving(build_app(engine, tok, model_name=NAME)) as url:
            r = client(url).completions.create(model=NAME, prompt="the quick brown fox", max_tokens=6, temperature=0,
                                               logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == [forced] * 6
            assert r.choices[0].text == tok.decode([forced] * 6)
            for body, field in ((dict(presence_penalty=2.5), "presence_penalty"),
                                (dict(frequency_penalty=-3), "frequency_penalty"),
                                (dict(logit_bias={"x": 1}), "logit_bias"),
                                (dict(logit_bias={"100000": 1}), "logit_bias"),
                                (dict(logit_bias={"5": 101}), "logit_bias"),
                                (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
                                (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=7), "min_tokens")):
                resp = httpx.post(url + "/v1/completions", json=dict(model=NAME, prompt="hi", max_tokens=6, **body),
                                  timeout=60)
                assert resp.status_code == 400, (body, resp.text)
                assert resp.json()["error"]["param"] == field, resp.text
    finally:
        engine.shutdown(timeout=5)
