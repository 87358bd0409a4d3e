"""Adaptive verify width (issue 37): the target verifies the last token plus the first W drafts, W
chosen per iteration inside one compiled program (dflash_jax.width, loop.iterate).

Oracles: HF transformers' greedy decoding of the target (every width is lossless), the reference
`dflash_generate` (the full width is today's loop: same tokens and acceptance lengths), the exact
joint distribution by enumeration (sampling at a prefix width, as tests/test_sampling.py), and a
numpy restatement of the width rule (the choice is a deterministic function of its statistics)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.checkpoints import hf_greedy, load_torch_pair, reference_generate

from dflash_jax import decode, generate, load_draft, load_target, loop, width

CAPACITY = 128


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    p = trained_small_vocab_pair
    hf, ref_draft = load_torch_pair(p["target_path"], p["draft_path"])
    target = load_target(p["target_path"], dtype="float32")
    return dict(p, hf=hf, ref_draft=ref_draft, target=target,
                draft=load_draft(p["draft_path"], target=target, dtype="float32"))




def test_every_width_is_lossless_and_width_changes_never_recompile(pair):
    """W = 0 is plain decoding (one token per iteration), W = 7 (block 8's full width) is the
    reference loop token for token and iteration for iteration, 1 / auto are lossless and never
    accept past their width (auto also when it starts from its last call's statistics); one program
    serves every width of its set (0, 1, 3, 7 at block 8 on CPU, where the half block joins the set),
    and a call that names no width runs it."""
    prompts = pair["eval_prompts"][:3]
    n = 24
    want = [hf_greedy(pair["hf"], p, n) for p in prompts]
    ref = [reference_generate(pair["ref_draft"], pair["hf"], p, n, block_size=8) for p in prompts]
    kw = dict(max_new_tokens=n, capacity=CAPACITY)
    assert width.program_widths(8) == (0, 1, 7) and width.program_widths(8, per_row_cost=True) == (0, 1, 3, 7)
    st = decode._static_and_params(pair["target"], pair["draft"], prompts, stream=False, **kw)[0]
    assert st.widths == (0, 1, 3, 7)                   # a CPU program: every verified row costs compute
    res = {vw: None for vw in (7, 0, 1, 3, "auto")}
    for vw in res:
        res[vw] = generate(pair["target"], pair["draft"], prompts, verify_width=vw, **kw)
        if vw == 7:
            compiles = decode.compile_count()
    warm = generate(pair["target"], pair["draft"], prompts, verify_width="auto", **kw)   # from auto's statistics
    default = generate(pair["target"], pair["draft"], prompts, **kw)       # the default is auto's program
    assert decode.compile_count() == compiles          # no recompile when W changes
    assert warm.tokens == want and default.tokens == want
    for vw, r in res.items():
        assert r.tokens == want, vw
    assert res[7].acceptance_lengths == [list(r.acceptance_lengths) for r in ref]
    assert all(a == 1 for row in res[0].acceptance_lengths for a in row)
    for vw in (1, 3):
        seen = {a for row in res[vw].acceptance_lengths for a in row}
        assert max(seen) == vw + 1, (vw, seen)        # accepted up to the width, never past it
    assert res[7].mean_tau > 2.0                       # the pair really accepts (a real test of the prefixes)


def test_a_prefix_proposal_runs_the_head_on_its_rows_and_keeps_their_drafts(pair):
    """propose(heads=W) (a W-wide verify's draft pass) gives the whole block's first W drafts, 0
    past them, the same draft cache, and an LM head over W rows (its logits' shape in the jaxpr)."""
    target, draft = pair["target"], pair["draft"]
    S, B, cap = draft.config.block_size, 2, 64
    H = target.config.hidden_size * len(draft.config.target_layer_ids)
    rng = np.random.default_rng(0)
    current = jnp.asarray(rng.integers(0, target.config.vocab_size, (B, 1)), jnp.int32)
    lens = jnp.asarray([5, 9], jnp.int32)
    pending = jnp.asarray(rng.normal(size=(B, S, H)), jnp.float32)
    args = (target, current, lens, lens + 40, pending, jnp.asarray([3, 1], jnp.int32), draft.new_cache(B, cap))
    full, cache = draft.propose(*args, block_size=S, kernels=None)
    for W in (1, 3):
        cut, cache_w = draft.propose(*args, block_size=S, kernels=None, heads=W)
        np.testing.assert_array_equal(np.asarray(cut[:, :W]), np.asarray(full[:, :W]))
        assert not np.asarray(cut[:, W:]).any()
        for a, b in zip(jax.tree.leaves(cache_w), jax.tree.leaves(cache)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        jaxpr = str(jax.make_jaxpr(lambda *a: draft.propose(*a, block_size=S, kernels=None, heads=W))(*args))
        assert f"[{B},{W},{target.config.vocab_size}]" in jaxpr.replace(" ", "")
        assert f"[{B},{S - 1},{target.config.vocab_size}]" not in jaxpr.replace(" ", "")


def test_auto_learns_the_acceptance_and_narrows_where_it_pays(pair, monkeypatch):
    """Simulated acceptance (tau 3 at block 8) and fixed costs that make W = 1 the best tokens per
    cost (E = 1, 1.68, 2.48, 3.0 over costs 1, 1.2, 2.0, 2.4 at W = 0, 1, 3, 7; 3 is a CPU program's
    half block, width.program_widths): after the full-width warm-up the
    loop collects statistics and settles on W = 1 (accepts never exceed 2 tokens again); a second
    call of the same program starts there (loop.width_history). (Simulated acceptance accepts what it
    draws, so its tokens are not the target's: losslessness is the real-acceptance tests'.)"""
    costs = {0: 1.0, 1: 1.2, 3: 2.0, 7: 2.4}
    monkeypatch.setattr(decode, "width_costs", lambda key, fn, n: np.asarray(
        [costs[w] for w in width.program_widths(8, per_row_cost=n == 4)], np.float32))
    monkeypatch.setattr(loop, "_WIDTH_HISTORY", {})          # no earlier call's statistics
    prompts = pair["eval_prompts"][:4]
    with loop._simulated_acceptance(width.geometric_profile(3.0, 8)):
        res, s = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=80, capacity=CAPACITY,
                                   verify_width="auto")
        stats = np.asarray(s.width_stats)
        assert stats[0, 0] > width.WARMUP_EVIDENCE and stats[0, 6] > 0      # full width seen, then counted
        assert int(s.width) == 1, stats                                       # W = 1
        tails = [a for row in res.acceptance_lengths for a in row[6:]]
        assert max(tails) <= 2 and max(a for row in res.acceptance_lengths for a in row[:3]) > 2
        # the next call of the program starts from these statistics: at W = 1, no warm-up
        again, s2 = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=80,
                                     capacity=CAPACITY, verify_width="auto")
    assert max(a for row in again.acceptance_lengths for a in row) <= 2 and int(s2.width) == 1
    assert np.asarray(s2.width_stats)[0, 0] > stats[0, 0] * width.DECAY ** len(res.acceptance_lengths[0])


@pytest.mark.slow
def test_slot_engine_with_auto_width_is_lossless(pair):
    """generate(slots=2, verify_width="auto"): the slot engine's adaptive step programs (what
    `serve --slots N --verify-width auto` runs), 3 requests through 2 slots (a refill), each row =
    transformers' greedy; and a fixed W = 1 never accepts past its width."""
    prompts = pair["eval_prompts"][:3]
    n = 20
    want = [hf_greedy(pair["hf"], p, n) for p in prompts]
    got = generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY, slots=2,
                   verify_width="auto")
    assert got.tokens == want
    one = generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY, slots=2,
                   verify_width=1)
    assert one.tokens == want
    assert max(a for row in one.acceptance_lengths for a in row) <= 2


@pytest.mark.slow
def test_plain_width_is_plain_decoding_and_keeps_the_draft_context(pair):
    """W = 0 for a stretch, then the whole block: the draft's context written during the plain
    iterations must be complete, so the full-width iterations accept exactly as the reference,
    which never skipped: compare the tail's acceptance with a run at full width from the same
    point (same committed prefix, same draft context => same acceptance). Both W = 0 paths: the
    loops' (each step appends its taps to the pending ones; a full buffer is flushed: 20 plain
    steps at block 8 flush twice) and one iteration alone (writes the pending taps each step)."""
    prompt = pair["eval_prompts"][3]
    n = 30
    plain = generate(pair["target"], None, [prompt], max_new_tokens=n, capacity=CAPACITY)
    w0 = generate(pair["target"], pair["draft"], [prompt], max_new_tokens=n, capacity=CAPACITY, verify_width=0)
    assert w0.tokens == plain.tokens and w0.num_iterations == plain.num_iterations
    # k plain iterations (k + 1 tokens with the prefill's), then full width: the plain steps wrote
    # their context into the draft cache, so the rest equals a fresh full-width run from the longer prompt
    for plain_iters, loops in ((20, True), (10, False)):
        head = plain.tokens[0][:plain_iters]           # the fresh run's prefill commits token k + 1
        mixed = _mixed_run(pair, prompt, n, plain_iters, loops)
        fresh = generate(pair["target"], pair["draft"], [prompt + head], max_new_tokens=n - plain_iters,
                         capacity=CAPACITY, verify_width=7)
        assert mixed["tokens"] == plain.tokens[0]
        assert mixed["tail_accept"] == fresh.acceptance_lengths[0], loops
        assert mixed["flushes"] == (2 if loops else 0)


def _mixed_run(pair, prompt, n, plain_iters, loops):
    """One program driven by hand: `plain_iters` iterations forced to W = 0, then full width.
    loops: W = 0 as loop.run's loops run it (width index 0: append, flush_pending when a row's
    buffer is full); else one iteration alone (no index: lax.switch, the pending taps written)."""
    st, tstate, dstate, p, _, lens = decode._static_and_params(pair["target"], pair["draft"], [prompt],
                                                              stream=False, max_new_tokens=n, capacity=CAPACITY,
                                                              verify_width="auto")
    target, draft = loop.merge_models(st, tstate, dstate)
    k0 = 0 if loops else None
    step = jax.jit(lambda p, s: loop.iterate(st, target, draft, p, s, k0)[0])
    kfull = len(st.widths) - 1
    full_step = jax.jit(lambda p, s: loop.iterate(st, target, draft, p, s, kfull)[0]) if loops else step
    flush = jax.jit(lambda s: loop.flush_pending(draft, s))
    s = jax.jit(lambda p: loop.prefill(st, target, draft, p))(p)
    flushes = 0
    for _ in range(plain_iters):
        if loops and not bool(loop.pending_room(s)):
            s, flushes = flush(s), flushes + 1
        s = step(p.replace(verify_width=jnp.asarray(0, jnp.int32)), s)
    tail_from = int(s.iters[0])
    full = p.replace(verify_width=jnp.asarray(len(st.widths) - 1, jnp.int32))
    while not bool(s.done[0]):
        s = full_step(full, s)
    toks = np.asarray(s.tokens[0, lens[0]: int(s.lens[0]) + 1]).tolist()
    return dict(tokens=toks, tail_accept=np.asarray(s.accept_log[0, tail_from:int(s.iters[0])]).tolist(),
                flushes=flushes)


@pytest.mark.slow
def test_sampling_at_a_prefix_width_matches_the_exact_distribution(pair):
    """T = 1 at W = 1: the first iteration verifies one draft, so positions 2 and 3 of the joint
    come from the prefix acceptance (accepted draft + bonus, or the correction)."""
    from tests.test_sampling import ROWS, SEEDS, _chi_square_p, _exact_joint
    prompt = pair["eval_prompts"][0]
    expected = _exact_joint(pair["hf"], prompt, 1.0, 1.0, 0)
    counts, n, acc = {}, 0, []
    for seed in range(SEEDS):
        res = generate(pair["target"], pair["draft"], [prompt] * ROWS, max_new_tokens=3, temperature=1.0,
                       seed=seed, capacity=CAPACITY, verify_width=1)
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
            n += 1
        acc += [a for r in res.acceptance_lengths for a in r]
    assert max(acc) == 2                                # drafts were accepted at the prefix
    assert _chi_square_p(counts, expected, n) > 1e-4


def _scheduled_samples(pair, prompt, schedule, seeds, monkeypatch):
    """T = 1 sampling through generate(verify_width="auto") (loop.run: one while loop per width)
    with the width of iteration i forced to schedule[i] (the last repeated): loop.pick_width, the
    rule's one entry in run, replaced for the call (its programs compiled for it and dropped after).
    Returns ({first 3 tokens: count}, n, the first iteration's acceptance of every row)."""
    from tests.test_sampling import POSITIONS, ROWS
    widths = width.program_widths(8, per_row_cost=True)
    idx = jnp.asarray([widths.index(w) for w in schedule], jnp.int32)
    monkeypatch.setattr(loop, "pick_width",
                        lambda st, p, s, one_shot=False: idx[jnp.minimum(s.step, len(schedule) - 1)])
    monkeypatch.setattr(decode, "width_costs", lambda key, fn, n: np.ones((n,), np.float32))  # no profiling runs
    decode.clear_compiled()
    jax.clear_caches()                  # no trace of the real rule reused
    counts, n, first = {}, 0, []
    try:
        # the schedule is in force: greedy, unlimited by max_new_tokens, the first iteration stops at W + 1
        g = generate(pair["target"], pair["draft"], [prompt], max_new_tokens=24, capacity=CAPACITY,
                     verify_width="auto").acceptance_lengths[0]
        assert g[0] <= schedule[0] + 1 and max(g[1:]) > schedule[0] + 1, g
        for seed in seeds:
            res = generate(pair["target"], pair["draft"], [prompt] * ROWS, max_new_tokens=POSITIONS,
                           temperature=1.0, seed=seed, capacity=CAPACITY, verify_width="auto")
            for row in res.tokens:
                counts[tuple(row)] = counts.get(tuple(row), 0) + 1
                n += 1
            first += [r[0] for r in res.acceptance_lengths]
    finally:
        monkeypatch.undo()
        decode.clear_compiled()
        jax.clear_caches()
    return counts, n, np.asarray(first)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [(1, 7)], ids=["W1-then-W7"])
