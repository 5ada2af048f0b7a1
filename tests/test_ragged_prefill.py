"""Ragged prefill (prompts back to back, for the native prefill op): buckets, call plans and graph inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agents.runtime.ragged_prefill import plan_ragged, ragged_arrays, token_buckets
from llm_serving.protocol.batch import StepBatch


def test_token_buckets_step_by_half_octaves_up_to_the_largest_call():
    assert token_buckets((1, 4), (64, 256), 512) == (64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert token_buckets((1,), (32,), 100) == (32, 48, 64, 96, 100)  # a max_model_len recompute fits


def bucket_cost(tokens: int, buckets=(32, 64, 128, 256)) -> float:
    fit = next((b for b in buckets if b >= tokens), None)
    return float("inf") if fit is None else 40.0 + fit


def test_plan_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        lengths = rng.integers(1, 120, rng.integers(1, 8))
        groups = plan_ragged(lengths, 4, bucket_cost)
        assert np.concatenate(groups).tolist() == list(range(len(lengths)))
        assert all(len(g) <= 4 for g in groups)
        got = sum(bucket_cost(int(lengths[g].sum())) for g in groups)
        n = len(lengths)
        best = min(
            sum(bucket_cost(int(lengths[a:b].sum())) if b - a <= 4 else float("inf")
                for a, b in itertools.pairwise((0, *cuts, n)))
            for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert got == pytest.approx(best)


def test_a_prompt_no_bucket_holds_is_refused():
    with pytest.raises(ValueError, match="no ragged prefill bucket holds a prompt of 300 tokens"):
        plan_ragged(np.array([10, 300]), 4, bucket_cost)


def test_ragged_arrays_put_prompts_back_to_back():
    lens = np.array([3, 2], np.int32)
    batch = StepBatch(np.array([5, 6, 7, 8, 9], np.int32), np.array([0, 1, 2, 0, 1], np.int32),
                      np.array([40, 41, 42, 80, 81], np.int32), lens, lens.copy(), np.zeros((2, 1), np.int32))
    ids, pos, slots, query_lens, tables, last = ragged_arrays(batch, max_seqs=4, tokens=8)
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert slots.tolist() == [40, 41, 42, 80, 81, 0, 0, 0]
    assert query_lens.tolist() == [3, 2, 0, 0]
    assert last.tolist() == [2, 4, 0, 0]
    assert tables.shape == (4, 1)
