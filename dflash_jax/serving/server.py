"""`python -m dflash_jax.serve`: an OpenAI-compatible HTTP server around a serving engine.

    python -m dflash_jax.serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "2+2=", "max_tokens": 16, "temperature": 0}'

Routes: /v1/completions (a prompt string or token ids), /v1/chat/completions (the tokenizer's chat
template; `chat_template_kwargs: {"enable_thinking": false}` as vLLM), both streaming as server-sent
events ending in `data: [DONE]`; /v1/models, /health, /metrics (Prometheus).

OpenAI's extras: `n` choices (one engine request each; sampled choices seeded from the request's
seed, `_choice_seed`), batched prompts on /v1/completions (choices prompt-major x n), `logprobs` /
`top_logprobs` (<= 20) and `echo` (with `max_tokens: 0`: the prompt's logprobs alone, as
lm-evaluation-harness asks). Log-probabilities are the target's raw log_softmax (before temperature,
vLLM's default), from a scoring forward over prompt + output once the engine has the tokens
(dflash_jax.serving.scoring); a stream with logprobs sends each choice's tokens once they are scored.
`presence_penalty` / `frequency_penalty`, `logit_bias` and `min_tokens` adjust the target's
distribution inside the on-device loop (dflash_jax.penalties: exact, speculative or not).

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
import errno
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Literal, Sequence, Union

from dflash_jax import loading, validation
from dflash_jax.serving import multihost_serve
from dflash_jax.serving.engine import (EngineClosed, Finished, QueueFull, Request, RequestError, SimpleEngine, SlotEngine,
                               Tokens, parse_step_buckets)
from dflash_jax.serving.scoring import MAX_TOP_LOGPROBS

__all__ = ["build_app", "build_parser", "main"]

MAX_STOP_STRINGS = 16
# choices per prompt (OpenAI's limit)
MAX_N = 128
# a log-probability JSON can carry in place of -inf (vLLM's)
MIN_LOGPROB = -9999.0
# --capacity when not given (capped at the model's context + one block)
DEFAULT_CAPACITY = 4096
# A request body larger than this is refused (413) before it is parsed (--max-body-bytes). 8 MiB
# holds a 128k-token prompt as text or as JSON token ids with room to spare.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# How often a non-streaming request checks that its client is still connected.
DISCONNECT_POLL_S = 0.1
# A chat template is a program: a render (the model's template or, with --trust-request-chat-template,
# a request's own) that runs longer than this or writes more text than this is abandoned with a 400.
TEMPLATE_TIMEOUT_S = 10.0
TEMPLATE_MAX_CHARS = 8 << 20


# ----------------------------------------------------------------------------------------- request models
def _models():
    """Pydantic request bodies (built lazily so that importing this module needs no pydantic).

    Strict types: a JSON string is not a number and a number is not a bool (`"max_tokens": "8"`,
    `"stream": "yes"`, `"max_tokens": true` are 400s, as a client bug should be). Fields of the
    OpenAI / vLLM APIs that this server does not implement are declared so that a non-default value
    is refused by name (`_UNSUPPORTED`) instead of being ignored; unknown fields are ignored."""
    from pydantic import BaseModel, ConfigDict, Field

    class StreamOptions(BaseModel):
        model_config = ConfigDict(strict=True)
        include_usage: bool = False

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0)
        top_p: float | None = Field(None, gt=0, le=1)
        top_k: int | None = Field(None, ge=-1)          # -1 or 0: off (vLLM uses -1)
        n: int = Field(1, ge=1, le=MAX_N)
        stream: bool = False
        stream_options: StreamOptions | None = None
        stop: Union[str, list[str], None] = None
        stop_token_ids: list[int] | None = None
        seed: int | None = None
        ignore_eos: bool = False
        skip_special_tokens: bool = True
        return_token_ids: bool = False                 # vLLM's extension: the generated ids per choice
        logprobs: Any = None                           # completions: an int (top-k); chat: a bool
        top_logprobs: Any = None                       # chat: alternatives per token (with logprobs: true)
        presence_penalty: float = 0.0                  # ranges: penalties.problem (the engine's check)
        frequency_penalty: float = 0.0
        min_tokens: int = 0
        logit_bias: Any = None                         # {"token id": bias}: _logit_bias
        # not implemented: refused unless at their default (_UNSUPPORTED)
        repetition_penalty: float = 1.0
        min_p: float = 0.0
        prompt_logprobs: Any = None                    # vLLM's: alternatives per prompt position (0..20)
        response_format: Any = None                    # text, json_object, json_schema (dflash_jax.serving.grammar)
        best_of: Any = None
        use_beam_search: Any = None
        length_penalty: Any = None
        include_stop_str_in_output: Any = None
        guided_json: Any = None
        guided_regex: Any = None
        guided_choice: Any = None
        guided_grammar: Any = None
        structured_outputs: Any = None
        truncate_prompt_tokens: Any = None

    class CompletionBody(Common):
        prompt: Union[str, list[int], list[str], list[list[int]]]
        max_tokens: int | None = Field(None, ge=0)     # 0: with echo, the prompt's logprobs alone
        echo: bool = False
        suffix: Any = None
        # chat's tool fields, refused here too rather than ignored (_UNSUPPORTED)
        tools: Any = None
        tool_choice: Any = None
        functions: Any = None
        function_call: Any = None

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        role: str
        content: Union[str, list[dict], None] = None

    class ChatBody(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        chat_template: str | None = None
        chat_template_kwargs: dict | None = None
        add_generation_prompt: bool = True
        tools: Any = None
        tool_choice: Any = None
        functions: Any = None
        function_call: Any = None
        parallel_tool_calls: Any = None
        continue_final_message: Any = None
        documents: Any = None

    return CompletionBody, ChatBody


# Declared request fields this server does not implement, and the values that mean "not used" (a
# client may send those; anything else is a 400 naming the field).
_UNSUPPORTED = {
    "repetition_penalty": (1, 1.0), "min_p": (0, 0.0),

    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False), "guided_grammar": (None,),
    "truncate_prompt_tokens": (None,), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, False, True), "continue_final_message": (None, False), "documents": (None, []),
}


# Chat's tool fields this server serves (dflash_jax.serving.grammar: a forced call is decoded under a grammar;
# "auto" leaves the model free and parses its tool calls); /v1/completions refuses them
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


# Fields that change the sampled distribution per step: they belong in the on-device loop (target and
# draft alike, so that sampling stays exact), which does not have them yet.
_LOOP_FIELDS = ("repetition_penalty", "min_p")
_NEEDS_LOOP = ("it changes the distribution the on-device loop samples from (for the target and the draft "
               "alike), which this server does not do yet")


def _completion_logprobs(body) -> int | None:
    """/v1/completions' `logprobs`: alternatives per token (0..MAX_TOP_LOGPROBS), None: not asked."""
    if not _is_default(body.top_logprobs, (None, 0)):
        raise _bad("top_logprobs", "is a chat field; /v1/completions takes the number of alternatives in logprobs")
    lp = body.logprobs
    if lp is None or lp is False:
        return None
    if type(lp) is not int or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise _bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), "
                               f"got {lp!r:.40}")
    return lp


def _prompt_logprobs(body) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt position (0..MAX_TOP_LOGPROBS), None: not asked."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise _bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r:.40}")
    return k


def _chat_logprobs(body) -> int | None:
    """Chat's `logprobs` (a bool) and `top_logprobs` (0..MAX_TOP_LOGPROBS): alternatives per token,
    None: not asked."""
    lp, k = body.logprobs, body.top_logprobs
    if lp is not None and type(lp) is not bool:
        raise _bad("logprobs", f"must be a boolean in a chat request (the number of alternatives is "
                               f"top_logprobs), got {lp!r:.40}")
    if k is not None and (type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r:.40}")
    if not lp:
        if k:
            raise _bad("top_logprobs", "needs logprobs: true")
        return None
    return k or 0


def _choice_seed(seed: int, j: int) -> int:
    """The sampling seed of choice j of a request seeded `seed`: choice 0 keeps it (n = 1 is the
    plain request), the others get distinct seeds derived from it (splitmix64), so n choices are
    reproducible and a batched prompt's choices equal a separate request's."""
    if j == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + j * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2 ** 64 - 1)
    return (x ^ (x >> 31)) % (2 ** 31)


