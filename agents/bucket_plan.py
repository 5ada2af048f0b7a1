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


def plan_groups(lengths: np.ndarray, max_group: int, cost: Callable[[int, int], float]) -> list[np.ndarray]:
    """Groups of sequence indices (each sorted by length) minimising the summed ``cost(count, longest)``.

    ``cost`` returns ``inf`` for a group no compiled shape can run. ``max_group`` bounds a group's size.
    """
    order = np.argsort(lengths, kind="stable")
    sorted_lens = lengths[order].tolist()
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_group), j):
            c = best[i] + cost(j - i, sorted_lens[j - 1])
            if c < best[j]:
                best[j], cut[j] = c, i
    if best[n] == float("inf"):
        raise ValueError(f"no compiled shape fits a step of {n} sequences with lengths up to {max(sorted_lens)}")
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
