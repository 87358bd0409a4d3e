"""The slot engine (dflash_jax.serving.engine.Slots / SlotEngine): continuous batching over the one-shot
loop's own iteration. A request's tokens do not depend on its slot, its batch-mates or when it
arrived, and equal one-shot generate and plain greedy decoding (float32); a per-request seed gives
the same samples in any slot; inserting leaves the other slots bitwise unchanged; a reused slot is
a fresh one; a stream of requests compiles nothing after warm-up; step buckets (a step over the
busy slots' rows alone) change no token."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from tests.checkpoints import write_draft, write_target

from dflash_jax import decode, generate, load_draft, load_target
from dflash_jax.serving.engine import Request, SlotEngine
from dflash_jax.serving.slots import RowRequest, Slots, union_mode

CAP, SLOTS = 64, 3


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    """The trained vocab-32 target + draft (S = 8; built for the fast run's sampling and width tests
    already): blocks are accepted up to whole, so equal acceptance lengths compare something (a
    random draft's are lists of 1s); `accepts` checks each comparison saw blocks of 3 or more."""
    p = trained_small_vocab_pair
    target = load_target(p["target_path"], dtype="float32")
    return target, load_draft(p["draft_path"], target=target, dtype="float32")


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random 2-layer target + draft (S = 4): for the tests that compare tokens, not acceptance
    (their programs are half the trained pair's to compile)."""
    root = tmp_path_factory.mktemp("engine_pair")
    tp = write_target(str(root / "target"), num_layers=2, seed=11)
    dp = write_draft(str(root / "draft"), tp, num_layers=1, block_size=4, seed=12)
    target = load_target(tp, dtype="float32")
    return target, load_draft(dp, target=target, dtype="float32")


def prompts(n, seed=0):
    """Prompt ids below the MASK (31) of the vocab-32 pair."""
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 31, size=rng.randint(3, 20)).tolist() for _ in range(n)]


def accepts(lengths, at_least=3):
    """lengths: per request, tokens per iteration. The comparison they enter is not vacuous: some
    iteration accepted `at_least` tokens."""
    assert max(a for row in lengths for a in row) >= at_least, lengths


def rows(ps, max_new, **kw):
    return [RowRequest(prompt=tuple(p), max_new=m, rng_row=kw.pop("rng_row", 0), **kw)
            for p, m in zip(ps, max_new)]


def one_shot(pair, p, n, **kw):
    return generate(*pair, [p], max_new_tokens=n, capacity=CAP, **kw, verify_width="block")


@pytest.mark.slow
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
    accepts([r.acceptance_lengths for r in fwd])


def test_generate_with_slots_equals_one_shot_and_stops(pair):
    ps = prompts(5, seed=1)
    stop = [ps[0][0] % 128, 20]
    full = generate(*pair, ps, max_new_tokens=14, capacity=CAP, stop_token_ids=stop, verify_width="block")
    via = generate(*pair, ps, max_new_tokens=14, capacity=CAP, stop_token_ids=stop, slots=2, verify_width="block")
    assert via.tokens == full.tokens and via.finish_reasons == full.finish_reasons
    assert via.acceptance_lengths == full.acceptance_lengths
    accepts(via.acceptance_lengths)


@pytest.mark.slow
def test_seeded_samples_independent_of_slot_and_mates(random_pair):
    """A request's samples are keyed by (seed, rng_row, position): the same in any slot, next to
    any batch-mates; generate(slots=) keeps row i's stream i, so it equals one-shot sampling."""
    ps = prompts(4, seed=2)
    kw = dict(temperature=0.9, top_k=20)
    a = Slots(*random_pair, slots=SLOTS, capacity=CAP).run(
        [RowRequest(prompt=tuple(p), max_new=12, seed=7 + i, **kw) for i, p in enumerate(ps)])
    alone = [Slots(*random_pair, slots=SLOTS, capacity=CAP).run(
        [RowRequest(prompt=(1, 2), max_new=3, seed=1, **kw)] * (i % SLOTS) +      # occupy slots 0..i-1
        [RowRequest(prompt=tuple(p), max_new=12, seed=7 + i, **kw)])[-1] for i, p in enumerate(ps)]
    assert [r.tokens for r in a] == [r.tokens for r in alone]
    full = generate(*random_pair, ps, max_new_tokens=12, capacity=CAP, seed=5, temperature=0.9, top_k=20, verify_width="block")
    via = generate(*random_pair, ps, max_new_tokens=12, capacity=CAP, seed=5, temperature=0.9, top_k=20, slots=2, verify_width="block")
    assert via.tokens == full.tokens


