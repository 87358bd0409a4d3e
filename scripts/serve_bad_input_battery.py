"""The server's bad-input battery (issue 33): each case is one HTTP request with one bad field (or a
10 MB body), sent to the app of the dflash_jax under ROOT over tests/test_serve.py's stand-in
engine, and classed by its answer:

  clean    400 naming the field (413 for the body)
  silent   2xx: the field was ignored or coerced
  httpNNN  any other status
  hang     no answer within 5 s (a request stuck behind a frozen event loop counts too)

    JAX_PLATFORMS=cpu python scripts/serve_bad_input_battery.py [ROOT]

ROOT (default: this checkout) may be another checkout (`git archive <commit> | tar -x -C DIR`) for
counts before and after a change; the battery's cases and the test helpers come from this one.
"""

import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
COMMON = [("repetition_penalty", 1.1), ("min_p", 0.05), ("response_format", {"type": "json_object"}),
          ("top_logprobs", 2), ("best_of", 2), ("logit_bias", {"5": 500}), ("min_tokens", 3),
          ("guided_json", {"type": "object"}), ("max_tokens", "8"), ("max_tokens", True), ("max_tokens", 8.0),
          ("stream", "yes"), ("stream", 1), ("temperature", "0.5"), ("temperature", True), ("seed", "1"),
          ("ignore_eos", "true"), ("stop_token_ids", ["5"]), ("top_k", 1.0),
          ("stream_options", {"include_usage": "yes"}), ("top_k", 321)]


def cases():
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    out = [("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, k: v}, k) for k, v in COMMON]
    out += [("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "suffix": "x"}, "suffix"),
            ("/v1/completions", {"prompt": [1, True], "max_tokens": 2}, "prompt"),
            ("/v1/completions", {"prompt": ["1", 2], "max_tokens": 2}, "prompt")]
    out += [("/v1/chat/completions", {**chat, k: v}, k) for k, v in COMMON]
    out += [("/v1/chat/completions", {**chat, **extra}, field) for extra, field in (
        (dict(tools=[{"type": "function", "function": "f"}]), "tools[0]"),
        (dict(tool_choice="required"), "tool_choice"), (dict(max_completion_tokens="4"), "max_completion_tokens"),
        (dict(messages=[{"role": "user", "content": 5}]), "messages"), (dict(chat_template=LOOP), "chat_template"),
        (dict(chat_template_kwargs={"chat_template": LOOP}), "chat_template"),
        (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize"))]
    return out


def main() -> None:
    root = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else HERE
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [root, HERE]
    import tempfile

    import httpx

    from dflash_jax.serving.server import build_app
    from tests.test_cli import write_tokenizer
    from tests.test_serve import FakeGenerate, fake_engine, serving

    tok = write_tokenizer(tempfile.mkdtemp())
    counts = collections.Counter()
    with serving(build_app(fake_engine(FakeGenerate()), tok, model_name="tiny")) as url:
        for path, body, field in cases() + [("/v1/completions", None, "body")]:
            try:
                if body is None:   # 10 MB of prompt text
                    r = httpx.post(url + path, content=json.dumps({"prompt": "a " * 5_000_000, "max_tokens": 2}),
                                   headers={"content-type": "application/json"}, timeout=5)
                    c = "clean" if r.status_code == 413 else None
                else:
                    r = httpx.post(url + path, json=body, timeout=5)
                    c = "clean" if r.status_code == 400 and field.split(".")[0] in r.text else None
                c = c or ("silent" if r.status_code == 200 else f"http{r.status_code}")
            except httpx.TimeoutException:
                c = "hang"
            counts[c] += 1
            if c != "clean":
                print(f"{c:8} {path} {json.dumps(body)[:100] if body else '10 MB body'}")
    print(json.dumps(dict(counts)), "of", sum(counts.values()), flush=True)
    os._exit(0)   # a hung template may still hold the old server's event-loop thread


if __name__ == "__main__":
    main()
