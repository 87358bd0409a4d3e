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
    from dflash_jax.serve import build_app
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
