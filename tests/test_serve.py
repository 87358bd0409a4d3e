"""The OpenAI-compatible server (`dflash_jax.serve`) and the simple engine (`dflash_jax.serving.engine`).

Two servers, both in-process on 127.0.0.1 (uvicorn in a thread, a free port):
- the real one: a tiny float32 Qwen3 target + DFlash draft + byte-level BPE tokenizer (tests/test_cli's),
  SimpleEngine over `dflash_jax.generate`; every answer is checked token for token against one-shot
  `generate` of the same prompt and settings. The oracle calls generate with a no-op on_commit and the
  server's capacity, so it reuses the server's compiled program (one compile per prompt bucket and
  sampling mode on this machine is the cost that matters); the engine, streaming, detokenisation, stop
  handling and HTTP are what is under test. All prompts sit in one prompt bucket (33..64 tokens).
- a stand-in engine (SimpleEngine with a fake generate_fn that emits one token per "iteration" and can
  block, fail, or ignore on_commit's stop request) for the fault cases: queue full, one failing
  request, client disconnect, cancel, shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dflash_jax.decode import GenerateResult  # noqa: E402
from dflash_jax.serving.engine import (Finished, QueueFull, Request, SimpleEngine, SlotEngine, Tokens)  # noqa: E402
from dflash_jax.serving.server import build_app  # noqa: E402
from tests.test_cli import IM_END, ENDOFTEXT, _write_draft, _write_target, write_tokenizer  # noqa: E402

CAPACITY = 256
NAME = "tiny"


@contextlib.contextmanager
def serving(app):
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(10)
        sock.close()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def sse(url: str, path: str, body: dict) -> list:
    """The raw SSE data lines of a streamed request ('[DONE]' kept as a string)."""
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ----------------------------------------------------------------------------------------- real models
@pytest.fixture(scope="module")
def tiny(cli_models):
    import dflash_jax as dj
    from transformers import AutoTokenizer

    tp, dp = cli_models  # test_cli.py's pair, built once in conftest.py
    target = dj.load_target(tp, dtype="float32")
    draft = dj.load_draft(dp, target=target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(tp)
    return types.SimpleNamespace(target=target, draft=draft, tok=tok, eos=[IM_END, ENDOFTEXT])


# The default run serves through the simple engine; the slot engine's tokens are test_engine.py's.
@pytest.fixture(scope="module", params=["simple", pytest.param("slots4", marks=pytest.mark.slow)])
def real(tiny, request):
    if request.param == "slots4":   # the continuous-batching engine, as `serve --slots 4`
        engine = SlotEngine(tiny.target, tiny.draft, slots=4, capacity=CAPACITY, max_queue=64,
                            eos_token_ids=tiny.eos, attention_impl="xla")
    else:
        engine = SimpleEngine(tiny.target, tiny.draft, capacity=CAPACITY, max_queue=64, eos_token_ids=tiny.eos,
                              attention_impl="xla")
    app = build_app(engine, tiny.tok, model_name=NAME)
    with serving(app) as url:
        yield types.SimpleNamespace(url=url, engine=engine, **vars(tiny))
    engine.shutdown(timeout=5)


def oracle(m, ids, max_tokens, stop=None, **kw) -> list[int]:
    import dflash_jax

    stops = sorted(set(m.eos) | set(stop or []))
    res = dflash_jax.generate(m.target, m.draft, [list(ids)], max_new_tokens=max_tokens, stop_token_ids=stops,
                              capacity=CAPACITY, attention_impl="xla", on_commit=lambda rows: None, **kw, verify_width="block")
    return res.tokens[0]


def text_of(m, tokens) -> str:
    if tokens and tokens[-1] in m.eos:
        tokens = tokens[:-1]
    return m.tok.decode(tokens, skip_special_tokens=True)


def prompt_ids(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j + 11) % 300 for j in range(n)]


PROMPT = "the quick brown fox jumps over the lazy dog and then"   # 33..64 tokens: the shared bucket


def test_completion_matches_generate(real):
    c = client(real.url)
    ids = list(real.tok.encode(PROMPT))
    assert 32 < len(ids) <= 64
    want = oracle(real, ids, 24, temperature=0.0)
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                             extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.token_ids == want
    assert ch.text == text_of(real, want)
    assert ch.finish_reason == ("stop" if want[-1] in real.eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # token-id prompt: the same answer
    r2 = c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0,
                              extra_body={"return_token_ids": True})
    assert r2.choices[0].token_ids == want


def test_chat_matches_generate(real):
    c = client(real.url)
    msgs = [{"role": "user", "content": "why is the sky blue"}]
    for thinking in (False, True):
        text = real.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=thinking)
        ids = list(real.tok.encode(text, add_special_tokens=False))
        assert 32 < len(ids) <= 64
        want = oracle(real, ids, 20, temperature=0.0)
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": thinking},
                                                  "return_token_ids": True})
        assert r.choices[0].token_ids == want
        assert r.choices[0].message.content == text_of(real, want)
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids)


def test_streaming_matches_generate(real):
    c = client(real.url)
    ids = list(real.tok.encode(PROMPT + " over"))
    want = oracle(real, ids, 30, temperature=0.0)
    chunks = list(c.completions.create(model=NAME, prompt=ids, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text_of(real, want)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want)
    # raw SSE: token ids per chunk, OpenAI's chunk objects, the [DONE] terminator
    lines = sse(real.url, "/v1/completions", dict(prompt=ids, max_tokens=30, temperature=0, stream=True,
                                                  return_token_ids=True))
    assert lines[-1] == "[DONE]"
    assert all(l["object"] == "text_completion" for l in lines[:-1])
    assert [t for l in lines[:-1] for t in l["choices"][0]["token_ids"]] == want
    # chat streaming
    msgs = [{"role": "user", "content": "why is the sky so blue"}]
    text = real.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    want = oracle(real, real.tok.encode(text, add_special_tokens=False), 20, temperature=0.0)
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text_of(real, want)


def test_stop_strings_and_stop_ids(real):
    c = client(real.url)
    ids = prompt_ids(1, 40)
    want = oracle(real, ids, 24, temperature=0.0)
    full = text_of(real, want)
    # a stop string from the middle of the greedy text: cut before it, for both paths
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = full[:full.find(stop)]
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = list(c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    # a stop token id: ends at its first occurrence, the token counted but not shown
    sid = want[5]
    first = want.index(sid)
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0,
                             extra_body={"stop_token_ids": [sid], "return_token_ids": True})
    assert r.choices[0].token_ids == want[:first + 1] == oracle(real, ids, 24, stop=[sid], temperature=0.0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == real.tok.decode(want[:first], skip_special_tokens=True)


def test_models_health_metrics(real):
    c = client(real.url)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert httpx.get(real.url + "/health").json() == {"status": "ok"}
    c.completions.create(model=NAME, prompt=prompt_ids(2, 40), max_tokens=8, temperature=0)
    text = httpx.get(real.url + "/metrics").text
    for name in ("dflash_time_to_first_token_seconds_bucket", "dflash_time_per_output_token_seconds_bucket",
                 "dflash_acceptance_length_bucket", "dflash_generation_tokens_total", "dflash_tokens_per_second",
                 "dflash_queue_depth", "dflash_slots_busy", "dflash_compiles", "dflash_engine_steps_total",
                 "dflash_engine_slot_steps_total", "dflash_engine_inserts_total",
                 'dflash_engine_seconds_total{phase="insert_dispatch"}',
                 'dflash_engine_seconds_total{phase="step_dispatch"}', 'dflash_engine_seconds_total{phase="read_wait"}',
                 'dflash_engine_seconds_total{phase="idle"}'):
        assert name in text, name
    if real.engine.__class__.__name__ == "SlotEngine":    # its thread's counters moved (SimpleEngine: zeros)
        steps = [l for l in text.splitlines() if l.startswith("dflash_engine_steps_total")]
        assert float(steps[0].split()[-1]) >= 1
    gen = [l for l in text.splitlines() if l.startswith("dflash_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 8
    tau = [l for l in text.splitlines() if l.startswith("dflash_acceptance_length_count")]
    assert float(tau[0].split()[-1]) >= 1


@pytest.mark.parametrize("engine_kind", ["simple", pytest.param("slots2", marks=pytest.mark.slow)])
def test_served_acceptance_of_a_trained_pair_is_one_shot_generate(trained_small_vocab_pair, engine_kind):
    """The trained vocab-32 pair (S = 8) served without a tokenizer (token-id prompts): each answer's
    tokens and its `dflash` stats (iterations, mean acceptance length) are one-shot generate's at
    the full block, and blocks of 3 or more were accepted (a random draft's would be all 1s), so
    the served acceptance is compared, not assumed."""
    import dflash_jax as dj

    pair = trained_small_vocab_pair
    target = dj.load_target(pair["target_path"], dtype="float32")
    draft = dj.load_draft(pair["draft_path"], target=target, dtype="float32")
    if engine_kind == "slots2":
        engine = SlotEngine(target, draft, slots=2, capacity=CAPACITY, max_queue=8, eos_token_ids=[],
                            attention_impl="xla")
    else:
        engine = SimpleEngine(target, draft, capacity=CAPACITY, max_queue=8, eos_token_ids=[], attention_impl="xla")
    seen = []
    with serving(build_app(engine, None, model_name=NAME)) as url:
        for p in pair["eval_prompts"][:3]:
            want = dj.generate(target, draft, [p], max_new_tokens=24, capacity=CAPACITY, attention_impl="xla",
                               on_commit=lambda rows: None, verify_width="block")
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json=dict(model=NAME, prompt=p, max_tokens=24, temperature=0, return_token_ids=True)).json()
            acc = want.acceptance_lengths[0]
            assert r["choices"][0]["token_ids"] == want.tokens[0]
            assert r["dflash"] == {"iterations": len(acc), "mean_acceptance_length": round(sum(acc) / len(acc), 4)}
            seen += acc
    engine.shutdown(timeout=5)
    assert max(seen) >= 3, seen


def test_bad_requests_are_400_naming_the_field(real):
    c = client(real.url)
    cases = [
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt="hi", top_p=0), "top_p"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens="many"), "max_tokens"),
        (dict(prompt="hi", n=0), "n"),
        (dict(prompt="hi", stop_token_ids=[10 ** 6]), "stop_token_ids"),
        (dict(prompt=[10 ** 6]), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(max_tokens=4), "prompt"),
        (dict(prompt=[1] * CAPACITY), "prompt"),                 # longer than the capacity
        (dict(prompt=[1, 2, 3], max_tokens=CAPACITY), "max_tokens"),
    ]
    for body, field in cases:
        r = httpx.post(real.url + "/v1/completions", json={"model": NAME, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (body, err)
    r = httpx.post(real.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(real.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt="hi", temperature=-0.5)
    assert httpx.get(real.url + "/health").status_code == 200    # still up


@pytest.mark.slow
def test_load_50_requests_concurrency_8(real):
    """Every response complete and equal to its one-shot output; nothing lost."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(prompt_ids(i, 33 + i % 32), 4 + (i * 5) % 21, i % 3 == 0) for i in range(50)]
    want = [oracle(real, ids, n, temperature=0.0) for ids, n, _ in jobs]

    def one(job):
        ids, n, stream = job
        body = dict(model=NAME, prompt=ids, max_tokens=n, temperature=0, return_token_ids=True, stream=stream)
        if stream:
            lines = sse(real.url, "/v1/completions", body)
            assert lines[-1] == "[DONE]"
            return [t for l in lines[:-1] for t in l["choices"][0].get("token_ids", [])]
        r = httpx.post(real.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, jobs))
    assert got == want
    st = real.engine.stats()
    assert (st.queue_depth, st.slots_busy) == (0, 0)


