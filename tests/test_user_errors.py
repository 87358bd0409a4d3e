"""What a new user hits (issue 20): each item's refusal or behaviour, through the CLIs' `main(argv)`
(exit code 2, one line, no traceback) or the library (the exception type and message).

Shares test_cli.py's tiny float32 target + draft + byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import _thread
import io
import json
import os
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import data, validation
from dflash_jax.config import ConfigError, DraftConfig, TargetConfig
from dflash_jax.cli import benchmark as bench_cli
from dflash_jax.cli import generate as gen_cli
from tests import test_cli as tc

_usage_error, _run = tc._usage_error, tc._run


@pytest.fixture(scope="module")
def models(cli_models):
    return cli_models  # test_cli.py's pair, built once in conftest.py


@pytest.fixture(scope="module")
def loaded(models):
    from transformers import AutoTokenizer
    target = dj.load_target(models[0], dtype="float32")
    return target, dj.load_draft(models[1], target=target, dtype="float32"), AutoTokenizer.from_pretrained(models[0])


def _base(models, *extra):
    return ["--model", models[0], "--draft", models[1], "--dtype", "float32", *extra]


# ----------------------------------------------------------------------------------------- item 1
def test_jinja2_is_a_runtime_dependency():
    import tomllib
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("jinja2") for d in deps)  # the fresh-venv test (slow) proves it end to end


# ----------------------------------------------------------------------------------------- item 2
# on_commit's stop (True) and its exception arriving as itself: tests/test_speculative.py
# (test_on_commit_true_stops_the_loop_with_partial_tokens, test_on_commit_exception_reaches_the_caller)


def test_ctrl_c_while_waiting_cancels_and_keeps_the_result():
    """The main thread's wait is interruptible: KeyboardInterrupt sets the cancel event, the work
    (the generation) sees it at its next commit and returns what it has."""
    cancel = threading.Event()

    def work():
        for i in range(3000):  # 30 s: the interrupt lands long before, even on a loaded machine
            if cancel.is_set():
                return f"stopped at {i}"
            time.sleep(0.01)
        return "ran to the end"

    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.monotonic()
    out = gen_cli.run_interruptible(work, cancel)
    assert cancel.is_set() and out.startswith("stopped at") and time.monotonic() - t0 < 10


# ----------------------------------------------------------------------------------------- item 3
@pytest.mark.parametrize("argv,needle", [
    (["--max-new-tokens", "1000000000"], "--max-new-tokens 1000000000 is beyond the model's context: "
                                         "max_position_embeddings is 4096"),
    (["--max-new-tokens", "3000000000"], "--max-new-tokens 3000000000 overflows the int32 lengths"),
    (["--top-k", "3000000000"], "--top-k 3000000000 is above the vocabulary size 320"),
    (["--prompt-ids", ",".join(["5"] * 300), "--max-new-tokens", "3900"],
     "prompt of 300 tokens + --max-new-tokens 3900 = 4200 exceeds the model's max_position_embeddings 4096"),
])
def test_limits_that_cannot_be_met_are_refused(models, capsys, argv, needle):
    assert needle in _usage_error(gen_cli, _base(models, *argv), capsys)


@pytest.mark.slow
def test_length_limit_uses_true_lengths_not_the_bucket(loaded, recwarn):
    target, draft, _ = loaded
    small = dj.init_target(TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512),
                           dtype="float32")
    from dflash_jax.decode import precompile
    precompile(small, None, [[1] * 265], max_new_tokens=64)  # bucket 512 + 64 > 512, true 329 fits
    assert not [w for w in recwarn if "max_position" in str(w.message)]
    with pytest.raises(ValueError, match="prompt of 500 tokens \\+ max_new_tokens 64 = 564 exceeds"):
        dj.generate(small, None, [[1] * 500], max_new_tokens=64)
    for kw, msg in ((dict(max_new_tokens=3_000_000_000), "beyond the model's context"),
                    (dict(top_k=3_000_000_000), "above the vocabulary size 64"),
                    (dict(capacity=3_000_000_000), "capacity must be an integer in")):
        with pytest.raises(ValueError, match=msg):
            dj.generate(small, None, [[1, 2]], **kw)


# ----------------------------------------------------------------------------------------- item 4
def test_benchmark_refuses_an_output_path_it_cannot_write_before_running(models, tmp_path, capsys):
    argv = _base(models, "--dataset", "gsm8k", "--max-samples", "1", "--output", str(tmp_path / "no" / "r.json"))
    line = _usage_error(bench_cli, argv, capsys)
    assert "--output" in line and "does not exist" in line
    line = _usage_error(bench_cli, _base(models, "--dataset", "gsm8k", "--plot", str(tmp_path / "x" / "p.png")),
                        capsys)
    assert "--plot" in line


# ----------------------------------------------------------------------------------------- item 5
@pytest.mark.slow
def test_a_model_dir_without_tokenizer_files_is_an_error_and_prompt_ids_need_none(models, tmp_path, capsys):
    import shutil
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(models[0]):
        if f in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(os.path.join(models[0], f), bare / f)
    line = _usage_error(gen_cli, ["--model", str(bare), "--draft", "none", "--dtype", "float32", "hi"], capsys)
    assert "has no tokenizer files" in line and "--prompt-ids" in line
    code, out, err = _run(gen_cli, ["--model", str(bare), "--draft", "none", "--dtype", "float32",
                                    "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["text"] is None and 1 <= r["new_tokens"] <= 6  # ids out: no tokenizer loaded


# ----------------------------------------------------------------------------------------- item 6
def test_broken_files_and_configs_are_named(models, tmp_path):
    import shutil
    d = tmp_path / "t"
    shutil.copytree(models[0], d)
    for content in (b"", b"garbage not safetensors", (d / "model.safetensors").read_bytes()[:1000]):
        (d / "model.safetensors").write_bytes(content)
        with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
            dj.load_target(str(d))
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    with pytest.raises(ConfigError, match="num_attention_heads=0 must be an integer >= 1"):
        dj.load_target(str(d))
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        dj.load_target(str(d))
    with pytest.raises(ValueError, match="path_or_hub_id must be a local directory or a hub id"):
        dj.load_target(None)


def test_bad_library_inputs_are_one_line_errors(loaded, tmp_path):
    target, draft, _ = loaded
    with pytest.raises(ValueError, match="prompt 0 must be a flat list of token ids, got a ragged nested list"):
        dj.generate(target, None, [[[1, 2], [3]]], max_new_tokens=2)
    with pytest.raises(ValueError, match="got one flat list of ints"):
        dj.generate(target, None, [1, 2, 3], max_new_tokens=2)
    for seed in (-1, 1 << 32):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
            dj.generate(target, None, [[1, 2]], max_new_tokens=2, seed=seed)
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "fine"}\n{"question": 7}\n')
    with pytest.raises(ValueError, match="q.jsonl: row 2: a gsm8k row's prompt field is not a string"):
        data.load_prompts(data_file=str(bad))


@pytest.mark.parametrize("argv,needle", [
    (["--seed", "-1", "hi"], "--seed must be an integer in [0, 2**32), got -1"),
    (["--seed", str(1 << 32), "hi"], "--seed must be an integer in [0, 2**32)"),
    (["\udcff\udcfe"], "the prompt is not valid UTF-8 text"),
])
def test_bad_cli_inputs(models, capsys, argv, needle):
    assert needle in _usage_error(gen_cli, _base(models, *argv), capsys)


def test_invalid_utf8_on_stdin(models, capsys, monkeypatch):
    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"caf\xe9 au lait")

        def isatty(self):
            return False

    monkeypatch.setattr("sys.stdin", Stdin())
    assert "the prompt on stdin is not valid UTF-8" in _usage_error(gen_cli, _base(models), capsys)


# ----------------------------------------------------------------------------------------- item 8
def test_offline_hub_fails_fast_and_the_draft_is_resolved_first(models, capsys, monkeypatch, tmp_path):
    import huggingface_hub.constants as hc
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", hc.HF_HUB_OFFLINE)  # restored after the test
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    t0 = time.monotonic()
    line = _usage_error(gen_cli, ["--model", models[0], "--draft", "nobody/no-such-draft", "hi"], capsys)
    assert time.monotonic() - t0 < 5
    assert line.startswith("python -m dflash_jax.generate: error: --draft nobody/no-such-draft:") and "offline" in line
    err = capsys.readouterr().err
    assert "loading target" not in err  # refused before the target's weights


# ----------------------------------------------------------------------------------------- item 9
def _rewrite(src, dst, name, fn):
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors[name] = fn(tensors[name])
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_shape_and_nan_errors_name_the_hf_tensor(models, tmp_path):
    q = "model.layers.1.self_attn.q_proj.weight"
    bad = _rewrite(models[0], tmp_path / "shape", q, lambda t: t[:-1])
    with pytest.raises(ValueError, match=f"tensor {q} has shape \\(63, 64\\), the config implies \\(64, 64\\)"):
        dj.load_target(bad)
    down = "model.layers.2.mlp.down_proj.weight"
    nan = _rewrite(models[0], tmp_path / "nan", down, lambda t: np.where(np.arange(t.size).reshape(t.shape) == 5,
                                                                          np.nan, t).astype(t.dtype))
    with pytest.raises(ValueError, match=f"tensor {down} holds NaN or inf values"):
        dj.load_target(nan)


def test_for_target_never_builds_negative_taps_and_dtypes_agree():
    shallow = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16)
    cfg = DraftConfig.for_target(shallow, num_layers=5)
    assert cfg.target_layer_ids and all(0 <= t < 2 for t in cfg.target_layer_ids)
    cfg.check_fits(shallow)
    parser = gen_cli.build_parser()
    for name in ("fp16", "bf16", "float32"):
        assert parser.parse_args(["--dtype", name]).dtype == validation.dtype_name(name)
        dj.init_target(shallow, dtype=name)
    with pytest.raises(ValueError, match="dtype='int8'"):
        dj.init_target(shallow, dtype="int8")


@pytest.mark.parametrize("argv,needle", [
    (["--draft", "none", "--block-size", "4", "hi"], "--block-size 4 needs a draft"),
    (["--draft", "DRAFT", "--raw-prompt", "--system", "be brief", "hi"], "--system applies to the chat template"),
    (["--draft", "DRAFT", "--raw-prompt", "--thinking", "on", "hi"], "--thinking applies to the chat template"),
    (["--draft", "DRAFT", "--prompt-ids", "1,2", "hi"], "give one prompt source, got a positional prompt and --prompt-ids"),
])
def test_ignored_flags_are_refused(models, capsys, argv, needle):
    argv = ["--model", models[0]] + [models[1] if a == "DRAFT" else a for a in argv]
    assert needle in _usage_error(gen_cli, argv, capsys)


# ----------------------------------------------------------------------------------------- item 10
@pytest.mark.slow
def test_prompt_file_batch_json_with_finish_reasons(models, tmp_path, capsys):
    pf = tmp_path / "p.jsonl"
    pf.write_text('"Tell me a story."\n{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "a"}, '
                  '{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}\n')
    code, out, err = _run(gen_cli, _base(models, "--prompt-file", str(pf), "--max-new-tokens", "8", "--json"), capsys)
    rows = [json.loads(l) for l in out.strip().splitlines()]
    assert code == 0 and [r["index"] for r in rows] == [0, 1, 2]
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert rows[2]["prompt_tokens"] > rows[1]["prompt_tokens"]  # the three turns
    # the single-prompt run of the first line gives the same tokens as its batch row (greedy, lossless)
    code, out, _ = _run(gen_cli, _base(models, "--max-new-tokens", "8", "--json", "Tell me a story."), capsys)
    assert json.loads(out)["tokens"] == rows[0]["tokens"]


def test_messages_file_is_a_multi_turn_prompt(models, tmp_path, capsys):
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    mf = tmp_path / "chat.json"
    mf.write_text(json.dumps(conv))
    code, out, _ = _run(gen_cli, _base(models, "--messages", str(mf), "--max-new-tokens", "4", "--json"), capsys)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models[0])
    assert code == 0 and json.loads(out)["prompt_tokens"] == len(data.apply_chat_template(tok, conv))
    mf.write_text('[{"role": "robot", "content": "x"}]')
    assert "--messages" in _usage_error(gen_cli, _base(models, "--messages", str(mf)), capsys)


def test_stop_strings_and_stop_ids_cut_the_output(models, capsys):
    prompt = "Tell me a story."
    base = _base(models, "--max-new-tokens", "24", "--ignore-eos", "--json", prompt)
    code, out, _ = _run(gen_cli, base, capsys)
    full = json.loads(out)
    assert full["finish_reason"] == "length" and len(full["text"]) > 6
    stop = full["text"][4:6]
    code, out, _ = _run(gen_cli, base + ["--stop", stop], capsys)
    r = json.loads(out)
    assert r["finish_reason"] == "stop" and r["text"] == full["text"][:full["text"].find(stop)]
    assert r["tokens"] == full["tokens"][:len(r["tokens"])] and len(r["tokens"]) < len(full["tokens"])
    # streamed, the stop string is never printed
    code, streamed, _ = _run(gen_cli, [a for a in base if a != "--json"] + ["--stop", stop], capsys)
    assert streamed == r["text"] + "\n"
    sid = full["tokens"][3]
    code, out, _ = _run(gen_cli, base + ["--stop-token-ids", str(sid)], capsys)
    r = json.loads(out)
    assert r["finish_reason"] == "stop" and r["tokens"] == full["tokens"][:full["tokens"].index(sid) + 1]


@pytest.mark.slow
def test_generate_text_helper(loaded):
    target, draft, tok = loaded
    out = dj.generate_text(target, draft, tok, ["Tell me a story.", [{"role": "user", "content": "hi"}]],
                           max_new_tokens=12)
    assert len(out.texts) == 2 and out.finish_reasons[0] in ("stop", "length")
    assert out.texts[0] == tok.decode(out.tokens[0], skip_special_tokens=True)
    ref = dj.generate(target, draft, [data.apply_chat_template(tok, "Tell me a story.")], max_new_tokens=12,
                      stop_token_ids=[tc.IM_END])
    assert out.tokens[0] == ref.tokens[0]
    cut = out.texts[0][2:4]
    if cut:
        one = dj.generate_text(target, draft, tok, "Tell me a story.", max_new_tokens=12, stop=cut)
        assert one.texts[0] == out.texts[0][:out.texts[0].find(cut)] and one.finish_reasons == ["stop"]


def test_help_shows_defaults_and_where_datasets_come_from(capsys):
    with pytest.raises(SystemExit):
        gen_cli.main(["--help"])
    out = capsys.readouterr().out
    assert "(default: 256)" in out and "--prompt-file" in out and "--stop" in out
    with pytest.raises(SystemExit):
        bench_cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 2048)" in out and "Bundled with the package (no hub): gsm8k, humaneval, mt-bench" in out
    assert "from the hub" in out and "math500, mbpp" in out