@pytest.mark.slow
def test_insert_leaves_other_slots_bitwise_unchanged_and_reuse_is_fresh(random_pair):
    eng = Slots(*random_pair, slots=SLOTS, capacity=CAP)
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


@pytest.mark.slow
def test_no_compile_after_warmup_across_a_stream(random_pair):
    eng = Slots(*random_pair, slots=SLOTS, capacity=CAP, steps=2)
    ps = prompts(12, seed=4)
    eng.warmup([len(p) for p in ps], ["greedy"])
    n0 = decode.compile_count()
    out = eng.run(rows(ps, [2 + (7 * i) % 25 for i in range(12)]))
    assert decode.compile_count() == n0 and all(r.tokens for r in out)


def test_slot_engine_serves_handles_and_frees_cancelled_slots(random_pair):
    """...and its thread's counters (the server's dflash_engine_* metrics) add up: one prefill per
    request, at most 2 busy rows a step, enough row-steps for every request's iterations, and the
    timed phases inside the engine's lifetime."""
    import time
    t_start = time.perf_counter()
    eng = SlotEngine(*random_pair, slots=2, capacity=CAP, max_queue=4, eos_token_ids=[])
    ps = prompts(4, seed=5)
    hs = [eng.submit(Request(prompt=tuple(p), max_tokens=10 + i, temperature=0.0)) for i, p in enumerate(ps)]
    outs = [list(h.events())[-1] for h in hs]
    for p, h, f in zip(ps, hs, outs):
        assert f.finish_reason == "length" and f.tokens == one_shot(random_pair, p, h.request.max_tokens).tokens[0]
    long = eng.submit(Request(prompt=tuple(ps[0]), max_tokens=40))
    long.next(timeout=60)
    eng.cancel(long)
    assert list(long.events())[-1].finish_reason == "cancelled"
    h = eng.submit(Request(prompt=tuple(ps[1]), max_tokens=5))
    last = list(h.events())[-1]
    assert last.tokens == one_shot(random_pair, ps[1], 5).tokens[0]
    st = eng.stats()
    assert (st.slots, st.slots_busy, st.queue_depth) == (2, 0, 0)
    iterations = sum(f.stats.iterations for f in outs) + last.stats.iterations
    K = eng.slots.steps_for(2)
    assert st.engine_inserts == 6
    assert st.engine_steps <= st.engine_slot_steps <= 2 * st.engine_steps, st
    assert st.engine_slot_steps * K >= iterations > 0, (st, iterations)
    phases = (st.engine_insert_dispatch_s, st.engine_step_dispatch_s, st.engine_read_wait_s, st.engine_idle_s)
    assert all(x >= 0 for x in phases) and st.engine_insert_dispatch_s > 0 and st.engine_step_dispatch_s > 0
    assert sum(phases) <= time.perf_counter() - t_start, st
    eng.shutdown(timeout=5)


def test_steps_and_inserts_after_warmup_build_no_key_or_width_fields(random_pair, monkeypatch):
    """The hot path reuses what warmup built: a step or an insert of a warmed-up program builds no
    compile key (a key's hash walks the models' graph definitions: ~7 ms a step for a Qwen3-8B
    target) and no width fields (a dozen small device arrays); the tokens still equal plain
    decoding's. The warm-up compiles in 3 threads (the server's default on a host of 6+ cores)."""
    import dflash_jax.serving.slot_programs as programs_mod
    ps, ns = prompts(4, seed=5), [6, 9, 4, 11]
    eng = Slots(*random_pair, slots=SLOTS, capacity=CAP, steps=2, verify_width="auto")
    eng.warmup(sorted({len(p) for p in ps}), workers=3)

    def built(*a, **k):
        raise AssertionError("built on the hot path")
    monkeypatch.setattr(eng, "_static", built)
    monkeypatch.setattr(programs_mod, "width_params", built)
    out = eng.run(rows(ps, ns))
    for p, n, r in zip(ps, ns, out):
        assert r.tokens == generate(random_pair[0], None, [p], max_new_tokens=n, capacity=CAP).tokens[0]


