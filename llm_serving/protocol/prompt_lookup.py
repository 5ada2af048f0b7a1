"""Prompt lookup (vLLM's ``ngram`` speculative method): the tokens that followed a sequence's last ``n`` tokens
(the longest ``n`` first) at their latest earlier occurrence in its own prompt and output. It costs no model and
pays where the output copies from the input (summaries, code edits, extraction, quoting) or repeats itself.

In the protocol because both sides propose: the master for a verify step's first round, the agents for the later
rounds of a step that verifies several (``agents.runtime.verify_rounds``). Kept free of MindSpore.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min n-gram ({min_n}) <= max n-gram ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int] | npt.NDArray[np.integer[Any]], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest matching tail n-gram.

        One pass finds the earlier occurrences of the last token; each longer n keeps those whose preceding tokens
        match too (cheaper than a window per n: the agents run this every verify round)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        ids = np.asarray(tokens, np.int64)
        last = len(ids) - 1
        ends = np.flatnonzero(ids[:last] == ids[last])  # where a matching n-gram would end, before the last token
        found = None
        for n in range(1, self.max_n + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[ids[ends - (n - 1)] == ids[last - (n - 1)]]
            if not ends.size:
                break
            if n >= self.min_n:
                found = int(ends[-1])  # the latest occurrence of the longest n so far
        return [] if found is None else ids[found + 1:found + 1 + k].tolist()