@pytest.mark.slow
def test_sampling_with_seed_matches_generate(real):
    c = client(real.url)
    ids = prompt_ids(3, 40)
    want = oracle(real, ids, 16, temperature=0.9, seed=1234)
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0.9, seed=1234,
                             extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == want


# ----------------------------------------------------------------------------------------- stand-in engine
class FakeGenerate:
    """generate() stand-in: token i of a prompt is (sum(prompt) + i) % 200, one per iteration, `delay`
    seconds each; prompt[0] == 199 raises mid-way; `gate` (an Event) holds the first iteration;
    honour=False ignores on_commit's stop request (a generate that only stops at its end)."""

    def __init__(self, delay=0.0, honour=True):
        self.delay, self.honour = delay, honour
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0

    def __call__(self, target, draft, prompts, *, max_new_tokens, on_commit, stop_token_ids, **kw):
        self.calls += 1
        p = prompts[0]
        toks = []
        self.gate.wait(30)
        for i in range(max_new_tokens):
            if p[0] == 199 and i == 2:
                raise RuntimeError("injected fault")
            t = (sum(p) + i) % 200
            toks.append(t)
            stop = on_commit([[t]])
            if stop and self.honour or t in (stop_token_ids or []):
                break
            time.sleep(self.delay)
        return GenerateResult(tokens=[toks], acceptance_lengths=[[1] * (len(toks) - 1)], block_size=1,
                              num_iterations=len(toks), compile_time_s=0.0, run_time_s=0.0,
                              finish_reasons=["stop" if toks[-1] in (stop_token_ids or []) else "length"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(str(tmp_path_factory.mktemp("tok")))


def fake_engine(gen, max_queue=8):
    target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=320))
    return SimpleEngine(target, None, capacity=512, max_queue=max_queue, eos_token_ids=[IM_END], generate_fn=gen)


