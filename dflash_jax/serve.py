"""`python -m dflash_jax.serve`: an OpenAI-compatible HTTP server around a serving engine.

    python -m dflash_jax.serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "2+2=", "max_tokens": 16, "temperature": 0}'

Routes: /v1/completions (a prompt string or token ids), /v1/chat/completions (the tokenizer's chat
template; `chat_template_kwargs: {"enable_thinking": false}` as vLLM), both streaming as server-sent
events ending in `data: [DONE]`; /v1/models, /health, /metrics (Prometheus).

This module is the thin host layer: it turns HTTP requests into `engine.Request`s, detokenises the
engine's committed tokens, cuts stop strings host-side (as vLLM does: the stop string and what follows
are not returned), and maps faults to HTTP answers: a bad field is 400 naming it (OpenAI's error JSON),
a full queue 503 with Retry-After, an engine fault 500 for that request only. A client that goes away
cancels its request. SIGTERM stops accepting, lets in-flight requests finish (up to
--shutdown-timeout), fails the rest and exits.
"""

import argparse
import asyncio
import collections
import json
import secrets
import signal
import sys
import threading
import time
import uuid
from typing import Any, Literal, Sequence, Union

from dflash_jax.engine import (EngineClosed, Finished, QueueFull, Request, RequestError, SimpleEngine, SlotEngine,
                               Tokens, parse_step_buckets)

__all__ = ["build_app", "build_parser", "main"]

MAX_STOP_STRINGS = 16