def test_sampling_that_switches_widths_within_a_call_matches_the_exact_distribution(pair, schedule, monkeypatch):
    """An "auto" program at T = 1 made to switch widths between its first two iterations (forced,
    so the switch happens in every call): positions 2 and 3 of the joint come from one iteration at
    one width and, where it stopped after one token, the next at the other; the joint of the first
    3 tokens = the target's exact one (enumeration, tests/test_sampling.py)."""
    from tests.test_sampling import SEEDS, _chi_square_p, _exact_joint
    prompt = pair["eval_prompts"][0]
    expected = _exact_joint(pair["hf"], prompt, 1.0, 1.0, 0)
    counts, n, first = _scheduled_samples(pair, prompt, schedule, range(SEEDS), monkeypatch)
    # the first iteration ran at its width: at most W + 1 tokens (2 of the 3 left at most), drafts accepted
    assert first.max() == min(schedule[0] + 1, 2) and (first == 1).any(), np.bincount(first.ravel())
    assert _chi_square_p(counts, expected, n) > 1e-4


# ------------------------------------------------------------------------------- the width rule
def _numpy_choose(stats, cost, current, step, force, widths):
    """The rule of width.choose restated: conditional acceptance per position with a weak prior,
    survival = their running product, E(W) = 1 + sum_{p<W} s_p, most E per cost with hysteresis;
    full width in the warm-up (little evidence, still at full width) and on probe steps; a forced
    width wins."""
    if force >= 0:
        return force
    full = len(widths) - 1
    period = width.PROBE_EVERY * int(np.clip(np.ceil(np.float32(cost[-1]) / np.float32(cost[current])), 1, 64))
    if (stats[0, 0] < width.WARMUP_EVIDENCE and current == full) or step % period == period - 1:
        return full
    cond = np.clip((stats[1] + 0.05) / (stats[0] + 0.1), 0, 1)
    surv = np.cumprod(cond)
    e = np.concatenate([[1.0], 1.0 + np.cumsum(surv)])
    score = np.array([e[w] for w in widths]) / cost
    best = int(np.argmax(score))
    return best if score[best] > width.HYSTERESIS * score[current] else current


