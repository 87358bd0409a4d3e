"""The paged KV cache and prefix caching in the slot engine (dflash_jax.cache.PagedKVCache,
dflash_jax.pages.PageAllocator, Slots(kv_pages=...)): a paged run gives one-shot generate's tokens and
acceptance lengths; a prefix hit (ending on a page boundary and inside a page) gives the cold run's
tokens and acceptance lengths exactly, so the draft's context K/V came back with the target's; pages
running out makes requests wait or be preempted, and they finish identical; the served multi-turn
chat hits turn 1's prefix. Greedy, float32, the trained vocab-32 pair (acceptance >= 3)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import generate, load_draft, load_target
from dflash_jax.engine import Request, SlotEngine, Tokens
from dflash_jax.slots import PagesShort, RowRequest, Slots

CAP, PAGE, K = 96, 4, 3


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    p = trained_small_vocab_pair
    target = load_target(p["target_path"], dtype="float32")
    return target, load_draft(p["draft_path"], target=target, dtype="float32")


def one_shot(target, draft, prompt, n):
    res = generate(target, draft, [list(prompt)], max_new_tokens=n, capacity=CAP, verify_width="block")
    return res.tokens[0], res.acceptance_lengths[0]


def prompt_of(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, 32, n))


def test_paged_slots_equal_one_shot_and_give_every_page_back(pair):
    target, draft = pair
    reqs = [RowRequest(prompt=prompt_of(i, 5 + 3 * i), max_new=9 + 4 * i) for i in range(4)]
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=40, page_size=PAGE)
    out = eng.run(reqs)
    for r, res in zip(reqs, out):
        toks, acc = one_shot(target, draft, r.prompt, r.max_new)
        assert res.tokens == toks and res.acceptance_lengths == acc
    assert max(a for res in out for a in res.acceptance_lengths) >= 3
    eng.pages.check()
    assert eng.pages.used() == 0 and eng.pages.available() == 39


@pytest.mark.parametrize("shared", [8, 10], ids=["on_a_page", "inside_a_page"])
def test_a_prefix_hit_gives_the_cold_tokens_and_acceptance(pair, shared):
    """Request 2 shares `shared` tokens with request 1 (2 full pages of 4, then 0 or 2 more): it
    prefills only its tail, and its tokens and acceptance lengths equal a cold run's."""
    target, draft = pair
    first = prompt_of(1, 13)
    second = first[:shared] + prompt_of(2, 7)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE)
    eng.run([RowRequest(prompt=first, max_new=12)])
    hits = eng.pages.stats()["prefix_hits_tokens"]
    res = eng.run([RowRequest(prompt=second, max_new=15)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] - hits == 8            # the 2 full shared pages
    toks, acc = one_shot(target, draft, second, 15)
    assert res.tokens == toks and res.acceptance_lengths == acc
    assert max(acc) >= 3
    # and a request whose whole prompt is a cached prefix of an earlier output (a multi-turn chat)
    turn2 = first + tuple(eng.run([RowRequest(prompt=first, max_new=12)])[0].tokens) + prompt_of(3, 3)
    hits = eng.pages.stats()["prefix_hits_tokens"]
    res = eng.run([RowRequest(prompt=turn2, max_new=10)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] - hits >= 16
    toks, acc = one_shot(target, draft, turn2, 10)
    assert res.tokens == toks and res.acceptance_lengths == acc


def test_offline_pages_short_waits_then_runs_identical(pair):
    """A pool that holds one request at a time: the second waits for the first's pages."""
    target, draft = pair
    reqs = [RowRequest(prompt=prompt_of(10 + i, 9), max_new=20) for i in range(2)]
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=12, page_size=PAGE, prefix_cache=False)
    out = eng.run(reqs)
    for r, res in zip(reqs, out):
        assert (res.tokens, res.acceptance_lengths) == one_shot(target, draft, r.prompt, r.max_new)
    with pytest.raises(PagesShort, match="kv_pages=3"):
        Slots(target, draft, slots=1, capacity=CAP, steps=K, kv_pages=3, page_size=PAGE).run(reqs[:1])


def test_served_preemption_and_queueing_change_no_token(pair):
    """Four requests on a pool too small for them together: they queue, the newest running one is
    preempted when the others cannot grow, and every request's tokens equal one-shot generate's."""
    target, draft = pair
    reqs = [(prompt_of(20 + i, 6 + i), 60) for i in range(4)]
    eng = SlotEngine(target, draft, slots=4, capacity=CAP, steps=K, kv_pages=22, page_size=PAGE,
                     prefix_cache=False)
    try:
        hs = [eng.submit(Request(prompt=p, max_tokens=n, ignore_eos=True)) for p, n in reqs]
        got = [[t for ev in h.events() if isinstance(ev, Tokens) for t in ev.ids] for h in hs]
    finally:
        eng.shutdown(timeout=10)
    for (p, n), toks in zip(reqs, got):
        assert toks == one_shot(target, draft, p, n)[0]
    assert eng.slots.preemptions > 0
    eng.slots.pages.check()
    assert eng.slots.pages.used() == 0
