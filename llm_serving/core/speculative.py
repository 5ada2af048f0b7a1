"""Proposers for speculative decoding: tokens a sequence will probably generate next, verified by the model in one
step (``agents.runtime.verify_steps``), so several tokens can come from one model call.

``NgramProposer`` is prompt lookup (vLLM's ``ngram`` method): find the sequence's last ``n`` tokens earlier in its
own prompt and output (the longest ``n`` first) and propose what followed there. It costs no model and pays where
the output copies from the input (summaries, code edits, extraction, quoting) or repeats itself.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

METHODS = ("", "ngram", "draft", "self")
AGENT_METHODS = ("draft", "self")  # the agents' draft proposes (agents.runtime.speculative_runner)


class AgentProposer:
    """The agents propose (a draft model, or the target's first layers): the master reserves the positions and
    sends placeholders, which the agent replaces with its draft's tokens before verifying them."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [0] * max(k, 0)


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min n-gram ({min_n}) <= max n-gram ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
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