def test_auto_steps_run_4_iterations_over_few_rows_and_2_over_many(random_pair, monkeypatch):
    """steps="auto": a step over fewer than STEPS_AUTO_WIDE rows runs 4 iterations, one over more
    runs 2 (the threshold lowered to 2 rows here, so 3 slots show both); refilling ahead counts
    each step's own iterations, and every request's tokens equal plain decoding's."""
    import dflash_jax.serving.slots as slots_mod
    monkeypatch.setattr(slots_mod, "STEPS_AUTO_WIDE", 2)
    eng = Slots(*random_pair, slots=SLOTS, capacity=CAP, steps="auto")
    assert [eng.steps_for(n) for n in (1, 2, 3)] == [4, 2, 2]
    eng.insert([(0, RowRequest(prompt=(5, 6, 7), max_new=30))])
    assert np.asarray(eng.step_async([0])[0]).shape[0] == 4          # bucket 1
    assert np.asarray(eng.step_async()[0]).shape[0] == 2             # every slot
    eng.release(0)
    ps, ns = prompts(7, seed=8), [5, 17, 9, 3, 12, 2, 8]
    out = eng.run(rows(ps, ns), refill_ahead=True)
    assert {1, 3} <= set(eng.bucket_steps), eng.bucket_steps
    for p, n, r in zip(ps, ns, out):
        assert r.tokens == generate(random_pair[0], None, [p], max_new_tokens=n, capacity=CAP).tokens[0]
    with pytest.raises(ValueError, match="steps must be an integer >= 1 or 'auto'"):
        Slots(*random_pair, slots=SLOTS, capacity=CAP, steps="fast")


def test_union_mode():
    assert union_mode(["greedy", "greedy"]) == "greedy"
    assert union_mode(["greedy", "sample"]) == "sample"
    assert union_mode(["topk", "topp"]) == "filtered"
    assert union_mode(["topk", "sample", "greedy"]) == "topk"


def test_insert_widths_and_pipeline_give_the_same_tokens(pair):
    """Arrivals prefilled together (widths 1, 2 of one bucket) and steps read one behind (pipeline
    1) or at once (0): every request's tokens and acceptance lengths are the same (full-width steps:
    buckets have their own tests below)."""
    ps, ns = prompts(7, seed=6), [3, 11, 1, 8, 15, 2, 6]
    a = Slots(*pair, slots=SLOTS, capacity=CAP, steps=2, insert_width=1,
              step_buckets=None).run(rows(ps, ns), pipeline=0)
    eng = Slots(*pair, slots=SLOTS, capacity=CAP, steps=2, insert_width=2, step_buckets=None)
    assert eng.insert_widths() == [1, 2]
    b = eng.run(rows(ps, ns), pipeline=1)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.acceptance_lengths for r in a] == [r.acceptance_lengths for r in b]
    assert [len(r.tokens) for r in b] == ns
    accepts([r.acceptance_lengths for r in a])


def test_a_first_token_is_read_once_its_step_is_dispatched():
    """Pipeline depth 1: an insert at the head of what is in flight is read as soon as a step is
    dispatched behind it (the request's first token does not wait for the next step's dispatch,
    which with an adaptive step program blocks until the step has run: TTFT), while the step
    itself is still read one behind; reads keep dispatch order."""
    from dflash_jax.serving.slots import Pipeline

    class FakeSlots:
        def insert_async(self, items):
            return [([slot for slot, _ in items], np.asarray([7] * len(items)), np.zeros(len(items), bool))]

        def step_async(self, busy):
            return (np.zeros((1, 4, 2), np.int32), np.ones((1, 4), np.int32), np.zeros(4, bool))

    seen = []
    pipe = Pipeline(FakeSlots(), 1, lambda slot, who, tok, done: seen.append(("first", slot, tok)),
                    lambda slot, who, rows, done: seen.append(("step", slot)))
    pipe.insert([(0, None, "a")])
    pipe.step({0: "a"})
    pipe.read(stepped=True)
    assert seen == [("first", 0, 7)] and len(pipe) == 1            # the step stays one behind
    pipe.insert([(1, None, "b")])
    pipe.step({0: "a", 1: "b"})
    pipe.read(stepped=True)
    assert seen == [("first", 0, 7), ("step", 0), ("first", 1, 7)] and len(pipe) == 1