def expected(p, n):
    return [(sum(p) + i) % 200 for i in range(n)]


def test_engine_interface_events_and_stop_ids():
    eng = fake_engine(FakeGenerate())
    h = eng.submit(Request(prompt=(1, 2, 3), max_tokens=5))
    evs = list(h.events())
    assert all(isinstance(e, Tokens) for e in evs[:-1]) and isinstance(evs[-1], Finished)
    assert [t for e in evs[:-1] for t in e.ids] == evs[-1].tokens == expected((1, 2, 3), 5)
    assert evs[-1].finish_reason == "length" and evs[-1].stats.completion_tokens == 5
    assert eng.stop_ids(Request(prompt=(1,), stop_token_ids=(5,))) == [5, IM_END]
    assert eng.stop_ids(Request(prompt=(1,), stop_token_ids=(5,), ignore_eos=True)) == [5]
    eng.shutdown()


@pytest.mark.parametrize("honour", [True, False], ids=["generate-stops", "generate-runs-out"])
@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_slot(tokenizer, honour):
    gen = FakeGenerate(delay=0.02, honour=honour)
    eng = fake_engine(gen)
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json=dict(prompt=[1, 2, 3], max_tokens=100, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break                                  # one chunk, then hang up
        t0 = time.time()
        while eng.stats().slots_busy and time.time() - t0 < 10:
            time.sleep(0.02)
        assert eng.stats().slots_busy == 0
        if honour:
            assert time.time() - t0 < 1.5                # stopped at the next iteration, not after 100
        # the server takes the next request and answers it in full
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[4, 5], max_tokens=3, return_token_ids=True))
        assert r.json()["choices"][0]["token_ids"] == expected([4, 5], 3)
    eng.shutdown()


@pytest.mark.slow
def test_cancel_ends_the_response_and_frees_the_slot():
    for honour in (True, False):
        eng = fake_engine(FakeGenerate(delay=0.01, honour=honour))
        h = eng.submit(Request(prompt=(1, 2), max_tokens=200))
        assert isinstance(h.next(timeout=10), Tokens)
        eng.cancel(h)
        evs = list(h.events())
        assert evs[-1].finish_reason == "cancelled"
        t0 = time.time()
        while eng.stats().slots_busy and time.time() - t0 < 10:
            time.sleep(0.01)
        assert eng.stats().slots_busy == 0
        eng.shutdown()


def wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    """Wait for a state of the server or engine (no fixed sleep that a loaded machine outruns)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_full_queue_is_503_with_retry_after(tokenizer):
    """With the one slot running (held at its first iteration) and the queue of one full, a third
    request is 503 with Retry-After; the two others then finish. Each state is waited for, so the
    test does not race the engine on a loaded machine."""
    gen = FakeGenerate()
    gen.gate.clear()                                       # the running request holds the slot
    eng = fake_engine(gen, max_queue=1)
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
        results = []

        def post():
            results.append(httpx.post(url + "/v1/completions", json=dict(prompt=[1, 2], max_tokens=2), timeout=60))

        threads = [threading.Thread(target=post) for _ in range(2)]
        threads[0].start()
        wait_until(lambda: gen.calls == 1, "the first request to run")
        threads[1].start()
        wait_until(lambda: eng.stats().queue_depth == 1, "the second request to queue")
        assert eng.stats().slots_busy == 1 and gen.calls == 1
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[1, 2], max_tokens=2), timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        gen.gate.set()
        for th in threads:
            th.join(60)
        assert [x.status_code for x in results] == [200, 200]
    eng.shutdown()
    with pytest.raises(QueueFull):
        e2 = fake_engine(FakeGenerate(), max_queue=0)
        e2._running = object()                             # busy, and no room to wait
        e2.submit(Request(prompt=(1,), max_tokens=1))


def test_a_failing_request_fails_alone(tokenizer):
    eng = fake_engine(FakeGenerate())
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[199, 1], max_tokens=8))
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        lines = sse(url, "/v1/completions", dict(prompt=[199, 1], max_tokens=8, stream=True))
        assert "error" in lines[-2] and lines[-1] == "[DONE]"
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[3], max_tokens=4, return_token_ids=True))
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected([3], 4)
        metrics = httpx.get(url + "/metrics").text
        assert 'dflash_requests_total{finish_reason="error"} 2.0' in metrics
    eng.shutdown()


def test_shutdown_finishes_running_and_refuses_new():
    gen = FakeGenerate(delay=0.01)
    eng = fake_engine(gen)
    hs = [eng.submit(Request(prompt=(i + 1,), max_tokens=10)) for i in range(3)]
    eng.shutdown(timeout=30)
    assert [list(h.events())[-1].finish_reason for h in hs] == ["length"] * 3
    from dflash_jax.serving.engine import EngineClosed
    with pytest.raises(EngineClosed):
        eng.submit(Request(prompt=(1,), max_tokens=1))
    # with no time left, what has not finished fails
    gen = FakeGenerate(delay=0.05)
    eng = fake_engine(gen)
    hs = [eng.submit(Request(prompt=(i + 1,), max_tokens=50)) for i in range(2)]
    eng.shutdown(timeout=0.1)
    assert [list(h.events())[-1].finish_reason for h in hs] == ["error", "error"]


@pytest.mark.slow
def test_sigterm_finishes_in_flight_and_exits(tmp_path):
    """`python -m dflash_jax.serve` in a subprocess: SIGTERM during a streamed request lets it finish,
    then the process exits 0."""
    import signal

    tp, dp = str(tmp_path / "target"), str(tmp_path / "draft")
    _write_target(tp)
    write_tokenizer(tp)
    _write_draft(dp, tp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.serve", "--model", tp, "--draft", dp, "--dtype",
                             "float32", "--port", str(port), "--capacity", "256"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        got = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json=dict(prompt=[5, 6, 7], max_tokens=40, temperature=0, stream=True,
                                    ignore_eos=True, return_token_ids=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                    if len(got) == 1:
                        proc.send_signal(signal.SIGTERM)
        assert got[-1] == "data: [DONE]"
        assert sum(len(json.loads(l[6:])["choices"][0]["token_ids"]) for l in got[:-1]) == 40
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        print(proc.stdout.read())


def test_draining_answers_503(tokenizer):

    eng = fake_engine(FakeGenerate())
    app = build_app(eng, tokenizer, model_name=NAME)
    with serving(app) as url:
        app.state.draining = True
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[1], max_tokens=1))
        assert r.status_code == 503
    eng.shutdown()


def test_cli_refuses_bad_flags(capsys, monkeypatch):
    from dflash_jax.serving import server as serve

    monkeypatch.setattr(serve, "_default_pair", lambda: None)  # as a package that ships no pair
    for argv, msg in ((["--port", "8001"], "give --model"), (["--random-init", "qwen3-0.6b", "--slots", "0"], "--slots"),
                      (["--random-init", "qwen3-0.6b", "--port", "0"], "--port"),
                      (["--random-init", "qwen3-0.6b", "--warmup-prompt-len", "a:b"], "--warmup-prompt-len"),
                      (["--random-init", "qwen3-0.6b", "--engine-pipeline", "-1"], "--engine-pipeline"),
                      (["--random-init", "qwen3-0.6b", "--compile-workers", "0"], "--compile-workers must be >= 1"),
                      (["--random-init", "qwen3-0.6b", "--insert-width", "0"], "--insert-width"),
                      (["--random-init", "qwen3-0.6b", "--step-buckets", "1,x"], "--step-buckets"),
                      (["--random-init", "qwen3-0.6b", "--verify-width", "auto"], "--verify-width auto needs the slot"),
                      (["--random-init", "qwen3-0.6b", "--slots", "2", "--verify-width", "x"], "--verify-width"),
                      (["--random-init", "qwen3-0.6b", "--while-graphs", "off"],
                       "--while-graphs off needs the slot engine"),
                      (["--random-init", "qwen3-0.6b", "--slots", "2", "--while-graphs", "maybe"], "--while-graphs")):
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.slow
def test_load_test_script_20_requests_all_identical_to_one_shot(tmp_path):
    """scripts/load_test.py against the embedded pair (a server it starts itself on 127.0.0.1, slot
    engine): 20 streamed requests at concurrency 8 and 6 at 2, every response complete and equal to its
    one-shot generate output, a table printed and the JSON written, no compile during the run."""
    from dflash_jax.assets import default_pair

    assert default_pair() is not None, "the package must ship its default pair (dflash_jax/assets/pair)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "load.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "load_test.py"), "--requests", "20",
                           "--concurrency", "8,2x6", "--slots", "4", "--insert-width", "2", "--capacity", "256",
                           "--prompt-len", "33,60", "--max-tokens", "4,24", "--attention", "xla", "--check",
                           "--server-arg=--while-graphs=off",        # (the flag's plumbing: a no-op off CUDA)
                           "--json", str(out), "--server-log", str(tmp_path / "server.log")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (tmp_path / "server.log").read_text()
    assert "| concurrency 8 | 20 | 0 |" in proc.stdout and "all identical" in proc.stdout
    assert "| concurrency 2, 6 requests | 6 | 0 |" in proc.stdout      # CxN: C concurrent over N requests
    report = json.loads(out.read_text())
    (server,) = report["servers"]
    assert server["check"] == {"responses": 26, "problems": []}
    for run in server["runs"]:
        assert run["errors"] == 0 and run["output_tokens"] > 0 and run["compiles"] == 0 and run["tau"] >= 1
        # the engine thread over the run (/metrics dflash_engine_*): one prefill per request, at most
        # --slots rows a step, its phases a share of the run's wall
        e = run["engine"]
        assert e["inserts"] == run["requests"] and e["steps"] > 0 and 1 <= e["rows_per_step"] <= 4, e
        fracs = ("insert_dispatch_frac", "step_dispatch_frac", "read_wait_frac", "idle_frac", "host_frac")
        assert all(0 <= e[k] <= 1.05 for k in fracs), e
    assert "the engine thread over each run" in proc.stdout


# ----------------------------------------------------------------------------------------- issue 33: bad input
def _post(url, path, body, client=httpx, **kw):
    return client.post(url + path, json=body, timeout=30, **kw)


def _assert_400(r, field, body=None):
    assert r.status_code == 400, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], (body, err)


def test_unsupported_fields_and_coerced_types_are_400(tokenizer):
    """Fields the server does not implement are refused by name, not ignored; JSON strings are not
    numbers and numbers are not bools (no coercion). Their defaults are still accepted."""
    eng = fake_engine(FakeGenerate())
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    refused = [(dict(repetition_penalty=1.1), "repetition_penalty"), (dict(min_p=0.05), "min_p"),
               (dict(response_format={"type": "json_object"}), "response_format"),
               (dict(top_logprobs=2), "top_logprobs"), (dict(best_of=2), "best_of"),
               (dict(logit_bias={"x": 10}), "logit_bias"), (dict(min_tokens="3"), "min_tokens"),
               (dict(guided_json={"type": "object"}), "guided_json"),
               (dict(max_tokens="8"), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
               (dict(max_tokens=8.0), "max_tokens"), (dict(stream="yes"), "stream"), (dict(stream=1), "stream"),
               (dict(temperature="0.5"), "temperature"), (dict(temperature=True), "temperature"),
               (dict(seed="1"), "seed"), (dict(ignore_eos="true"), "ignore_eos"),
               (dict(stop_token_ids=["5"]), "stop_token_ids"), (dict(top_k=1.0), "top_k"),
               (dict(stream_options={"include_usage": "yes"}), "stream_options")]
    completion_only = [(dict(suffix="x"), "suffix"), (dict(prompt=[1, True]), "prompt"),
                       (dict(prompt=["1", 2]), "prompt")]
    chat_only = [(dict(tools=[{"type": "function", "function": "f"}]), "tools[0]"),
                 (dict(tool_choice="required"), "tool_choice"),
                 (dict(max_completion_tokens="4"), "max_completion_tokens"),
                 (dict(messages=[{"role": "user", "content": 5}]), "messages")]
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url, httpx.Client() as http:
        for extra, field in refused + completion_only:
            body = {"prompt": [1, 2], "max_tokens": 2, **extra}
            _assert_400(_post(url, "/v1/completions", body, http), field, body)
        for extra, field in refused + chat_only:
            body = {**chat, **extra}
            _assert_400(_post(url, "/v1/chat/completions", body, http), field, body)
        # the values that mean "not used" pass
        ok = dict(prompt=[1, 2], max_tokens=2, repetition_penalty=1, min_p=0.0, best_of=1, suffix=None,
                  response_format={"type": "text"}, logit_bias={}, temperature=0, return_token_ids=True)
        r = _post(url, "/v1/completions", ok)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected([1, 2], 2)
        r = _post(url, "/v1/chat/completions", {**chat, "tools": [], "tool_choice": "none"})
        assert r.status_code == 200, r.text
    eng.shutdown()


def test_request_chat_template_is_refused_unless_trusted(tokenizer):
    """A request's own chat template is code the server would run: refused (400 naming where it
    came) unless the operator allows it; template-call arguments cannot be smuggled in as kwargs."""
    eng = fake_engine(FakeGenerate())
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": "hi there"}]
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
        for extra, field in ((dict(chat_template=loop), "chat_template"),
                             (dict(chat_template_kwargs={"chat_template": loop}), "chat_template_kwargs.chat_template"),
                             (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize"),
                             (dict(chat_template_kwargs={"add_generation_prompt": False}),
                              "chat_template_kwargs.add_generation_prompt")):
            body = dict(messages=msgs, max_tokens=2, **extra)
            _assert_400(_post(url, "/v1/chat/completions", body), field, body)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    trusted = build_app(eng, tokenizer, model_name=NAME, trust_request_chat_template=True)
    with serving(trusted) as url:
        # the request's template is the one used: the prompt is exactly the message's text
        for extra in (dict(chat_template="{{ messages[0]['content'] }}"),
                      dict(chat_template_kwargs={"chat_template": "{{ messages[0]['content'] }}"})):
            r = _post(url, "/v1/chat/completions", dict(messages=msgs, max_tokens=3, return_token_ids=True, **extra))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected(tokenizer.encode("hi there"), 3)
    eng.shutdown()


class _SlowTokenizer:
    """The test tokenizer with an encode that takes `delay` seconds (a 10 MB prompt's worth)."""

    def __init__(self, tok, delay):
        self._tok, self.delay = tok, delay

    def encode(self, *a, **kw):
        time.sleep(self.delay)
        return self._tok.encode(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_tokenising_runs_off_the_event_loop_and_the_body_is_limited(tokenizer):
    """While one prompt is being tokenised the server answers others at once; a body over the
    limit is 413 before it is parsed, whether its size is declared or it arrives chunked."""
    eng = fake_engine(FakeGenerate())
    app = build_app(eng, _SlowTokenizer(tokenizer, 2.0), model_name=NAME, max_body_bytes=4000)
    with serving(app) as url:
        for path, body in (("/v1/completions", dict(prompt="a long prompt", max_tokens=2)),
                           ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], max_tokens=2))):
            slow = []
            th = threading.Thread(target=lambda: slow.append(_post(url, path, body)))
            th.start()
            time.sleep(0.3)                                  # the slow request is tokenising now
            t0 = time.perf_counter()
            r = httpx.get(url + "/health", timeout=10)
            assert r.status_code == 200 and time.perf_counter() - t0 < 1.0, time.perf_counter() - t0
            th.join(30)
            assert slow[0].status_code == 200, slow[0].text
        big = dict(prompt=[1] * 2000, max_tokens=2)         # ~6 kB of JSON
        r = _post(url, "/v1/completions", big)
        assert r.status_code == 413 and "4000 bytes" in r.json()["error"]["message"]
        chunks = (json.dumps(big)[i:i + 500].encode() for i in range(0, len(json.dumps(big)), 500))
        r = httpx.post(url + "/v1/completions", content=chunks, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and "4000 bytes" in r.json()["error"]["message"], r.text
        r = _post(url, "/v1/completions", dict(prompt=[1, 2], max_tokens=2))
        assert r.status_code == 200
        assert 'dflash_requests_rejected_total{status="413"} 2.0' in httpx.get(url + "/metrics").text
    eng.shutdown()


def test_non_streaming_client_that_goes_away_frees_its_slot(tokenizer):
    """Tokens keep coming every 20 ms; the client gives up after 0.5 s: its request is cancelled
    and its slot free within a second, not when its 400 tokens are done (8 s)."""
    eng = fake_engine(FakeGenerate(delay=0.02))
    with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=dict(prompt=[1, 2], max_tokens=400), timeout=0.5)
        t0 = time.time()
        while eng.stats().slots_busy and time.time() - t0 < 10:
            time.sleep(0.02)
        assert eng.stats().slots_busy == 0 and time.time() - t0 < 1.5, time.time() - t0
        r = _post(url, "/v1/completions", dict(prompt=[4, 5], max_tokens=3, return_token_ids=True))
        assert r.json()["choices"][0]["token_ids"] == expected([4, 5], 3)
    eng.shutdown()


