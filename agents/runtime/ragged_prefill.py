"""Ragged prefill: the prompts of a call back to back in one token-flat bucket, for backends whose prefill
attention takes them so (``OpsBackend.ragged_prefill``; the native CPU ops do).

Why: padding every prompt of a call to the longest one's length bucket wasted up to half the prefill compute on
short, uneven prompts (alpaca-like: 8 prompts of ~31 tokens ran as 8 x 64). A ragged prefill op attends within
each prompt by its length, so only the call's total token count is bucketed. Graph shapes are
``("ragged", max_seqs, tokens)``: ``max_seqs`` (the largest prefill batch) fixes the per-sequence inputs, and the
token buckets step by 1.5x-2x (32, 48, 64, 96, ...) up to the largest ``batch x seq_length`` the config allows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agents.runtime.bucket_plan import bucket_ladder, groups_from_cuts
from llm_serving.protocol.batch import StepBatch


def token_buckets(batch_sizes: tuple[int, ...], seq_lengths: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    """Powers of two and their 1.5x from the smallest prompt bucket up to the largest call (at least one
    ``max_model_len`` sequence, for the recompute of a preempted sequence)."""
    top = max(batch_sizes[-1] * seq_lengths[-1], max_model_len)
    return bucket_ladder(top, 16, half_steps=True, low=seq_lengths[0])


def plan_ragged(lengths: np.ndarray, max_seqs: int, cost: Callable[[int], float]) -> list[np.ndarray]:
    """Consecutive groups (in the given order) of at most ``max_seqs`` sequences minimising the summed
    ``cost(total tokens)`` (``inf`` when no bucket holds the total)."""
    n = len(lengths)
    sums = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_seqs), j):
            c = best[i] + cost(sums[j] - sums[i])
            if c < best[j]:
                best[j], cut[j] = c, i
    if best[n] == float("inf"):
        raise ValueError(f"no ragged prefill bucket holds a prompt of {int(np.max(lengths))} tokens")
    return groups_from_cuts(np.arange(n), cut)


def ragged_arrays(batch: StepBatch, max_seqs: int, tokens: int) -> list[np.ndarray]:
    """Graph inputs of one ragged call: ids, positions, slots ``[tokens]`` (zero padding after the prompts,
    which the kernel neither writes nor attends), query lengths and last-token indices ``[max_seqs]``
    (0 for padding sequences) and an unused ``[max_seqs, 1]`` block table."""
    used = int(batch.query_lens.sum())
    ids, pos, slots = (np.zeros(tokens, np.int32) for _ in range(3))
    ids[:used], pos[:used], slots[:used] = batch.input_ids, batch.positions, batch.slot_mapping
    lens = np.zeros(max_seqs, np.int32)
    lens[: batch.batch_size] = batch.query_lens
    last = np.zeros(max_seqs, np.int32)
    last[: batch.batch_size] = np.cumsum(batch.query_lens) - 1
    return [ids, pos, slots, lens, np.zeros((max_seqs, 1), np.int32), last]