def test_refill_ahead_changes_no_token_and_saves_steps(pair):
    """Under pipeline 1 a slot whose request must end in the step in flight is refilled right
    behind it (refill_ahead): every request's tokens and acceptance lengths are those of waiting for
    the read, one of them ends on a stop id (never predicted); refills batched by refill_min change
    no token either. The job takes fewer steps: shown with plain steps (a row's end is predicted
    from one token an iteration, exact there; the trained pair's blocks of up to 8 end its requests
    sooner than predicted, so its step counts need not differ)."""
    ps, ns = prompts(9, seed=8), [6, 13, 4, 9, 17, 5, 8, 11, 7]
    eng = Slots(*pair, slots=SLOTS, capacity=CAP, steps=2, step_buckets=None)
    base = eng.run(rows(ps, ns), pipeline=1, refill_ahead=False)
    stop = base[4].tokens[5]                      # request 4 ends on a stop id at its 6th token
    reqs = rows(ps, ns)
    reqs[4] = RowRequest(prompt=tuple(ps[4]), max_new=ns[4], stop_ids=(stop,))
    off = eng.run(reqs, pipeline=1, refill_ahead=False)
    on = eng.run(reqs, pipeline=1)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert [r.acceptance_lengths for r in on] == [r.acceptance_lengths for r in off]
    accepts([r.acceptance_lengths for r in on])
    assert on[4].finish_reason == "stop" and on[4].tokens[-1] == stop
    assert [len(r.tokens) for i, r in enumerate(on) if i != 4] == [n for i, n in enumerate(ns) if i != 4]
    for pipe, m in ((1, 2), (2, 1), (2, 3)):         # refills batched; two steps in flight
        again = eng.run(reqs, pipeline=pipe, refill_min=m)
        assert [r.tokens for r in again] == [r.tokens for r in off], (pipe, m)
    with pytest.raises(ValueError, match="refill_min"):
        eng.run(reqs, refill_min=0)
    plain = Slots(pair[0], None, slots=SLOTS, capacity=CAP, steps=2, step_buckets=None)
    off = plain.run(reqs, pipeline=1, refill_ahead=False)
    n_off = sum(plain.bucket_steps.values())
    plain.bucket_steps.clear()
    on = plain.run(reqs, pipeline=1)
    n_on = sum(plain.bucket_steps.values())
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert n_on < n_off, (n_on, n_off)


# ------------------------------------------------------------------------------- step buckets
def state_rows(eng, slot):
    """Every leaf row of `slot` in the slot state (host copies), done apart."""
    st = jax.tree.map(np.array, eng.state)
    return [x[slot] for x in jax.tree.leaves(st.loop.replace(step=None, done=None)) + jax.tree.leaves(st.params)]


def test_step_buckets_are_checked(random_pair):
    assert Slots(*random_pair, slots=6, capacity=CAP).step_buckets == (1, 2, 4, 6)
    assert Slots(*random_pair, slots=4, capacity=CAP, step_buckets=[2]).step_buckets == (2, 4)
    assert Slots(*random_pair, slots=4, capacity=CAP, step_buckets=None).step_buckets == ()
    assert Slots(*random_pair, slots=4, capacity=CAP, step_buckets=()).step_buckets == ()
    for bad, msg in (("fast", "'auto', None or a sequence"), (3, "'auto', None or a sequence"),
                     ((0, 2), r"integers in \[1, slots=4\], got 0"), ((2, 8), "got 8"), ((1.5,), "got 1.5"),
                     ((2, 2), "repeated")):
        with pytest.raises(ValueError, match=msg):
            Slots(*random_pair, slots=4, capacity=CAP, step_buckets=bad)


def test_step_programs_loop_a_known_trip_count(random_pair):
    """Every loop in the compiled step programs (full width and a bucket) has a trip count the
    compiler knows: XLA:GPU runs a loop of unknown trip count by reading its predicate back and
    waiting for the device at each iteration on the launching thread, which kept the host from
    dispatching ahead (docs/perf-log.md, session 22)."""
    eng = Slots(*random_pair, slots=SLOTS, capacity=CAP, steps=3)
    for rows in (None, 2):
        text = eng._step_program("greedy", rows).as_text()
        loops = [line for line in text.splitlines() if " while(" in line]
        assert loops, text[:2000]
        assert all("known_trip_count" in line for line in loops), loops


