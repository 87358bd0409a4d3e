"""`python -m dflash_jax.train` regenerate → train → export on a tiny random target (in process)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dflash_jax import load_draft, load_target
from dflash_jax.train.__main__ import main
from tests import checkpoints as ck


@pytest.mark.slow
def test_cli_regenerate_train_export(tmp_path, capsys):
    tp = ck.write_target(str(tmp_path / "target"), vocab_size=64, num_layers=4, seed=0)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for p in ck.random_prompts(8, 63, min_len=3, max_len=6, seed=0):
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    common = ["--model", tp, "--dtype", "float32", "--attention", "xla"]
    data = str(tmp_path / "data")
    assert main(["regenerate", *common, "--prompts", str(prompts), "--prompts-are-ids", "--out", data,
                 "--max-len", "32", "--max-new-tokens", "20", "--batch-size", "4", "--shard-rows", "4"]) == 0
    # a rerun finds every prompt done and changes nothing
    assert main(["regenerate", *common, "--prompts", str(prompts), "--prompts-are-ids", "--out", data,
                 "--max-len", "32", "--max-new-tokens", "20", "--batch-size", "4", "--shard-rows", "4"]) == 0
    assert json.load(open(os.path.join(data, "manifest.json")))["rows"] == 8
    run = str(tmp_path / "run")
    assert main(["train", *common, "--data", data, "--out", run, "--draft-layers", "1", "--block-size", "4",
                 "--taps", "1,2", "--batch-size", "4", "--max-steps", "3", "--num-anchors", "8",
                 "--compute-dtype", "float32", "--log-every", "1"]) == 0
    out = str(tmp_path / "exported")
    assert main(["export", "--run", run, "--out", out, "--dtype", "float32"]) == 0
    draft = load_draft(out, target=load_target(tp, dtype="float32"), dtype="float32")
    assert draft.config.block_size == 4 and draft.config.target_layer_ids == (1, 2)
    capsys.readouterr()
    with pytest.raises(SystemExit, match="already exists"):
        main(["export", "--run", run, "--out", out])
    # a different contract on resume: one clear line, exit 2
    assert main(["train", *common, "--data", data, "--out", run, "--draft-layers", "1", "--block-size", "4",
                 "--taps", "1,2", "--batch-size", "4", "--max-steps", "3", "--num-anchors", "6",
                 "--compute-dtype", "float32"]) == 2
    assert "contract differs" in capsys.readouterr().err


@pytest.mark.slow
def test_regenerate_resumes_after_a_kill(tmp_path, monkeypatch):
    import dflash_jax.decode as dec
    from dflash_jax.train.data import DataError, TokenData, regenerate
    tp = ck.write_target(str(tmp_path / "target"), vocab_size=64, num_layers=2, seed=0)
    target = load_target(tp, dtype="float32")
    prompts = ck.random_prompts(8, 63, min_len=3, max_len=6, seed=0)
    kw = dict(max_len=24, max_new_tokens=12, batch_size=4, shard_rows=4, attention_impl="xla", progress=False)
    real, calls = dec.generate, []

    def killed_on_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(dec, "generate", killed_on_second)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, prompts, str(tmp_path / "d"), **kw)
    assert json.load(open(tmp_path / "d" / "manifest.json"))["prompts_done"] == 4
    monkeypatch.setattr(dec, "generate", real)
    data = regenerate(target, prompts, str(tmp_path / "d"), **kw)
    whole = regenerate(target, prompts, str(tmp_path / "whole"), **kw)
    np.testing.assert_array_equal(data.tokens, whole.tokens)
    np.testing.assert_array_equal(data.loss_mask, whole.loss_mask)
    assert TokenData.from_dir(str(tmp_path / "d")).tokens.shape == (8, 24)
    with pytest.raises(DataError, match="other settings"):
        regenerate(target, prompts, str(tmp_path / "d"), **dict(kw, temperature=1.0))


@pytest.mark.slow
def test_bench_train_quick_runs():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_train.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [l for l in p.stdout.splitlines() if l.startswith("| 1 ") or l.startswith("| 2 ")]
    assert len(rows) == 2, p.stdout


@pytest.mark.slow
def test_bench_train_breakdown_quick_runs():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_train.py"), "--quick", "--breakdown", "2"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    for part in ("full step", "(a) target", "(b) draft", "(b1) draft layers", "(b2) LM head"):
        assert any(l.startswith(f"| {part}") for l in p.stdout.splitlines()), p.stdout
