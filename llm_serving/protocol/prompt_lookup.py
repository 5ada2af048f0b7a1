"""Prompt lookup (vLLM's ``ngram`` speculative method): the tokens that followed a sequence's last ``n`` tokens
(the longest ``n`` first) at their latest earlier occurrence in its own prompt and output. It costs no model and
pays where the output copies from the input (summaries, code edits, extraction, quoting) or repeats itself.

In the protocol because both sides propose: the master for a verify step's first round, the agents for the later
rounds of a step that verifies several (``agents.runtime.verify_rounds``). Kept free of MindSpore.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min n-gram ({min_n}) <= max n-gram ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest matching tail n-gram."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        ids = np.asarray(tokens, np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # occurrences that end before the last token
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