def test_step_buckets_same_tokens_as_full_width_and_one_shot(pair):
    """Requests of mixed lengths through 4 slots, so the busy count rises and falls through the
    buckets: every request's tokens and acceptance lengths equal the full-width engine's,
    one-shot generate's and plain decoding's, whichever buckets it ran in; nothing compiles after
    warm-up; a request alone runs in bucket 1 throughout and gets the same tokens."""
    ps, ns = prompts(7, seed=7), [3, 21, 6, 2, 14, 9, 25]
    on = Slots(*pair, slots=4, capacity=CAP, steps=2)
    assert on.step_buckets == (1, 2, 4)
    on.warmup([len(p) for p in ps], ["greedy"])
    n0 = decode.compile_count()
    a = on.run(rows(ps, ns))
    assert decode.compile_count() == n0
    assert set(on.bucket_steps) >= {1, 4}                     # full width while full, 1 at the end
    b = Slots(*pair, slots=4, capacity=CAP, steps=2, step_buckets=None).run(rows(ps, ns))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.acceptance_lengths for r in a] == [r.acceptance_lengths for r in b]
    accepts([r.acceptance_lengths for r in a])
    for p, n, r in zip(ps, ns, a):
        want = one_shot(pair, p, n)
        assert r.tokens == want.tokens[0] and r.acceptance_lengths == want.acceptance_lengths[0]
        assert r.tokens == generate(pair[0], None, [p], max_new_tokens=n, capacity=CAP).tokens[0]
    on.bucket_steps.clear()
    n0 = decode.compile_count()
    alone = on.run(rows(ps[6:], ns[6:]))[0]
    assert set(on.bucket_steps) == {1} and alone.tokens == a[6].tokens
    assert decode.compile_count() == n0


def test_step_buckets_insert_and_release_across_buckets_keep_other_slots(random_pair):
    """Inserts and a release while the step bucket moves 1 -> 4 -> 2: the rows of slots outside a
    bucket are bitwise untouched by its step, and every request's tokens equal its one-shot ones."""
    ps = prompts(3, seed=9)
    want = [one_shot(random_pair, p, n).tokens[0] for p, n in zip(ps, (30, 4, 20))]
    eng = Slots(*random_pair, slots=4, capacity=CAP, steps=2)
    got = {2: [], 0: [], 3: []}

    def step(busy):
        c, n, done = eng.step(busy)
        for slot in got:
            for k in range(n.shape[0]):
                got[slot] += c[k, slot, :n[k, slot]].tolist()
        return done

    got[2].append(eng.insert([(2, RowRequest(prompt=tuple(ps[0]), max_new=30))])[2][0])
    free = [state_rows(eng, s) for s in (0, 1, 3)]
    step([2])                                                   # bucket 1: slot 2 alone
    for s, before in zip((0, 1, 3), free):
        for x, y in zip(before, state_rows(eng, s)):
            np.testing.assert_array_equal(x, y)
    first = eng.insert([(0, RowRequest(prompt=tuple(ps[1]), max_new=4)),
                        (3, RowRequest(prompt=tuple(ps[2]), max_new=20))])
    got[0].append(first[0][0])
    got[3].append(first[3][0])
    step([0, 2, 3])                                             # bucket 4
    eng.release(0)                                              # slot 0 leaves mid-flight
    slot0, slot1 = state_rows(eng, 0), state_rows(eng, 1)
    step([2, 3])                                                # bucket 2: 0 and 1 untouched
    for before, s in ((slot0, 0), (slot1, 1)):
        for x, y in zip(before, state_rows(eng, s)):
            np.testing.assert_array_equal(x, y)
    assert bool(np.asarray(eng.state.loop.done)[0])
    for _ in range(30):
        done = step([2, 3])
        if done[2] and done[3]:
            break
    assert set(eng.bucket_steps) == {1, 2, 4}
    assert got[2] == want[0] and got[3] == want[2]
    assert got[0] == want[1][:len(got[0])] and got[0]


