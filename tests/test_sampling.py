"""Lossless speculative sampling: the distribution of the first generated positions under DFlash
sampling equals the target's exact plain-sampling distribution, computed by enumeration with HF
transformers and the reference package's own temperature / top-k / top-p processing.

False-failure rate: each distribution check is a chi-square test at p < 1e-4 on a fixed seed; with
eight such checks a correct implementation fails on a random seed with probability < 1e-3 (and on the
fixed seeds here never: the outcome is deterministic)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy.stats import chi2

from tests.checkpoints import load_torch_pair

from dflash_jax import generate, load_draft, load_target
from dflash_jax import sampling

POSITIONS = 3          # joint of the first three generated tokens: prefill token + one verify chain
ROWS, SEEDS = 512, 6   # 3072 samples per setting
# A KV capacity just above prompt + block (the default rounds up to 1024): every generation in this
# file attends over 64 entries, not 1024, and the sampling programs share one compile key each.
CAPACITY = 64


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    p = trained_small_vocab_pair
    hf, _ = load_torch_pair(p["target_path"])
    target = load_target(p["target_path"], dtype="float32")
    return dict(p, hf=hf, target=target, draft=load_draft(p["draft_path"], target=target, dtype="float32"))


def _exact_joint(hf, prompt, temperature, top_p, top_k):
    """p(x1, x2, x3 | prompt) under plain sampling, by enumeration (reference processing)."""
    from dflash.model import _sampling_probs
    V = hf.config.vocab_size
    joint = {(): 1.0}
    for _ in range(POSITIONS):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        with torch.no_grad():
            logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
        probs = _sampling_probs(logits, temperature, top_p, top_k).double().numpy()
        nxt = {}
        for pre, row in zip(prefixes, probs):
            for tok in np.nonzero(row > 1e-12)[0]:
                nxt[pre + (int(tok),)] = joint[pre] * row[tok]
        joint = nxt
    return joint


def _chi_square_p(observed: dict, expected: dict, n: int) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 merged into one."""
    small = [k for k, p in expected.items() if p * n < 5]
    cells = [(observed.get(k, 0), p * n) for k, p in expected.items() if p * n >= 5]
    o_small = sum(observed.get(k, 0) for k in small) + sum(v for k, v in observed.items() if k not in expected)
    e_small = sum(expected[k] for k in small) * n
    if e_small > 0:
        cells.append((o_small, max(e_small, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(chi2.sf(stat, max(1, len(cells) - 1)))


def _sample_joint(pair, prompt, temperature, top_p, top_k, use_draft=True, seeds=SEEDS):
    """Counts of the first POSITIONS sampled tokens over `seeds` x ROWS rows ({"target", "draft"}
    pair), their number, and the acceptance lengths of the last seed's run (None without the draft)."""
    counts, n = {}, 0
    for seed in range(seeds):
        res = generate(pair["target"], pair["draft"] if use_draft else None, [prompt] * ROWS,
                       max_new_tokens=POSITIONS, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       capacity=CAPACITY, verify_width="block")
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
            n += 1
        if use_draft:
            acc = [a for r in res.acceptance_lengths for a in r]
    return counts, n, (acc if use_draft else None)


SETTINGS = {
    "T1": (1.0, 1.0, 0),
    "T1-topk4": (1.0, 1.0, 4),
    "T1-topp0.8": (1.0, 0.8, 0),
    "T0.6-topp0.95-topk20": (0.6, 0.95, 20),
}


_EXACT: dict = {}


def _expected(pair, name):
    """The exact joint of one setting, enumerated once for this module's tests."""
    if name not in _EXACT:
        _EXACT[name] = _exact_joint(pair["hf"], pair["eval_prompts"][0], *SETTINGS[name])
    return _EXACT[name]


# A plain `pytest` checks Qwen3's recommended setting (temperature, top-p and top-k at once);
# `.ci/run` every setting.
@pytest.mark.parametrize("name", [n if n == "T0.6-topp0.95-topk20" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SETTINGS])
def test_speculative_sampling_matches_the_exact_distribution(pair, name):
    temperature, top_p, top_k = SETTINGS[name]
    prompt = pair["eval_prompts"][0]
    expected = _expected(pair, name)
    counts, n, acc = _sample_joint(pair, prompt, temperature, top_p, top_k)
    p = _chi_square_p(counts, expected, n)
    # acceptance chains really happen: the iteration after prefill accepted drafts in some rows
    assert max(acc) >= 2, acc[:20]
    assert p > 1e-4, (name, p)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_plain_sampling_matches_the_exact_distribution(pair, name):
    """The plain sampler against the same oracle, end to end (our processing = the reference's; the
    processing alone is checked against `_sampling_probs` in the default run, below)."""
    temperature, top_p, top_k = SETTINGS[name]
    counts, n, _ = _sample_joint(pair, pair["eval_prompts"][0], temperature, top_p, top_k, use_draft=False)
    assert _chi_square_p(counts, _expected(pair, name), n) > 1e-4


@pytest.mark.slow
def test_a_biased_rule_would_be_caught(pair):
    """Power check: the same test rejects the draft-biased distribution (accept with probability 1)."""
    prompt = pair["eval_prompts"][0]
    expected = _expected(pair, "T1")
    # tempering the target by 0.5 is a mild, wrong distribution: the test must notice it
    counts, n, _ = _sample_joint(pair, prompt, 0.5, 1.0, 0)
    assert _chi_square_p(counts, expected, n) < 1e-4


@pytest.mark.slow
def test_top_k_one_and_tiny_temperature_equal_greedy(pair):
    prompts = pair["eval_prompts"][:3]
    greedy = generate(pair["target"], pair["draft"], prompts, max_new_tokens=24, verify_width="block").tokens
    assert generate(pair["target"], pair["draft"], prompts, max_new_tokens=24, temperature=1.0, top_k=1, verify_width="block").tokens == greedy
    assert generate(pair["target"], pair["draft"], prompts, max_new_tokens=24, temperature=1e-4, seed=5, verify_width="block").tokens == greedy


@pytest.mark.slow
def test_seeds_reproduce_and_differ(pair):
    prompts = pair["eval_prompts"][:4]
    kw = dict(max_new_tokens=32, temperature=1.0)
    a = generate(pair["target"], pair["draft"], prompts, seed=1, **kw, verify_width="block")
    b = generate(pair["target"], pair["draft"], prompts, seed=1, **kw, verify_width="block")
    c = generate(pair["target"], pair["draft"], prompts, seed=2, **kw, verify_width="block")
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert a.tokens != c.tokens
    # a row's stream depends on (seed, row index, position), not on the other rows of the batch
    d = generate(pair["target"], pair["draft"], prompts[:1] + [[1, 2, 3]], seed=1, **kw, verify_width="block")
    assert d.tokens[0] == a.tokens[0]


@pytest.mark.slow
def test_no_nan_with_minus_inf_logits():
    V, S = 16, 4
    logits = jnp.where(jnp.arange(V) % 3 == 0, -jnp.inf, jnp.linspace(-2.0, 2.0, V))
    logits = jnp.broadcast_to(logits, (2, S, V))
    block = jnp.array([[1, 3, 4, 5], [1, 6, 9, 2]], jnp.int32)   # 3, 6, 9 have -inf logits: never accepted
    key = jax.vmap(lambda i: jax.random.key(i))(jnp.arange(2))
    for mode, (tk, tp) in (("sample", (0, 1.0)), ("filtered", (5, 0.9)), ("topp", (0, 0.9)),
                           ("topk", (100, 1.0)), ("filtered", (0, 0.9))):
        lp = sampling.log_probs(logits, jnp.float32(0.7), jnp.int32(tk), jnp.float32(tp), mode)
        assert not jnp.any(jnp.isnan(lp))
        a, nxt = sampling.accept(block, logits, key, jnp.float32(0.7), jnp.int32(tk), jnp.float32(tp), mode)
        assert a.tolist()[1] == 0 and a.tolist()[0] <= 3
        assert all(int(t) % 3 != 0 for t in nxt.tolist())
        tok = sampling.select(logits[:, 0], key, jnp.float32(0.7), jnp.int32(tk), jnp.float32(tp), mode)
        assert all(int(t) % 3 != 0 for t in tok.tolist())


def test_invalid_sampling_values_are_clear_errors(pair):
    for kw, word in ((dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(top_p=1.01), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k")):
        with pytest.raises(ValueError, match=word):
            generate(pair["target"], pair["draft"], [[1, 2]], **kw, verify_width="block")


@pytest.mark.slow
def test_processing_matches_the_reference_on_both_paths():
    """The sort-free rank thresholds equal the reference's `_sampling_probs` (torch, a sort) for
    top-k alone, top-p alone and both; ties at the cut are cut by rank, as a sort cuts them."""
    from dflash.model import _sampling_probs
    rng = np.random.RandomState(0)
    V = 300
    logits = (rng.randn(3, 5, V) * 2).astype(np.float32)
    for top_k in (0, 1, 2, 7, 20, 64, 100, 299, 300, 1000):
        for top_p in (1.0, 0.9, 0.5, 0.05):
            ref = _sampling_probs(torch.tensor(logits), 0.8, top_p, top_k).numpy()
            modes = {sampling.mode_for(0.8, top_p, top_k), "filtered"} - {"sample", "greedy"}
            for mode in modes:
                ours = np.exp(np.asarray(sampling.log_probs(jnp.asarray(logits), jnp.float32(0.8),
                                                            jnp.int32(top_k), jnp.float32(top_p), mode)))
                np.testing.assert_allclose(ours, ref, atol=1e-6, err_msg=f"top_k={top_k} top_p={top_p} {mode}")
    assert sampling.mode_for(0.6, 0.95, 20) == "filtered" and sampling.mode_for(1.0, 1.0, 0) == "sample"
    assert sampling.mode_for(1.0, 1.0, 20) == "topk" and sampling.mode_for(1.0, 0.9, 0) == "topp"
    tied = jnp.asarray([[2.0, 1.0, 1.0, 1.0, 0.0]])
    for top_k, top_p in ((2, 1.0), (0, 0.8), (3, 0.8)):  # top-k and top-p cuts inside the tie
        mode = sampling.mode_for(1.0, top_p, top_k)
        p = np.exp(np.asarray(sampling.log_probs(tied, jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p), mode)))
        want = _sampling_probs(torch.tensor(np.asarray(tied)), 1.0, top_p, top_k).numpy()
        assert (p > 0).sum() == (want > 0).sum()
        np.testing.assert_allclose(np.sort(p[0]), np.sort(want[0]), atol=1e-6)
        if top_k == 2:  # the lower index wins inside a tie, as a stable sort
            assert p[0, 1] > 0 and p[0, 2] == 0 and p[0, 3] == 0
    # negative scores, -inf, and a large vocabulary (index bits beyond 16)
    big = jnp.asarray(np.where(rng.rand(2, 70000) < 0.1, -np.inf, rng.randn(2, 70000) * 3 - 20), jnp.float32)
    for top_k, top_p in ((50, 1.0), (0, 0.7), (1000, 0.3)):
        mode = sampling.mode_for(1.0, top_p, top_k)
        p = np.exp(np.asarray(sampling.log_probs(big, jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p), mode)))
        want = _sampling_probs(torch.tensor(np.asarray(big)), 1.0, top_p, top_k).numpy()
        np.testing.assert_allclose(p, want, atol=1e-6, err_msg=f"top_k={top_k} top_p={top_p}")


def test_unknown_sampling_mode_is_a_clear_error():
    from dflash_jax import decode
    from dflash_jax.config import TargetConfig
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="sampling_mode='nucleus'"):
        decode.lower_generate(cfg, None, sampling_mode="nucleus", dtype="float32")