def test_the_choice_is_a_deterministic_function_of_the_statistics():
    widths = width.widths_for(16)
    assert widths == (0, 1, 3, 7, 15) and width.widths_for(8) == (0, 1, 3, 7)
    # compiled into the adaptive program: plain, the middle width, the block; a forced other one too
    assert width.program_widths(16) == (0, 3, 15) and width.program_widths(8, 3) == (0, 1, 3, 7)
    assert width.program_widths(16, per_row_cost=True) == (0, 3, 7, 15)
    rng = np.random.default_rng(0)
    choose = jax.jit(lambda *a: width.choose(*a, widths))
    for _ in range(40):
        seen = rng.uniform(0, 60, 15).astype(np.float32)
        seen = np.sort(seen)[::-1].copy()
        passed = (seen * rng.uniform(0.3, 1.0, 15)).astype(np.float32)
        stats = np.stack([seen, passed])
        cost = np.sort(rng.uniform(1, 6, 5)).astype(np.float32)
        current, step = int(rng.integers(0, 5)), int(rng.integers(0, 300))
        if _ % 4 == 0:   # a probe step of the current width's period (longer away from full width)
            period = int(width.probe_period(jnp.asarray(cost), jnp.int32(current)))
            step = period * int(rng.integers(1, 3)) - 1
        force = int(rng.choice([-1, -1, -1, 2]))
        got = [int(choose(jnp.asarray(stats), jnp.asarray(cost), jnp.int32(current), jnp.int32(step),
                          jnp.int32(force))) for _ in range(2)]
        assert got[0] == got[1] == _numpy_choose(stats, cost, current, step, force, widths)
    # a cheap plain step and low acceptance: plain; costly plain relative to a block: the block
    low = np.stack([np.full(15, 100.0), np.full(15, 10.0)]).astype(np.float32)
    high = np.stack([np.full(15, 100.0), np.full(15, 95.0)]).astype(np.float32)
    cost = jnp.asarray([1.0, 1.3, 1.4, 1.6, 2.0])
    assert int(choose(jnp.asarray(low), cost, jnp.int32(4), jnp.int32(1), jnp.int32(-1))) == 0
    assert int(choose(jnp.asarray(high), cost, jnp.int32(0), jnp.int32(1), jnp.int32(-1))) == 4
    # probes: every PROBE_EVERY steps at full width; at plain, as often in time (8.7x costlier: 9x rarer)
    probe = jnp.asarray([7.285, 26.95, 63.101])
    assert [int(width.probe_period(probe, jnp.int32(c))) for c in (2, 1, 0)] == [128, 384, 1152]
    assert int(choose(jnp.asarray(low), cost, jnp.int32(0), jnp.int32(127), jnp.int32(-1))) == 0
    assert int(choose(jnp.asarray(low), cost, jnp.int32(0), jnp.int32(255), jnp.int32(-1))) == 4
    # hysteresis: a near tie keeps the current width
    flat = jnp.asarray(np.stack([np.full(15, 100.0), np.zeros(15)]).astype(np.float32))
    assert int(choose(flat, jnp.asarray([1.0, 1.01, 1.02, 1.03, 1.04]), jnp.int32(1), jnp.int32(1),
                      jnp.int32(-1))) == 1


