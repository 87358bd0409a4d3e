"""Shared helpers of the oracle comparisons at every verify width (issue 55, "Tests of the default
path"): `generate()` defaults to verify_width="auto", so each family's reference / transformers
comparison runs at the full block (acceptance lengths = the reference's), at "auto" and at a fixed
prefix width (tokens = the oracle's; acceptance capped at W + 1, the reference's never compared).

`WIDTHS` parametrizes a comparison: the block case keeps its test's marks, "auto" and the prefix
width (3 at block 8: width.widths_for(8) = 0, 1, 3, 7) share one compiled adaptive program (on
CPU program_widths(8) already holds 3), so the two cost one compile between them."""

from __future__ import annotations

import pytest


def widths(prefix: int = 3) -> list:
    """pytest params over verify_width: "block" (the test's own marks), then "auto" and `prefix` (a
    width below the block's), both slow (`.ci/run` runs them; a plain `pytest` the block case)."""
    return ["block", pytest.param("auto", marks=pytest.mark.slow),
            pytest.param(prefix, marks=pytest.mark.slow, id=f"W{prefix}")]


def cap(verify_width, block_size: int) -> int:
    """The most tokens one iteration may produce at this width: W + 1 (the block at "auto")."""
    return block_size if verify_width in ("block", "auto") else int(verify_width) + 1


def assert_width_result(res, tokens, acceptance, verify_width, block_size: int) -> None:
    """res (a GenerateResult) against the oracle's tokens [per row] and, at the full block, its
    acceptance lengths; at "auto" / a prefix width each iteration's count within [1, W + 1]."""
    assert res.tokens == tokens
    if verify_width == "block":
        if acceptance is not None:
            assert res.acceptance_lengths == acceptance
        return
    top = cap(verify_width, block_size)
    for row in res.acceptance_lengths:
        assert row and all(1 <= a <= top for a in row), (verify_width, row)
