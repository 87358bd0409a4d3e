"""lm-evaluation-harness's requests against the server, scripted (issue 59): what its
`local-completions` model sends for a loglikelihood task and for a generate task, parsed as it
parses them (lm_eval 0.4.13, lm_eval/models/openai_completions.py: `_create_payload`,
`parse_logprobs`, `parse_generations`), without lm_eval installed.

    python scripts/lm_eval_smoke.py                      # serves the embedded pair in-process
    python scripts/lm_eval_smoke.py --url http://127.0.0.1:8000 --model NAME --tokenizer DIR
    python scripts/lm_eval_smoke.py --lm-eval            # and lm_eval itself, where it is importable

`--lm-eval` also runs lm_eval (`pip install "lm_eval[api]"`, not a dependency of this project) with
its `local-completions` model over two local tasks written to a temporary directory: a
multiple_choice task (loglikelihood requests, batched two prompts a request) and a generate_until
task.

Loglikelihood: prompt = context + continuation token ids (a batch of them), echo, logprobs 1,
max_tokens 1; the continuation's log-probability is the sum of token_logprobs[ctxlen:-1] and
is_greedy holds when each of its tokens is its position's top alternative. The same again with
max_tokens 0 (token_logprobs[ctxlen:]) must agree. A continuation the model itself generated
greedily must come back is_greedy. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXTS = ["The quick brown fox", "Once upon a time, there was", "def add(a, b):\n    return", "1, 2, 3, 4,"]
CONTINUATIONS = [" jumps over the lazy dog", " a little girl", " a + b", " 5, 6"]
SEED = 1234


def _post(url: str, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url + path, json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def loglikelihood_payload(model: str, prompts: list[list[int]], max_tokens: int = 1) -> dict:
    """lm_eval's LocalCompletionsAPI._create_payload(generate=False) (max_tokens 0: the variant
    other harnesses send)."""
    return {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": SEED, "echo": True}


def parse_logprobs(out: dict, ctxlens: list[int], drop_last: bool = True) -> list[tuple[float, bool]]:
    """lm_eval's parse_logprobs (drop_last=False: for max_tokens 0, nothing was generated)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0, "Context length must be greater than 0"
        end = -1 if drop_last else None
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:end]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def loglikelihood(url: str, model: str, requests: list[tuple[list[int], list[int]]]) -> dict:
    """(context ids, continuation ids) pairs, as one batched request each way: max_tokens 1 (lm_eval)
    and max_tokens 0. Returns {"max_tokens=1": [(logprob, is_greedy)], "max_tokens=0": [...]}."""
    prompts = [c + x for c, x in requests]
    ctxlens = [len(c) for c, _ in requests]
    one = _post(url, "/v1/completions", loglikelihood_payload(model, prompts, 1))
    zero = _post(url, "/v1/completions", loglikelihood_payload(model, prompts, 0))
    return {"max_tokens=1": parse_logprobs(one, ctxlens), "max_tokens=0": parse_logprobs(zero, ctxlens, False)}


def generate_until(url: str, model: str, contexts: list[str], until=("\n\n",), max_gen_toks: int = 32) -> list[str]:
    """lm_eval's _create_payload(generate=True) and parse_generations."""
    out = _post(url, "/v1/completions", {"prompt": contexts, "model": model, "max_tokens": max_gen_toks,
                                         "temperature": 0, "stop": list(until), "seed": SEED})
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def greedy_ids(url: str, model: str, context: list[int], n: int) -> list[int]:
    out = _post(url, "/v1/completions", {"prompt": context, "model": model, "max_tokens": n, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})
    return out["choices"][0]["token_ids"]


