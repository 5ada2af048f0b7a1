"""A stand-in for ``ModelRunner`` that answers instantly, so the master, IPC and scheduler can be tested and
benchmarked without MindSpore.

Its answer is a deterministic function of the batch, so tests can compute the expected tokens themselves:
sequence ``i`` gets ``(input token at its last position * 31 + context_lens[i]) % vocab_size`` with
logprob -1.0.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from llm_serving.protocol.batch import StepBatch, StepOutput

STANDIN_LOGPROB = -1.0


def standin_tokens(batch: StepBatch, vocab_size: int) -> np.ndarray:
    """The stand-in's next token of every sequence (int32 ``[B]``)."""
    last = np.cumsum(batch.query_lens, dtype=np.int64) - 1
    last_ids = batch.input_ids[last].astype(np.int64)
    return ((last_ids * 31 + batch.context_lens) % vocab_size).astype(np.int32)


class StandinRunner:
    """Same ``warmup``/``step`` surface as ``agents.runner.ModelRunner``; ``step_delay_s`` fakes compute time."""

    def __init__(self, vocab_size: int, step_delay_s: float = 0.0) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s

    def warmup(self, progress: Callable[[str], None] | None = None) -> dict[tuple, float]:
        if progress:
            progress("stand-in runner: nothing to warm up")
        return {}

    def step(self, batch: StepBatch) -> StepOutput:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        tokens = standin_tokens(batch, self.vocab_size)
        return StepOutput(tokens, np.full(tokens.shape, STANDIN_LOGPROB, np.float32))