def _stats_of(survival_profile, seen=1e6):
    """Statistics whose survival estimate is the profile (many observations, every position seen)."""
    s = np.asarray(survival_profile, np.float64)
    cond = s / np.concatenate([[1.0], s[:-1]])
    return jnp.asarray(np.stack([np.full_like(s, seen), cond * seen]), jnp.float32)


def test_a_one_shot_batch_weighs_its_slowest_row():
    """width.batch_tokens: with one row it is E(W); with many it is the slowest row's rate, which a
    Monte Carlo batch of simulated rows reproduces; and the H200's B = 128 profile (session 29:
    W = 3 ran the batch 6% slower than W = 0) now picks W = 0 while B = 64's keeps W = 3."""
    prof = width.geometric_profile(6.54)
    stats, widths = _stats_of(prof), (0, 3, 15)
    mean = np.asarray(width.expected_tokens(stats))[list(widths)]
    np.testing.assert_allclose(np.asarray(width.batch_tokens(stats, widths, 256, 1)), mean, rtol=1e-5)
    # Monte Carlo: rows drawing acceptance from the profile at W = 3 until each has 256 tokens
    rng = np.random.default_rng(0)
    rows, need, sims = 128, 256, 40
    iters = []
    for _ in range(sims):
        got, m = np.zeros(rows), 0
        while got.min() < need:
            a = (rng.random((rows, 3)) < np.asarray(prof[:3]) / np.concatenate([[1.0], prof[:2]])).cumprod(1).sum(1)
            got += 1 + a
            m += 1
        iters.append(m)
    slow = need / np.mean(iters)
    got = float(width.batch_tokens(stats, widths, need, rows)[1])
    assert abs(got - slow) / slow < 0.03, (got, slow)
    assert got < 0.95 * mean[1]
    pick = lambda cost, rows: int(width.choose(stats, jnp.asarray(cost, jnp.float32), 1, 1000, -1, widths,  # noqa: E731
                                               batch=(256, rows)))
    b128, b64 = [7.474, 23.433, 62.542], [6.822, 14.52, 32.814]     # ms, the H200 profiles of call 2
    assert int(width.choose(stats, jnp.asarray(b128), 1, 1000, -1, widths)) == 1   # mean tokens: W = 3
    assert pick(b128, 128) == 0 and pick(b64, 64) == 1