def _logit_bias(value) -> tuple:
    """A request's logit_bias ({"token id": bias}, OpenAI's JSON keys are strings) as (id, bias)
    pairs; the ids' vocabulary, the values' range and the entry count are the engine's check."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad("logit_bias", "must be an object mapping token ids to biases")
    out = []
    for k, v in value.items():
        try:
            tid = int(k)
        except ValueError:
            raise _bad("logit_bias", f"key {k!r:.40} is not a token id") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad("logit_bias", f"value {v!r:.40} for token {k!r:.40} is not a number")
        out.append((tid, float(v)))
    return tuple(out)


def _guided(body) -> tuple | None:
    """(field, kind, value) of vLLM's guided decoding fields (structured_outputs {"json" | "regex" |
    "choice": ...}, or the older guided_json / guided_regex / guided_choice); None when absent."""
    so = body.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "must be an object with one of json, regex, choice")
        given = [k for k, v in so.items() if v is not None]
        bad = [k for k in given if k not in ("json", "regex", "choice")]
        if bad:
            raise _bad(f"structured_outputs.{bad[0]}", "is not supported by this server (json, regex and choice are)")
        if len(given) != 1:
            raise _bad("structured_outputs", "must hold exactly one of json, regex, choice")
        return "structured_outputs", given[0], so[given[0]]
    old = [(f"guided_{k}", k, getattr(body, f"guided_{k}")) for k in ("json", "regex", "choice")
           if getattr(body, f"guided_{k}") is not None]
    if len(old) > 1:
        raise _bad(old[1][0], f"cannot be combined with {old[0][0]}")
    if old and old[0][1] == "json" and not isinstance(old[0][2], dict):
        raise _bad("guided_json", "must be a JSON schema object")
    return old[0] if old else None


def _constrains(body, chat: bool, guided=()) -> bool:
    """A grammar decides the request's output: a response_format other than text, a forced tool
    call (chat), or a guided field (`guided`: _guided(body) when the caller has it)."""
    tools = getattr(body, "tools", None) if chat else None
    forced = bool(tools) and getattr(body, "tool_choice", None) not in (None, "auto", "none")
    guided = _guided(body) if guided == () else guided
    return not _is_default(body.response_format, (None, {"type": "text"})) or forced or guided is not None


def _tool_list(tools) -> list[dict]:
    """A chat request's `tools` checked for the shape OpenAI sends ({"type": "function", "function":
    {"name": ..., "parameters": {...}}}); a 400 naming the entry otherwise."""
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} entries")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                      "\"parameters\": {...}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}].function.name", "must be a non-empty string")
    return tools


def _tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of an answer: Qwen3's <tool_call> blocks become calls."""
    from dflash_jax.serving.grammar import parse_tool_calls

    content, calls = parse_tool_calls(text)
    out = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return (content or None) if out else text, out


def _is_default(value, defaults) -> bool:
    # by type too: `true` is not the 1 of best_of, `0.0` not the 0 of a count
    return any(value is d if d is None else (type(value) is type(d) and value == d) for d in defaults)

# Arguments of transformers' apply_chat_template that a request's chat_template_kwargs must not
# reach (they change what the call returns or which template runs, not what the template sees).
_TEMPLATE_CALL_ARGS = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


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


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _RenderAbandoned(BaseException):
    """Raised inside an abandoned render thread (BaseException: a template's or jinja2's own
    `except Exception` does not swallow it)."""


class _TooLong(Exception):
    pass


def _stop_thread(th: threading.Thread) -> None:
    """Make `th` raise _RenderAbandoned at its next bytecode: a template's loops are Python code,
    so an abandoned render stops instead of spinning on for hours."""
    import ctypes

    if th.ident is not None and th.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(th.ident), ctypes.py_object(_RenderAbandoned))


def _cap_template_output(template, max_chars: int) -> None:
    """Make the compiled jinja2 template of `template` (transformers caches one environment per
    template) refuse, while it renders, an output over `max_chars` characters: a loop writing
    gigabytes fails when it passes the limit, not when memory runs out."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        env = _compile_jinja_template(template).environment
    except Exception:  # another transformers: the rendered text's length is still checked
        return
    if getattr(env.concat, "_max_chars", None) == max_chars:
        return

    def concat(parts):
        out, n = [], 0
        for part in parts:
            n += len(part)
            if n > max_chars:
                raise _TooLong()
            out.append(part)
        return "".join(out)

    concat._max_chars = max_chars
    env.concat = concat


async def _abandonable(work, timeout: float):
    """`work()` in a daemon thread, awaited for at most `timeout` seconds. Past it the thread is
    stopped (see _stop_thread) and abandoned, and TimeoutError raised: a render that never ends
    holds neither this request nor, being a daemon, the process's exit."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(ok, value):
        if not done.done():
            done.set_result(value) if ok else done.set_exception(value)

    def run():
        try:
            ok, value = True, work()
        except _RenderAbandoned:
            return
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting request
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed (the server stopped)
            pass

    th = threading.Thread(target=run, name="dflash-render", daemon=True)
    th.start()
    try:
        return await asyncio.wait_for(done, timeout)
    except asyncio.TimeoutError:
        _stop_thread(th)
        raise TimeoutError from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         f"(--max-body-bytes)", type_="invalid_request_error")


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes is answered 413, from its Content-Length before a
    byte of it is read, or (chunked) as soon as the bytes received pass the limit."""

    def __init__(self, app, limit: int, on_refuse=None):
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:   # FastAPI passes an HTTPException from here on as it is
                    from starlette.exceptions import HTTPException
                    raise HTTPException(413, _too_large(self.limit).message)
            return msg

        await self.app(scope, limited, send)

    async def _refuse(self, send):
        err = _too_large(self.limit)
        if self.on_refuse is not None:
            self.on_refuse(err)
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------------------- output text
class _Output:
    """Incremental text of one choice: detokenisation, the stop token left out of the text, stop
    strings cut host-side. Text that could still begin a stop string is held back while streaming."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], stop_ids: set[int], skip_special: bool):
        from dflash_jax.cli.generate import StreamDecoder

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


class _Choice:
    """One choice of a response: its prompt, engine request and handle (None: max_tokens 0), its
    text, and (streaming logprobs) the tokens whose logprobs were sent and the text waiting for them."""

    def __init__(self, index: int, prompt: list[int], request: Request, out: _Output, timing: "_Timing"):
        self.index, self.prompt, self.request, self.out, self.timing = index, prompt, request, out, timing
        self.handle = None
        self.fin: Finished | None = None
        self.sent = 0                    # output tokens whose logprobs were sent (streaming)
        self.offset = 0                  # completions' text_offset of the next token
        self.pending_text, self.pending_ids = "", []


def _entries(seq: list[int], first: int, scores, k: int, *, first_null: bool) -> list[tuple]:
    """(token id, logprob or None, [(id, logprob)] * k or None) of seq[first:] from its Scores
    (scoring.Scorer over seq from `first`), led by seq[0] without a logprob when first_null (echo:
    nothing precedes the first prompt token)."""
    out: list[tuple] = [(seq[0], None, None)] if first_null else []
    if scores is None:
        return out
    for i, t in enumerate(seq[first:]):
        top = [(int(a), max(float(b), MIN_LOGPROB)) for a, b in zip(scores.top_ids[i, :k], scores.top_logprobs[i, :k])]
        out.append((t, max(float(scores.token_logprobs[i]), MIN_LOGPROB), top))
    return out