# ----------------------------------------------------------------------------------------- request models
def _models():
    """Pydantic request bodies (built lazily so that importing this module needs no pydantic)."""
    from pydantic import BaseModel, ConfigDict, Field

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0)
        top_p: float | None = Field(None, gt=0, le=1)
        top_k: int | None = Field(None, ge=-1)          # -1 or 0: off (vLLM uses -1)
        n: int = Field(1, ge=1)
        stream: bool = False
        stream_options: StreamOptions | None = None
        stop: Union[str, list[str], None] = None
        stop_token_ids: list[int] | None = None
        seed: int | None = None
        ignore_eos: bool = False
        skip_special_tokens: bool = True
        return_token_ids: bool = False                 # vLLM's extension: the generated ids per choice
        logprobs: Any = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0

    class CompletionBody(Common):
        prompt: Union[str, list[int], list[str], list[list[int]]]
        echo: bool = False

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: str
        content: Union[str, list[dict], None] = None

    class ChatBody(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        chat_template_kwargs: dict | None = None
        add_generation_prompt: bool = True

    return CompletionBody, ChatBody


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# ----------------------------------------------------------------------------------------- output text
class _Output:
    """Incremental text of one choice: detokenisation, the stop token left out of the text, stop
    strings cut host-side. Text that could still begin a stop string is held back while streaming."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], stop_ids: set[int], skip_special: bool):
        from dflash_jax.generate import StreamDecoder

        self.decoder = StreamDecoder(tokenizer, skip_special) if tokenizer is not None else None
        self.stops = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = stop_ids
        self.text = ""
        self.sent = 0
        self.tokens: list[int] = []
        self.stopped = False             # a stop string was found: generation should end

    def _decode(self, ids: list[int]) -> str:
        if self.decoder is None:
            return "".join(f"{t} " for t in ids)
        return self.decoder.push(ids)

    def _cut(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, max(0, start)) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def add(self, ids: list[int]) -> str:
        """Feed committed tokens; returns the text that may be sent now."""
        if self.stopped:
            return ""
        self.tokens.extend(ids)
        shown = [t for t in ids if t not in self.stop_ids]  # the stop token only ever ends a chunk
        before = len(self.text)
        self.text += self._decode(shown)
        self._cut(before - self.hold)
        end = len(self.text) if self.stopped else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def finish(self) -> str:
        if not self.stopped:
            before = len(self.text)
            if self.decoder is not None:
                self.text += self.decoder.flush()
            self._cut(before - self.hold)
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta


# ----------------------------------------------------------------------------------------- metrics
class _Metrics:
    def __init__(self, engine, block_size: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=lat, registry=r)
        self.tpot = Histogram("dflash_time_per_output_token_seconds", "(last - first token time) / (tokens - 1)",
                              buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                              registry=r)
        self.e2e = Histogram("dflash_request_latency_seconds", "request arrival to its end", buckets=lat, registry=r)
        self.tau = Histogram("dflash_acceptance_length", "tokens produced per draft-verify-accept iteration (tau)",
                             buckets=tuple(range(1, max(block_size, 1) + 1)), registry=r)
        self.generated = Counter("dflash_generation_tokens", "tokens generated", registry=r)
        self.prompt = Counter("dflash_prompt_tokens", "prompt tokens of started requests", registry=r)
        self.requests = Counter("dflash_requests", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("dflash_requests_rejected", "requests answered 4xx/5xx before running",
                                ["status"], registry=r)
        self._window: collections.deque = collections.deque()
        self._lock = threading.Lock()
        Gauge("dflash_tokens_per_second", "generated tokens per second over the last 10 s",
              registry=r).set_function(self.tokens_per_s)
        for name, doc, key in (("dflash_queue_depth", "requests waiting", "queue_depth"),
                               ("dflash_slots_busy", "slots running a request", "slots_busy"),
                               ("dflash_slots", "slots", "slots"),
                               ("dflash_compiles", "programs compiled by this process", "compiles")):
            Gauge(name, doc, registry=r).set_function(lambda key=key: getattr(engine.stats(), key))

    WINDOW_S = 10.0

    def tokens(self, n: int) -> None:
        self.generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n))
            while self._window and self._window[0][0] < now - self.WINDOW_S:
                self._window.popleft()

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            return sum(n for t, n in self._window if t >= now - self.WINDOW_S) / self.WINDOW_S


# ----------------------------------------------------------------------------------------- the app
def build_app(engine, tokenizer=None, *, model_name: str = "dflash", default_max_tokens: int = 16):
    """The FastAPI app serving `engine` (see dflash_jax.engine's interface) with `tokenizer` (an HF
    tokenizer, or None: token-id prompts only, token ids rendered as text)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    CompletionBody, ChatBody = _models()
    metrics = _Metrics(engine, engine.block_size)
    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.draining = engine, metrics, False
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        if e.status != 500:
            metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            api = ApiError(400, f"the body is not valid JSON: {err.get('msg', '')}")
        elif not loc:
            api = ApiError(400, f"the body must be a JSON object: {err.get('msg', '')}")
        else:
            # pydantic appends the union member it tried ("prompt.str"); name the field itself
            path = ".".join(x for x in loc if not x.startswith(("list[", "str", "int", "float", "bool")))
            api = _bad(loc[0], f"{err.get('msg', 'invalid value')} (at {path or loc[0]})")
        return await _api_error(None, api)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    # ---- routes
    @app.get("/health")
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        st = engine.stats()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                             "owned_by": "dflash-jax", "max_model_len": st.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        t0 = time.perf_counter()
        _check_common(body)
        if body.echo:
            raise _bad("echo", "is not supported")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _bad("prompt", "batched prompts are not supported; send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise _bad("prompt", "this server has no tokenizer; send token ids")
            ids = list(tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise _bad("prompt", "is empty")
        return await _run(body, ids, body.max_tokens or default_max_tokens, http, t0, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        t0 = time.perf_counter()
        _check_common(body)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise _bad("messages", "this server's tokenizer has no chat template; use /v1/completions")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.get("type") != "text" for p in content):
                    raise _bad("messages", f"message {i}: only text content parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 **(body.chat_template_kwargs or {}))
        except Exception as e:  # a template's own refusals (roles out of order, ...)
            raise _bad("messages", f"the chat template refused them: {e}") from None
        # the template already holds every special token; encode must not add BOS again
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context
            max_tokens = max(1, engine.stats().max_model_len - len(ids))
        return await _run(body, ids, max_tokens, http, t0, chat=True)

    # ---- shared request path
    def _check_common(body) -> None:
        if app.state.draining:
            raise ApiError(503, "the server is shutting down", type_="service_unavailable")
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model: '{body.model}' is not served here (serving '{model_name}')",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise _bad("n", "only n = 1 is supported")
        if body.logprobs not in (None, False):
            raise _bad("logprobs", "is not supported")
        for f in ("presence_penalty", "frequency_penalty"):
            if getattr(body, f):
                raise _bad(f, "is not supported (only 0)")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")

    def _engine_request(body, ids, max_tokens) -> Request:
        temperature = 1.0 if body.temperature is None else body.temperature
        return Request(prompt=tuple(ids), max_tokens=max_tokens, temperature=temperature,
                       top_p=1.0 if body.top_p is None else body.top_p,
                       top_k=max(0, body.top_k or 0),
                       seed=secrets.randbits(31) if body.seed is None else body.seed,
                       stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)

    async def _run(body, ids, max_tokens, http, t0, *, chat: bool):
        req = _engine_request(body, ids, max_tokens)
        try:
            handle = engine.submit(req)
        except RequestError as e:
            raise _bad(e.field, e.message) from None
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry later", type_="service_unavailable", headers={"Retry-After": "1"})
        except EngineClosed as e:
            raise ApiError(503, str(e), type_="service_unavailable")
        metrics.prompt.inc(len(ids))
        stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(engine.eos_token_ids))
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = _Output(tokenizer, stops, stop_ids, body.skip_special_tokens)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        timing = _Timing(t0)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(handle, out, ident, chat, body.return_token_ids, include_usage,
                                             timing, len(ids)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        fin = None
        try:
            while fin is None:
                try:
                    ev = await asyncio.wait_for(handle.anext(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        engine.cancel(handle)
                        return Response(status_code=499)
                    continue
                if isinstance(ev, Tokens):
                    timing.tokens(len(ev.ids))
                    metrics.tokens(len(ev.ids))
                    out.add(ev.ids)
                    if out.stopped:
                        engine.cancel(handle)
                else:
                    fin = ev
        finally:
            if not handle.done:
                engine.cancel(handle)
        reason = _reason(fin, out)
        timing.observe(metrics, fin, reason)
        if reason == "error":
            raise ApiError(500, f"the request failed: {fin.error}")
        out.finish()
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if body.return_token_ids:
            choice["token_ids"] = list(out.tokens)
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": _usage(len(ids), len(out.tokens)),
                "dflash": _dflash_stats(fin)}

    async def _stream(handle, out: _Output, ident, chat, return_ids, include_usage, timing, n_prompt):
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())

        def chunk(text: str | None, reason=None, ids=None, role=False, **extra) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if return_ids and ids is not None:
                c["token_ids"] = ids
            payload = {"id": ident, "object": obj, "created": now, "model": model_name, "choices": [c], **extra}
            return f"data: {json.dumps(payload)}\n\n"

        fin = None
        try:
            if chat:
                yield chunk(None, role=True)
            async for ev in handle.aevents():
                if isinstance(ev, Tokens):
                    timing.tokens(len(ev.ids))
                    metrics.tokens(len(ev.ids))
                    delta = out.add(ev.ids)
                    if delta or return_ids:
                        yield chunk(delta, ids=list(ev.ids))
                    if out.stopped:
                        engine.cancel(handle)
                else:
                    fin = ev
            reason = _reason(fin, out)
            timing.observe(metrics, fin, reason)
            if reason == "error":
                err = ApiError(500, f"the request failed: {fin.error}").body()
                yield f"data: {json.dumps(err)}\n\n"
            else:
                rest = out.finish()
                if rest:
                    yield chunk(rest, ids=[])
                yield chunk(None if chat else "", reason=reason, ids=[], dflash=_dflash_stats(fin))
                if include_usage:
                    usage = {"id": ident, "object": obj, "created": now, "model": model_name, "choices": [],
                             "usage": _usage(n_prompt, len(out.tokens))}
                    yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or we are done
            if not handle.done:
                engine.cancel(handle)

    return app


def _reason(fin: Finished, out: _Output) -> str:
    if out.stopped:
        return "stop"
    return fin.finish_reason


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _dflash_stats(fin: Finished) -> dict:
    s = fin.stats
    return {"iterations": s.iterations, "mean_acceptance_length": round(s.mean_acceptance_length, 4)}


class _Timing:
    """Per-request host timestamps for TTFT / TPOT (from the request's arrival at the server)."""

    def __init__(self, t0: float):
        self.t0, self.first, self.last, self.n = t0, None, None, 0

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last, self.n = now, self.n + n

    def observe(self, m: _Metrics, fin: Finished, reason: str) -> None:
        m.requests.labels(reason).inc()
        m.e2e.observe(time.perf_counter() - self.t0)
        if self.first is not None:
            m.ttft.observe(self.first - self.t0)
            if self.n > 1:
                m.tpot.observe((self.last - self.first) / (self.n - 1))
        for a in fin.stats.acceptance_lengths:
            m.tau.observe(a)


# ----------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.generate import add_model_args

    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.serve",
        description="OpenAI-compatible HTTP server for a Qwen3 target with a DFlash draft.",
        epilog="Example: python -m dflash_jax.serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 "
               "--port 8000")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    g.add_argument("--slots", type=int, default=1,
                   help="requests decoded at once (> 1: the continuous-batching slot engine; 1: one at a time)")
    g.add_argument("--engine-steps", type=int, default=4,
                   help="loop iterations per engine step between admissions (--slots > 1)")
    g.add_argument("--insert-width", type=int, default=None,
                   help="most arrivals prefilled in one call (--slots > 1; default min(slots, 8))")
    g.add_argument("--engine-pipeline", type=int, default=1,
                   help="engine steps dispatched ahead of the one whose tokens are read (0: wait for each)")
    g.add_argument("--step-buckets", default="auto", metavar="auto|none|N,N,...",
                   help="row counts an engine step may run over (the smallest holding the busy slots; --slots "
                        "always one): auto = powers of two up to --slots, none = every step over all slots")
    g.add_argument("--warmup-prompt-len", default="512", metavar="N|LO:HI",
                   help="compile the slot engine's programs for prompts up to N tokens (or of LO..HI) at start; 0: none")
    g.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 503")
    g.add_argument("--capacity", type=int, default=4096,
                   help="KV-cache entries per slot: prompt + max_tokens + one block must fit")
    g.add_argument("--default-max-tokens", type=int, default=16,
                   help="max_tokens of a completion that gives none (chat: the rest of the context)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--seed", type=int, default=0, help="random weights' seed with --random-init")
    return p


def _default_pair():
    """(target_dir, draft_dir) of the pair embedded in the package, or None."""
    try:
        from dflash_jax.assets import default_pair
    except ImportError:
        return None
    return default_pair()


def _cli():
    """The generate CLI module (its flag, loading and stop-id helpers); the package attribute of the
    same name may be the library function."""
    import importlib
    return importlib.import_module("dflash_jax.generate")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    cli = _cli()

    if args.model is None and args.random_init is None:
        pair = _default_pair()
        if pair is None:
            parser.error("give --model (a hub id or a local HF directory) and --draft, or --random-init PRESET "
                         "(this package ships no default pair)")
        args.model, default_draft = pair
        args.draft = args.draft or default_draft
        args.served_model_name = args.served_model_name or "dflash-default"
    # check_args also validates the sampling flags, which are per request here
    args.max_new_tokens, args.temperature, args.top_p, args.top_k = 1, 0.0, 1.0, 0
    args.stop_token_ids = None   # per request here
    cli.check_args(parser, args)
    if args.slots < 1:
        parser.error(f"--slots must be >= 1, got {args.slots}")
    if args.engine_steps < 1:
        parser.error(f"--engine-steps must be >= 1, got {args.engine_steps}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.insert_width is not None and args.insert_width < 1:
        parser.error(f"--insert-width must be >= 1, got {args.insert_width}")
    if args.engine_pipeline < 0:
        parser.error(f"--engine-pipeline must be >= 0, got {args.engine_pipeline}")
    try:
        lo, _, hi = str(args.warmup_prompt_len).rpartition(":")
        args.warmup_prompt_len = (int(lo), int(hi)) if lo else int(hi)
        if min(args.warmup_prompt_len if lo else (args.warmup_prompt_len,)) < 0:
            raise ValueError
    except ValueError:
        parser.error(f"--warmup-prompt-len must be N or LO:HI (token counts >= 0), got {args.warmup_prompt_len!r}")
    try:
        args.step_buckets = parse_step_buckets(args.step_buckets)
    except ValueError as e:
        parser.error(f"--step-buckets: {e}")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")


def _load(parser, args):
    """(target, draft, tokenizer, eos ids, served name) from the flags."""
    cli = _cli()

    tokenizer = cli.load_tokenizer(parser, args)
    target, draft = cli.load_models(parser, args)
    eos = [] if args.random_init else cli.stop_token_ids(args.model, tokenizer)
    name = args.served_model_name or args.model or f"random-init:{args.random_init}"
    return target, draft, tokenizer, eos, name


def _server(config, app):
    """A uvicorn.Server that marks the app as draining the moment SIGTERM / SIGINT arrives, so that
    requests on open keep-alive connections get 503 while in-flight ones finish."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.draining = True
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

XX

    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    target, draft, tokenizer, eos, name = _load(parser, args)
    block = None if draft is None else (args.block_size or draft.config.block_size)
    try:
        if args.slots > 1:
            engine = SlotEngine(target, draft, slots=args.slots, capacity=args.capacity, max_queue=args.max_queue,
                                eos_token_ids=eos, block_size=block, attention_impl=args.attention,
                                steps=args.engine_steps, insert_width=args.insert_width,
                                pipeline=args.engine_pipeline, warmup_prompt_len=args.warmup_prompt_len,
                                step_buckets=args.step_buckets)
        else:
            engine = SimpleEngine(target, draft, capacity=args.capacity, max_queue=args.max_queue,
                                  eos_token_ids=eos, block_size=block, attention_impl=args.attention)
    except ValueError as e:
        parser.error(str(e))
    app = build_app(engine, tokenizer, model_name=args.served_model_name or name,
                    default_max_tokens=args.default_max_tokens)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off")
    server = _server(config, app)
    print(f"[dflash] serving {name} on http://{args.host}:{args.port} (capacity {args.capacity}, "
          f"block {engine.block_size}, {args.slots} slot(s))", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has drained; these handlers absorb it so
    # that the engine is shut down and the process exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        # uvicorn has drained (up to --shutdown-timeout): wait for the engine's thread to leave the
        # device, then free the device state and the compiled programs while the runtime is still
        # up, so nothing on the device is torn down by interpreter exit.
        engine.shutdown(timeout=args.shutdown_timeout)
        del engine, app, server, target, draft
        _release_device()
    print("[dflash] server stopped", file=sys.stderr, flush=True)
    return 0


def _release_device() -> None:
    import gc

    import jax

    from dflash_jax import decode

    decode.clear_compiled()
    jax.clear_caches()
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())