def test_the_warm_up_is_priced_by_the_costs_and_the_horizon():
    """Full width while evidence is low, but no longer than WARMUP_SHARE of the run's plain cost
    pays for: a block at 6.1 plain steps (2 CPU cores) over 128 tokens warms up for 2 iterations, a
    block at 1.25 (the H200 at B = 1) for its whole evidence; unmeasured costs leave it unbounded."""
    widths = (0, 3, 15)
    choose = jax.jit(lambda st, c, cur, step, h: width.choose(st, c, cur, step, jnp.int32(-1), widths, horizon=h))
    no_evidence = jnp.zeros((2, 15), jnp.float32)
    cpu = jnp.asarray([5.53, 24.5, 33.7])
    gpu = jnp.asarray([4.33, 5.41, 5.41])
    assert int(width.warmup_steps(cpu, 128)) == 2 and int(width.warmup_steps(cpu, 2)) == 1
    assert int(width.warmup_steps(gpu, 256)) == 102
    assert int(width.warmup_steps(jnp.ones(3), 128)) >= 2 ** 30     # not measured yet
    got = [int(choose(no_evidence, cpu, jnp.int32(2), jnp.int32(t), jnp.int32(128))) for t in range(4)]
    assert got == [2, 2, 0, 0]           # two full-width iterations, then the costs decide (plain)
    assert [int(choose(no_evidence, gpu, jnp.int32(2), jnp.int32(t), jnp.int32(128))) for t in range(4)] == [2] * 4
    # no horizon: the evidence alone (the rule of test_the_choice_is_a_deterministic_function...)
    assert int(width.choose(no_evidence, cpu, jnp.int32(2), jnp.int32(3), jnp.int32(-1), widths)) == 2