def test_top_k_above_the_vocabulary_is_400_on_both_engines(tiny, tokenizer):
    """Both engines refuse it as the client's mistake (docs: 400), not 500 or a silent clamp."""
    vocab = tiny.target.config.vocab_size
    slot_engine = SlotEngine(tiny.target, tiny.draft, slots=2, capacity=CAPACITY, attention_impl="xla")
    from dflash_jax.serving.engine import RequestError
    for eng in (slot_engine, fake_engine(FakeGenerate())):
        with pytest.raises(RequestError) as e:
            eng.check(Request(prompt=(1, 2), max_tokens=2, temperature=1.0, top_k=eng.vocab_size + 1))
        assert e.value.field == "top_k" and str(eng.vocab_size) in e.value.message
        eng.check(Request(prompt=(1, 2), max_tokens=2, temperature=1.0, top_k=eng.vocab_size))   # the whole vocabulary
        with serving(build_app(eng, tokenizer, model_name=NAME)) as url:
            _assert_400(_post(url, "/v1/completions", dict(prompt=[1, 2], max_tokens=2, top_k=vocab + 1)), "top_k")
        eng.shutdown(timeout=5)


def test_shutdown_timeout_ends_open_streams_with_an_error_and_done(tokenizer, caplog):
    """SIGTERM while a stream cannot finish within --shutdown-timeout: the stream gets an error
    event and [DONE] (not a cut connection), the server stops, and nothing logs a traceback."""
    import logging
    import signal

    import uvicorn

    from dflash_jax.serving import server as serve

    eng = fake_engine(FakeGenerate(delay=0.05))
    app = build_app(eng, tokenizer, model_name=NAME)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, log_level="info", lifespan="off", log_config=None,
                            timeout_graceful_shutdown=0.5 + serve.SHUTDOWN_GRACE_S)
    server = serve._server(config, app, eng, 0.5)
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.INFO)
    th.start()
    while not server.started:
        time.sleep(0.01)
    lines = []
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json=dict(prompt=[1, 2], max_tokens=400, stream=True)) as r:   # 20 s of tokens
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    server.handle_exit(signal.SIGTERM, None)
    th.join(15)
    sock.close()
    assert not th.is_alive()
    assert lines[-1] == "[DONE]", lines[-3:]
    err = json.loads(lines[-2])["error"]
    assert "shut down" in err["message"] and err["code"] == 500
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


