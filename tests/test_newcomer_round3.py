"""What a new user hits, round 3 (issue 60): the hang, the out-of-memory kill, the misleading lines
and the silently ignored inputs, each through the CLIs' `main(argv)` (exit 2, one line) or the
library / the server (the exception or the 4xx)."""

from __future__ import annotations

import json
import os
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from tests import test_cli as tc

_usage_error, _run = tc._usage_error, tc._run


# ----------------------------------------------------------------------------------------- the hang
def test_a_request_template_that_never_ends_is_a_400_and_its_render_stops(cli_models):
    """A trusted request's template of three nested range(100000) loops is answered 400 at the
    render time limit, its thread stops (and is a daemon: it holds no process exit); a template
    writing more than the output limit is a 400 too; the server answers on."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from dflash_jax.serving.server import build_app
    from tests.test_serve import FakeGenerate, fake_engine, serving

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli_models[0])
    eng = fake_engine(FakeGenerate())
    loop = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
            "{% endfor %}{% endfor %}{% endfor %}")
    big = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    app = build_app(eng, tokenizer, model_name="tiny", trust_request_chat_template=True, template_timeout_s=0.5,
                    template_max_chars=10_000)
    before = set(threading.enumerate())
    try:
        with serving(app) as url:
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json=dict(messages=msgs, max_tokens=2, chat_template=loop),
                           timeout=20)
            assert r.status_code == 400 and "within this server's limit of 0.5 s" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "chat_template" and time.monotonic() - t0 < 10
            r = httpx.post(url + "/v1/chat/completions", json=dict(messages=msgs, max_tokens=2, chat_template=big),
                           timeout=20)
            assert r.status_code == 400 and "over this server's limit of 10000 characters" in r.text, r.text
            r = httpx.post(url + "/v1/chat/completions", json=dict(messages=msgs, max_tokens=2), timeout=20)
            assert r.status_code == 200, r.text
            for _ in range(200):  # the abandoned render is stopped, not left spinning
                left = [t for t in set(threading.enumerate()) - before if t.name == "dflash-render"]
                if not left:
                    break
                time.sleep(0.05)
            assert not left and all(t.daemon for t in set(threading.enumerate()) - before if "render" in t.name)
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------------------- the OOM kill
def test_a_selector_rank_past_the_memory_is_one_line_before_any_allocation(cli_models, tmp_path, capsys,
                                                                            monkeypatch):
    from dflash_jax import validation
    from dflash_jax.train.__main__ import main

    tp = cli_models[0]
    monkeypatch.setattr(validation, "free_memory", lambda: (10 ** 8, "test memory"))
    common = ["train", "--model", tp, "--dtype", "float32", "--data", str(tmp_path / "none"), "--out",
              str(tmp_path / "run"), "--draft-layers", "1"]
    assert main(common + ["--arch", "dflash2", "--selector-rank", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--selector-rank 100000" in err and "test memory has 0.1 GB free" in err, err
    monkeypatch.setattr(validation, "free_memory", lambda: (10 ** 6, "test memory"))
    assert main(common + ["--draft-layers", "100"]) == 2   # any flag that sizes the draft: its layers too
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "100 layers" in err and "lower --selector-rank or --draft-layers" in err, err


# ----------------------------------------------------------------------------------------- silently ignored
def test_bool_prompt_ids_are_refused_by_the_library():
    import numpy as np

    from dflash_jax import validation

    for prompts in ([[1, True, 2]], [(False, 3)], [np.array([True, False])]):
        with pytest.raises(ValueError, match="prompt 0 (holds booleans|holds non-integer values \\(bool\\))"):
            validation.check_prompts(prompts, 320)
    assert validation.check_prompts([[1, 2]], 320)[0].tolist() == [1, 2]


@pytest.mark.parametrize("cap", [0, -5.0, float("nan"), "x"])
def test_a_non_positive_dflash2_softcap_is_refused(cap):
    from dflash_jax.config import ConfigError, DraftConfig

    d = dict(architectures=["DFlash2DraftModel"], vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_target_layers=2,
             layer_types=["full_attention"],
             dflash_config=dict(mask_token_id=63, conv_kernel_size=2, conv_group_size=16, selector_rank=4,
                                selector_top_k=2))
    assert DraftConfig.from_dict(d).final_logit_softcapping is None
    assert DraftConfig.from_dict({**d, "final_logit_softcapping": 30}).final_logit_softcapping == 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping=.* must be a finite number > 0"):
        DraftConfig.from_dict({**d, "final_logit_softcapping": cap})


def test_dflash2_flags_with_arch_dflash_are_refused(tmp_path, capsys):
    from dflash_jax.train.__main__ import main

    common = ["train", "--model", str(tmp_path / "never-read"), "--data", str(tmp_path), "--out", str(tmp_path / "r")]
    for flag, value in (("--conv-kernel-size", "3"), ("--selector-rank", "8"), ("--selector-weight", "0.5")):
        assert main(common + [flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} is a DFlash2 setting" in err and "--arch dflash2" in err, err


# ----------------------------------------------------------------------------------------- training runs
def _fake_run(out, steps=(1, 2), hidden=32):
    """A run directory of saved train states (a 1-layer draft's, no step taken: no compile), as
    `train` writes them."""
    import dataclasses

    from dflash_jax import DraftConfig, TargetConfig, init_draft
    from dflash_jax.train.checkpoint import RunCheckpoints
    from dflash_jax.train.step import StepConfig, init_state, split_draft

    target = TargetConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=4,
                          num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
    dcfg = DraftConfig.for_target(target, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    _, params = split_draft(init_draft(dcfg, seed=1, dtype="float32"), "float32")
    scfg = StepConfig(block_size=4, mask_token_id=dcfg.mask_token_id, target_layer_ids=(1, 2), total_steps=10)
    ck = RunCheckpoints(os.path.join(out, "checkpoints"))
    contract = dict(scfg.contract(), max_len=32, batch_size=4, seed=0, total_steps=10)
    for s in steps:
        ck.save(s, init_state(params, scfg), dict(step=s, epoch=0, cursor=0, seed=0, contract=contract, identity={},
                                                  settings={}, draft_config=dataclasses.asdict(dcfg)))
    ck.close()
    return out, target, dcfg


@pytest.mark.slow
def test_export_past_a_damaged_step_is_one_warning_line(tmp_path, capfd, monkeypatch):
    """The newest step's array data damaged: export says so in one line and exports the previous
    step; the reads that were in flight when the restore failed print nothing (they printed an
    "Event loop is closed" traceback each, into a closed loop, in about a third of the runs): no
    event loop is closed with tasks still pending."""
    import asyncio
    import shutil

    from dflash_jax.train.__main__ import main

    closed_pending, close = [], asyncio.BaseEventLoop.close

    def counting_close(loop):
        closed_pending.append(sum(not t.done() for t in asyncio.all_tasks(loop)))
        close(loop)

    monkeypatch.setattr(asyncio.BaseEventLoop, "close", counting_close)

    run, _, _ = _fake_run(str(tmp_path / "src"), hidden=256)
    for i in range(3):
        d = shutil.copytree(run, str(tmp_path / f"run{i}"))
        for root, _, files in os.walk(os.path.join(d, "checkpoints", "2", "state", "d")):
            for f in files:
                p = os.path.join(root, f)
                with open(p, "rb") as fh:
                    data = fh.read()
                with open(p, "wb") as fh:
                    fh.write(bytes(b ^ 0x5A for b in data))
        capfd.readouterr()
        assert main(["export", "--run", d, "--out", str(tmp_path / f"out{i}"), "--dtype", "float32"]) == 0
        time.sleep(0.3)  # what was in flight has landed
        out, err = capfd.readouterr()
        assert err.strip().splitlines() == [f"warning: checkpoint step 2 cannot be read back; moved to "
                                            f"{d}/checkpoints.damaged/2, using step 1"], err[:3000]
        assert out.strip() == f"exported step 1 of {d} to {tmp_path / f'out{i}'}"
    assert closed_pending and not any(closed_pending), closed_pending


def test_resuming_a_dflash_run_as_dflash2_names_the_arch(tmp_path):
    import dataclasses

    import numpy as np

    from dflash_jax import init_target
    from dflash_jax.drafts.dflash2 import DFlash2Draft
    from dflash_jax.train.checkpoint import ContractError
    from dflash_jax.train.data import TokenData
    from dflash_jax.train.run import RunConfig, train

    run, tcfg, dcfg = _fake_run(str(tmp_path / "run"), steps=(1,))
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 63, (8, 32)).astype(np.int32)
    lm = np.ones((8, 32), np.uint8)
    target = init_target(tcfg, dtype="float32")
    v2 = dataclasses.replace(dcfg, architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16,
                             selector_rank=4, selector_top_k=2)
    kw = dict(run=RunConfig(out_dir=run, batch_size=4, progress=False), num_anchors=6, compute_dtype="float32")
    with pytest.raises(ContractError, match=r"it trains a DFlash-1 draft \(--arch dflash\) and this run a DFlash2 "
                                            r"draft \(--arch dflash2\); give the original --arch"):
        train(target, DFlash2Draft.for_training(v2), TokenData(tok, lm), **kw)
    with pytest.raises(ContractError, match=r"the draft differs \(--draft-layers: checkpoint 1 vs this run 2\)"):
        train(target, dataclasses.replace(dcfg, num_layers=2), TokenData(tok, lm), **kw)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["1"]  # nothing set aside as damaged


# ----------------------------------------------------------------------------------------- prompt files
def test_prompt_and_data_files_name_the_file_and_line(tmp_path):
    from dflash_jax import data

    bad = tmp_path / "q.jsonl"
    bad.write_bytes(b'{"question": "fine"}\n{"question": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: not UTF-8 text"):
        data.load_prompts(data_file=str(bad))
    with pytest.raises(ValueError, match=r"q.jsonl:2: not UTF-8 text"):
        data.read_prompt_file(str(bad))
    for read in (lambda p: data.load_prompts(data_file=p), data.read_prompt_file):
        with pytest.raises(FileNotFoundError, match=f"{tmp_path} is a directory, not a file"):
            read(str(tmp_path))
    msgs = tmp_path / "m.jsonl"
    for line in ('{"messages": "x"}', '{"messages": []}', '{"messages": [{"role": "user"}]}'):
        msgs.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=r"m.jsonl:2: messages"):
            data.read_prompt_file(str(msgs))
    msgs.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "p"}\n')
    assert data.read_prompt_file(str(msgs)) == [[{"role": "user", "content": "hi"}], "p"]


def test_a_prompt_file_that_is_a_directory_is_one_cli_line(cli_models, tmp_path, capsys):
    argv = ["--model", cli_models[0], "--draft", cli_models[1], "--dtype", "float32", "--prompt-file", str(tmp_path)]
    line = _usage_error(tc.gen_cli, argv, capsys)
    assert f"--prompt-file: prompt file {tmp_path} is a directory, not a file" in line, line


# ----------------------------------------------------------------------------------------- serve
@pytest.mark.parametrize("argv,needle", [
    (["--step-buckets", "1,2"], "--step-buckets 1,2 needs the slot engine (--slots > 1)"),
    (["--engine-steps", "4"], "--engine-steps 4 needs the slot engine"),
    (["--insert-width", "2"], "--insert-width 2 needs the slot engine"),
    (["--engine-pipeline", "0"], "--engine-pipeline 0 needs the slot engine"),
    (["--slots", "2", "--warmup-prompt-len", "9:3"], "--warmup-prompt-len must be N or LO:HI (token counts >= 0, "
                                                      "LO <= HI), got '9:3'"),
])
def test_serve_flags_that_would_do_nothing_are_refused(argv, needle, capsys):
    pytest.importorskip("fastapi")
    from dflash_jax.serving import server as serve

    assert needle in _usage_error(serve, ["--random-init", "qwen3-0.6b", *argv], capsys)


def test_tools_on_completions_are_a_400_as_on_chat(cli_models):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from transformers import AutoTokenizer

    from dflash_jax.serving.server import build_app
    from tests.test_serve import FakeGenerate, _assert_400, fake_engine, serving

    eng = fake_engine(FakeGenerate())
    try:
        with serving(build_app(eng, AutoTokenizer.from_pretrained(cli_models[0]), model_name="tiny")) as url:
            tool = [{"type": "function", "function": {"name": "f"}}]
            for extra, field in ((dict(tools=tool), "tools"), (dict(tool_choice="required"), "tool_choice"),
                                 (dict(functions=[{"name": "f"}]), "functions")):
                body = dict(prompt=[1, 2], max_tokens=2, **extra)
                _assert_400(httpx.post(url + "/v1/completions", json=body, timeout=30), field, body)
            r = httpx.post(url + "/v1/completions", json=dict(prompt=[1, 2], max_tokens=2, tools=[]), timeout=30)
            assert r.status_code == 200, r.text
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------------------- loading
def test_offline_hub_message_says_what_to_do_not_hf_hub_offline_0(cli_models, capsys, monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", hc.HF_HUB_OFFLINE)  # restored after the test
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    line = _usage_error(tc.gen_cli, ["--model", cli_models[0], "--draft", "nobody/no-such-draft", "hi"], capsys)
    assert "HF_HUB_OFFLINE=0" not in line and "(offline:" not in line, line
    assert f"'nobody/no-such-draft' is not in the local hub cache ({tmp_path}) and the hub is offline" in line


def test_tokenizer_sources_are_named(cli_models, tmp_path, capsys, monkeypatch):
    """--tokenizer nope is no hub id: no such directory, not a hub look-up; an empty tokenizer.json
    is named; serve and benchmark, which have no --prompt-ids, do not suggest it."""
    import shutil

    pytest.importorskip("fastapi")
    from dflash_jax.serving import server as serve

    line = _usage_error(tc.gen_cli, ["--model", cli_models[0], "--draft", "none", "--tokenizer", "nope", "hi"], capsys)
    assert "--tokenizer nope: no such directory (and not a hub id 'org/name')" in line, line
    d = tmp_path / "t"
    shutil.copytree(cli_models[0], d)
    (d / "tokenizer.json").write_text("")
    line = _usage_error(tc.gen_cli, ["--model", str(d), "--draft", "none", "hi"], capsys)
    assert f"{d}/tokenizer.json is not a readable JSON file" in line, line
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(d / f, bare / f)
    monkeypatch.setattr(serve, "_bind", lambda *a: type("S", (), {"close": lambda self: None})())
    for cli, argv in ((serve, ["--model", str(bare), "--draft", "none"]),
                      (tc.bench_cli, ["--model", str(bare), "--draft", cli_models[1], "--dataset", "gsm8k"])):
        line = _usage_error(cli, argv, capsys)
        assert "has no tokenizer files" in line and "--prompt-ids" not in line and "--tokenizer DIR" in line, line


def _with_generation_config(src, dst, text):
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        f.write(text)
    return str(dst)


def test_a_bad_generation_config_is_named_not_blamed_on_stop_token_ids(cli_models, tmp_path, capsys):
    """An eos id outside the vocabulary in generation_config.json names the file (as the server
    does, one shared check) before any weight loads; an unparsable one says its eos ids are not
    used instead of dropping them silently."""
    bad = _with_generation_config(cli_models[0], tmp_path / "bad", json.dumps({"eos_token_id": [314, 10 ** 6]}))
    for cli, argv in ((tc.gen_cli, ["--model", bad, "--draft", "none", "hi"]),
                      (tc.bench_cli, ["--model", bad, "--draft", cli_models[1], "--dataset", "gsm8k"])):
        line = _usage_error(cli, argv, capsys)
        assert "generation_config.json has eos_token_id [1000000] outside the vocabulary [0, 320)" in line, line
        assert "--stop-token-ids" not in line
    from dflash_jax import loading

    broken = _with_generation_config(cli_models[0], tmp_path / "broken", "{not json")
    tok = type("Tok", (), {"eos_token_id": 314})()
    assert loading.stop_token_ids(broken, tok) == [314]
    err = capsys.readouterr().err
    assert f"warning: {broken}/generation_config.json cannot be read" in err and "not used" in err, err
    assert loading.stop_token_ids(tc.DATA_DIR, tok) == [314] and capsys.readouterr().err == ""  # none: silent


@pytest.mark.parametrize("cli,argv,needle", [
    ("gen", ["--model", "TARGET", "--draft", "none", "--prompt-len", "64", "hi"],
     "--prompt-len sets the random prompt of --random-init without a tokenizer; here it would be ignored"),
    ("gen", ["--random-init", "qwen3-0.6b", "--prompt-ids", "1,2", "--prompt-len", "64"],
     "(the prompt is --prompt-ids)"),
    ("bench", ["--model", "TARGET", "--draft", "DRAFT", "--dataset", "gsm8k", "--prompt-len", "64"],
     "--prompt-len sets the random prompts of --random-init without a dataset"),
])
def test_prompt_len_where_no_random_prompt_is_made_is_refused(cli_models, capsys, cli, argv, needle):
    argv = [{"TARGET": cli_models[0], "DRAFT": cli_models[1]}.get(a, a) for a in argv]
    assert needle in _usage_error(tc.gen_cli if cli == "gen" else tc.bench_cli, argv, capsys)


# ----------------------------------------------------------------------------------------- checkpoints
def _checkpoint_variant(src, dst, config=None, drop=None):
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if drop is not None:
        t = load_file(os.path.join(dst, "model.safetensors"))
        save_file({k: v for k, v in t.items() if not drop(k)}, os.path.join(dst, "model.safetensors"),
                  metadata={"format": "pt"})
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            c = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**c, **config}, f)
    return str(dst)


def test_checkpoint_mismatches_are_named_in_hf_terms(cli_models, tmp_path):
    """Missing tensors by their HF names (not layers.1.mlp.gate_up), a layer count that differs as
    'config.json has 5 layers, the checkpoint 4', a Llama config with attention_bias and no biases."""
    import dflash_jax as dj

    src = cli_models[0]
    for name, kw, match in (
            ("missing", dict(drop=lambda k: k == "model.layers.1.mlp.up_proj.weight"),
             r"checkpoint lacks 1 tensor\(s\): model.layers.1.mlp.up_proj.weight$"),
            ("more", dict(config={"num_hidden_layers": 5}),
             r"config.json has 5 layers \(num_hidden_layers\), the checkpoint 4$"),
            ("fewer", dict(config={"num_hidden_layers": 3}),
             r"config.json has 3 layers \(num_hidden_layers\), the checkpoint more \(it has model.layers.3"),
            ("llama", dict(config={"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                   "attention_bias": True},
                           drop=lambda k: k.endswith(("q_norm.weight", "k_norm.weight"))),
             r"checkpoint lacks 16 tensor\(s\): model.layers.0.self_attn.k_proj.bias, .*; config.json says the "
             r"model has biases \(attention_bias / mlp_bias\), the checkpoint has none")):
        with pytest.raises(ValueError, match=match):
            dj.load_target(_checkpoint_variant(src, tmp_path / name, **kw), dtype="float32")


# ----------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
def test_ctrl_c_while_a_command_starts_is_exit_130_and_one_line(cli_models, tmp_path):
    """SIGINT into `python -m dflash_jax.<command>` while it imports, loads or compiles: exit 130, one
    line, no traceback (was: a traceback from inside an import, or swallowed by jax's gc callback and
    the run completed)."""
    import signal
    import subprocess
    import sys

    from tests.test_cli_process import REPO, _env

    gen = [sys.executable, "-m", "dflash_jax.generate", "--model", cli_models[0], "--draft", cli_models[1],
           "--dtype", "float32", "--max-new-tokens", "8", "hi"]
    train = [sys.executable, "-m", "dflash_jax.train", "train", "--model", cli_models[0], "--data",
             str(tmp_path / "none"), "--out", str(tmp_path / "run")]
    for cmd, after in ((gen, 0.3), (gen, 0.9), (gen, 1.8), (train, 1.2)):
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the child's Ctrl-C: not ignored
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO,
                                    text=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, (after, proc.returncode, err[-2000:])
        assert "Traceback" not in err and "Exception ignored" not in err and err.strip().endswith(
            "[dflash] interrupted"), (after, err[-2000:])