def test_a_plain_stretch_settles_only_when_nothing_would_leave_it():
    """width.settled (loop.run's retirement): forced W = 0 settles, another forced width never; in
    "auto" W = 0 settles when no width beats it (by HYSTERESIS) now or with the evidence faded over
    the call's remaining iterations, and no full-width probe falls within them."""
    widths = (0, 3, 15)
    cost = jnp.asarray([1.0, 4.4, 6.1])                     # 2 CPU cores: W > 0 costs 4-6 plain steps
    low = _stats_of([0.2 ** (p + 1) for p in range(15)])    # poor acceptance: plain wins
    settled = lambda st, step=0, left=100, force=-1, rows=None, cost=cost: bool(width.settled(  # noqa: E731
        st, cost, jnp.int32(step), jnp.int32(force), widths, jnp.int32(left), rows))
    assert settled(low) and settled(low, rows=jnp.int32(8))
    assert settled(low, force=0) and settled(_stats_of([1.0] * 15), force=0) and not settled(low, force=2)
    period = int(width.probe_period(cost, 0))               # 128 x ceil(6.1): 896
    assert period == 896
    assert settled(low, step=period - 1 - 100) and not settled(low, step=period - 1 - 99)   # a probe in reach
    assert settled(low, step=period) and not settled(low, step=period - 1)
    high = _stats_of(width.geometric_profile(6.54))
    assert not settled(high, cost=jnp.asarray([1.0, 1.5, 2.0]))      # the block wins now
    # weak evidence of 10% conditional acceptance: plain wins now, but as it fades to the prior's
    # (0.05 / 0.1 = 50%) W = 3 (E ~ 1.9 at 1.5 plain steps) would win: settled only for a short rest
    faint = jnp.asarray(np.stack([np.full(15, 20.0), np.full(15, 2.0)]), jnp.float32)
    near = jnp.asarray([1.0, 1.5, 6.0])
    assert settled(faint, left=10, cost=near) and not settled(faint, left=400, cost=near)


