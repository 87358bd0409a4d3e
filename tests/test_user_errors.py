"""What a new user hits (issue 20): each item's refusal or behaviour, through the CLIs' `main(argv)`
(exit code 2, one line, no traceback) or the library (the exception type and message).

Shares test_cli.py's tiny float32 target + draft + byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import _thread
import io
import json
import os
import signal
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

    # interrupt_main does nothing while SIGINT is ignored or default (CI's session 31 run: some earlier
    # test in the same worker left it so): Ctrl-C's own handler, Python's, for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, _thread.interrupt_main).start()
        t0 = time.monotonic()
        out = gen_cli.run_interruptible(work, cancel)
    finally:
        signal.signal(signal.SIGINT, previous)
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
                           max_new_tokens=12, verify_width="block")
    assert len(out.texts) == 2 and out.finish_reasons[0] in ("stop", "length")
    assert out.texts[0] == tok.decode(out.tokens[0], skip_special_tokens=True)
    ref = dj.generate(target, draft, [data.apply_chat_template(tok, "Tell me a story.")], max_new_tokens=12,
                      stop_token_ids=[tc.IM_END], verify_width="block")
    assert out.tokens[0] == ref.tokens[0]
    cut = out.texts[0][2:4]
    if cut:
        one = dj.generate_text(target, draft, tok, "Tell me a story.", max_new_tokens=12, stop=cut, verify_width="block")
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


# ----------------------------------------------------------------------------------------- issue 33
_SHALLOW = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16)


def _with_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as Python's json writes them
    return str(dst)


def test_a_huge_block_size_is_refused_naming_the_limit(models, tmp_path, capsys):
    limit = validation.MAX_BLOCK_SIZE
    with pytest.raises(ConfigError, match=f"draft: block_size=100000 must be an integer in \\[1, {limit}\\]"):
        DraftConfig.for_target(TargetConfig(**_SHALLOW), block_size=100000)
    DraftConfig.for_target(TargetConfig(**_SHALLOW), block_size=limit)  # the limit itself is fine
    big = _with_config(models[1], tmp_path / "draft", block_size=100000)
    with pytest.raises(ConfigError, match="block_size=100000 must be an integer in"):
        dj.load_draft(big)
    line = _usage_error(gen_cli, ["--model", models[0], "--draft", big, "hi"], capsys)
    assert f"block_size=100000 must be an integer in [1, {limit}]" in line


@pytest.mark.parametrize("field,value", [("rope_theta", float("nan")), ("rope_theta", float("inf")),
                                         ("rope_theta", 0), ("rope_theta", -1e6), ("rope_theta", "1e6x"),
                                         ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6),
                                         ("num_hidden_layers", float("inf")), ("vocab_size", float("nan"))])
def test_non_finite_or_impossible_config_numbers_name_the_field(field, value):
    d = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1e4)
    with pytest.raises(ConfigError, match=f"target: {field}=.* must be"):
        TargetConfig.from_dict({**d, field: value})
    if field == "rope_theta":  # also when built by hand
        with pytest.raises(ConfigError, match="rope_theta"):
            TargetConfig(**{**_SHALLOW, "rope_theta": value if not isinstance(value, str) else float("nan")})


def test_a_nan_rope_theta_on_disk_is_refused(models, tmp_path):
    bad = _with_config(models[0], tmp_path / "t", rope_theta=float("nan"), rope_parameters=None)
    assert "NaN" in (tmp_path / "t" / "config.json").read_text()
    with pytest.raises(ConfigError, match="target: rope_theta=nan must be a finite number > 0"):
        dj.load_target(bad)
    draft = _with_config(models[1], tmp_path / "d", dflash_config={"mask_token_id": float("inf")})
    with pytest.raises(ConfigError, match="draft: mask_token_id=inf must be an integer >= 0"):
        dj.load_draft(draft)


@pytest.mark.parametrize("kind", ["int8", "bool", "int32"])
def test_integer_and_bool_weights_are_refused_naming_the_tensor(models, tmp_path, kind):
    name = "model.layers.0.mlp.up_proj.weight"
    bad = _rewrite(models[0], tmp_path / kind, name, lambda t: (t > 0) if kind == "bool" else t.astype(kind))
    with pytest.raises(ValueError, match=f"tensor {name} has dtype {kind}; weights must be floating point"):
        dj.load_target(bad)


def test_for_target_given_the_module_says_to_pass_its_config():
    module = dj.init_target(TargetConfig(**_SHALLOW), dtype="float32")
    with pytest.raises(TypeError, match="takes a TargetConfig, got Qwen3 \\(pass target.config"):
        DraftConfig.for_target(module)
    assert DraftConfig.for_target(module.config).hidden_size == 32


def test_on_commit_that_is_not_callable_is_refused_before_compiling(loaded):
    target, _, _ = loaded
    from dflash_jax.decode import precompile
    for call in (dj.generate, precompile):
        with pytest.raises(TypeError, match="on_commit must be a callable .* got 5"):
            call(target, None, [[1, 2]], max_new_tokens=2, on_commit=5)


def test_a_kernel_fallback_is_said_once_per_reason(caplog):
    """The GPU kernel cannot take a GQA group of 3; every trace (each layer, each program) falls back
    to XLA, and the warning is logged once, however many times it happens."""
    import jax
    import jax.numpy as jnp
    import pallas_kernels
    from pallas_kernels import _common
    caplog.set_level("WARNING", logger="pallas_kernels.attention")
    _common._WARNED.clear()
    for T in (1, 2, 4, 1, 2):
        q = jnp.ones((1, T, 6, 64), jnp.float32)
        kv = jnp.ones((1, 2, 128, 64), jnp.float32)
        out = jax.jit(lambda q, k, e: pallas_kernels.block_attention(q, k, k, e, impl="gpu", interpret=True))(
            q, kv, jnp.full((1, T), 5, jnp.int32))
        assert out.shape == q.shape
    said = [r for r in caplog.records if "cannot take" in r.getMessage()]
    assert len(said) == 1 and "GQA group 3 is not a power of two" in said[0].getMessage()
    q = jnp.ones((1, 1, 2, 96), jnp.float32)  # another reason (head_dim 96) is said too, once
    for _ in range(3):
        pallas_kernels.block_attention(q, jnp.ones((1, 2, 128, 96)), jnp.ones((1, 2, 128, 96)),
                                       jnp.ones((1, 1), jnp.int32), impl="gpu", interpret=True)
    said = [r for r in caplog.records if "cannot take" in r.getMessage()]
    assert len(said) == 2 and "head_dim=96" in said[1].getMessage()


def test_skip_absent_tpu_leaves_a_chosen_platform_and_an_accelerator_alone(monkeypatch):
    import jax
    calls = []
    monkeypatch.setattr(jax.config, "update", lambda k, v: calls.append((k, v)))
    assert gen_cli.skip_absent_tpu() is False  # JAX_PLATFORMS=cpu (this process), backends running
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(gen_cli, "_accelerator_attached", lambda: True)  # a TPU VM or a GPU machine
    assert gen_cli.skip_absent_tpu() is False
    monkeypatch.setattr(gen_cli, "_accelerator_attached", lambda: False)
    monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
    assert gen_cli.skip_absent_tpu() is False and calls == []


@pytest.mark.slow
def test_no_libtpu_noise_off_a_tpu_vm():
    """With libtpu installed (the test extra) and no accelerator attached, JAX's TPU probe prints
    libtpu's errors; after skip_absent_tpu (what every CLI calls first) nothing is printed."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("libtpu") is None or gen_cli._accelerator_attached():
        pytest.skip("needs libtpu installed and no TPU or GPU attached")
    # a fresh user's environment: no platform chosen, none of the TPU_* settings that quiet libtpu
    # (tests that compile for TPU ahead of time set TPU_WORKER_HOSTNAMES in this process)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")

    def stderr(code):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=600, cwd=root).stderr

    probe = "import jax; assert jax.devices()[0].platform == 'cpu'"
    assert "TPU" in stderr(probe)  # the noise this removes (if libtpu stops printing, drop this line)
    assert stderr("from dflash_jax.cli.generate import skip_absent_tpu; skip_absent_tpu(); " + probe) == ""