def run(url: str, model: str, tokenizer, out=sys.stdout) -> bool:
    """Every check against the server at url; prints a line per request, returns all passed."""
    ok = True
    reqs = [(list(tokenizer.encode(c)), list(tokenizer.encode(x))) for c, x in zip(CONTEXTS, CONTINUATIONS)]
    ctx = reqs[0][0]
    reqs.append((ctx, greedy_ids(url, model, ctx, 4)))      # the model's own greedy continuation
    res = loglikelihood(url, model, reqs)
    print(f"{'context':34} {'continuation':26} {'logprob (max_tokens 1)':>23} {'(max_tokens 0)':>15} greedy", file=out)
    for i, ((c, x), (lp1, g1), (lp0, g0)) in enumerate(zip(reqs, res["max_tokens=1"], res["max_tokens=0"])):
        print(f"{tokenizer.decode(c)!r:34.34} {tokenizer.decode(x)!r:26.26} {lp1:23.4f} {lp0:15.4f} {g1}", file=out)
        if abs(lp1 - lp0) > 1e-3 * max(1.0, abs(lp1)) or g1 != g0:
            print(f"  FAIL: max_tokens 1 and 0 disagree ({lp1} / {g1} vs {lp0} / {g0})", file=out)
            ok = False
    if not res["max_tokens=1"][-1][1]:
        print("  FAIL: the model's own greedy continuation is not is_greedy", file=out)
        ok = False
    for c, text in zip(CONTEXTS, generate_until(url, model, CONTEXTS)):
        print(f"generate_until {c!r:34.34} -> {text!r:.60}", file=out)
    print("lm-eval smoke: " + ("ok" if ok else "FAILED"), file=out)
    return ok


MC_DOCS = [{"context": "1, 2, 3, 4,", "choices": [" 5", " 9", " cat"], "label": 0},
           {"context": "The quick brown fox jumps over the lazy", "choices": [" dog", " car", " idea"], "label": 0},
           {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " none"], "label": 0},
           {"context": "Once upon a", "choices": [" time", " table", " seven"], "label": 0}]
GEN_DOCS = [{"context": "Question: What is 2 + 3?\nAnswer:", "answer": " 5"},
            {"context": "Question: What is 10 - 4?\nAnswer:", "answer": " 6"}]
TASKS = {"dflash_smoke_mc": ("mc.jsonl", MC_DOCS, """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_target: "{{label}}"
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
"""), "dflash_smoke_gen": ("gen.jsonl", GEN_DOCS, """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")}


def run_lm_eval(url: str, model: str, tokenizer_dir: str, out=sys.stdout) -> dict:
    """lm_eval's local-completions over TASKS (local data): its results dict."""
    import json
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    tmp = tempfile.mkdtemp(prefix="dflash-lm-eval-")
    for name, (data, docs, body) in TASKS.items():
        with open(os.path.join(tmp, data), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        with open(os.path.join(tmp, name + ".yaml"), "w") as f:
            f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                    f"{os.path.join(tmp, data)}\ntest_split: test\n{body}")
    args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
            f"tokenized_requests=True,num_concurrent=1,max_retries=1")
    res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=list(TASKS), batch_size=2,
                                  task_manager=TaskManager(include_path=tmp))
    print(make_table(res), file=out)
    return res


@contextlib.contextmanager
def _embedded_server():
    """The embedded pair served in-process (simple engine) on a free port: (url, model, tokenizer)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, HERE)
    import uvicorn
    from transformers import AutoTokenizer

    import dflash_jax as dj
    from dflash_jax import loading
    from dflash_jax.assets import default_pair
    from dflash_jax.serving.engine import SimpleEngine
    from dflash_jax.serving.server import build_app

    tp, dp = default_pair()
    target = dj.load_target(tp)
    draft = dj.load_draft(dp, target=target)
    tok = AutoTokenizer.from_pretrained(tp)
    engine = SimpleEngine(target, draft, capacity=1024, eos_token_ids=loading.stop_token_ids(tp, tok))
    app = build_app(engine, tok, model_name="dflash-default")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", "dflash-default", tok, tp
    finally:
        server.should_exit = True
        th.join(10)
        engine.shutdown(timeout=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: serve the embedded pair in-process)")
    p.add_argument("--model", help="the served model name (with --url)")
    p.add_argument("--tokenizer", help="the server's tokenizer directory or hub id (with --url)")
    p.add_argument("--lm-eval", action="store_true", help="also run lm_eval's local-completions on two local tasks")
    args = p.parse_args()
    if args.url:
        if not (args.model and args.tokenizer):
            p.error("--url needs --model and --tokenizer")
        from transformers import AutoTokenizer
        server = contextlib.nullcontext((args.url.rstrip("/"), args.model,
                                         AutoTokenizer.from_pretrained(args.tokenizer), args.tokenizer))
    else:
        server = _embedded_server()
    with server as (url, model, tok, tok_dir):
        ok = run(url, model, tok)
        if args.lm_eval:
            res = run_lm_eval(url, model, tok_dir)
            ok = ok and res["results"]["dflash_smoke_mc"]["acc,none"] is not None
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