def test_a_settled_call_retires_to_plain_decoding(pair, monkeypatch):
    """Costs that price every W > 0 far above its tokens: after its warm-up "auto" settles on W = 0
    and retires (plain steps without draft context for the rest of the call); tokens = plain
    decoding's = transformers' greedy. The next call starts settled and retires at once; a forced
    W = 0 retires at once; a forced W > 0 never does."""
    costs = {0: 1.0, 1: 6.0, 3: 8.0, 7: 12.0}
    monkeypatch.setattr(decode, "width_costs", lambda key, fn, n: np.asarray(
        [costs[w] for w in width.program_widths(8, per_row_cost=n == 4)], np.float32))
    monkeypatch.setattr(loop, "_WIDTH_HISTORY", {})
    prompts = pair["eval_prompts"][:2]
    n = 40
    want = generate(pair["target"], None, prompts, max_new_tokens=n, capacity=CAPACITY).tokens
    assert want == [hf_greedy(pair["hf"], p, n) for p in prompts]
    res, s = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY,
                              verify_width="auto")
    assert res.tokens == want and bool(s.retired) and int(s.width) == 0
    assert float(s.width_stats[0, 0]) > 0                                          # warmed up at full width
    again, s2 = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY,
                                 verify_width="auto")
    assert again.tokens == want and bool(s2.retired)
    assert all(a == 1 for row in again.acceptance_lengths for a in row)            # plain steps only
    # its statistics decayed over its steps as an unretired W = 0 loop's would (the next call's start)
    np.testing.assert_allclose(np.asarray(s2.width_stats),
                               np.asarray(s.width_stats) * width.DECAY ** int(s2.step), rtol=1e-4)
    w0, s0 = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY,
                              verify_width=0)
    assert w0.tokens == want and bool(s0.retired)
    # settled from the start (forced W = 0, a warm start at a settled W = 0): the prefill wrote no
    # draft context; a call that warmed up at full width did
    written = lambda st: any(np.asarray(k).any() for k in st.draft_cache.k)       # noqa: E731
    assert not written(s0) and not written(s2) and written(s)
    w7, s7 = decode._generate(pair["target"], pair["draft"], prompts, max_new_tokens=n, capacity=CAPACITY,
                              verify_width=7)
    assert w7.tokens == want and not bool(s7.retired)


