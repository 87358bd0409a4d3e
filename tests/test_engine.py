"""The slot engine (dflash_jax.engine.Slots / SlotEngine): continuous batching over the one-shot
loop's own iteration. A request's tokens do not depend on its slot, its batch-mates or when it
arrived, and equal one-shot generate and plain greedy decoding (float32); a per-request seed gives
the same samples in any slot; inserting leaves the other slots bitwise unchanged; a reused slot is
a fresh one; a stream of requests compiles nothing after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.checkpoints import write_draft, write_target

from dflash_jax import decode, generate, load_draft, load_target
from dflash_jax.engine import Request, RowRequest, SlotEngine, Slots, union_mode

CAP, S, SLOTS = 64, 4, 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_pair")
    tp = write_target(str(root / "target"), num_layers=2, seed=11)
    dp = write_draft(str(root / "draft"), tp, num_layers=1, block_size=S, seed=12)
    target = load_target(tp, dtype="float32")
    return target, load_draft(dp, target=target, dtype="float32")


def prompts(n, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 120, size=rng.randint(3, 20)).tolist() for _ in range(n)]


def rows(ps, max_new, **kw):
    return [RowRequest(prompt=tuple(p), max_new=m, rng_row=kw.pop("rng_row", 0), **kw)
            for p, m in zip(ps, max_new)]


def one_shot(pair, p, n, **kw):
    return generate(*pair, [p], max_new_tokens=n, capacity=CAP, **kw)


def test_greedy_tokens_independent_of_slot_mates_and_arrival(pair):
    """Six requests of mixed lengths through 3 slots in two orders: each equals its one-shot
    generate (tokens and acceptance lengths) and plain decoding, wherever and whenever it ran."""
    ps, ns = prompts(6), [5, 17, 9, 30, 2, 12]
    eng = Slots(*pair, slots=SLOTS, capacity=CAP, steps=3)
    fwd = eng.run(rows(ps, ns))
    rev = eng.run(rows(ps[::-1], ns[::-1]))[::-1]
    for p, n, a, b in zip(ps, ns, fwd, rev):
        want = one_shot(pair, p, n)
        assert a.tokens == b.tokens == want.tokens[0]
        assert a.acceptance_lengths == b.acceptance_lengths == want.acceptance_lengths[0]
        assert a.tokens == generate(pair[0], None, [p], max_new_tokens=n, capacity=CAP).tokens[0]


def test_generate_with_slots_equals_one_shot_and_stops(pair):
    ps = prompts(5, seed=1)
    stop = [ps[0][0] % 128, 20]
    full = generate(*pair, ps, max_new_tokens=14, capacity=CAP, stop_token_ids=stop)
    via = generate(*pair, ps, max_new_tokens=14, capacity=CAP, stop_token_ids=stop, slots=2)
    assert via.tokens == full.tokens and via.finish_reasons == full.finish_reasons
    assert via.acceptance_lengths == full.acceptance_lengths


def test_seeded_samples_independent_of_slot_and_mates(pair):
    """A request's samples are keyed by (seed, rng_row, position): the same in any slot, next to
    any batch-mates; generate(slots=) keeps row i's stream i, so it equals one-shot sampling."""
    ps = prompts(4, seed=2)
    kw = dict(temperature=0.9, top_k=20)
    a = Slots(*pair, slots=SLOTS, capacity=CAP).run(
        [RowRequest(prompt=tuple(p), max_new=12, seed=7 + i, **kw) for i, p in enumerate(ps)])
    alone = [Slots(*pair, slots=SLOTS, capacity=CAP).run(
        [RowRequest(prompt=(1, 2), max_new=3, seed=1, **kw)] * (i % SLOTS) +      # occupy slots 0..i-1
        [RowRequest(prompt=tuple(p), max_new=12, seed=7 + i, **kw)])[-1] for i, p in enumerate(ps)]
    assert [r.tokens for r in a] == [r.tokens for r in alone]
    full = generate(*pair, ps, max_new_tokens=12, capacity=CAP, seed=5, temperature=0.9, top_k=20)
    via = generate(*pair, ps, max_new_tokens=12, capacity=CAP, seed=5, temperature=0.9, top_k=20, slots=2)
    assert via.tokens == full.tokens