def test_the_test_command_uses_its_own_venv():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    read = lambda *p: open(os.path.join(root, *p), encoding="utf-8").read()
    script = read("scripts", "test.sh")
    assert ". .venv-test/bin/activate" in script and ".venv/" not in script
    assert "bash scripts/test.sh" in read(".ci", "run")
    assert ".venv-test/" in read(".gitignore").splitlines()
    readme = read("README.md")
    assert "`.venv-test`" in readme and "python3 -m venv .venv &&" in readme


def test_default_dtype_is_float32_only_for_the_embedded_pair_on_cpu():
    import argparse
    ns = lambda **kw: argparse.Namespace(**{"dtype": None, "default_pair": False, **kw})
    assert gen_cli.default_dtype(ns(default_pair=True)) == "float32"  # this process runs on the CPU
    assert gen_cli.default_dtype(ns()) == "bfloat16"
    assert gen_cli.default_dtype(ns(default_pair=True, dtype="bfloat16")) == "bfloat16"
    assert gen_cli.build_parser().parse_args([]).dtype is None
    assert "float32 for the embedded demo pair on CPU" in " ".join(gen_cli.build_parser().format_help().split())


@pytest.mark.slow
def test_benchmark_says_why_bf16_rows_can_differ_and_the_cpu_pair_runs_in_float32(models, capsys, monkeypatch,
                                                                                   tmp_path):
    import dflash_jax.assets as assets
    monkeypatch.setattr(assets, "default_pair", lambda: models)
    argv = ["--max-samples", "1", "--max-new-tokens", "8", "--output", str(tmp_path / "r.json")]
    code, out, err = _run(bench_cli, argv, capsys)
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and r["dtype"] == "float32" and r["greedy_match_rate"] == 1.0, err
    assert "round differently" not in out
    code, out, err = _run(bench_cli, argv + ["--dtype", "bf16"], capsys)
    assert code == 0, err
    assert ("in bfloat16 the 8-row verify and the 1-row step round differently" in out
            and "--dtype float32 shows identity" in out)


