"""Prompt sets for benchmarks (HF `datasets` or local JSONL) and the chat template that turns a
user turn into target token ids.

The prompt formats are the DFlash paper's (and z-lab/dflash `benchmark.py`'s, which vLLM's acceptance
test copies): only the wording below, first user turn, chat template applied, thinking off. Changing a
format changes τ, so the benchmark numbers are only comparable with the paper while these stay exact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

__all__ = ["DATASETS", "load_prompts", "detect_format", "format_turns", "apply_chat_template",
           "normalize_dataset_name", "check_messages", "read_prompt_file", "BUNDLED", "HUB_ONLY"]

_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL = ("Write a solution to the following problem and make sure that it passes the tests:\n"
              "```python\n{prompt}\n```")


def _gsm8k(row: Mapping[str, Any]) -> list[str]:
    return [row["question"] + _BOXED]


def _math500(row: Mapping[str, Any]) -> list[str]:
    return [row["problem"] + _BOXED]


def _humaneval(row: Mapping[str, Any]) -> list[str]:
    return [_HUMANEVAL.replace("{prompt}", row["prompt"])]


def _mbpp(row: Mapping[str, Any]) -> list[str]:
    # z-lab uses the "sanitized" config, whose task text is `prompt`; the "full" config calls it `text`.
    return [row["prompt"] if "prompt" in row else row["text"]]


def _mt_bench(row: Mapping[str, Any]) -> list[str]:
    # FastChat's question.jsonl has `turns`; HuggingFaceH4/mt_bench_prompts has `prompt` (a list).
    turns = row.get("turns", row.get("prompt"))
    return [turns] if isinstance(turns, str) else list(turns)


# name → (HF hub dataset args, kwargs, formatter). Hub ids and splits are z-lab's.
DATASETS: dict[str, tuple[tuple[str, ...], dict[str, str], Callable[[Mapping[str, Any]], list[str]]]] = {
    "gsm8k": (("openai/gsm8k", "main"), {"split": "test"}, _gsm8k),
    "humaneval": (("openai/openai_humaneval",), {"split": "test"}, _humaneval),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), {"split": "train"}, _mt_bench),
    "math500": (("HuggingFaceH4/MATH-500",), {"split": "test"}, _math500),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), {"split": "test"}, _mbpp),
}

_ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "math-500": "math500", "math_500": "math500",
            "human-eval": "humaneval", "human_eval": "humaneval", "openai_humaneval": "humaneval"}


def normalize_dataset_name(name: str) -> str:
    """The canonical dataset name, or ValueError naming the known ones."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return key


def detect_format(row: Mapping[str, Any]) -> str:
    """Which prompt set a JSONL row comes from, judged by its fields."""
    # MBPP before HumanEval: sanitized MBPP rows also carry `prompt` and `task_id`.
    if "test_list" in row and ("text" in row or "prompt" in row):
        return "mbpp"
    if "question" in row:
        return "gsm8k"
    if "prompt" in row and "task_id" in row:
        return "humaneval"
    if "turns" in row:
        return "mt-bench"
    if "problem" in row:
        return "math500"
    raise ValueError(f"cannot tell the prompt format from fields {sorted(row)}; expected `question` (gsm8k), "
                     "`prompt`+`task_id` (humaneval), `turns` (mt-bench), `problem` (math500) or "
                     "`text`/`prompt`+`test_list` (mbpp); or name the dataset with the file")


def format_turns(dataset: str, row: Mapping[str, Any]) -> list[str]:
    """The user turns of one row in the paper's format."""
    name = normalize_dataset_name(dataset)
    try:
        turns = DATASETS[name][2](row)
    except KeyError as e:
        raise ValueError(f"a {name} row lacks the field {e.args[0]!r} (fields: {sorted(row)})") from None
    except TypeError:  # e.g. a number where the text belongs: `question + suffix`
        raise ValueError(f"a {name} row's prompt field is not a string (fields: "
                         f"{ {k: type(v).__name__ for k, v in row.items()} })") from None
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"a {name} row has no user turn text")
    return turns


def _row_id(row: Mapping[str, Any], index: int) -> str:
    for key in ("task_id", "question_id", "unique_id", "id"):
        if key in row:
            return str(row[key])
    return str(index)