# ----------------------------------------------------------------------------------------- the command
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_copy(root, src, config=None, generation=None) -> str:
    """A copy of the model directory `src` (files linked) with config.json / generation_config.json
    fields replaced."""
    dst = os.path.join(root, "target")
    os.makedirs(dst)
    for f in os.listdir(src):
        edits = {"config.json": config, "generation_config.json": generation}.get(f)
        if edits:
            with open(os.path.join(src, f)) as fh:
                d = json.load(fh)
            with open(os.path.join(dst, f), "w") as fh:
                json.dump({**d, **edits}, fh)
        else:
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    return dst


@pytest.fixture
def quiet_main(monkeypatch):
    """serve.main in this process without serving: the built (server, app, engine) are returned
    instead of run, and no signal handler or device state of the test process is touched."""
    from dflash_jax.serving import server as serve

    import functools

    import uvicorn

    built = {}

    def fake_run(server, sockets=None):
        built.update(server=server, app=server.config.app, sockets=sockets)

    monkeypatch.setattr(serve, "_release_device", lambda: None)
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    # uvicorn's logging set-up would keep handlers on this test's captured stderr
    monkeypatch.setattr(uvicorn, "Config", functools.partial(uvicorn.Config, log_config=None))

    def run(argv):
        built.clear()
        with monkeypatch.context() as m:         # only main's server is not run
            m.setattr(uvicorn.Server, "run", fake_run)
            code = serve.main(argv)
        return code, built

    return run


