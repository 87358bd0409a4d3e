"""Adaptive verify width: which prefix of the draft block the target verifies each iteration.

The draft always proposes its whole block (cutting it would change its non-causal context); the
target verifies the last token plus the first W drafts, W from a small set whose row counts W + 1
are powers of two (`widths_for`: 0, 1, 3, 7, 15 for block 16; an adaptive program compiles the
`program_widths`, 0, 3, 15; 0, 3, 7, 15 on CPU). W = 0 is plain decoding (no draft pass; its taps still reach the
draft context). Verifying a prefix is lossless: acceptance stops at W at the
latest and the bonus / correction comes from slot a <= W, exactly as a shorter block's would.

The choice runs on the device inside the loop, from values every replica holds (so every replica
of a mesh takes the same one): per-position acceptance statistics (`Stats`, summed over rows,
decayed) and the measured cost of an iteration at each width (host-profiled, passed in as a traced
array). Expected tokens per iteration at W are 1 + sum_{p<W} s_p, s_p the estimated probability
that draft p+1 is accepted (survival); the width with most expected tokens per unit of cost wins,
with hysteresis. The estimate is censoring-aware: position p counts only in iterations that
verified it, as a conditional acceptance given that p was reached.

Benchmarks also need real costs at a realistic acceptance without real weights: `simulate` draws
each row's acceptance from a survival profile (`SURVIVAL_PROFILES`); loop.py reaches it only
through its private `_simulated_acceptance` context (never from generate(), the CLIs or the server).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri
import numpy as np

__all__ = ["widths_for", "program_widths", "width_index", "choose", "is_probe", "kept", "settled", "update", "expected_tokens", "probe_period", "simulate", "geometric_profile",
           "survival", "batch_tokens",
           "warmup_steps", "SURVIVAL_PROFILES", "DECAY", "HYSTERESIS", "WARMUP_EVIDENCE", "WARMUP_SHARE",
           "PROBE_EVERY"]

# Decay of the acceptance statistics per iteration (the window is ~1 / (1 - DECAY) iterations).
DECAY = 0.98
# A width must beat the current one's tokens per cost by this factor before the loop switches.
HYSTERESIS = 1.03
# Full width while position 0 has fewer (decayed) row-verifications than this and the loop is still
# at full width: the warm-up. Once it has left full width, fading evidence does not bring it back
# (the estimates are ratios, kept by the decay); the probes below refresh them.
WARMUP_EVIDENCE = 8.0
# ... and for at most the iterations whose extra cost over plain steps is this share of a plain run
# of the horizon (the longest row's max_new_tokens): `warmup_steps`. On 2 CPU cores a block-16
# iteration of the demo pair costs 6.1 plain steps, and 8 of them were a third of a 128-token run.
WARMUP_SHARE = 0.1
# One full-width iteration every this many iterations keeps the tail positions' estimates current,
# at full width's cost: away from it the period grows with what a probe costs in iterations of the
# current width (probe_period), so probes always take ~1/PROBE_EVERY of the time.
PROBE_EVERY = 128
# Prior of a position's conditional acceptance (pseudo-counts): weak, only for unseen positions.
_PRIOR_PASS, _PRIOR_SEEN = 0.05, 0.1


def widths_for(block_size: int) -> tuple[int, ...]:
    """The verify widths (drafts verified) of a block: 0, then 2^k - 1 below S - 1, then S - 1."""
    full = block_size - 1
    return tuple(sorted({0, full} | {(1 << k) - 1 for k in range(1, 16) if (1 << k) - 1 < full}))


def program_widths(block_size: int, verify_width="auto", per_row_cost: bool = False) -> tuple[int, ...]:
    """The widths compiled into an adaptive program: 0 (plain), the middle width whose rows are
    ~sqrt(S) (3 at block 16, 1 at block 8: where a large batch is compute-bound, a few verified
    rows are what pays) and the full block (where verifying is memory-bound); plus a forced
    `verify_width` outside that set. Each width is one more target verify body in the program, and
    its compile time grows with them (measured: docs/adaptive-width.md, "Compile time"); the other
    widths of `widths_for` win too rarely to pay that, except where every verified row costs its
    own compute even at one row (per_row_cost: XLA:CPU): there the half block (7 at block 16, 3 at
    block 8) is added (docs/adaptive-width.md)."""
    full = block_size - 1
    mid = (1 << (max(block_size, 1).bit_length() - 1) // 2) - 1
    ws = {0, full} | ({mid} if 0 < mid < full else set())
    if per_row_cost and 0 < block_size // 2 - 1 < full:
        ws.add(block_size // 2 - 1)
    if isinstance(verify_width, (int, np.integer)) and not isinstance(verify_width, bool):
        ws.add(int(verify_width))
    return tuple(sorted(ws))


def width_index(widths: tuple[int, ...], verify_width) -> int:
    """The index into `widths` of a verify_width setting: -1 for "auto", else the given width's
    (ValueError naming the allowed widths when it is not one of them)."""
    if isinstance(verify_width, str):
        if verify_width != "auto":
            raise ValueError(f"verify_width must be 'auto' or one of {list(widths)}, got {verify_width!r}")
        return -1
    if isinstance(verify_width, bool) or not isinstance(verify_width, (int, np.integer)) or verify_width not in widths:
        raise ValueError(f"verify_width must be 'auto' or one of {list(widths)} (drafts verified per iteration "
                         f"at this block size), got {verify_width!r}")
    return widths.index(int(verify_width))


def survival(stats) -> jax.Array:
    """[S-1] estimated P(draft p+1 accepted), from stats [2, S-1] (row 0: decayed count of rows
    that reached position p in an iteration verifying it; row 1: of those, how many accepted draft
    p+1): conditional acceptance per position, then their running product (non-increasing)."""
    seen, passed = stats[0], stats[1]
    cond = (passed + _PRIOR_PASS) / (seen + _PRIOR_SEEN)                      # [S-1]
    return jnp.cumprod(jnp.clip(cond, 0.0, 1.0))


def expected_tokens(stats) -> jax.Array:
    """[S] expected tokens per iteration at W = 0 .. S-1 drafts verified (1 + sum_{p<W} s_p)."""
    s = survival(stats)
    return 1.0 + jnp.concatenate([jnp.zeros((1,), s.dtype), jnp.cumsum(s)])


def batch_tokens(stats, widths: tuple[int, ...], remaining, rows) -> jax.Array:
    """[n] tokens per iteration at each width as a one-shot batch sees them: the rate at which its
    slowest row covers `remaining` tokens (the most any running row still has to produce) when
    `rows` rows draw their acceptance independently. A row's tokens after m iterations have mean
    m·mu and variance m·var (mu = E(W), var from the same survival: E[A^2] = sum_{p<W} (2p+1) s_p);
    the slowest of `rows` trails by z·sqrt(m·var) (z the expected maximum of `rows` standard
    normals, Blom's approximation; 0 for one row), so it needs m = x^2 iterations with
    mu·x^2 - z·sd·x = remaining. With one row (or var 0, W = 0) this is E(W). Why: the batch ends
    with its slowest row, and at B = 128 on the H200 W = 3 beat W = 0 in tokens per cost but ran
    the batch slower (Qwen3-8B shapes, simulated acceptance: 15,564 against W = 0's 16,492 tok/s)."""
    s = survival(stats)
    p = jnp.arange(s.shape[0], dtype=s.dtype)
    zero = jnp.zeros((1,), s.dtype)
    mean_a = jnp.concatenate([zero, jnp.cumsum(s)])[jnp.asarray(widths)]
    sq_a = jnp.concatenate([zero, jnp.cumsum((2 * p + 1) * s)])[jnp.asarray(widths)]
    mu = 1.0 + mean_a
    sd = jnp.sqrt(jnp.maximum(sq_a - mean_a ** 2, 0.0))
    n = jnp.maximum(jnp.asarray(rows, jnp.float32), 1.0)
    z = jnp.maximum(ndtri((n - 0.375) / (n + 0.25)), 0.0)
    r = jnp.maximum(jnp.asarray(remaining, jnp.float32), 1.0)
    x = (z * sd + jnp.sqrt((z * sd) ** 2 + 4.0 * mu * r)) / (2.0 * mu)
    return r / (x * x)


def update(stats, accepted, verified: jax.Array, active) -> jax.Array:
    """The statistics after an iteration: accepted [B] drafts accepted per row (<= verified),
    verified [] drafts the iteration verified, active [B] rows that ran. Position p counts for a
    row that reached it (accepted >= p) only when p < verified (censoring)."""
    p = jnp.arange(stats.shape[1], dtype=jnp.int32)
    on = active[:, None] & (p[None] < verified)
    reached = on & (accepted[:, None] >= p[None])
    passed = on & (accepted[:, None] > p[None])
    new = jnp.stack([jnp.sum(reached, axis=0), jnp.sum(passed, axis=0)]).astype(stats.dtype)
    return DECAY * stats + new


def warmup_steps(cost, horizon) -> jax.Array:
    """The most warm-up iterations a run of `horizon` plain steps pays for: WARMUP_SHARE of its
    plain cost over a full-width iteration's extra cost (cost [n] per width, W = 0 first), at least
    one; unbounded while the costs are unmeasured (all equal)."""
    extra = cost[-1] - cost[0]
    n = jnp.floor(WARMUP_SHARE * horizon * cost[0] / jnp.maximum(extra, 1e-6 * cost[0]))
    n = jnp.where(extra > 0, jnp.minimum(n, 2 ** 30), 2 ** 30)
    return jnp.maximum(n, 1).astype(jnp.int32)


def _tokens(stats, widths: tuple[int, ...], batch) -> jax.Array:
    """[n] expected tokens per iteration at each width: E(W) for one row (batch None), else the
    one-shot batch's (remaining, rows) rate, batch_tokens."""
    return expected_tokens(stats)[jnp.asarray(widths)] if batch is None else batch_tokens(stats, widths, *batch)


def choose(stats, cost, current, step, force, widths: tuple[int, ...], horizon=None, batch=None) -> jax.Array:
    """The width index of the next iteration (a [] int32): force (>= 0) when given; else full width
    during the warm-up (low evidence while still at full width, for at most warmup_steps(cost,
    horizon) iterations when a horizon is given) and on probe steps (is_probe); else the width of
    most expected tokens per cost (cost [n] per iteration at each width), kept at `current` unless
    another beats it by HYSTERESIS. batch = (remaining, rows) for a one-shot batch, which ends with
    its slowest row: its tokens are batch_tokens' (the slot engine refills rows: mean tokens).
    Deterministic in its inputs (all replicated on a mesh)."""
    full = len(widths) - 1
    score = _tokens(stats, widths, batch) / cost                              # [n]
    best = jnp.argmax(score).astype(jnp.int32)
    pick = jnp.where(score[best] > HYSTERESIS * score[current], best, current)
    warmup = (stats[0, 0] < WARMUP_EVIDENCE) & (current == full)
    if horizon is not None:
        warmup = warmup & (step < warmup_steps(cost, horizon))
    pick = jnp.where(warmup | is_probe(step, cost, current), full, pick)
    return jnp.where(force >= 0, force, pick).astype(jnp.int32)


def probe_period(cost, current) -> jax.Array:
    """Iterations between full-width probes while at width index `current`: PROBE_EVERY times the
    probe's cost in iterations of the current width (rounded up, at most 64x). At B = 128 on the
    H200 a block-16 probe costs several plain steps, and a fixed period held "auto" below the plain
    steps it had chosen (Qwen3-8B shapes: one 63.1 ms probe per 128 plain steps of 7.3 ms held auto
    at 0.96x W = 0; 1.01x with this period)."""
    ratio = jnp.ceil(cost[-1] / cost[current])
    return PROBE_EVERY * jnp.clip(ratio, 1, 64).astype(jnp.int32)


def is_probe(step, cost, current) -> jax.Array:
    """Whether iteration `step` is a full-width probe (its width is not kept as the current one)."""
    period = probe_period(cost, current)
    return step % period == period - 1


def kept(chosen, current, step, force, cost) -> jax.Array:
    """The width index an iteration leaves as `current` for the next choice: the chosen one, except
    on an auto probe step (the choice before it stands)."""
    return jnp.where(is_probe(step, cost, current) & (force < 0), current, chosen).astype(jnp.int32)


def settled(stats, cost, step, force, widths: tuple[int, ...], left, rows) -> jax.Array:
    """[] bool: a one-shot loop now at W = 0 (width index 0) would stay there for the rest of its
    call, so it may decode plainly to the end without keeping the draft's context (loop.run's
    retirement). True when W = 0 is forced; in "auto" when no full-width probe falls within the
    `left` iterations the call has at most (a W = 0 iteration commits one token per running row;
    left = the most tokens a running row still has to produce) and no width beats W = 0 by
    HYSTERESIS, neither with the statistics as they are nor with them decayed over those `left`
    iterations (a W = 0 iteration verifies nothing, so its statistics only decay: each position's
    conditional acceptance moves monotonically towards the prior's, and so does every width's score;
    if neither end beats W = 0, no point between does). `rows` running rows: the one-shot batch rule
    (batch_tokens), E(W) for one row."""
    left = jnp.asarray(left, jnp.int32)
    period = probe_period(cost, 0)
    no_probe = (period - 1 - jnp.asarray(step, jnp.int32) % period) >= left

    def stays(st):
        score = _tokens(st, widths, None if rows is None else (left, rows)) / cost
        return jnp.max(score) <= HYSTERESIS * score[0]

    faded = stats * jnp.power(jnp.float32(DECAY), left.astype(jnp.float32))
    auto = no_probe & stays(stats) & stays(faded)
    forced_plain = (force >= 0) & (jnp.asarray(widths, jnp.int32)[jnp.maximum(force, 0)] == 0)
    return jnp.where(force >= 0, forced_plain, auto)


def geometric_profile(tau: float, block_size: int = 16) -> tuple[float, ...]:
    """Survival s_p = r^(p+1), p < S-1, with r solved (bisection) so that 1 + sum s_p = tau (the
    mean tokens per full-width iteration)."""
    if not 1.0 <= tau <= block_size:
        raise ValueError(f"tau must be in [1, {block_size}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        r = (lo + hi) / 2
        if 1 + sum(r ** (p + 1) for p in range(block_size - 1)) < tau:
            lo = r
        else:
            hi = r
    r = (lo + hi) / 2
    return tuple(float(r ** (p + 1)) for p in range(block_size - 1))


# Per-position survival at block 16 fitted to the paper's tau (geometric, see geometric_profile):
# MT-Bench 4.24, GSM8K 6.54, and 6.35 / 8.09.
SURVIVAL_PROFILES = {f"geometric-tau{t}": geometric_profile(t) for t in (4.24, 6.54, 6.35, 8.09)}


def simulate(survival: tuple[float, ...], keys) -> jax.Array:
    """Benchmark only: each row's accepted drafts drawn from a survival profile (P(a > p) =
    survival[p]): [B] int32 from keys [B]."""
    s = jnp.asarray(survival, jnp.float32)                                     # [S-1], non-increasing
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)                    # [B]
    return jnp.sum(u[:, None] < s[None], axis=1).astype(jnp.int32)