def _text_lines(path: str):
    """(line number, text) of a UTF-8 file; a line that is not UTF-8 is a ValueError naming the
    file and the line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None


def _is_not_a_file(path: str, what: str) -> FileNotFoundError:
    """The error of a path that is no file (FileNotFoundError, as the callers catch it), saying
    which: missing or a directory."""
    if os.path.isdir(path):
        return FileNotFoundError(f"{what} {path} is a directory, not a file")
    return FileNotFoundError(f"{what} {path} does not exist")


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise _is_not_a_file(path, "data file")
    rows = []
    for n, line in _text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object per line")
        rows.append(row)
    if not rows:
        raise ValueError(f"data file {path} has no rows")
    return rows


def _load_hub(name: str) -> list[dict[str, Any]]:
    try:
        import datasets  # optional: only needed to fetch prompt sets from the hub
    except ImportError:
        raise ValueError(f"loading {name!r} from the hub needs the `datasets` package: "
                         "pip install datasets, or pass --data-file PATH.jsonl") from None
    args, kwargs, _ = DATASETS[name]
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # network, auth and cache errors all mean the same to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"could not load {name!r} ({'/'.join(args)}) from the hub: {first}; "
                         "pass --data-file PATH.jsonl to use a local copy") from None
    return [dict(row) for row in ds]


# Prompt sets shipped with the package (unchanged source files, see datasets/README.md): read
# locally, so the paper's three main benchmarks need no hub.
_BUNDLED = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mt-bench": "mt_bench.jsonl"}
BUNDLED = tuple(_BUNDLED)
HUB_ONLY = tuple(n for n in DATASETS if n not in _BUNDLED)


def bundled_path(name: str) -> str | None:
    """The packaged JSONL of a prompt set, or None when it is only on the hub."""
    f = _BUNDLED.get(name)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "datasets", f) if f else None
    return path if path and os.path.isfile(path) else None


def load_prompts(dataset: str | None = None, data_file: str | None = None,
                 max_samples: int | None = None) -> list[dict[str, Any]]:
    """Prompts as `[{"id": str, "turns": [user turn, ...]}]` in the paper's format.

    `data_file` (JSONL) is read locally; its format is `dataset` when given, else detected from the
    first row's fields. Without a file, GSM8K, HumanEval and MT-Bench come from the copies bundled with
    the package, MATH-500 and MBPP from the hub through `datasets`. The first
    `max_samples` rows are kept, in file order, so that runs are reproducible.
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    if data_file is not None:
        rows = _read_jsonl(data_file)
        name = normalize_dataset_name(dataset) if dataset else detect_format(rows[0])
    elif dataset is not None:
        name = normalize_dataset_name(dataset)
        bundled = bundled_path(name)
        rows = _read_jsonl(bundled) if bundled else _load_hub(name)
    else:
        raise ValueError("give a dataset name or a data file")
    if max_samples is not None:
        rows = rows[:max_samples]
    out = []
    where = data_file or name
    for i, row in enumerate(rows):
        try:
            turns = format_turns(name, row)
        except ValueError as e:
            raise ValueError(f"{where}: row {i + 1}: {e}") from None
        out.append({"id": _row_id(row, i), "turns": turns, "dataset": name})
    return out


_ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str = "messages") -> list[dict[str, str]]:
    """A conversation: a non-empty list of {"role": system|user|assistant, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty JSON list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in _ROLES:
            raise ValueError(f"{where}[{i}] must be {{\"role\": one of {'/'.join(_ROLES)}, \"content\": text}}, "
                             f"got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def apply_chat_template(tokenizer, user_text, system: str | None = None,
                        thinking: bool = False) -> list[int]:
    """Token ids of one user turn (and an optional system turn), or of a whole conversation (a list
    of {"role", "content"} messages as `user_text`), with the generation prompt.

    Qwen3's template reads `enable_thinking`; templates that do not use it ignore it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass raw text (--raw-prompt) or a tokenizer "
                         "with a chat_template")
    if isinstance(user_text, str):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}]
    else:
        messages = check_messages(user_text)
        if system:
            messages = [{"role": "system", "content": system}] + messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    # The template already holds every special token; letting encode add BOS would double it.
    return list(tokenizer.encode(text, add_special_tokens=False))


def read_prompt_file(path: str) -> list:
    """Prompts of `generate --prompt-file`, one per line: a JSONL line is a string (the user turn),
    an object with `prompt` (text) or `messages` (a conversation), or a list of messages; in a file
    that is not JSONL every non-empty line is one user turn. Returns str or message lists."""
    if not os.path.isfile(path):
        raise _is_not_a_file(path, "prompt file")
    lines = [(n, l.rstrip("\r\n")) for n, l in _text_lines(path) if l.strip()]
    if not lines:
        raise ValueError(f"prompt file {path} has no prompts")
    jsonl = path.endswith(".jsonl") or lines[0][1].lstrip().startswith(("{", "[", '"'))
    if not jsonl:
        return [l for _, l in lines]
    out: list = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if isinstance(row, dict) and "messages" in row:  # a conversation, never text
            out.append(check_messages(row["messages"], f"{path}:{n}: messages"))
            continue
        if isinstance(row, dict):
            row = row.get("prompt")
        if isinstance(row, str):
            if not row.strip():
                raise ValueError(f"{path}:{n}: the prompt is empty")
            out.append(row)
        elif isinstance(row, list):
            out.append(check_messages(row, f"{path}:{n}: messages"))
        else:
            raise ValueError(f"{path}:{n}: expected a string, {{\"prompt\": text}}, {{\"messages\": [...]}} "
                             "or a list of messages")
    return out