def test_cli_capacity_against_the_context(cli_models, tmp_path, quiet_main, capsys, monkeypatch):
    """A model with 128 positions: an explicit --capacity past them is exit 2 before any weight
    loads; the default fits them, and /v1/models and the engine's checks say 128 (block 8)."""
    from dflash_jax.serving import server as serve
    from dflash_jax.serving.engine import RequestError

    tp = _model_copy(str(tmp_path), cli_models[0], config={"max_position_embeddings": 128})
    base = ["--model", tp, "--draft", cli_models[1], "--dtype", "float32", "--attention", "xla",
            "--port", str(_free_port())]
    load = serve._load
    monkeypatch.setattr(serve, "_load", lambda *a: pytest.fail("models loaded before the capacity check"))
    with pytest.raises(SystemExit) as e:
        quiet_main(base + ["--capacity", "4096"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "max_position_embeddings 128" in err and "--capacity 136" in err, err
    monkeypatch.setattr(serve, "_load", load)
    code, built = quiet_main(base)
    assert code == 0
    eng = built["app"].state.engine
    assert (eng.capacity, eng.stats().max_model_len) == (136, 128)
    with serving(built["app"]) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 128
        _assert_400(_post(url, "/v1/completions", dict(prompt=[1] * 100, max_tokens=40)), "max_tokens")
    # the slot engine, given a larger cache than the model has positions, stops at the positions
    import dflash_jax as dj
    target = dj.load_target(tp, dtype="float32")
    slot_engine = SlotEngine(target, None, slots=2, capacity=512, attention_impl="xla")
    assert slot_engine.stats().max_model_len == 128
    with pytest.raises(RequestError) as e:
        slot_engine.check(Request(prompt=(1,) * 100, max_tokens=40))
    assert e.value.field == "max_tokens"
    slot_engine.shutdown(timeout=5)


def test_cli_capacity_against_memory(cli_models, tmp_path, quiet_main, capsys, monkeypatch):
    """--slots 2 x --capacity 10**9 of KV cache is refused at start with the numbers (not an OOM
    kill); what fits starts."""
    from dflash_jax.serving import server as serve

    tp = _model_copy(str(tmp_path), cli_models[0], config={"max_position_embeddings": 1 << 30})
    base = ["--model", tp, "--draft", cli_models[1], "--dtype", "float32", "--attention", "xla",
            "--port", str(_free_port())]
    with pytest.raises(SystemExit) as e:
        quiet_main(base + ["--slots", "2", "--capacity", str(10 ** 9), "--warmup-prompt-len", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--slots 2 x --capacity 1000000000" in err and "GB" in err, err
    assert "host RAM" in err and "at most" in err
    # the check reads the device's free memory: 1 MB free refuses what 1 GB would take
    monkeypatch.setattr(serve, "_free_memory", lambda: (10 ** 6, "test device memory"))
    with pytest.raises(SystemExit) as e:
        quiet_main(base + ["--capacity", "4096"])
    assert e.value.code == 2 and "test device memory has 0.00 GB free" in capsys.readouterr().err
    monkeypatch.setattr(serve, "_free_memory", lambda: (10 ** 9, "test device memory"))
    code, built = quiet_main(base + ["--capacity", "4096"])
    assert code == 0 and built["app"].state.engine.capacity == 4096


def test_cli_eos_outside_the_vocabulary_names_generation_config(cli_models, tmp_path, quiet_main, capsys):
    tp = _model_copy(str(tmp_path), cli_models[0], generation={"eos_token_id": [IM_END, 10 ** 6]})
    with pytest.raises(SystemExit) as e:
        quiet_main(["--model", tp, "--draft", cli_models[1], "--port", str(_free_port())])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "generation_config.json" in err and "1000000" in err, err


def test_cli_port_in_use_is_refused_before_loading(cli_models, quiet_main, capsys, monkeypatch):
    from dflash_jax.serving import server as serve

    monkeypatch.setattr(serve, "_load", lambda *a: pytest.fail("models loaded before the port was bound"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            quiet_main(["--model", cli_models[0], "--draft", cli_models[1], "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--port {port}" in err and "already in use" in err, err


def test_cli_warm_up_prints_progress(cli_models, quiet_main, capsys, monkeypatch):
    """--slots N compiles its programs at start, in --compile-workers threads, with a line naming the
    prompt buckets before and one after (compiles are stubbed out here: what is tested is that the
    operator sees them and that the buckets and threads reach Slots.warmup)."""
    from dflash_jax.serving import engine

    calls = []
    monkeypatch.setattr(engine.Slots, "warmup",
                        lambda self, lengths, modes, workers=None: calls.append((list(lengths), modes, workers)))
    code, built = quiet_main(["--model", cli_models[0], "--draft", cli_models[1], "--dtype", "float32",
                              "--attention", "xla", "--port", str(_free_port()), "--slots", "2", "--capacity", "256",
                              "--warmup-prompt-len", "40", "--compile-workers", "3"])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if "compiling" in l]
    assert code == 0 and len(lines) == len(calls) == 1, err
    assert "prompt buckets 16, 32, 64 (3 threads)" in lines[0] and "warm-up done" in err
    assert calls[0][2] == 3 and len(calls[0][0]) == 3
    built["app"].state.engine.shutdown(timeout=5)
    # a paged server with prefix caching: a hit prefills only a prompt's tail, so every bucket up to
    # the range's top compiles (65:128 alone would be bucket 128); without caching the range's own
    for flags, want in ((["--prefix-cache", "on"], "prompt buckets 16, 32, 64, 128 ("),
                        (["--prefix-cache", "off"], "prompt buckets 128 (")):
        code, built = quiet_main(["--model", cli_models[0], "--draft", cli_models[1], "--dtype", "float32",
                                  "--attention", "xla", "--port", str(_free_port()), "--slots", "2", "--capacity",
                                  "256", "--kv-pages", "40", "--warmup-prompt-len", "65:128", *flags])
        err = capsys.readouterr().err
        assert code == 0 and want in err, err
        built["app"].state.engine.shutdown(timeout=5)
    # --warmup-modes: the sampling programs too (an OpenAI client's default temperature is 1)
    calls.clear()
    code, built = quiet_main(["--model", cli_models[0], "--draft", cli_models[1], "--dtype", "float32",
                              "--attention", "xla", "--port", str(_free_port()), "--slots", "2", "--capacity", "256",
                              "--warmup-prompt-len", "40", "--warmup-modes", "greedy,sample,topp+penalties+grammar"])
    err = capsys.readouterr().err
    assert code == 0 and calls[0][1] == ("greedy", "sample", "topp+penalties+grammar"), (calls, err)
    assert "modes greedy, sample, topp+penalties+grammar (" in err, err
    built["app"].state.engine.shutdown(timeout=5)
    for bad in ("greedy,beam", ",", "sample+grammar+penalties"):
        with pytest.raises(SystemExit) as e:
            quiet_main(["--model", cli_models[0], "--draft", cli_models[1], "--port", str(_free_port()),
                        "--slots", "2", "--warmup-modes", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--warmup-modes:" in err and "choose from greedy, sample" in err, err


@pytest.mark.slow     # a Python that imports jax: seconds
def test_cli_without_the_serve_extra_says_what_to_install():
    code = ("import sys, runpy\n"
            "for m in ('fastapi', 'uvicorn'): sys.modules[m] = None\n"
            "sys.argv = ['serve', '--help']\n"
            "runpy.run_module('dflash_jax.serve', run_name='__main__')\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "pip install 'dflash-jax[serve]'" in p.stderr, p.stderr
    assert "fastapi" in p.stderr and "Traceback" not in p.stderr
