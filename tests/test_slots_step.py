"""The slot engine's step runs no iteration when every row it holds is done at its start (issue 33:
the served embedded pair lost DFlash throughput to the step dispatched ahead of the read that ends a
request, which ran its K full iterations over done rows), and still gives each request the tokens
and acceptance lengths of one-shot generate, DFlash and plain, at full width and in a step bucket,
offline and served."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import generate, load_draft, load_target
from dflash_jax.serving.engine import Request, SlotEngine, Tokens
from dflash_jax.serving.slots import RowRequest, Slots

CAP, SLOTS, K = 64, 3, 3


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    """The trained vocab-32 target + draft (S = 8): the acceptance lengths compared below are
    blocks of up to 8, not a random draft's 1s."""
    p = trained_small_vocab_pair
    target = load_target(p["target_path"], dtype="float32")
    return target, load_draft(p["draft_path"], target=target, dtype="float32")


def iterations_run(eng: Slots) -> int:
    return int(np.asarray(eng.state.loop.step))        # the loop state's counter of iterations run


@pytest.mark.parametrize("draft", ["dflash", pytest.param("plain", marks=pytest.mark.slow)])
def test_a_step_of_done_rows_runs_no_iteration_and_tokens_equal_one_shot(pair, draft):
    target, d = pair[0], (pair[1] if draft == "dflash" else None)
    prompt, n = [5, 17, 3, 29, 12], 11
    want = generate(target, d, [prompt], max_new_tokens=n, capacity=CAP, verify_width="block")
    eng = Slots(target, d, slots=SLOTS, capacity=CAP, steps=K)
    first, done = eng.insert([(1, RowRequest(prompt=tuple(prompt), max_new=n))])[1]
    tokens, accepted, live_steps = [first], [], 0
    while not done:
        before = iterations_run(eng)
        commits, produced, done_all = eng.step([1])                  # a bucket of one slot
        assert iterations_run(eng) == before + K                     # a live row: all K iterations
        live_steps += 1
        for k in range(K):
            if produced[k, 1]:
                tokens += commits[k, 1, :produced[k, 1]].tolist()
                accepted.append(int(produced[k, 1]))
        done = bool(done_all[1])
    assert tokens == want.tokens[0] and accepted == want.acceptance_lengths[0]
    assert d is None or max(accepted) >= 3, accepted
    # the row is done: a step over it (a bucket of one, then every slot) runs nothing, commits nothing
    for busy in ([1], None):
        before = iterations_run(eng)
        commits, produced, done_all = eng.step(busy)
        assert iterations_run(eng) == before and not produced.any() and done_all.all()
    assert iterations_run(eng) == K * live_steps


@pytest.mark.slow
def test_served_request_runs_no_step_past_its_end_and_equals_one_shot(pair):
    """Through SlotEngine (one step dispatched ahead of each read): the request's tokens equal
    one-shot generate's, and the device ran only the steps in which its row was live (the step
    dispatched ahead of the read that ended it ran no iteration)."""
    target, draft = pair
    prompt, n = [7, 1, 30, 2], 17
    want = generate(target, draft, [prompt], max_new_tokens=n, capacity=CAP, verify_width="block")
    eng = SlotEngine(target, draft, slots=2, capacity=CAP, steps=K, pipeline=1)
    try:
        h = eng.submit(Request(prompt=tuple(prompt), max_tokens=n, ignore_eos=True))
        got = [t for ev in h.events() if isinstance(ev, Tokens) for t in ev.ids]
        assert got == want.tokens[0]
        iters = len(want.acceptance_lengths[0])
        assert eng.slots.bucket_steps[1] > -(-iters // K)               # a step was dispatched past the end
        assert iterations_run(eng.slots) == K * -(-iters // K)          # and it ran no iteration
    finally:
        eng.shutdown(timeout=10)