def test_statistics_are_censored_at_the_verified_width():
    stats = jnp.zeros((2, 7), jnp.float32)
    accepted = jnp.asarray([3, 0, 1, 3])       # rows verified 3 drafts: 3 = all accepted
    active = jnp.asarray([True, True, True, False])
    got = np.asarray(width.update(stats, accepted, jnp.int32(3), active))
    # reached p: rows with accepted >= p among active ones, only p < 3 counted
    np.testing.assert_array_equal(got[0], [3, 2, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[1], [2, 1, 1, 0, 0, 0, 0])
    again = np.asarray(width.update(jnp.asarray(got), accepted, jnp.int32(3), active))
    np.testing.assert_allclose(again, width.DECAY * got + got)


def test_width_costs_survive_a_slow_fixed_part():
    """One slow prefill-only run (the fixed part subtracted) must not make a width look free: the
    fastest run and the fastest fixed part are kept apart (a fastest difference measured a B = 1 MoE
    plain step at ~0 ms on the H200, and "auto" then decoded plainly at 0.33x the block)."""
    per_iter = [0.006, 0.0027, 0.0061]           # seconds per iteration at widths 0, 3, 15
    calls = []

    def time_width(i):
        calls.append(i)
        first_of_width = calls.count(i) == (2 if i == 2 else 1)
        base = 0.2 if i == 0 and first_of_width else 0.03      # the first W = 0 fixed part is slow
        return 0.03 + 16 * per_iter[i], base, 16

    loop.WIDTH_COSTS.pop("spike-test", None)
    costs = loop.width_costs("spike-test", time_width, 3)
    loop.WIDTH_COSTS.pop("spike-test", None)
    np.testing.assert_allclose(costs, [0.006, 0.006, 0.0061], rtol=1e-5)   # non-decreasing in the width


def test_simulated_acceptance_draws_the_profile():
    prof = width.geometric_profile(6.54)
    assert abs(1 + sum(prof) - 6.54) < 1e-6 and all(b <= a for a, b in zip(prof, prof[1:]))
    keys = jax.random.split(jax.random.key(0), 20000)
    a = np.asarray(width.simulate(jnp.asarray(prof), keys))
    assert abs(1 + a.mean() - 6.54) < 0.1
    for p in (0, 4, 10):
        assert abs((a > p).mean() - prof[p]) < 0.015


# ------------------------------------------------------------------------------- user paths
def test_bad_widths_are_one_line_errors(pair):
    for bad, msg in ((2, r"one of \[0, 1, 3, 7\]"), ("fast", "'auto' or one of"), (8, "one of"), (True, "one of")):
        with pytest.raises(ValueError, match=msg):
            generate(pair["target"], pair["draft"], [[1, 2, 3]], max_new_tokens=4, verify_width=bad)
    with pytest.raises(ValueError, match="needs a draft"):
        generate(pair["target"], None, [[1, 2, 3]], max_new_tokens=4, verify_width=3)


def test_the_simulated_acceptance_cannot_be_set_from_user_paths():
    """Benchmark only: not a generate() keyword, not a flag of the generate / benchmark / serve
    CLIs; only loop._simulated_acceptance turns it on, and programs built outside it are real."""
    from dflash_jax.serving import server as serve
    from dflash_jax.cli import benchmark as cli_bench, generate as cli_gen
    assert not [f for f in decode.GenerateOptions.__dataclass_fields__ if "sim" in f]
    for parser in (cli_gen.build_parser(), cli_bench.build_parser(), serve.build_parser()):
        flags = [s for a in parser._actions for s in a.option_strings]
        assert not [f for f in flags if "sim" in f or "survival" in f], flags
    assert "--verify-width" in [s for a in cli_gen.build_parser()._actions for s in a.option_strings]
    assert loop._SIMULATE[0] is None
    with loop._simulated_acceptance(width.geometric_profile(4.0, 8)):
        assert loop._SIMULATE[0] is not None
    assert loop._SIMULATE[0] is None
    with pytest.raises(TypeError, match="unexpected"):
        generate(None, None, [[1]], simulate=True)


def test_verify_width_flag_is_checked_against_the_block(pair, capsys):
    from dflash_jax.cli import generate as cli_gen
    p = cli_gen.build_parser()
    assert p.parse_args(["--verify-width", "3", "x"]).verify_width == 3
    assert p.parse_args(["x"]).verify_width == "auto"
    from dflash_jax.cli import benchmark as cli_bench       # the tau tool verifies whole blocks
    assert cli_bench.build_parser().parse_args([]).verify_width == "block"
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--verify-width", "wide", "x"])
    assert e.value.code == 2


def test_the_server_defaults_to_auto_with_the_slot_engine():
    """serve: "auto" by default when the slot engine runs (--slots > 1), the block with one slot;
    an explicit width is kept, and one other than the block with one slot is a usage error."""
    from dflash_jax.serving import server as serve
    p = serve.build_parser()

    def checked(*argv):
        args = p.parse_args(["--random-init", "qwen3-0.6b", *argv])
        serve._check(p, args)
        return args.verify_width
    assert checked("--slots", "8") == "auto"
    assert checked("--slots", "1") == "block"
    assert checked("--slots", "8", "--verify-width", "block") == "block"
    assert checked("--slots", "8", "--verify-width", "3") == 3
    with pytest.raises(SystemExit) as e:
        checked("--slots", "1", "--verify-width", "auto")
    assert e.value.code == 2


# ------------------------------------------------------------------------------- mesh = one device
# In the 4-device child of tests/test_quantize.py::test_int8_and_fp8_on_a_2x2_mesh_equal_one_device (one
# process for every 4-device case). Directly:
#     DFLASH_ADAPTIVE_MESH_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/test_adaptive.py -k mesh_child
MESH_CHILD = os.environ.get("DFLASH_ADAPTIVE_MESH_CHILD") == "1"


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child (tests/test_quantize.py's mesh parent)")
def test_mesh_child_takes_the_one_device_decisions(monkeypatch):
    """Simulated acceptance (drawn per row from its own keys) and fixed costs: the widths chosen
    per iteration, hence the acceptance lengths and tokens, are the same on a 2 x 2 mesh of virtual
    CPU devices as on one device (every replica decides from replicated statistics)."""
    from dflash_jax import DraftConfig, TargetConfig, init_draft, init_target, sharding
    assert jax.device_count() == 4
    t = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=16, rope_theta=10000.0)
    d = DraftConfig.for_target(t, num_layers=1, block_size=8, mask_token_id=127)
    costs = {0: 1.0, 1: 1.6, 3: 2.1, 7: 2.4}      # W = 0, 1, 7; and 3 (the half block) on CPU
    fixed = lambda key, fn, n: np.asarray(                                         # noqa: E731  (the same on both)
        [costs[w] for w in width.program_widths(8, per_row_cost=n == 4)], np.float32)
    monkeypatch.setattr(loop, "width_costs", fixed)
    monkeypatch.setattr(decode, "width_costs", fixed)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9] * 9, [3, 1]]
    out = []
    with loop._simulated_acceptance(width.geometric_profile(3.0, 8)):
        for mesh in (None, "data=2,model=2"):
            tg, dr = init_target(t, seed=0, dtype="float32"), init_draft(d, seed=1, dtype="float32")
            if mesh is not None:
                m = sharding.as_mesh(mesh)
                tg, dr = sharding.shard_model(tg, m), sharding.shard_model(dr, m)
            r = decode.generate(tg, dr, prompts, max_new_tokens=60, capacity=128, verify_width="auto")
            out.append((r.tokens, r.acceptance_lengths))
    assert out[0] == out[1], out
    acc = [a for row in out[0][1] for a in row]
    assert len(set(acc)) > 2, acc
