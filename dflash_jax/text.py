"""Text in, text out: `generate_text` wraps `generate` with a tokenizer, the chat template and stop
strings.

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")
    out = generate_text(target, draft, tok, ["What is 17 * 23?"], max_new_tokens=128, stop=["\\n\\n"])
    out.texts[0], out.finish_reasons[0], out.result.mean_tau

Stop strings are matched on the host: the streaming callback decodes each row's committed tokens and
asks the loop to stop once every row has met a stop string (or finished on its own); each row's text
is cut before its stop string and its tokens after the token that completed it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from dflash_jax.data import apply_chat_template

__all__ = ["generate_text", "TextResult", "StopWatcher", "eos_token_ids"]


def eos_token_ids(tokenizer, generation_config_eos=None) -> list[int]:
    """The stop ids a chat model needs: its generation config's eos (int or list) and the tokenizer's."""
    ids: list[int] = []
    if generation_config_eos is not None:
        ids.extend([generation_config_eos] if isinstance(generation_config_eos, int) else list(generation_config_eos))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


class StopWatcher:
    """on_commit helper: per-row committed tokens, stop ids, max_new_tokens and stop strings.

    `__call__(rows)` returns True once every row is finished (a stop id, max_new_tokens, or a stop
    string in its decoded text), which stops the compiled loop. The loop commits whole accepted
    blocks, so tokens past a row's end are dropped here as the library trims them.
    """

    def __init__(self, n_rows: int, tokenizer=None, stop_strings: Sequence[str] = (), stop_ids: Sequence[int] = (),
                 max_new_tokens: int | None = None, cancel: Callable[[], bool] | None = None):
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.stop_ids = set(int(i) for i in stop_ids)
        self.max_new = max_new_tokens
        self.cancel = cancel
        self.tokens: list[list[int]] = [[] for _ in range(n_rows)]
        self.finished = [False] * n_rows
        self.cut: list[tuple[int, int] | None] = [None] * n_rows  # (tokens kept, text chars kept)
        self.cancelled = False

    def _text(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _find(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stop_strings]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def __call__(self, rows: Sequence[Sequence[int]]) -> bool:
        for i, new in enumerate(rows):
            if self.finished[i] or not new:
                continue
            start = len(self.tokens[i])
            for t in new:
                self.tokens[i].append(int(t))
                if int(t) in self.stop_ids or (self.max_new is not None and len(self.tokens[i]) >= self.max_new):
                    self.finished[i] = True
                    break
            if self.stop_strings:
                pos = self._find(self._text(self.tokens[i]))
                if pos is not None:
                    k = next(k for k in range(start + 1, len(self.tokens[i]) + 1)
                             if self._find(self._text(self.tokens[i][:k])) is not None)
                    self.cut[i] = (k, pos)
                    self.finished[i] = True
        if self.cancel is not None and self.cancel():
            self.cancelled = True
        return self.cancelled or all(self.finished)

    def apply(self, tokens: list[int], reason: str, row: int) -> tuple[list[int], str | None, str]:
        """(tokens, text or None without a tokenizer, finish reason) of one row of the result."""
        if self.cut[row] is not None:
            k, pos = self.cut[row]
            return tokens[:k], self._text(tokens[:k])[:pos], "stop"
        if self.cancelled and reason not in ("stop", "length"):  # stopped by the callback, not by the cache
            reason = "interrupted"
        return tokens, (self._text(tokens) if self.tokenizer is not None else None), reason


@dataclasses.dataclass
class TextResult:
    texts: list[str]               # completion per prompt (special tokens skipped, cut before a stop string)
    tokens: list[list[int]]        # its token ids
    finish_reasons: list[str]      # "stop" (stop id or string), "length", "capacity", "interrupted"
    prompt_tokens: list[list[int]]  # the prompts as the model saw them (chat template applied)
    result: Any                    # the GenerateResult (acceptance lengths, timings)


def generate_text(target, draft, tokenizer, prompts, *, system: str | None = None, thinking: bool = False,
                  chat_template: bool = True, stop: Sequence[str] | str | None = None, stop_token_ids=None,
                  cancel: Callable[[], bool] | None = None, **kwargs) -> TextResult:
    """Generate from text. `prompts`: a string, a list of strings (user turns), a conversation (list
    of {"role", "content"} dicts) or a list of conversations. The chat template is applied unless
    `chat_template=False` (then each string is tokenized as is). Stop ids default to the tokenizer's
    eos; `stop` adds stop strings. `cancel()` returning True stops the generation (what was
    committed is returned, finish reason "interrupted"). Other keywords go to `generate`
    (max_new_tokens, temperature, top_p, top_k, block_size, seed, attention_impl, capacity).
    """
    from dflash_jax.decode import generate

    if tokenizer is None:
        raise ValueError("generate_text needs a tokenizer (use generate for token ids)")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of strings or a list of conversations")
    ids = []
    for i, p in enumerate(prompts):
        if chat_template:
            ids.append(apply_chat_template(tokenizer, p, system=system, thinking=thinking))
        elif isinstance(p, str):
            ids.append(list(tokenizer.encode(p, add_special_tokens=False)))
        else:
            raise ValueError(f"prompt {i}: a conversation needs the chat template (chat_template=True)")
        if not ids[-1]:
            raise ValueError(f"prompt {i} tokenizes to nothing")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    stop_ids = eos_token_ids(tokenizer) if stop_token_ids is None else stop_token_ids
    user_commit = kwargs.pop("on_commit", None)
    watcher = StopWatcher(len(ids), tokenizer, stops, [stop_ids] if isinstance(stop_ids, int) else stop_ids,
                          kwargs.get("max_new_tokens", 256), cancel)

    def on_commit(rows):
        stop_now = watcher(rows)
        if user_commit is not None and user_commit(rows):
            return True
        return stop_now

    res = generate(target, draft, ids, stop_token_ids=stop_ids or None, on_commit=on_commit, **kwargs)
    texts, toks, reasons = [], [], []
    for i, row in enumerate(res.tokens):
        t, text, reason = watcher.apply(row, res.finish_reasons[i], i)
        toks.append(t)
        texts.append(text)
        reasons.append(reason)
    return TextResult(texts=texts, tokens=toks, finish_reasons=reasons, prompt_tokens=ids, result=res)