def _byte_level_chars() -> dict[str, int]:
    """A byte-level BPE's printable stand-in character of each byte -> the byte (GPT-2's map)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class _LogprobFormat:
    """Token strings and OpenAI's two logprobs layouts (completions' parallel lists, chat's content
    entries) of `_entries` lists. A token's string is its own decode (special tokens shown); its
    bytes, for a byte-level BPE, the bytes it stands for (a token holding part of a character
    decodes to U+FFFD, its bytes are exact)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_map = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and "ByteLevel" in type(backend.decoder).__name__ + repr(backend.decoder)[:200]:
            self._byte_map = _byte_level_chars()

    def text(self, t: int) -> str:
        s = self._text.get(t)
        if s is None:
            s = f"{t} " if self.tokenizer is None else self.tokenizer.decode([t], skip_special_tokens=False)
            self._text[t] = s
        return s

    def bytes(self, t: int) -> list[int]:
        b = self._bytes.get(t)
        if b is None:
            b = list(self.text(t).encode("utf-8"))
            if self._byte_map is not None:
                piece = self.tokenizer.convert_ids_to_tokens(t)
                if isinstance(piece, str) and all(ch in self._byte_map for ch in piece):
                    b = [self._byte_map[ch] for ch in piece]
            self._bytes[t] = b
        return b

    def completion(self, entries, offset: int = 0) -> tuple[dict, int]:
        """({tokens, token_logprobs, top_logprobs, text_offset}, the offset after them)."""
        tokens, lps, tops, offsets = [], [], [], []
        for t, lp, top in entries:
            s = self.text(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            lps.append(lp)
            # keyed by string: of tokens that decode alike (U+FFFD, ...) the likeliest stays
            tops.append(None if top is None else {s: v for s, v in reversed([(self.text(a), v) for a, v in top])})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def prompt(self, prompt: list[int], scores, k: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per position a dict keyed by token id
        of {logprob, rank, decoded_token}: the prompt's token (its exact rank among the vocabulary)
        and the k likeliest."""
        out: list = [None]
        for i, t in enumerate(prompt[1:]):
            d = {str(int(a)): {"logprob": max(float(v), MIN_LOGPROB), "rank": j + 1, "decoded_token": self.text(int(a))}
                 for j, (a, v) in enumerate(zip(scores.top_ids[i, :k], scores.top_logprobs[i, :k]))}
            d[str(t)] = {"logprob": max(float(scores.token_logprobs[i]), MIN_LOGPROB), "rank": int(scores.ranks[i]),
                         "decoded_token": self.text(t)}
            out.append(d)
        return out

    def chat(self, entries) -> dict:
        def one(t, lp):
            return {"token": self.text(t), "logprob": lp, "bytes": self.bytes(t)}
        return {"content": [{**one(t, lp), "top_logprobs": [one(a, v) for a, v in top or ()]}
                            for t, lp, top in entries], "refusal": None}


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
        r.register(_EngineCounters(engine))

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


class _EngineCounters:
    """The engine's cumulative counters under vLLM's metric names and meanings, so a vLLM user's
    dashboards and checks read them unchanged: prefix-cache queries and hits (tokens), KV pages
    used / total, preemptions, and the speculative counters (acceptance length = 1 + accepted /
    drafts between two scrapes, the engine's tau)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        st = self.engine.stats()
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache", st.prefix_queries_tokens),
                ("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", st.prefix_hits_tokens),
                ("vllm:num_preemptions", "requests preempted for KV pages (recomputed later)", st.preemptions),
                ("vllm:spec_decode_num_drafts", "draft-verify iterations", st.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens", "draft tokens proposed", st.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted", st.spec_accepted)):
            yield CounterMetricFamily(name, doc, value=value)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted at each block position", labels=["position"])
        for i, n in enumerate(st.spec_accepted_per_pos):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        for name, doc, value in (
                ("dflash_engine_steps", "engine steps dispatched", st.engine_steps),
                ("dflash_engine_slot_steps", "busy slots of the engine's steps, summed (/ steps: rows a step ran)",
                 st.engine_slot_steps),
                ("dflash_engine_inserts", "requests prefilled into slots", st.engine_inserts)):
            yield CounterMetricFamily(name, doc, value=value)
        secs = CounterMetricFamily("dflash_engine_seconds", "the engine thread's time: the insert and step "
                                   "programs' dispatch, reads waiting for the device, idle (nothing to run); the "
                                   "rest is host bookkeeping", labels=["phase"])
        for phase, value in (("insert_dispatch", st.engine_insert_dispatch_s),
                             ("step_dispatch", st.engine_step_dispatch_s), ("read_wait", st.engine_read_wait_s),
                             ("idle", st.engine_idle_s)):
            secs.add_metric([phase], value)
        yield secs
        yield GaugeMetricFamily("dflash_kv_pages_used", "KV pages holding a live reference", value=st.kv_pages_used)
        yield GaugeMetricFamily("dflash_kv_pages_total", "KV pages in the pool", value=st.kv_pages_total)
        if st.kv_window_pages_total:
            yield GaugeMetricFamily("dflash_kv_window_pages_used", "window pages (the draft's sliding layers) "
                                    "holding a live reference", value=st.kv_window_pages_used)
            yield GaugeMetricFamily("dflash_kv_window_pages_total", "window pages in the draft's sliding layers' pool",
                                    value=st.kv_window_pages_total)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "fraction of the KV pages in use",
                                value=st.kv_pages_used / st.kv_pages_total if st.kv_pages_total else 0.0)


# ----------------------------------------------------------------------------------------- the app
def build_app(engine, tokenizer=None, *, model_name: str = "dflash", default_max_tokens: int = 16,
              trust_request_chat_template: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              template_timeout_s: float = TEMPLATE_TIMEOUT_S, template_max_chars: int = TEMPLATE_MAX_CHARS,
              scorer=None):
    """The FastAPI app serving `engine` (see dflash_jax.serving.engine's interface) with `tokenizer` (an HF
    tokenizer, or None: token-id prompts only, token ids rendered as text).

    trust_request_chat_template: accept a request's own `chat_template` (a template is code run
    here); refused (400) by default. max_body_bytes: a larger request body is answered 413 before
    it is read in full. template_timeout_s / template_max_chars: a chat template's render that runs
    longer or writes more is abandoned (400). scorer: the dflash_jax.serving.scoring.Scorer that computes
    `logprobs` / `echo` log-probabilities (default: one over the engine's target, built on first use)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    CompletionBody, ChatBody = _models()
    metrics = _Metrics(engine, engine.block_size)
    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.draining = engine, metrics, False
    app.add_middleware(_BodyLimit, limit=max_body_bytes,
                       on_refuse=lambda e: metrics.rejected.labels(str(e.status)).inc())
    created = int(time.time())
    fmt = _LogprobFormat(tokenizer)

    def _decode(ids: list[int]) -> str:
        return "".join(f"{t} " for t in ids) if tokenizer is None else tokenizer.decode(ids)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        if e.status != 500:
            metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):   # 404 route, 405 method, 413 body, ...
        return await _api_error(None, ApiError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)))

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
        top = _completion_logprobs(body)
        prompt = body.prompt
        # a list of strings or of token-id lists is a batch; choices are indexed prompt-major x n
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if tokenizer is None and any(isinstance(p, str) for p in batch):
            raise _bad("prompt", "this server has no tokenizer; send token ids")
        prompts = await _off_loop(lambda: [list(tokenizer.encode(p)) if isinstance(p, str) else [int(t) for t in p]
                                           for p in batch])
        for i, ids in enumerate(prompts):
            if not ids:
                raise _bad("prompt", "is empty" if len(prompts) == 1 else f"prompt {i} of the batch is empty")
        max_tokens = default_max_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise _bad("max_tokens", "must be >= 1 (0 only with echo: the prompt and its logprobs alone)")
        echo = None
        if body.echo:
            echo = await _off_loop(lambda: [p if isinstance(p, str) else _decode(ids)
                                            for p, ids in zip(batch, prompts)])
        return await _run(body, prompts, max_tokens, http, t0, chat=False, top=top, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        t0 = time.perf_counter()
        _check_common(body)
        kwargs = dict(body.chat_template_kwargs or {})
        if _constrains(body, chat=True):
            # the grammar starts at the first generated token: a thinking model's <think> block
            # would not fit it, so its template renders the answer directly (Qwen3: an empty
            # think block), unless the request says otherwise
            kwargs.setdefault("enable_thinking", False)
        template = body.chat_template
        if "chat_template" in kwargs:
            template = kwargs.pop("chat_template")
            field = "chat_template_kwargs.chat_template"
        else:
            field = "chat_template"
        if template is not None and not trust_request_chat_template:
            # a template is a program (loops included) run on the server: the operator's to allow
            raise _bad(field, "a request's own chat template is refused by this server (its operator can "
                              "allow it with --trust-request-chat-template)")
        if template is not None and not isinstance(template, str):
            raise _bad(field, "must be a string")
        for k in kwargs:
            if k in _TEMPLATE_CALL_ARGS:
                raise _bad(f"chat_template_kwargs.{k}", "is an argument of the template call, not a template "
                                                      "variable; it cannot be set here")
        if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
            raise _bad("messages", "this server's tokenizer has no chat template; use /v1/completions")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.get("type") != "text" for p in content):
                    raise _bad("messages", f"message {i}: only text content parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})

        too_long = _bad(field if template is not None else "messages",
                        f"the chat template's output is over this server's limit of {template_max_chars} "
                        f"characters")

        def render() -> list[int]:
            source = template if template is not None else getattr(tokenizer, "chat_template", None)
            if isinstance(source, str):
                _cap_template_output(source, template_max_chars)
            try:
                tools = {} if not body.tools or body.tool_choice == "none" else {"tools": body.tools}
                text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                     add_generation_prompt=body.add_generation_prompt,
                                                     **tools, **kwargs)
            except _TooLong:
                raise too_long from None
            except Exception as e:  # a template's own refusals (roles out of order, ...)
                raise _bad("messages", f"the chat template refused them: {_one_line(e)}") from None
            if len(text) > template_max_chars:
                raise too_long
            # the template already holds every special token; encode must not add BOS again
            return list(tokenizer.encode(text, add_special_tokens=False))

        try:  # a template is a program: its render is bounded in time (and above, in output)
            ids = await _abandonable(render, template_timeout_s)
        except TimeoutError:
            raise _bad(field if template is not None else "messages",
                       f"the chat template did not finish rendering within this server's limit of "
                       f"{template_timeout_s:g} s") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context
            max_tokens = max(1, engine.stats().max_model_len - len(ids))
        return await _run(body, [ids], max_tokens, http, t0, chat=True, top=_chat_logprobs(body))

    # ---- shared request path
    async def _off_loop(work):
        """Run tokenisation / templating in a worker thread: a long prompt or a slow template must
        not stall the event loop that feeds every other stream."""
        return await asyncio.get_running_loop().run_in_executor(None, work)

    async def _cancel_on_disconnect(http, handles, gone: list) -> None:
        """Cancel `handles` (freeing their slots) once the client of a non-streaming request has gone."""
        while not all(h.done for h in handles):
            if await http.is_disconnected():
                gone.append(True)
                for h in handles:
                    engine.cancel(h)
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    def _check_common(body) -> None:
        if app.state.draining:
            raise ApiError(503, "the server is shutting down", type_="service_unavailable")
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model: '{body.model}' is not served here (serving '{model_name}')",
                           param="model", code="model_not_found")
        served = _TOOL_FIELDS if isinstance(body, ChatBody) else ()
        for f, defaults in _UNSUPPORTED.items():
            if f in type(body).model_fields and f not in served and not _is_default(getattr(body, f), defaults):
                why = f": {_NEEDS_LOOP}" if f in _LOOP_FIELDS else ""
                raise _bad(f, f"is not supported by this server (got {getattr(body, f)!r:.60}){why}")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")

    def _engine_request(body, ids, max_tokens, seed: int, grammar=None) -> Request:
        temperature = 1.0 if body.temperature is None else body.temperature
        return Request(prompt=tuple(ids), max_tokens=max_tokens, temperature=temperature, grammar=grammar,
                       top_p=1.0 if body.top_p is None else body.top_p,
                       top_k=max(0, body.top_k or 0), seed=seed,
                       stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                       presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                       logit_bias=_logit_bias(body.logit_bias), min_tokens=body.min_tokens)

    scorers: list = [scorer]            # [the Scorer (built on first use), its one-thread executor]
    grammars: list = [None]             # the dflash_jax.serving.grammar.Grammars of this tokenizer (first use)

    def _parses_tools(body) -> bool:
        """A chat answer whose <tool_call> blocks become tool_calls (tools given, tool_choice not none)."""
        return isinstance(body, ChatBody) and bool(body.tools) and body.tool_choice != "none"

    def _grammar_spec(body, chat: bool):
        """The compiled grammar of a request's response_format / forced tool call / vLLM guided
        fields (None: free text), or a 400 naming the field (a schema the grammar library refuses,
        parameters that are not a schema, an engine that cannot constrain)."""
        tools = getattr(body, "tools", None) if chat else None
        choice = getattr(body, "tool_choice", None) if chat else None
        rf = body.response_format
        if tools is not None:
            _tool_list(tools)            # checked even when the model is left free
        if chat and not tools and choice not in (None, "auto", "none"):
            raise _bad("tool_choice", f"{choice!r:.60} needs tools to choose from")
        pattern = _guided(body)
        if not _constrains(body, chat, pattern):
            return None
        field = ("response_format" if not _is_default(rf, (None, {"type": "text"})) else
                 pattern[0] if pattern else "tool_choice")
        if tokenizer is None:
            raise _bad(field, "structured output needs the server's tokenizer (the grammar is over its tokens)")
        if not getattr(engine, "structured_output", False):
            raise _bad(field, "structured output is served by the slot engine on one host: serve with --slots 2 "
                              "or more")
        from dflash_jax.serving.grammar import GrammarError, Grammars
        if grammars[0] is None:
            grammars[0] = Grammars(tokenizer, engine.vocab_size)
        try:
            if pattern and pattern[1] == "json":
                rf = {"type": "json_schema", "json_schema": {"name": "guided", "schema": pattern[2]}}
            elif pattern:
                return grammars[0].compile(field=pattern[0], **{pattern[1]: pattern[2]})
            return grammars[0].compile(response_format=rf, tools=tools, tool_choice=choice)
        except GrammarError as e:
            raise _bad(e.field, e.message) from None

    def _scorer(field: str):
        """The Scorer of this server's target, built on first use (build_app's `scorer`, else one
        over the engine's target); a 400 naming `field` where there is no target to score with."""
        if scorers[0] is None:
            from dflash_jax.models.stack import CausalLM
            from dflash_jax.serving.scoring import Scorer

            target = getattr(engine, "target", None) or getattr(getattr(engine, "slots", None), "target", None)
            if not isinstance(target, CausalLM):
                raise _bad(field, "this server's engine has no target model to compute log-probabilities with")
            scorers[0] = Scorer(target)
        return scorers[0]

    async def _score(sc, seqs: list[list[int]], firsts: list[int]) -> list:
        """Scores per sequence (None where nothing is to be scored), computed off the event loop."""
        todo = [i for i, (s, f) in enumerate(zip(seqs, firsts)) if f < len(s)]
        out: list = [None] * len(seqs)
        if todo:
            if not scorers[1:]:   # one thread: scoring passes queue here, not in the pool tokenisation uses
                from concurrent.futures import ThreadPoolExecutor
                scorers.append(ThreadPoolExecutor(1, thread_name_prefix="dflash-score"))
            work = lambda: sc.score([seqs[i] for i in todo], [firsts[i] for i in todo])  # noqa: E731
            try:
                res = await asyncio.get_running_loop().run_in_executor(scorers[1], work)
            except Exception as e:  # noqa: BLE001 -- this request's fault, reported as such
                raise ApiError(500, f"computing the log-probabilities failed: {_one_line(e)}") from None
            for i, r in zip(todo, res):
                out[i] = r
        return out

    async def _run(body, prompts: list[list[int]], max_tokens: int, http, t0, *, chat: bool, top: int | None,
                   echo: list[str] | None = None):
        """Submit n choices of each prompt (max_tokens 0: none, the echo alone) and answer them."""
        n = body.n
        sc = _scorer("logprobs") if top is not None else None
        pk = _prompt_logprobs(body)
        psc = _scorer("prompt_logprobs") if pk is not None else None
        spec = await _off_loop(lambda: _grammar_spec(body, chat))
        if max_tokens > 0:
            st = engine.stats()
            room = st.max_queue + st.slots
            if n * len(prompts) > room:
                raise _bad("n" if n > 1 else "prompt",
                           f"{n} choice(s) x {len(prompts)} prompt(s) = {n * len(prompts)} requests; this server "
                           f"takes at most {room} at once (its queue + slots)")
        base = secrets.randbits(31) if body.seed is None else body.seed
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices: list[_Choice] = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                req = _engine_request(body, ids, max(1, max_tokens), _choice_seed(base, j),
                                      None if spec is None else spec.new())
                stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(engine.eos_token_ids))
                choices.append(_Choice(p * n + j, ids, req, _Output(tokenizer, stops, stop_ids,
                                                                     body.skip_special_tokens), _Timing(t0)))
        try:
            for c in choices:
                if max_tokens == 0:
                    engine.check(c.request)     # the prompt alone, checked as a request of one token
                else:
                    c.handle = engine.submit(c.request)
                    metrics.prompt.inc(len(c.prompt))
        except BaseException as e:
            for c in choices:
                if c.handle is not None:
                    engine.cancel(c.handle)
            if isinstance(e, RequestError):
                raise _bad(e.field, e.message) from None
            if isinstance(e, QueueFull):
                raise ApiError(503, f"{e}; retry later", type_="service_unavailable", headers={"Retry-After": "1"})
            if isinstance(e, EngineClosed):
                raise ApiError(503, str(e), type_="service_unavailable")
            raise
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        n_prompt = sum(len(ids) for ids in prompts)
        prompt_lp = None            # vLLM's prompt_logprobs, one list per prompt (scored while the engine runs)
        if pk is not None:
            try:
                got = await _score(psc, prompts, [1] * len(prompts))
            except BaseException:
                for c in choices:
                    if c.handle is not None:
                        engine.cancel(c.handle)
                raise
            prompt_lp = [[None] if s is None else fmt.prompt(ids, s, pk) for ids, s in zip(prompts, got)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(choices, ident, chat, body.return_token_ids, include_usage, n_prompt,
                                             sc, top, echo, n, _parses_tools(body) and sc is None, prompt_lp),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        gone: list = []
        handles = [c.handle for c in choices if c.handle is not None]
        # watched on its own clock: tokens arriving faster than the poll must not hide a hang-up
        watch = asyncio.ensure_future(_cancel_on_disconnect(http, handles, gone))

        async def collect(c: _Choice) -> None:
            while c.fin is None:
                ev = await c.handle.anext()
                if isinstance(ev, Tokens):
                    c.timing.tokens(len(ev.ids))
                    metrics.tokens(len(ev.ids))
                    c.out.add(ev.ids)
                    if c.out.stopped:
                        engine.cancel(c.handle)
                else:
                    c.fin = ev

        try:
            await asyncio.gather(*(collect(c) for c in choices if c.handle is not None))
        finally:
            watch.cancel()
            for h in handles:
                if not h.done:
                    engine.cancel(h)
        if gone:
            return Response(status_code=499)   # nginx's "client closed request"; nobody reads it
        for c in choices:
            if c.fin is None:
                continue
            reason = _reason(c.fin, c.out)
            c.timing.observe(metrics, c.fin, reason)
            if reason == "error":
                raise ApiError(500, f"the request failed: {c.fin.error}")
            c.out.finish()
        scores = [None] * len(choices)
        if sc is not None:   # one scoring pass over prompt + output; echo: from the prompt's second token
            seqs = [c.prompt + c.out.tokens for c in choices]
            scores = await _score(sc, seqs, [1 if echo is not None else len(c.prompt) for c in choices])
        out = []
        for c, s in zip(choices, scores):
            reason = "length" if c.fin is None else _reason(c.fin, c.out)
            choice: dict[str, Any] = {"index": c.index, "finish_reason": reason, "logprobs": None}
            entries = None
            if sc is not None:
                entries = _entries(c.prompt + c.out.tokens, 1 if echo is not None else len(c.prompt), s, top,
                                   first_null=echo is not None)
            if chat:
                choice["message"] = {"role": "assistant", "content": c.out.text}
                if _parses_tools(body):
                    content, calls = _tool_calls(c.out.text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                        choice["finish_reason"] = "tool_calls" if reason == "stop" else reason
                if entries is not None:
                    choice["logprobs"] = fmt.chat(entries)
            else:
                choice["text"] = (echo[c.index // n] if echo is not None else "") + c.out.text
                if entries is not None:
                    choice["logprobs"] = fmt.completion(entries)[0]
            if body.return_token_ids:
                choice["token_ids"] = list(c.out.tokens)
            if prompt_lp is not None and not chat:       # vLLM: per choice on completions
                choice["prompt_logprobs"] = prompt_lp[c.index // n]
            out.append(choice)
        fins = [c.fin for c in choices if c.fin is not None]
        extra = {"prompt_logprobs": prompt_lp[0]} if prompt_lp is not None and chat else {}   # vLLM: top level
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": out, **extra,
                "usage": _usage(n_prompt, sum(len(c.out.tokens) for c in choices)), "dflash": _dflash_stats(fins)}

    async def _stream(choices, ident, chat, return_ids, include_usage, n_prompt, sc, top, echo, n, tools=False,
                      prompt_lp=None):
        """Server-sent events of every choice, interleaved as their tokens come (each chunk names
        its choice's index). With logprobs, a choice's tokens are sent once scored: the events
        that arrived while a scoring pass ran are scored together in the next one (one forward
        over each choice's prompt + output so far), so a fast engine gets fewer, larger chunks.
        tools: a chat answer that may hold tool calls is held back and sent whole when it ends, as
        its content or as one delta of tool_calls (finish_reason "tool_calls"). prompt_lp (vLLM's
        prompt_logprobs, per prompt): on each choice's first chunk."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())
        first_sent: set = set()            # choices whose first chunk has gone (prompt_logprobs ride on it)

        def chunk(c, text: str | None, reason=None, ids=None, role=False, logprobs=None, tool_calls=None,
                  **extra) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                d: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                d = {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            if return_ids and ids is not None:
                d["token_ids"] = ids
            if prompt_lp is not None and c.index not in first_sent:
                first_sent.add(c.index)
                (extra if chat else d)["prompt_logprobs"] = prompt_lp[c.index // n]
            payload = {"id": ident, "object": obj, "created": now, "model": model_name, "choices": [d], **extra}
            return f"data: {json.dumps(payload)}\n\n"

        def logprobs_of(c, entries):
            if chat:
                return fmt.chat(entries)
            lp, c.offset = fmt.completion(entries, c.offset)
            return lp

        def final(c) -> list[str]:
            """The last chunks of choice c; an error event instead if it failed."""
            reason = "length" if c.fin is None else _reason(c.fin, c.out)
            if c.fin is not None:
                c.timing.observe(metrics, c.fin, reason)
            if reason == "error":
                return [f"data: {json.dumps(ApiError(500, f'the request failed: {c.fin.error}').body())}\n\n"]
            rest = c.out.finish()
            if tools:
                content, calls = _tool_calls(c.out.text)
                if calls:
                    reason = "tool_calls" if reason == "stop" else reason
                    calls = [dict(call, index=k) for k, call in enumerate(calls)]
                    rest = None
                    done = [chunk(c, None, ids=[], tool_calls=calls)] + ([chunk(c, content, ids=[])] if content else [])
                else:
                    rest = c.out.text
            if not tools or rest is not None:
                done = [chunk(c, rest, ids=[])] if rest else []
            stats = {} if c.fin is None else {"dflash": _dflash_stats([c.fin])}
            return done + [chunk(c, None if chat else "", reason=reason, ids=[], **stats)]

        events: asyncio.Queue = asyncio.Queue()

        async def pump(c) -> None:
            async for ev in c.handle.aevents():
                events.put_nowait((c, ev))

        tasks, failed = [], False
        try:
            if chat:
                for c in choices:
                    yield chunk(c, None, role=True)
            if echo is not None:   # the prompt first, with its logprobs (the first token's is null)
                prompt_scores = [None] * len(choices)
                if sc is not None:
                    try:
                        prompt_scores = await _score(sc, [c.prompt for c in choices], [1] * len(choices))
                    except ApiError as e:
                        yield f"data: {json.dumps(e.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                for c, s in zip(choices, prompt_scores):
                    lp = None if sc is None else logprobs_of(c, _entries(c.prompt, 1, s, top, first_null=True))
                    yield chunk(c, echo[c.index // n], ids=[], logprobs=lp)
            running = [c for c in choices if c.handle is not None]
            for c in choices:
                if c.handle is None:      # max_tokens 0: the echo was all
                    for s in final(c):
                        yield s
            tasks = [asyncio.ensure_future(pump(c)) for c in running]
            left = len(running)
            while left and not failed:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                waiting, ended = [], []       # (logprobs) choices with tokens to score; finished after them
                for c, ev in batch:
                    if isinstance(ev, Tokens):
                        c.timing.tokens(len(ev.ids))
                        metrics.tokens(len(ev.ids))
                        delta = c.out.add(ev.ids)
                        if c.out.stopped and not c.handle.done:
                            engine.cancel(c.handle)
                        if sc is None:
                            if (delta or return_ids) and not tools:
                                yield chunk(c, delta, ids=list(ev.ids))
                        else:
                            c.pending_text += delta
                            c.pending_ids += list(ev.ids)
                            if c not in waiting:
                                waiting.append(c)
                    else:
                        c.fin, left = ev, left - 1
                        if sc is None:
                            lines = final(c)
                            failed = lines[0].startswith('data: {"error"')
                            for s in lines:
                                yield s
                            if failed:
                                break
                        else:
                            ended.append(c)
                if waiting:
                    seqs = [c.prompt + c.out.tokens for c in waiting]
                    try:
                        scores = await _score(sc, seqs, [len(c.prompt) + c.sent for c in waiting])
                    except ApiError as e:
                        yield f"data: {json.dumps(e.body())}\n\n"
                        failed = True
                        break
                    for c, s, seq in zip(waiting, scores, seqs):
                        lp = None
                        if s is not None:
                            lp = logprobs_of(c, _entries(seq, len(c.prompt) + c.sent, s, top, first_null=False))
                        if c.pending_text or lp is not None or return_ids:
                            yield chunk(c, c.pending_text, ids=c.pending_ids, logprobs=lp)
                        c.sent, c.pending_text, c.pending_ids = len(seq) - len(c.prompt), "", []
                for c in ended:
                    lines = final(c)
                    failed = lines[0].startswith('data: {"error"')
                    for s in lines:
                        yield s
                    if failed:
                        break
            if not failed and include_usage:
                usage = {"id": ident, "object": obj, "created": now, "model": model_name, "choices": [],
                         "usage": _usage(n_prompt, sum(len(c.out.tokens) for c in choices))}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled), a choice failed, or we are done
            for t in tasks:
                t.cancel()
            for c in choices:
                if c.handle is not None and not c.handle.done:
                    engine.cancel(c.handle)

    return app


def _reason(fin: Finished, out: _Output) -> str:
    if out.stopped:
        return "stop"
    return fin.finish_reason


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _dflash_stats(fins: list[Finished]) -> dict:
    """Loop iterations and tau over a response's choices."""
    accepted = [a for f in fins for a in f.stats.acceptance_lengths]
    return {"iterations": sum(f.stats.iterations for f in fins),
            "mean_acceptance_length": round(sum(accepted) / len(accepted), 4) if accepted else 0.0}


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
def _engine_steps(text: str):
    """--engine-steps: an integer or auto (argparse type: a bad value is a one-line error)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give an integer >= 1 or auto, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.cli.generate import add_model_args, add_width_args

    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.serve",
        description="OpenAI-compatible HTTP server for a target (Qwen3, Llama-3.x, Qwen3-MoE, Qwen3.5) with a "
                    "DFlash or DFlash2 draft.",
        epilog="Example: python -m dflash_jax.serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 "
               "--port 8000")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    g.add_argument("--slots", type=int, default=1,
                   help="requests decoded at once (> 1: the continuous-batching slot engine; 1: one at a time)")
    g.add_argument("--engine-steps", type=_engine_steps, default="auto", metavar="{N,auto}",
                   help="loop iterations per engine step between admissions (--slots > 1); auto (default): 4 in a "
                        "step over fewer than 16 rows, 2 over more")
    g.add_argument("--insert-width", type=int, default=None,
                   help="most arrivals prefilled in one call (--slots > 1; default min(slots, 8))")
    # --verify-width: the slot engine's (--slots > 1), per step; its default is auto there (_check)
    add_width_args(g, default=None, default_help="auto with the slot engine (--slots > 1), else block")
    g.add_argument("--engine-pipeline", type=int, default=1,
                   help="engine steps dispatched ahead of the one whose tokens are read (0: wait for each)")
    g.add_argument("--while-graphs", choices=("auto", "on", "off"), default="auto",
                   help="CUDA only (--slots > 1): the slot engine's loops as CUDA-graph while loops with a "
                        "device-side condition (auto = on: KernelConfig.while_graphs) or XLA's own loops, whose "
                        "condition the host reads each iteration (off); part of each program's compile key")
    g.add_argument("--step-buckets", default="auto", metavar="auto|none|N,N,...",
                   help="row counts an engine step may run over (the smallest holding the busy slots; --slots "
                        "always one): auto = powers of two up to --slots, none = every step over all slots")
    g.add_argument("--warmup-prompt-len", default="512", metavar="N|LO:HI",
                   help="compile the slot engine's programs for prompts up to N tokens (or of LO..HI) at start (with "
                        "--kv-pages and prefix caching: every bucket up to HI's, a hit prefilling only the tail); "
                        "0: none")
    g.add_argument("--warmup-modes", default="greedy", metavar="MODES",
                   help="the sampling modes whose programs the warm-up compiles, comma-separated from "
                        "greedy, sample (temperature), topk, topp, filtered (top-k and top-p), each optionally "
                        "with +penalties (presence / frequency / logit_bias / min_tokens) and / or +grammar "
                        "(structured output). A request runs in a warmed program that serves its mode "
                        "(filtered serves every sampling mode, +penalties rows without penalties), else its "
                        "own is compiled on arrival. Default: greedy; greedy,filtered for clients that "
                        "sample (an OpenAI client's default temperature is 1)")
    g.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="threads compiling the warm-up's programs (default: half the host's cores, 1 to 8; "
                        "each compile of a large model holds a few GB of host memory)")
    g.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 503")
    g.add_argument("--capacity", type=int, default=None,
                   help=f"KV-cache entries per slot: prompt + max_tokens + one block must fit (default "
                        f"{DEFAULT_CAPACITY}, or the model's max_position_embeddings + block when smaller); "
                        f"checked at start against the model's context and the device's memory")
    g.add_argument("--kv-pages", type=int, default=None,
                   help="paged KV cache (--slots > 1): a pool of this many pages shared by every slot, for the target "
                        "and the draft's context, instead of a fixed row of --capacity per slot; requests wait while "
                        "pages are short and the newest is preempted (recomputed) when a running one cannot grow")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="size the paged pool (--kv-pages) from this many GiB of KV (target + draft)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (with --kv-pages / --kv-cache-memory)")
    g.add_argument("--kv-window-pages", default="auto", metavar="N|auto",
                   help="with pages and a draft with sliding-window layers: their context in a pool of N pages of its "
                        "own, holding only each row's window (auto: every slot's window at a step's reach + one row's "
                        "pages, at most --kv-pages; 0: in the main pages, the window a mask). --kv-cache-memory "
                        "takes this pool's bytes first")
    g.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="with pages: reuse the K/V of prompts' cached full-page prefixes, the draft's context with the "
                        "target's (on by default)")
    g.add_argument("--default-max-tokens", type=int, default=16,
                   help="max_tokens of a completion that gives none (chat: the rest of the context)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM; then open streams end with an "
                        "error event and [DONE]")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="request bodies larger than this are answered 413 before they are read")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (a template is code run by this server: refused "
                        "with 400 unless this is given)")
    g.add_argument("--seed", type=int, default=0, help="random weights' seed with --random-init")
    multihost_serve.add_args(g)
    return p


def _default_pair():
    """(target_dir, draft_dir) of the pair embedded in the package, or None."""
    try:
        from dflash_jax.assets import default_pair
    except ImportError:
        return None
    return default_pair()


def _cli():
    """The generate CLI module (its flag helpers; the models load through dflash_jax.loading)."""
    from dflash_jax.cli import generate as cli
    return cli


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
    if args.engine_steps != "auto" and args.engine_steps < 1:
        parser.error(f"--engine-steps must be >= 1 or auto, got {args.engine_steps}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.insert_width is not None and args.insert_width < 1:
        parser.error(f"--insert-width must be >= 1, got {args.insert_width}")
    if args.engine_pipeline < 0:
        parser.error(f"--engine-pipeline must be >= 0, got {args.engine_pipeline}")
    if args.verify_width is None:
        # the server's default: the slot engine picks its verify width per step ("auto": >= the whole
        # block at every batch measured on the H200, well above it from B = 32 up, docs/adaptive-width.md;
        # a server compiles once, so the adaptive program's longer compile is paid once); one slot: block
        args.verify_width = "auto" if args.slots > 1 else "block"
    elif args.verify_width != "block" and args.slots < 2:
        parser.error(f"--verify-width {args.verify_width} needs the slot engine (--slots > 1)")
    if (args.kv_pages is not None or args.kv_cache_memory is not None) and args.slots < 2:
        parser.error("--kv-pages / --kv-cache-memory need the slot engine (--slots > 1)")
    if args.slots < 2:  # the slot engine's flags would do nothing to the one-request engine
        for flag, value, default in (("--engine-steps", args.engine_steps, "auto"),
                                     ("--insert-width", args.insert_width, None),
                                     ("--step-buckets", args.step_buckets, "auto"),
                                     ("--engine-pipeline", args.engine_pipeline, 1),
                                     ("--while-graphs", args.while_graphs, "auto")):
            if value != default:
                parser.error(f"{flag} {value} needs the slot engine (--slots > 1); with --slots 1 requests run "
                             f"one at a time")
    given = str(args.warmup_prompt_len)
    try:
        lo, _, hi = given.rpartition(":")
        args.warmup_prompt_len = (int(lo), int(hi)) if lo else int(hi)
        if min(args.warmup_prompt_len if lo else (args.warmup_prompt_len,)) < 0 or (lo and int(lo) > int(hi)):
            raise ValueError  # LO > HI: an empty range, nothing would compile
    except ValueError:
        parser.error(f"--warmup-prompt-len must be N or LO:HI (token counts >= 0, LO <= HI), got {given!r}")
    try:
        args.step_buckets = parse_step_buckets(args.step_buckets)
    except ValueError as e:
        parser.error(f"--step-buckets: {e}")
    if args.compile_workers is not None and args.compile_workers < 1:
        parser.error(f"--compile-workers must be >= 1, got {args.compile_workers}")
    modes = [m.strip() for m in str(args.warmup_modes).split(",") if m.strip()]
    bad = [m for m in modes if not _warmup_mode_ok(m)]
    if bad or not modes:
        parser.error(f"--warmup-modes: {', '.join(map(repr, bad)) or 'none given'}; choose from "
                     f"{', '.join(WARMUP_MODES)}, each optionally with +penalties and / or +grammar")
    args.warmup_modes = tuple(dict.fromkeys(modes))
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.capacity is not None and not 2 <= args.capacity <= validation.INT32_MAX // 2:
        parser.error(f"--capacity must be in [2, {validation.INT32_MAX // 2}] (KV-cache entries), got {args.capacity}")
    # the configs (no weights yet): the capacity against the model's context
    cfg = loading.resolve_sources(parser, args)
    args.vocab_size = cfg.vocab_size
    block = _block_of(args)
    context = cfg.max_position_embeddings
    if args.capacity is None:
        args.capacity = min(DEFAULT_CAPACITY, context + block)
    elif args.capacity - block > context:
        parser.error(f"--capacity {args.capacity} would serve a context of {args.capacity - block} tokens "
                     f"(capacity - block {block}), beyond the model's max_position_embeddings {context}; "
                     f"use --capacity {context + block} or less")
    if args.capacity - block < 2:
        parser.error(f"--capacity {args.capacity} leaves no room next to a block of {block}")


def _block_of(args) -> int:
    """The block size the engine will run (1: plain decoding), from the flags and the draft's config."""
    if args.draft is not None and args.draft.lower() == "none":
        return 1
    if args.block_size is not None:
        return args.block_size
    if getattr(args, "draft_dir", None):
        from dflash_jax import drafts
        from dflash_jax.config import read_json
        return drafts.read_config(read_json(args.draft_dir)).block_size
    return loading.RANDOM_DRAFT_BLOCK


def _load(parser, args):
    """(target, draft, tokenizer, eos ids, served name) from the flags."""
    tokenizer = loading.load_tokenizer(parser, args, hint="pass --tokenizer DIR")
    eos = [] if args.random_init else loading.stop_token_ids(args.model, tokenizer)
    loading.check_eos(parser, args, eos, args.vocab_size)
    target, draft = loading.load_models(parser, args)
    name = args.served_model_name or args.model or f"random-init:{args.random_init}"
    return target, draft, tokenizer, eos, name


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


# read at each call through this name (tests replace it)
_free_memory = validation.free_memory


def _check_memory(parser, args, target, draft, mesh_devices: int = 1) -> None:
    """--slots x --capacity of KV cache (target and draft) must fit what the device has free once
    the weights are loaded, checked before anything is allocated for it (an over-large capacity
    would otherwise be killed by the OS or fail every request)."""
    import jax
    from flax import nnx

    per_entry = 0      # KV bytes of one cache entry of one slot, target and draft
    for m in (target, draft):
        if m is not None:
            shapes = jax.eval_shape(lambda m=m: m.new_cache(1, 1))
            per_entry += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes) if len(x.shape) == 4)
    need = per_entry * args.slots * args.capacity // max(1, mesh_devices)
    free, where = _free_memory()
    if free is None or need <= free:
        return
    weights = sum(getattr(x, "nbytes", 0) for m in (target, draft) if m is not None
                  for x in jax.tree.leaves(nnx.state(m))) // max(1, mesh_devices)
    most = free * max(1, mesh_devices) // max(1, per_entry * args.slots)
    parser.error(f"--slots {args.slots} x --capacity {args.capacity}: the KV caches need {_gb(need)} (beside "
                 f"{_gb(weights)} of weights), and the {where} has {_gb(free)} free; lower --capacity (at most "
                 f"{most} with {args.slots} slot(s)) or --slots")


# the sampling modes --warmup-modes takes, each optionally with serving.slots' PENALTIES and / or
# GRAMMAR suffixes (in that order: RowRequest.mode's program modes)
WARMUP_MODES = ("greedy", "sample", "topk", "topp", "filtered")


def _warmup_mode_ok(mode: str) -> bool:
    from dflash_jax.serving.slots import GRAMMAR, PENALTIES
    return any(mode == base + suffix for base in WARMUP_MODES
               for suffix in ("", PENALTIES, GRAMMAR, PENALTIES + GRAMMAR))


def _warm_up(engine, spec, workers: int | None = None, modes=("greedy",)) -> None:
    """Compile the slot engine's programs of `modes` (--warmup-modes) for the prompt buckets of
    `spec` (N or (LO, HI); with prefix caching every bucket up to HI's, since a hit prefills only a
    prompt's tail), in threads (Slots.warmup), a progress line before and after: minutes on a large
    model, which must not look like a hang."""
    from dflash_jax.serving.slots import compile_workers
    lo, hi = spec if isinstance(spec, tuple) else (1, spec)
    hi = min(hi, engine.max_model_len - 1)
    slots = engine.slots
    if getattr(getattr(slots, "pages", None), "prefix_cache", False):
        lo = 1    # a prefix hit prefills only the prompt's tail: any bucket up to hi's
    lengths = sorted({min(slots.prompt_bucket(n), hi) for n in range(max(1, lo), hi + 1)})
    t0, c0 = time.perf_counter(), engine.stats().compiles
    buckets = ", ".join(str(slots.prompt_bucket(n)) for n in lengths)
    workers = compile_workers() if workers is None else workers
    loading.progress(f"compiling the step programs and the prefill programs for prompt buckets {buckets}"
                     + ("" if tuple(modes) == ("greedy",) else f", modes {', '.join(modes)}")
                     + f" ({workers} thread{'s' if workers > 1 else ''}) ...")
    slots.warmup(lengths, tuple(modes), workers=workers)
    loading.progress(f"warm-up done: {engine.stats().compiles - c0} programs compiled in "
                     f"{time.perf_counter() - t0:.1f} s")


def _bind(parser, host: str, port: int) -> socket.socket:
    """The listening socket, bound before the models load: a port in use is a usage error now, not
    after minutes of loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        parser.error(f"--host {host}: {e.strerror or e}")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror or e}"
        parser.error(f"--port {port}: {host}:{port} {why}")
    sock.set_inheritable(True)
    return sock


def _server(config, app, engine=None, shutdown_timeout: float | None = None):
    """A uvicorn.Server that marks the app as draining the moment SIGTERM / SIGINT arrives, so that
    requests on open keep-alive connections get 503 while in-flight ones finish; and shuts the
    engine down beside it, so that what has not finished after `shutdown_timeout` seconds fails
    through its handles (an open stream gets an error event and [DONE]) before uvicorn's own,
    later, timeout would cut the connections."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not app.state.draining and engine is not None:
                threading.Thread(target=engine.shutdown, kwargs={"timeout": shutdown_timeout},
                                 name="dflash-drain", daemon=True).start()
            app.state.draining = True
            super().handle_exit(sig, frame)

    return Server(config)


def _missing_extra() -> list[str]:
    """The [serve] extra's modules this Python cannot import."""
    import importlib

    missing = []
    for name in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _run(server, sock) -> None:
    server.run(sockets=[sock])


# uvicorn's own graceful-shutdown limit is this much later than --shutdown-timeout, so that the
# engine fails what is left (error event + [DONE]) before uvicorn would cancel the responses.
SHUTDOWN_GRACE_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    missing = _missing_extra()
    if missing:
        print(f"python -m dflash_jax.serve needs the [serve] extra: pip install 'dflash-jax[serve]' "
              f"(missing: {', '.join(missing)})", file=sys.stderr)
        return 2
    from dflash_jax.cli.generate import skip_absent_tpu
    skip_absent_tpu()  # libtpu's noise off a TPU VM
    parser = build_parser()
    args = parser.parse_args(argv)
    flags = dict(vars(args))      # as given: every process of a multi-host server must have process 0's
    _check(parser, args)
    hosts = multihost_serve.Hosts.join(parser, args, flags)    # None on one process
    sock = _bind(parser, args.host, args.port) if hosts is None or hosts.leader else None
    try:
        return _serve(parser, args, sock, hosts)
    finally:
        if sock is not None:
            sock.close()


def paged_args(parser, args, target, draft) -> dict:
    """SlotEngine's paged-cache arguments from --kv-pages / --kv-cache-memory / --page-size /
    --prefix-cache ({} without pages)."""
    if args.kv_pages is None and args.kv_cache_memory is None:
        return {}
    if args.kv_pages is not None and args.kv_cache_memory is not None:
        parser.error("give --kv-pages or --kv-cache-memory, not both")
    if args.page_size < 1:
        parser.error(f"--page-size must be >= 1, got {args.page_size}")
    wp = getattr(args, "kv_window_pages", "auto")
    if wp != "auto":
        try:
            wp = int(wp)
        except ValueError:
            parser.error(f"--kv-window-pages must be an integer or 'auto', got {wp!r}")
        if wp < 0 or wp == 1:
            parser.error(f"--kv-window-pages must be 0 (off), >= 2 or 'auto', got {wp}")
    window = draft.window() if draft is not None and hasattr(draft, "window") else None
    windowed = window is not None and wp != 0
    pages = args.kv_pages
    if pages is None:
        if args.kv_cache_memory <= 0:
            parser.error(f"--kv-cache-memory must be > 0 GiB, got {args.kv_cache_memory}")
        budget = int(args.kv_cache_memory * 2**30)
        main = page_bytes(target, draft, args.page_size, windowed=False if windowed else None)
        if windowed:   # the window pool's bytes first (auto: sized as Slots sizes it, at most the shared pages)
            from dflash_jax.serving.pages import WindowPages
            from dflash_jax.serving.slots import steps_for_rows
            S = args.block_size or draft.config.block_size
            ppr = -(-(args.capacity or DEFAULT_CAPACITY) // args.page_size)
            steps = steps_for_rows(getattr(args, "engine_steps", "auto"), 1)
            auto = wp == "auto"
            if auto:
                wp = min(budget // (main + page_bytes(None, draft, args.page_size, windowed=True)),
                         WindowPages.default_pages(args.slots, window, S, args.page_size, steps, ppr))
            budget -= wp * page_bytes(None, draft, args.page_size, windowed=True)
        pages = int(max(budget, 0) // main)
        if windowed and auto and wp < pages and wp - 1 < min(
                WindowPages.live_pages(window, S, args.page_size, (2 * steps + 1) * S), ppr):
            # a budget too small for one row's live window: the main pool no larger than the window
            # pool, which then holds any row the main pool can (Slots refuses a window pool smaller
            # than both one row's live window and the main pool)
            pages = wp
    if pages < 2:
        parser.error(f"the KV page pool must hold at least 2 pages, got {pages}")
    out = dict(kv_pages=pages, page_size=args.page_size, prefix_cache=args.prefix_cache == "on")
    if window is not None:
        out["window_pages"] = wp
    return out


def page_bytes(target, draft, page_size: int, windowed: bool | None = None) -> int:
    """Bytes one KV page takes over every layer of the target and of the draft (K and V). windowed
    (a draft with sliding layers): False, the target and the draft's full layers only (a main page
    when the sliding layers have a window pool); True, the draft's sliding layers only (a window
    page, no target); None: every layer."""
    import numpy as np

    def one(model, layers):
        c = model.config
        return 2 * layers * model.layers[0].num_kv_heads * page_size * c.head_dim * np.dtype(model.dtype).itemsize
    out = 0 if target is None or windowed else one(target, target.config.num_layers)
    if draft is not None:
        c = draft.config
        sliding = sum(c.layer_window(i) is not None for i in range(c.num_layers)) if hasattr(c, "layer_window") else 0
        out += one(draft, {None: c.num_layers, False: c.num_layers - sliding, True: sliding}[windowed])
    return out


def _serve(parser, args, sock, hosts=None) -> int:
    import uvicorn

    target, draft, tokenizer, eos, name = _load(parser, args)
    block = None if draft is None else (args.block_size or draft.config.block_size)
    mesh = loading.get_mesh(parser, args)
    _check_memory(parser, args, target, draft, 1 if mesh is None else mesh.devices.size)
    _cli().check_verify_width(parser, args, draft)
    try:
        if args.slots > 1:
            from dflash_jax.kernel_config import KernelConfig
            graphs = {"auto": None, "on": True, "off": False}[args.while_graphs]
            engine = SlotEngine(target, draft, slots=args.slots, capacity=args.capacity, max_queue=args.max_queue,
                                eos_token_ids=eos, block_size=block, attention_impl=None,
                                kernels=KernelConfig(attention=args.attention, while_graphs=graphs),
                                steps=args.engine_steps, insert_width=args.insert_width,
                                pipeline=args.engine_pipeline, warmup_prompt_len=0,
                                step_buckets=args.step_buckets,
                                verify_width=None if args.verify_width == "block" else args.verify_width,
                                wrap=None if hosts is None else hosts.wrap, **paged_args(parser, args, target, draft))
        else:
            engine = SimpleEngine(target, draft, capacity=args.capacity, max_queue=args.max_queue,
                                  eos_token_ids=eos, block_size=block, attention_impl=args.attention)
    except ValueError as e:
        parser.error(str(e))
    if hosts is not None and not hosts.leader:    # a worker: process 0's engine calls, no port
        code = hosts.follow()
        engine.shutdown(timeout=0)
        del engine, target, draft
        _release_device()
        return code
    if args.slots > 1 and args.warmup_prompt_len:
        _warm_up(engine, args.warmup_prompt_len, args.compile_workers, args.warmup_modes)
    from dflash_jax.serving.scoring import Scorer

    app = build_app(engine, tokenizer, model_name=args.served_model_name or name,
                    default_max_tokens=args.default_max_tokens,
                    trust_request_chat_template=args.trust_request_chat_template, max_body_bytes=args.max_body_bytes,
                    scorer=None if hosts is not None else Scorer(target, kernels=args.attention))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S, lifespan="off")
    server = _server(config, app, engine, args.shutdown_timeout)
    if hosts is not None:
        hosts.watch(engine, app)
    print(f"[dflash] serving {name} on http://{args.host}:{args.port} (capacity {args.capacity}, context "
          f"{engine.stats().max_model_len}, block {engine.block_size}, {args.slots} slot(s))",
          file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has drained; these handlers absorb it so
    # that the engine is shut down and the process exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        _run(server, sock)
    finally:
        # uvicorn has drained (up to --shutdown-timeout): wait for the engine's thread to leave the
        # device, then free the device state and the compiled programs while the runtime is still
        # up, so nothing on the device is torn down by interpreter exit.
        engine.shutdown(timeout=args.shutdown_timeout)
        if hosts is not None:
            hosts.stop()
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
