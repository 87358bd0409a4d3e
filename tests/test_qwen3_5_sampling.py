"""Sampling at T > 0 on a hybrid (Qwen3.5) target: the joint distribution of the first five
generated tokens, plain and DFlash, equals the exact one enumerated with transformers'
Qwen3_5ForCausalLM and the reference package's processing. Five positions with block size 4 span
two verify blocks, and the DFlash proposer (the target's greedy path, so drafts are accepted
part of the time) has blocks cut mid-block in most rows: a wrong rollback of the recurrent state
after a mid-block rejection would shift the later positions' distribution. top_k = 2 keeps the
support at 32 sequences. Chi-square at p < 1e-4 on fixed seeds (deterministic). Issue 38."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from tests import tpu_aot  # noqa: F401  (quiets libtpu before JAX initialises)
from tests.doubles import truth_proposer
from tests.test_qwen3_5 import write_qwen3_5

from dflash_jax import DraftConfig, generate, init_draft, load_target

transformers = pytest.importorskip("transformers")

POSITIONS, TOP_K, TEMPERATURE = 5, 2, 1.0
# 2,048 samples: at 512 the planted bug below (the GDN fold skipped on rejection) passed at p = 0.066;
# at 2,048 it fails at p = 5e-7 (test_a_state_not_rolled_back_would_be_caught)
ROWS, SEEDS = 256, 8
PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_qwen3_5(str(tmp_path_factory.mktemp("q35s")), full_attention_interval=2)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    target = load_target(path, dtype="float32")
    draft = init_draft(DraftConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2)),
                       seed=1, dtype="float32")
    greedy = generate(target, None, [PROMPT], max_new_tokens=16).tokens[0]
    truth = np.zeros((ROWS, 64), np.int32)
    truth[:, :len(PROMPT) + 16] = PROMPT + greedy
    return hf, target, truth_proposer(draft, truth, None, 128)


def _exact_joint(hf):
    from dflash.model import _sampling_probs
    joint = {(): 1.0}
    for _ in range(POSITIONS):
        prefixes = list(joint)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
        probs = _sampling_probs(logits, TEMPERATURE, 1.0, TOP_K).double().numpy()
        joint = {p + (int(t),): joint[p] * row[t] for p, row in zip(prefixes, probs)
                 for t in np.nonzero(row > 1e-12)[0]}
    return joint


def _chi_square_p(observed: dict, expected: dict, n: int) -> float:
    small = [k for k, p in expected.items() if p * n < 5]
    cells = [(observed.get(k, 0), p * n) for k, p in expected.items() if p * n >= 5]
    o_small = sum(observed.get(k, 0) for k in small) + sum(v for k, v in observed.items() if k not in expected)
    e_small = sum(expected[k] for k in small) * n
    if e_small > 0:
        cells.append((o_small, max(e_small, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(chi2.sf(stat, max(1, len(cells) - 1)))


def _sample(target, draft):
    counts, acc = {}, []
    for seed in range(SEEDS):
        res = generate(target, draft, [PROMPT] * ROWS, max_new_tokens=POSITIONS, temperature=TEMPERATURE,
                       top_k=TOP_K, seed=seed, capacity=32, verify_width="block")
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        if draft is not None:
            acc += [a for r in res.acceptance_lengths for a in r[:-1]]
    return counts, acc


@pytest.mark.slow
def test_plain_and_dflash_sampling_match_the_exact_distribution(setup):
    hf, target, draft = setup
    expected = _exact_joint(hf)
    assert len(expected) == TOP_K ** POSITIONS
    n = ROWS * SEEDS
    plain, _ = _sample(target, None)
    assert _chi_square_p(plain, expected, n) > 1e-4
    spec, acc = _sample(target, draft)
    # most blocks are cut (the state rolled back to 1 of the block's 4 tokens), many after
    # 2 or 3 of them
    assert sum(a < 4 for a in acc) > len(acc) // 2 and sum(1 < a < 4 for a in acc) > 40, np.bincount(acc)
    assert _chi_square_p(spec, expected, n) > 1e-4


def _drop_programs():
    """Forget every compiled program and JAX's traces (a cached trace would keep the code it saw)."""
    import jax

    from dflash_jax import decode
    decode.clear_compiled()
    jax.clear_caches()


@pytest.mark.slow
def test_a_state_not_rolled_back_would_be_caught(setup, monkeypatch):
    """Power of the check above: a plausible bug planted (the GDN state fold skipped on rejection: a
    block cut mid-way leaves the recurrent state where it was before the block, while the conv
    window and the attention layers move on) moves the DFlash joint off the exact one at p < 1e-4."""
    import jax.numpy as jnp

    from dflash_jax.models.qwen3_5 import GatedDeltaNet
    hf, target, draft = setup
    advance = GatedDeltaNet.advance

    def no_fold_on_rejection(self, state, records, n):
        if records.kind != "deltas":                      # prefill, plain steps: as they were
            return advance(self, state, records, n)
        whole = records.xx.shape[1] - (self.kernel - 1)
        return advance(self, state, records, jnp.where(n < whole, 0, n))[0], advance(self, state, records, n)[1]

    monkeypatch.setattr(GatedDeltaNet, "advance", no_fold_on_rejection)
    _drop_programs()                                      # programs traced with the bug, dropped after
    try:
        spec, acc = _sample(target, draft)
    finally:
        monkeypatch.undo()
        _drop_programs()
    assert sum(a < 4 for a in acc) > len(acc) // 2        # the bug had rejections to act on
    assert _chi_square_p(spec, _exact_joint(hf), ROWS * SEEDS) < 1e-4