@pytest.mark.slow
def test_step_buckets_seeded_samples_same_in_any_bucket(random_pair):
    """Sampled requests with their own seeds: the same tokens with buckets and without, and alone
    (bucket 1 throughout) as next to the others."""
    ps, ns = prompts(5, seed=10), [4, 15, 7, 11, 2]
    reqs = [RowRequest(prompt=tuple(p), max_new=n, seed=3 + i, temperature=0.9, top_k=20)
            for i, (p, n) in enumerate(zip(ps, ns))]
    on = Slots(*random_pair, slots=4, capacity=CAP, steps=2)
    a = on.run(reqs)
    assert set(on.bucket_steps) >= {1, 4}
    b = Slots(*random_pair, slots=4, capacity=CAP, steps=2, step_buckets=None).run(reqs)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [on.run([r])[0].tokens for r in reqs] == [r.tokens for r in a]
    # (sampled generate(slots=2), its default buckets on, = one-shot sampling: the last lines of
    # test_seeded_samples_independent_of_slot_and_mates, the same call on 4 prompts)


# ------------------------------------------------------------------------------- on a mesh
# The virtual devices need XLA_FLAGS before JAX starts, so the mesh case runs in a child pytest:
# tests/test_sharding.py::test_on_8_devices's 8-device child (one process start for its cases, these
# and tests/test_moe_sharding.py's). Directly:
#     DFLASH_ENGINE_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_engine.py -m slow -k mesh_child
CHILD = os.environ.get("DFLASH_ENGINE_CHILD") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not CHILD, reason="runs in the 8-device child (tests/test_sharding.py::test_on_8_devices)")
@pytest.mark.parametrize("spec", ["2x2"])
def test_slots_mesh_child_greedy_equals_one_device(spec):
    """Slots on a mesh (slots on 'data', model on 'model'): each request's tokens and acceptance
    lengths equal one-device one-shot generate; generate(slots=) on the mesh equals one batch."""
    from dflash_jax import sharding as sh
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.weights import init_draft, init_target

    cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=4)

    def models(mesh):
        t, d = init_target(cfg, dtype="float32"), init_draft(dcfg, dtype="float32")
        if mesh is not None:
            sh.shard_model(t, mesh)
            sh.shard_model(d, mesh)
        return t, d

    d, m = sh.parse_mesh(spec)
    mesh = sh.make_mesh(spec, devices=jax.devices()[:d * m])
    ps, ns = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3], [9, 10, 11, 12], [5], [6, 7]], [5, 12, 3, 9, 7, 10]
    kw = dict(capacity=CAP, attention_impl="xla")
    one = [generate(*models(None), [p], max_new_tokens=n, **kw, verify_width="block") for p, n in zip(ps, ns)]
    eng = Slots(*models(mesh), slots=4, steps=2, **kw)
    # step buckets: on with a data axis of 1 (the rows of a bucket stay on their shard), off beyond
    assert eng.step_buckets == ((1, 2, 4) if d == 1 else ())
    out = eng.run(rows(ps, ns))
    assert [o.tokens for o in out] == [w.tokens[0] for w in one]
    assert [o.acceptance_lengths for o in out] == [w.acceptance_lengths[0] for w in one]
    via = generate(*models(mesh), ps, max_new_tokens=8, slots=2 * d, **kw, verify_width="block")
    assert via.tokens == generate(*models(None), ps, max_new_tokens=8, **kw, verify_width="block").tokens
    # the server's engine on the mesh (serve --mesh): the handles get the same tokens
    eng = SlotEngine(*models(mesh), slots=2 * d, capacity=CAP, attention_impl="xla", max_queue=8)
    hs = [eng.submit(Request(prompt=tuple(p), max_tokens=n, temperature=0.0)) for p, n in zip(ps[:3], ns[:3])]
    assert [list(h.events())[-1].tokens for h in hs] == [w.tokens[0] for w in one[:3]]
    eng.shutdown(timeout=5)
    if d > 1:
        with pytest.raises(ValueError, match="multiple of the mesh's data axis"):
            Slots(*models(mesh), slots=3, **kw)
        with pytest.raises(ValueError, match="data axis of 2"):
            Slots(*models(mesh), slots=4, step_buckets=(2,), **kw)
