"""Cost-based splitting of a step into bucketed graph calls."""

from __future__ import annotations

import numpy as np
import pytest

from agents.runtime.bucket_plan import bucket_ladder, plan_groups

SEQ_BUCKETS = (64, 256)
BATCH_BUCKETS = (1, 4, 8)


def padded_cost(count: int, longest: int) -> float:
    """A call costs a fixed 100 plus its padded token count (like prefill)."""
    b = next((x for x in BATCH_BUCKETS if x >= count), None)
    s = next((x for x in SEQ_BUCKETS if x >= longest), None)
    return float("inf") if b is None or s is None else 100.0 + b * s


def test_one_long_prompt_is_split_off():
    lengths = np.array([30, 200, 25, 40, 31, 33, 20, 28])
    groups = plan_groups(lengths, BATCH_BUCKETS, padded_cost)
    assert [sorted(lengths[g].tolist()) for g in groups] == [[20, 25, 28, 30, 31, 33, 40], [200]]
    assert sorted(np.concatenate(groups).tolist()) == list(range(8))


def test_uniform_lengths_stay_in_one_call():
    groups = plan_groups(np.array([10, 12, 9, 11]), BATCH_BUCKETS, padded_cost)
    assert len(groups) == 1 and sorted(groups[0].tolist()) == [0, 1, 2, 3]


def test_groups_respect_the_largest_bucket():
    groups = plan_groups(np.full(20, 16), BATCH_BUCKETS, padded_cost)
    assert all(len(g) <= 8 for g in groups)
    assert sum(len(g) for g in groups) == 20


def test_plan_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = rng.integers(1, 257, rng.integers(1, 11))
        groups = plan_groups(lengths, BATCH_BUCKETS, padded_cost)
        got = sum(padded_cost(len(g), int(lengths[g].max())) for g in groups)
        order = np.argsort(lengths, kind="stable")
        n = len(order)
        best = min(  # every way to cut the sorted list into consecutive groups
            sum(padded_cost(b - a, int(lengths[order[a:b]].max())) for a, b in zip((0, *cuts), (*cuts, n)))
            for mask in range(2 ** (n - 1))
            for cuts in [tuple(i + 1 for i in range(n - 1) if mask >> i & 1)])
        assert got == pytest.approx(best)


def test_nothing_fits():
    with pytest.raises(ValueError, match="no compiled shape fits a step of 2 sequences with lengths up to 300"):
        plan_groups(np.array([300, 10]), BATCH_BUCKETS, padded_cost)


def test_a_lone_sequence_may_have_a_shape_of_its_own():
    """Like the runner's recompute shape: one sequence longer than every bucket runs alone."""
    def cost(count: int, longest: int) -> float:
        return 500.0 if count == 1 and longest > SEQ_BUCKETS[-1] else padded_cost(count, longest)

    lengths = np.array([10, 300, 12])
    groups = plan_groups(lengths, BATCH_BUCKETS, cost)
    assert [300] in [lengths[g].tolist() for g in groups]
    assert sorted(np.concatenate(groups).tolist()) == [0, 1, 2]


def test_one_ladder_buckets_every_dimension() -> None:
    """Block-table widths (powers of two from 4), token totals (from 16 with their 1.5x) and a floor: one ladder."""
    assert bucket_ladder(40, 4) == (4, 8, 16, 32, 40)
    assert bucket_ladder(3, 4) == (3,)  # a top below the start is the only bucket
    assert bucket_ladder(200, 16, half_steps=True) == (16, 24, 32, 48, 64, 96, 128, 192, 200)
    assert bucket_ladder(200, 16, half_steps=True, low=50) == (64, 96, 128, 192, 200)
    assert bucket_ladder(64, 16, half_steps=True) == (16, 24, 32, 48, 64)  # the top is never doubled
