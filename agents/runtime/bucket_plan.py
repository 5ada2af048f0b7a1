"""Split one step's sequences into bucketed graph calls of least total cost.

A batch pays for the bucket it is padded to: one 70-token prompt among seven 30-token prompts makes all eight
run at the 256 bucket, and one long context widens every row's decode attention. Sorting the sequences by
length and cutting the sorted list into consecutive groups, each run as its own call, trades padding for the
fixed per-call cost. The cut is chosen by dynamic programming over the costs the runner measured for each
compiled shape during warm-up. Results do not depend on the grouping: sequences never interact in a step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def bucket_ladder(top: int, start: int = 1, half_steps: bool = False, low: int = 0) -> tuple[int, ...]:
    """The one ladder every compiled dimension is bucketed on: ``start, 2*start, ...`` (with ``half_steps``, each
    one's 1.5x too) from ``low`` up to below ``top``, then ``top``. Powers of two keep a bucket's padding under half
    (under a third with the half steps) for a graph count logarithmic in ``top``: decode block-table widths from 4,
    ragged prefill and mixed-step token totals from 16 with half steps."""
    out, v = set(), start
    while v < top:
        out.update(size for size in ((v, v * 3 // 2) if half_steps else (v,)) if low <= size < top)
        v *= 2
    return tuple(sorted(out | {top}))


def plan_groups(lengths: np.ndarray, batch_buckets: tuple[int, ...],
                cost: Callable[[int, int], float]) -> list[np.ndarray]:
    """Groups of sequence indices (each sorted by length) minimising the summed ``cost(count, longest)``.

    ``cost`` returns ``inf`` for a group no compiled shape can run. It must be the same for every ``count`` that
    pads to the same one of the sorted ``batch_buckets``, except that a lone sequence may cost differently (it
    may have a shape of its own, like the runner's recompute shape); the largest bucket bounds a group. So for
    each group end only the cheapest start within each bucket's size range is a candidate: O(n x buckets) cost
    calls instead of O(n x largest bucket), which took 8 ms per decode step of 128 sequences.
    """
    order = np.argsort(lengths, kind="stable")
    sorted_lens = lengths[order].tolist()
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        smaller = 0
        for bucket in sorted({1, *batch_buckets}):
            lo, hi = max(0, j - bucket), j - smaller - 1  # starts giving group sizes in (smaller, bucket]
            count, smaller = smaller + 1, bucket
            if hi < lo:
                continue
            start = min(range(lo, hi + 1), key=best.__getitem__)
            c = best[start] + cost(count, sorted_lens[j - 1])
            if c < best[j]:
                best[j], cut[j] = c, start
            if hi == 0:
                break
    if best[n] == float("inf"):
        raise ValueError(f"no compiled shape fits a step of {n} sequences with lengths up to {max(sorted_lens)}")
    return groups_from_cuts(order, cut)


def groups_from_cuts(order: np.ndarray, cut: list[int]) -> list[np.ndarray]:
    """The groups of a DP over ``order`` whose best split of its first ``j`` entries starts its last group at
    ``cut[j]``."""
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