def test_readme_says_what_the_demo_prints_and_how_long_random_init_takes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = " ".join(open(os.path.join(root, "README.md"), encoding="utf-8").read().split())
    assert "14 M-parameter model trained from scratch on Python's standard library" in readme
    assert "not an assistant" in readme and "code-like text" in readme
    i = readme.index("--random-init qwen3-0.6b --prompt-len 64")
    assert "minutes" in readme[i:i + 400] and "2-core" in readme[i:i + 400]


def test_the_embedded_pair_runs_the_gpu_kernels_without_a_fallback(caplog):
    """The shipped pair's heads (target and draft) make a power-of-two GQA group, so the default demo
    runs our GPU attention kernel (interpret mode here) and never says "cannot take" (issue 33: the
    old pair's group of 3 fell back to XLA on every GPU call)."""
    import jax
    import jax.numpy as jnp
    import pallas_kernels
    from pallas_kernels import _common
    from dflash_jax.assets import default_pair
    pair = default_pair()
    if pair is None:
        pytest.skip("this checkout carries no embedded pair")
    caplog.set_level("WARNING", logger="pallas_kernels.attention")
    _common._WARNED.clear()
    for path in pair:
        cfg = json.load(open(os.path.join(path, "config.json")))
        hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        group = hq // hkv
        assert hq % hkv == 0 and group & (group - 1) == 0, (path, hq, hkv)
        q = jnp.ones((1, 2, hq, d), jnp.float32)
        kv = jnp.ones((1, hkv, 128, d), jnp.float32)
        out = jax.jit(lambda q, k, e: pallas_kernels.block_attention(q, k, k, e, impl="gpu", interpret=True))(
            q, kv, jnp.full((1, 2), 5, jnp.int32))
        assert out.shape == q.shape
    assert not [r.getMessage() for r in caplog.records if "cannot take" in r.getMessage()]


@pytest.mark.slow
def test_server_bad_input_battery_is_all_clean():
    """Issue 33's server battery on this checkout: every one of its 53 cases is a clean 400 / 413. (The
    loaders' battery, 41 processes, is scripts/bad_input_battery.py: its cases are this file's tests
    above, one by one; counts in docs/perf-log.md.)"""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "serve_bad_input_battery.py")], cwd=root,
                       env=env, capture_output=True, text=True, timeout=420)
    assert r.stdout.strip().splitlines()[-1] == '{"clean": 53} of 53', r.stdout[-3000:] + r.stderr[-2000:]
