"""The demo pair's pipeline (scripts/train_demo_pair.py) and the embedded-pair loader (dflash_jax.assets).

- the tokenizer: byte-level round trip, the special tokens, the chat template (= the training text);
- save_target: what it writes loads in our load_target and in transformers' Qwen3ForCausalLM with
  the same logits (float32), non-unit norms so a misplaced tensor shows;
- default_pair: None without a shipped pair, the two directories with one;
- (slow) the whole pipeline end to end (--size ci: the cpu size with fewer steps): acceptance > 1,
  lossless, identical to the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("train_demo_pair", REPO / "scripts" / "train_demo_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tdp():
    return _script()


@pytest.fixture(scope="module")
def tokenizer_dir(tdp, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_rel, _, root = tdp.stdlib_files()
    texts = [t for _, t in tdp.read_sources(root, train_rel[:20])]
    texts += ["Natalia sold 48/2 = 24 clips in May.\n#### 72"] * 20
    tdp.train_tokenizer(texts, 600, str(d))
    return str(d)


SAMPLE = ('def fibonacci(n):\n    """Return the n-th number: 12345."""\n\tif n < 2:  # é ünïcode 日本 🐍\n'
          '        return n\r\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n')


def test_tokenizer_round_trips_and_has_special_tokens(tdp, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 600
    for text in (SAMPLE, "", " leading and trailing  ", "\n\n\t\t x", "<<a>> #### 7 \\boxed{7}"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode(SAMPLE, add_special_tokens=False)[:1] != [tok.unk_token_id]
    # ids 0..3 in the pipeline's order; eos = end of turn; each special token is one id
    ids = tdp.special_ids(tok)
    assert ids == {"pad": 0, "im_start": 1, "im_end": 2, "mask": 3}
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 0 and tok.mask_token == "<|mask|>" and tok.mask_token_id == 3
    assert tok.encode("x<|mask|>y<|im_end|>", add_special_tokens=False)[1::2] == [3, 2]
    cfg = json.load(open(os.path.join(tokenizer_dir, "tokenizer_config.json")))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["chat_template"] == tdp.CHAT_TEMPLATE


def test_chat_template_matches_training_text(tdp, tokenizer_dir):
    """The template the evaluation prompts go through renders exactly the text the target trained on."""
    from transformers import AutoTokenizer

    from dflash_jax.data import apply_chat_template

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    msgs = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "```python\npass\n```"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == tdp.chat("def f(x):", "```python\npass\n```")
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == tdp.chat("def f(x):")
    ids = apply_chat_template(tok, "def f(x):")
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids) == tdp.chat("def f(x):")


def test_corpus_excludes_tests_and_holds_out_modules(tdp):
    train, held, root = tdp.stdlib_files()
    assert train and sorted(held) == sorted(tdp.HELDOUT_MODULES)
    parts = {p for rel in train for p in Path(rel).parts[:-1]}
    assert not parts & tdp.EXCLUDED_DIRS
    assert not [r for r in train if os.path.basename(r).startswith("test_") or r in tdp.HELDOUT_MODULES]
    assert tdp.gsm8k_answer("a <<2*3=6>>6 b\n#### 6") == "a 6 b\nThe final answer is \\boxed{6}."
    fns = tdp.functions("x.py", 'def g(a, b):\n    """Add."""\n    c = a + b\n    return c\n')
    assert fns[0]["head"] == 'def g(a, b):\n    """Add."""' and fns[0]["signature"] == "def g(a, b):"


def test_regen_mix_and_self_prompts(tdp, tokenizer_dir):
    """The regeneration prompts: the mix's counts add up; a user turn the target closed at T = 1
    becomes a chat turn awaiting the assistant (the evaluation's form), anything else a cut of the
    sample; every prompt fits regen_prompt_tokens."""
    from transformers import AutoTokenizer

    for n in (32, 1000, 32768):
        counts = tdp.mix_counts(tdp.REGEN_MIX, n)
        biggest = max(tdp.REGEN_MIX, key=tdp.REGEN_MIX.get)
        assert sum(counts.values()) == n and set(counts) == set(tdp.REGEN_MIX)
        # each kind its floor share, the largest kind the rounding remainder (fewer than one per kind)
        assert all(counts[k] == int(n * f) for k, f in tdp.REGEN_MIX.items() if k != biggest), counts
        assert 0 <= counts[biggest] - int(n * tdp.REGEN_MIX[biggest]) < len(tdp.REGEN_MIX), counts
        assert n < 1000 or min(counts.values()) > 0, counts
    assert abs(sum(tdp.REGEN_MIX.values()) - 1.0) < 1e-9 and set(tdp.REGEN_MIX) == set(tdp.REGEN_KINDS)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    class FakeRun:
        seed, size = 0, dict(regen_prompt_tokens=40)

    seed = tok.encode(f"<|im_start|>user\n{tdp.HUMANEVAL_WORDING}", add_special_tokens=False)
    body = tok.encode("def add(a, b):\n    return a + b", add_special_tokens=False)
    closed, open_ = body + [2], body + [7, 8]
    out = tdp.self_prompts(FakeRun, tok, [dict(kind="self-humaneval", ids=seed)] * 2 + [dict(kind="self-code", ids=[5])],
                           [closed, open_, closed])
    assert tok.decode(out[0]["ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    full = seed + closed + tok.encode("\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out[0]["ids"] == full[-40:] and len(out[0]["ids"]) <= 40
    assert 2 not in out[1]["ids"] and 2 not in out[2]["ids"]           # an open turn / code: a cut, no eos
    assert out[2]["ids"][0] == 5 or len(seed) + len(closed) > 40


def _random_target(seed=0):
    from flax import nnx

    from dflash_jax.config import TargetConfig
    from dflash_jax.models.qwen3 import Qwen3

    cfg = TargetConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)
    m = Qwen3(cfg, jnp.float32, rngs=nnx.Rngs(seed))
    key = jax.random.PRNGKey(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        if path[-1] == "weight":  # every RMSNorm: non-unit, so a swapped or missing norm shows
            key, k = jax.random.split(key)
            var.set_value(1.0 + 0.3 * jax.random.normal(k, var.get_value().shape))
    return m


def _our_logits(model, ids):
    tokens = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    h, _, _ = model(tokens, pos, model.new_cache(1, len(ids)), pos + 1, kernels="xla", prefill=True)
    return np.asarray(model.logits(h))[0]


@pytest.mark.slow
def test_save_target_loads_in_ours_and_transformers(tmp_path):
    import torch
    from transformers import Qwen3ForCausalLM

    from dflash_jax import load_target
    from dflash_jax.assets import save_target

    model = _random_target()
    d = save_target(model, str(tmp_path / "t"), "float32", eos_token_id=2, pad_token_id=0)
    ids = [5, 17, 3, 90, 44, 44, 8, 61, 2, 30]
    ref = _our_logits(model, ids)

    ours = load_target(d, dtype="float32")
    np.testing.assert_array_equal(_our_logits(ours, ids), ref)

    hf = Qwen3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings is False and hf.config.eos_token_id == 2
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(theirs, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_save_target_bfloat16_is_half_the_size(tmp_path):
    from dflash_jax import load_target
    from dflash_jax.assets import save_target

    model = _random_target(1)
    f32 = os.path.getsize(os.path.join(save_target(model, str(tmp_path / "a"), "float32"), "model.safetensors"))
    d = save_target(model, str(tmp_path / "b"), "bfloat16")
    assert os.path.getsize(os.path.join(d, "model.safetensors")) < 0.55 * f32
    assert load_target(d, dtype="bfloat16").embed[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        save_target(model, str(tmp_path / "c"), "int8")


def test_default_pair(tmp_path):
    from dflash_jax.assets import PAIR_DIR, default_pair

    assert default_pair(str(tmp_path)) is None
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    assert default_pair(str(tmp_path)) is None  # no weights yet
    for name in ("target", "draft"):
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    assert default_pair(str(tmp_path)) == (str(tmp_path / "target"), str(tmp_path / "draft"))
    shipped = default_pair()  # the package's own: absent, or a real pair
    assert shipped is None or shipped == (os.path.join(PAIR_DIR, "target"), os.path.join(PAIR_DIR, "draft"))


@pytest.mark.slow
def test_cpu_pipeline_end_to_end(tmp_path):
    """tokenizer → target → regenerate → draft → eval (with the reference check) → ship, then a
    rerun skips every stage (resumable), and generate runs on the shipped files."""
    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    # --size ci: the cpu size's shapes and every stage, with a smaller corpus and fewer steps (CI time)
    cmd = [sys.executable, "scripts/train_demo_pair.py", "--size", "ci", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| humaneval |" in proc.stdout and "| stdlib-heldout |" in proc.stdout

    man = json.load(open(out / "manifest.json"))
    assert set(man["stages"]) == {"tokenizer", "target", "regen", "draft", "eval", "ship"}
    data = man["data"]
    assert data["heldout_modules"] and data["stdlib_files"] and data["gsm8k_train"]["rows_used"] > 0
    assert all(len(f["sha256"]) == 64 for f in data["stdlib_files"])
    assert not {f["path"] for f in data["stdlib_files"]} & set(data["heldout_modules"])
    tgt = man["stages"]["target"]
    assert 0.5e6 < tgt["params"] < 2e6 and tgt["final_loss"] < tgt["loss_curve"][0][1]
    regen = man["stages"]["regen"]  # greedy continuations and, by default, sampled (T = 1) ones
    assert 0 < regen["sampled_sequences"] < regen["sequences"]
    draft_stage, ev = man["stages"]["draft"], man["stages"]["eval"]
    assert draft_stage["status"] == "done" and draft_stage["final_loss"] < draft_stage["loss_curve"][0][1]
    assert ev["draft"] and all(row.get("tau_greedy", 0) > 1 for row in ev["sets"].values())
    assert all(row["greedy_identical"] for row in ev["sets"].values() if "greedy_identical" in row)
    ref = ev["reference"]  # the reference dflash_generate on the shipped weights (torch + dflash are installed)
    assert ref["identical"] and len(ref["prompts"]) == 3, ref
    ship = man["stages"]["ship"]
    assert ship["total_mb"] < 40 and (out / "pair.tar.00").exists()
    pair = out / "ship" / "pair"
    assert (pair / "README.md").read_text().count("$") == 0  # every placeholder filled

    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and rerun.stdout.count("done earlier, skipped") == 6

    import dflash_jax as dj
    from dflash_jax.data import apply_chat_template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair / "target"))
    target = dj.load_target(str(pair / "target"), dtype="float32")
    prompt = apply_chat_template(tok, "def fibonacci(n):")
    draft = None
    if not man["stages"]["draft"].get("skipped"):
        draft = dj.load_draft(str(pair / "draft"), target=target, dtype="float32")
    res = dj.generate(target, draft, [prompt], max_new_tokens=32, stop_token_ids=[2, 0], verify_width="block")
    assert len(res.tokens[0]) > 0
    if draft is not None:
        assert res.mean_tau > 1.0
        plain = dj.generate(target, None, [prompt], max_new_tokens=32, stop_token_ids=[2, 0])
        assert res.tokens == plain.tokens
