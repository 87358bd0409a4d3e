"""The trainer's sharp edges: damaged or foreign inputs, refused resumes, flags out of range, the
regenerate CLI's prompt checks, and the batch trim (same loss and gradients as the padded batch).
Every bad input is a one-line error (DataError / ContractError / CheckpointError, CLI exit 2)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import DraftConfig, TargetConfig, init_draft, init_target
from dflash_jax.train.__main__ import build_parser, main
from dflash_jax.train.checkpoint import CheckpointError, ContractError
from dflash_jax.train.data import DataError, TokenData, write_shard
from dflash_jax.train.run import RunConfig, train
from tests import checkpoints as ck

TINY = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=8, rope_theta=1e4)


def _rows(rows=8, T=32, seed=0, vocab=63):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, vocab, (rows, T)).astype(np.int32)
    lm = np.zeros((rows, T), np.uint8)
    for r in range(rows):
        lm[r, rng.integers(2, 6): rng.integers(T // 2, T)] = 1
    return tok, lm


def _data_dir(path, shards=2, **kw) -> str:
    os.makedirs(path, exist_ok=True)
    m = dict(shards=[])
    for i in range(shards):
        tok, lm = _rows(seed=i, **kw)
        m["shards"].append(write_shard(str(path), i, TokenData(tok, lm)))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)
    return str(path)


# --- damaged data -----------------------------------------------------------------------------------

def test_damaged_data_is_refused_naming_the_file(tmp_path):
    good = _data_dir(tmp_path / "good")
    assert len(TokenData.from_dir(good)) == 16

    def case(name, edit, match):
        d = str(tmp_path / name)
        shutil.copytree(good, d)
        edit(d)
        with pytest.raises(DataError, match=match):
            TokenData.from_dir(d)

    tokens0 = "shard_00000.tokens.npy"
    # truncated, garbage, object arrays (never unpickled), float ids, negative ids, 1-D, wrong shape
    case("trunc", lambda d: _truncate(os.path.join(d, tokens0)), "not a readable .npy")
    case("garbage", lambda d: open(os.path.join(d, tokens0), "wb").write(b"\x00garbage" * 50), "not a readable .npy")
    case("object", lambda d: np.save(os.path.join(d, tokens0), np.array([[1, "x"]], dtype=object), allow_pickle=True),
         "not a readable .npy")
    case("float", lambda d: np.save(os.path.join(d, tokens0), _rows()[0].astype(np.float32) + 0.5),
         "float32 values are not token ids")
    case("negative", lambda d: np.save(os.path.join(d, tokens0), _rows()[0] - 5), "negative token id -5")
    case("flat", lambda d: np.save(os.path.join(d, tokens0), _rows()[0].ravel()), "2-D")
    case("shape", lambda d: np.save(os.path.join(d, tokens0), _rows()[0][:, :16]), "differ in shape")
    # the manifest: not JSON, not a manifest, a shard path that leaves the directory
    case("notjson", lambda d: open(os.path.join(d, "manifest.json"), "w").write("{shards: oops"), "is not JSON")
    case("notman", lambda d: open(os.path.join(d, "manifest.json"), "w").write("[1, 2]"), "no list of shards")
    escape = dict(shards=[dict(tokens="../../../../etc/passwd", loss_mask="shard_00000.mask.npy", rows=8)])
    case("escape", lambda d: json.dump(escape, open(os.path.join(d, "manifest.json"), "w")),
         "leaves the data directory")


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_ids_outside_the_vocabulary_name_the_shard(tmp_path):
    d = _data_dir(tmp_path / "d", vocab=63)
    tok = np.load(os.path.join(d, "shard_00001.tokens.npy"))
    tok[3, 5] = 70
    np.save(os.path.join(d, "shard_00001.tokens.npy"), tok)
    data = TokenData.from_dir(d)
    data.check_vocab(71)
    with pytest.raises(DataError, match=r"shard_00001.tokens.npy row 3: token id 70 is outside .* 64"):
        data.check_vocab(64)
    with pytest.raises(DataError, match="token ids must be integers"):
        TokenData(np.ones((2, 8), np.float32), np.ones((2, 8), np.uint8))
    with pytest.raises(DataError, match="negative token id"):
        TokenData(-np.ones((2, 8), np.int32), np.ones((2, 8), np.uint8))


# --- flags ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value", [("--num-anchors", "0"), ("--block-size", "1"), ("--lr", "-1"),
                                        ("--lr", "0"), ("--max-steps", "0"), ("--batch-size", "0"),
                                        ("--warmup", "1.5"), ("--lr", "nan")])
def test_train_flags_out_of_range_exit_2(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--model", "m", "--data", "d", "--out", "o", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_regenerate_temperature_negative_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["regenerate", "--model", "m", "--prompts", "p", "--out", "o", "--temperature", "-1"])
    assert e.value.code == 2 and "--temperature" in capsys.readouterr().err


def test_step_config_and_run_config_refuse_nonsense():
    from dflash_jax.train.step import StepConfig
    base = dict(block_size=4, mask_token_id=63, target_layer_ids=(1,))
    for bad, match in ((dict(num_anchors=0), "num_anchors"), (dict(block_size=1), "block_size"),
                       (dict(lr=-1.0), "lr"), (dict(lr=0.0), "lr")):
        with pytest.raises(ValueError, match=match):
            StepConfig(**dict(base, **bad))
    with pytest.raises(ValueError, match="max_steps"):
        RunConfig(out_dir="x", max_steps=0)


def test_every_flag_has_help_and_shown_defaults():
    p = build_parser()
    subs = next(a for a in p._actions if a.dest == "cmd").choices
    for name in ("regenerate", "train", "export"):
        for a in subs[name]._actions:
            if a.dest == "help":
                continue
            assert a.help, f"{name} {a.option_strings} has no help"
        text = subs[name].format_help()
        assert "(default: " in text
    assert "(default: 6e-4)" in subs["train"].format_help().replace("0.0006", "6e-4")


# --- the CLI's regenerate checks ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny") / "target")
    ck.write_target(d, vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64, head_dim=8, seed=0)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [7, 9]}, f)
    return d


def _jsonl(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_regenerate_cli_refuses_bad_prompts(tiny_dir, tmp_path, capsys):
    common = ["regenerate", "--model", tiny_dir, "--out", str(tmp_path / "o"), "--prompts-are-ids"]
    cases = [
        (['{"prompt_ids": [1, 2]}', '{"prompt_ids": [3, 64]}'], r"p.jsonl:2: token id 64 is outside"),
        (['{"prompt_ids": [1, -1]}'], r"p.jsonl:1: token id -1 is outside"),
        (['{"prompt_ids": []}'], r"p.jsonl:1: prompt_ids must be a non-empty list"),
        (['{"prompt_ids": [1.5]}'], r"p.jsonl:1: prompt_ids holds 1.5"),
        (['{"prompt_ids": [1]}', '{"prompt_ids": [1,'], r"p.jsonl:2: not a JSON line"),
        (['{"text": "hi"}'], r"p.jsonl:1: --prompts-are-ids needs prompt_ids"),
    ]
    for lines, match in cases:
        p = _jsonl(tmp_path / "p.jsonl", lines)
        assert main(common + ["--prompts", p]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        assert __import__("re").search(match, err), (match, err)
    p = _jsonl(tmp_path / "p.jsonl", ['{"prompt_ids": [1, 2]}'])
    assert main(common + ["--prompts", p, "--dataset", "gsm8k"]) == 2
    assert "not both" in capsys.readouterr().err


def test_prompts_are_ids_keeps_stop_tokens_and_float32_default(tiny_dir, tmp_path, monkeypatch, capsys):
    import dflash_jax.train.data as data_mod
    seen = {}

    def fake_regenerate(target, prompts, out, **kw):
        seen.update(kw, dtype=str(target.dtype), prompts=prompts)
        raise DataError("stop here")

    monkeypatch.setattr(data_mod, "regenerate", fake_regenerate)
    p = _jsonl(tmp_path / "p.jsonl", ['{"prompt_ids": [1, 2]}'])
    assert main(["regenerate", "--model", tiny_dir, "--out", str(tmp_path / "o"), "--prompts-are-ids",
                 "--prompts", p]) == 2
    assert seen["stop_token_ids"] == [7, 9]
    assert seen["dtype"] == "float32"          # the checkpoint is float32: not bfloat16 by default
    assert seen["prompts"] == [[1, 2]]


@pytest.mark.slow
def test_regenerate_drops_long_prompts_and_counts_them(tmp_path):
    from dflash_jax import load_target
    from dflash_jax.train.data import regenerate
    d = ck.write_target(str(tmp_path / "t"), vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64,
                        head_dim=8, seed=0)
    target = load_target(d, dtype="float32")
    prompts = [[1, 2, 3], list(range(1, 40)), [4, 5, 6, 7]]
    data = regenerate(target, prompts, str(tmp_path / "o"), max_len=24, max_new_tokens=8, batch_size=4,
                      attention_impl="xla", progress=False)
    m = json.load(open(tmp_path / "o" / "manifest.json"))
    assert m["dropped_long"] == 1 and len(data) + m["dropped"] == 2
    # no row starts with a cut prompt: every kept row's prompt is one of the short ones, whole
    for t, lm in zip(data.tokens, data.loss_mask):
        plen = int(np.argmax(lm))
        assert list(t[:plen]) in ([1, 2, 3], [4, 5, 6, 7])


# --- resume: identity, settings, damaged checkpoints ---------------------------------------------------

@pytest.mark.slow
def test_resume_refuses_other_target_data_settings_and_survives_a_damaged_step(tmp_path, capsys):
    target = init_target(TINY, dtype="float32")
    dcfg = DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    tok, lm = _rows(rows=16)
    data = TokenData(tok, lm)
    out = str(tmp_path / "run")
    kw = dict(out_dir=out, batch_size=4, epochs=2, log_every=1, save_every=1, progress=False, keep_checkpoints=5)
    sk = dict(num_anchors=6, compute_dtype="float32", chunk_blocks=4)
    first = train(target, init_draft(dcfg, seed=1, dtype="float32"), data, run=RunConfig(stop_after=2, **kw), **sk)
    assert first.step == 2
    d = lambda: init_draft(dcfg, seed=1, dtype="float32")  # noqa: E731
    other_target = init_target(TINY, seed=5, dtype="float32")   # same config, other weights
    with pytest.raises(ContractError, match="target's weights"):
        train(other_target, d(), data, run=RunConfig(**kw), **sk)
    other_cfg = init_target(dataclasses.replace(TINY, rms_norm_eps=1e-5), dtype="float32")
    with pytest.raises(ContractError, match="target's config"):
        train(other_cfg, d(), data, run=RunConfig(**kw), **sk)
    tok2 = tok.copy(); tok2[0, 10] = (tok2[0, 10] + 1) % 63
    with pytest.raises(ContractError, match=r"data set .*--data"):
        train(target, d(), TokenData(tok2, lm), run=RunConfig(**kw), **sk)
    with pytest.raises(ContractError, match=r"--lr: checkpoint 0.0006 vs this run 0.001"):
        train(target, d(), data, run=RunConfig(**kw), **dict(sk, lr=1e-3))
    with pytest.raises(ContractError, match=r"--compute-dtype: checkpoint 'float32' vs this run 'bfloat16'"):
        train(target, d(), data, run=RunConfig(**kw), **dict(sk, compute_dtype="bfloat16"))
    with pytest.raises(ContractError, match=r"--dtype: checkpoint 'float32' vs this run 'bfloat16'"):
        train(init_target(TINY, dtype="bfloat16"), d(), data, run=RunConfig(**kw), **sk)

    # a damaged newest step: moved aside with a warning, the run continues from the previous one
    ckdir = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(ckdir)) == ["1", "2"]
    for root, _, files in os.walk(os.path.join(ckdir, "2", "state")):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    capsys.readouterr()
    res = train(target, d(), data, run=RunConfig(**dict(kw, stop_after=1)), **sk)
    assert res.step == 2 and "checkpoint step 2 cannot be read back" in capsys.readouterr().err
    assert os.path.isdir(os.path.join(out, "checkpoints.damaged", "2"))
    # a step without meta/ and nothing else readable: one clear error
    shutil.rmtree(os.path.join(ckdir, "1"))
    shutil.rmtree(os.path.join(ckdir, "2", "meta"))
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be read back"):
        train(target, d(), data, run=RunConfig(**kw), **sk)


def test_curves_skipped_without_matplotlib_says_why(tmp_path, monkeypatch, capsys):
    import sys

    from dflash_jax.train.run import _plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _plot([dict(step=1, loss=1.0, tau_est=1.0, slot_acc=[0.5])], str(tmp_path / "curves.png"))
    err = capsys.readouterr().err
    assert "curves.png skipped: matplotlib is not installed" in err and len(err.strip().splitlines()) == 1


# --- the batch trim ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_trim_batch_keeps_loss_and_gradients():
    """A batch cut to its longest row (and the anchors to the most a row has) gives the padded batch's
    loss and gradients: the same anchors, labels and weights; only XLA's summation order over the
    longer axes differs (float32 rounding)."""
    from dflash_jax.train.step import StepConfig, loss_and_metrics, split_draft, trim_batch
    target = init_target(TINY, dtype="float32")
    dcfg = DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2))
    gd, params = split_draft(init_draft(dcfg, seed=1, dtype="float32"), "float32")
    rng = np.random.default_rng(0)
    B, T = 2, 192
    tok = rng.integers(0, 63, (B, T)).astype(np.int32)
    lm = np.zeros((B, T), np.uint8)
    for r, (p, e) in enumerate([(3, 40), (8, 34)]):
        lm[r, p:e] = 1
    cfg = StepConfig(block_size=4, mask_token_id=63, target_layer_ids=(1, 2), num_anchors=96,
                     compute_dtype="float32", chunk_blocks=16, anchor_draw_len=T)
    t2, m2, n = trim_batch(tok, lm, cfg.num_anchors, min_len=16)
    assert t2.shape == (B, 64) and n == 64           # 40 -> 64 positions, 36 valid anchors -> 64

    tdef, tstate = nnx.split(target)

    @functools.partial(jax.jit, static_argnums=0)
    def grads(c, tstate, t, m):
        return jax.value_and_grad(loss_and_metrics, has_aux=True)(
            params, gd, nnx.merge(tdef, tstate), t, m, jnp.arange(B), jnp.int32(0), c)

    def run(c, t, m):
        return grads(c, tstate, jnp.asarray(t), jnp.asarray(m, jnp.int32))

    (l0, s0), g0 = run(cfg, tok, lm)
    (l1, s1), g1 = run(dataclasses.replace(cfg, num_anchors=n), t2, m2)
    for k in ("blocks", "tau_sum", "slot_count", "slot_correct"):   # counts: exact
        np.testing.assert_array_equal(np.asarray(s0[k]), np.asarray(s1[k]), err_msg=k)
    np.testing.assert_allclose(float(s1["weight_sum"]), float(s0["weight_sum"]), rtol=1e-6)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))


def test_init_draft_with_disagreeing_shape_flags_exit_2(tmp_path, capsys):
    pair = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_jax", "assets", "pair")
    common = ["train", "--model", os.path.join(pair, "target"), "--init-draft", os.path.join(pair, "draft"),
              "--data", str(tmp_path / "none"), "--out", str(tmp_path / "run")]
    for flags, name in ((["--block-size", "8"], "--block-size 8"), (["--draft-layers", "3"], "--draft-layers 3"),
                        (["--taps", "0,1"], "--taps 0,1")):
        assert main(common + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {name} disagrees with --init-draft"), err
    # flags that agree (block 16, 2 layers) pass the check and reach the data, which is missing
    assert main(common + ["--block-size", "16", "--draft-layers", "2"]) == 2
    assert "has no manifest.json" in capsys.readouterr().err


def test_train_refuses_ids_outside_the_vocabulary_before_its_first_step(tmp_path, monkeypatch):
    """Data from another tokenizer is refused by train() itself, naming the shard and row, before
    anything compiles (issue 33: it ran 19 s, then reported a NaN loss at "step None")."""
    import dflash_jax.train.run as run_mod
    d = _data_dir(tmp_path / "d", vocab=63)
    tok = np.load(os.path.join(d, "shard_00000.tokens.npy"))
    tok[2, 7] = 200
    np.save(os.path.join(d, "shard_00000.tokens.npy"), tok)
    target = init_target(TINY, dtype="float32")
    draft = init_draft(DraftConfig.for_target(TINY, num_layers=1, block_size=4, target_layer_ids=(1, 2)),
                       seed=1, dtype="float32")
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled before the data check"))
    with pytest.raises(DataError, match=r"shard_00000.tokens.npy row 2: token id 200 is outside .* 64"):
        train(target, draft, TokenData.from_dir(d), run=RunConfig(out_dir=str(tmp_path / "run"), batch_size=4,
                                                                   progress=False), num_anchors=6)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_the_cpu_example_in_docs_training_parses(tmp_path):
    """docs/training.md's first-run example on a CPU: every `python -m dflash_jax.train` line of it
    parses with the CLI's own parser (its flags exist and are in range), so the example a new user
    copies does not go stale."""
    import re
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "training.md"), encoding="utf-8").read()
    block = re.search(r"\*\*A first run on a CPU\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, "docs/training.md has no CPU example"
    commands = [c for c in block.group(1).replace("\\\n", " ").splitlines() if "-m dflash_jax.train" in c]
    assert [shlex.split(c)[3] for c in commands] == ["regenerate", "train", "export"]
    for c in commands:
        argv = shlex.split(c.replace("$T", "dflash_jax/assets/pair/target"))[3:]
        build_parser().parse_args(argv)


def test_train_cli_quantize_loads_the_target_in_int8(tiny_dir, capsys):
    """--quantize int8 (regenerate and train) loads the frozen target quantized; another choice is a
    usage error naming the choices."""
    from dflash_jax import quantize
    from dflash_jax.train import __main__ as cli
    assert cli.QUANTIZE == quantize.QUANTIZE
    args = build_parser().parse_args(["train", "--model", tiny_dir, "--data", "d", "--out", "o", "--quantize", "int8"])
    target = cli._target(args)
    assert target.quantize == "int8" and quantize.quantized_leaves(target)
    assert build_parser().parse_args(["regenerate", "--model", tiny_dir, "--out", "o", "--quantize", "int8"]).quantize
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--model", tiny_dir, "--data", "d", "--out", "o", "--quantize", "fp4"])
    assert e.value.code == 2 and "invalid choice: 'fp4'" in capsys.readouterr().err