def test_insert_leaves_other_slots_bitwise_unchanged_and_reuse_is_fresh(pair):
    eng = Slots(*pair, slots=SLOTS, capacity=CAP)
    ps = prompts(3, seed=3)
    eng.insert([(0, RowRequest(prompt=tuple(ps[0]), max_new=20)), (2, RowRequest(prompt=tuple(ps[1]), max_new=20))])
    eng.step()
    before = jax.tree.map(np.array, eng.state)
    eng.insert([(1, RowRequest(prompt=tuple(ps[2]), max_new=20))])
    after = jax.tree.map(np.array, eng.state)

    def rows_of(tree, slot):
        return [x[slot] for x in jax.tree.leaves(tree.loop.replace(step=None)) + jax.tree.leaves(tree.params)]
    for slot in (0, 2):
        for x, y in zip(rows_of(before, slot), rows_of(after, slot)):
            np.testing.assert_array_equal(x, y)
    # slot 0 reused (released mid-flight) for the request that ran in slot 1: same tokens
    eng.release(0)
    c, n, _ = eng.step()
    toks1 = [int(after.loop.tokens[1, len(ps[2])])] + [t for k in range(n.shape[0]) for t in c[k, 1, :n[k, 1]]]
    first = eng.insert([(0, RowRequest(prompt=tuple(ps[2]), max_new=20))])
    toks0 = [first[0][0]]
    for _ in range(8):
        c, n, d = eng.step()
        for k in range(n.shape[0]):
            toks0 += c[k, 0, :n[k, 0]].tolist()
            toks1 += c[k, 1, :n[k, 1]].tolist()
    m = min(len(toks0), len(toks1))
    assert toks0[:m] == toks1[:m] and m >= 10


def test_no_compile_after_warmup_across_a_stream(pair):
    eng = Slots(*pair, slots=SLOTS, capacity=CAP, steps=2)
    ps = prompts(12, seed=4)
    eng.warmup([len(p) for p in ps], ["greedy"])
    n0 = decode.compile_count()
    out = eng.run(rows(ps, [2 + (7 * i) % 25 for i in range(12)]))
    assert decode.compile_count() == n0 and all(r.tokens for r in out)


def test_slot_engine_serves_handles_and_frees_cancelled_slots(pair):
    eng = SlotEngine(*pair, slots=2, capacity=CAP, max_queue=4, eos_token_ids=[])
    ps = prompts(4, seed=5)
    hs = [eng.submit(Request(prompt=tuple(p), max_tokens=10 + i, temperature=0.0)) for i, p in enumerate(ps)]
    outs = [list(h.events())[-1] for h in hs]
    for p, h, f in zip(ps, hs, outs):
        assert f.finish_reason == "length" and f.tokens == one_shot(pair, p, h.request.max_tokens).tokens[0]
    long = eng.submit(Request(prompt=tuple(ps[0]), max_tokens=40))
    long.next(timeout=60)
    eng.cancel(long)
    assert list(long.events())[-1].finish_reason == "cancelled"
    h = eng.submit(Request(prompt=tuple(ps[1]), max_tokens=5))
    assert list(h.events())[-1].tokens == one_shot(pair, ps[1], 5).tokens[0]
    st = eng.stats()
    assert (st.slots, st.slots_busy, st.queue_depth) == (2, 0, 0)
    eng.shutdown(timeout=5)


def test_union_mode():
    assert union_mode(["greedy", "greedy"]) == "greedy"
    assert union_mode(["greedy", "sample"]) == "sample"
    assert union_mode(["topk", "topp"]) == "filtered"
    assert union_mode(["topk", "sample", "greedy"]) == "topk"
