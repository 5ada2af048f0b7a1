"""A stand-in for ``ModelRunner`` that answers instantly, so the master, IPC and scheduler can be tested and
benchmarked without MindSpore.

Its answer is a deterministic function of the batch, so tests can compute the expected tokens themselves:
sequence ``i`` gets ``(input token at its last position * 31 + context_lens[i]) % vocab_size`` with
logprob -1.0. Sampled or penalised sequences also go through the real sampler, on logits peaked at that
token, so the sampler's per-sequence containment is exercised end to end; only its failures show in the
answer (``FAILED_TOKEN``), the tokens stay the rule's. Rows in ``want_logits`` get those peaked logits back.
Built with adapter slots (``AgentSpec.lora``), it reads each adapter's configuration as the real agents do
(``protocol.lora.LoraConfig``), and a row computed with one (``StepBatch.lora_slots``) gets its token shifted by
``1 + `` the adapter's largest rank, so a test sees which adapter, if any, answered each row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from agents.runtime.sampler import sample
from llm_serving.protocol.batch import FAILED_TOKEN, StepBatch, StepOutput
from llm_serving.protocol.lora import LoraConfig

STANDIN_LOGPROB = -1.0
_PEAK = 30.0  # logit of the rule's token (the others are 0): any temperature/top-k/top-p/penalty keeps it


def standin_tokens(batch: StepBatch, vocab_size: int) -> np.ndarray:
    """The stand-in's next token of every sequence (int32 ``[B]``)."""
    last = np.cumsum(batch.query_lens, dtype=np.int64) - 1
    last_ids = batch.input_ids[last].astype(np.int64)
    return ((last_ids * 31 + batch.context_lens) % vocab_size).astype(np.int32)


class StandinRunner:
    """Same ``warmup``/``step`` surface as ``agents.runtime.runner.ModelRunner``; ``step_delay_s`` fakes compute
    time."""

    def __init__(self, vocab_size: int, step_delay_s: float = 0.0, lora: Mapping[str, Any] | None = None,
                 num_layers: int = 1) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.step_costs = {("standin",): step_delay_s}  # as ModelRunner: the master's step timeout uses it
        self.max_loras = int(lora["max_loras"]) if lora is not None else 0
        self.max_lora_rank = int(lora["max_lora_rank"]) if lora is not None else 0
        self.num_layers = num_layers
        self.adapter_shifts = np.zeros(self.max_loras, np.int64)  # slot -> token shift (0: empty)

    def load_adapter(self, slot: int, path: str | None) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"adapter slot {slot} is not one of the {self.max_loras} slots (max_loras)")
        if path is None:
            self.adapter_shifts[slot] = 0
            return
        rank = LoraConfig.from_dir(path, self.num_layers).max_rank
        if rank > self.max_lora_rank:
            raise ValueError(f"adapter {path} has rank {rank}, above max_lora_rank {self.max_lora_rank}")
        self.adapter_shifts[slot] = 1 + rank

    num_blocks: int | None = None  # no KV cache

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        if known_costs:
            raise ValueError("the stand-in runner compiles nothing to load known costs for")
        if progress:
            progress("stand-in runner: nothing to warm up")
        return {}

    def step(self, batch: StepBatch) -> StepOutput:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        tokens = standin_tokens(batch, self.vocab_size)
        if batch.lora_slots is not None:
            shifts = np.where(batch.lora_slots >= 0, self.adapter_shifts[np.maximum(batch.lora_slots, 0)], 0)
            tokens = ((tokens + shifts) % self.vocab_size).astype(np.int32)
        logprobs = np.full(tokens.shape, STANDIN_LOGPROB, np.float32)
        sampled = batch.sampling is not None and batch.sampling.needs_logits
        if not sampled and batch.want_logits is None:
            return StepOutput(tokens, logprobs)
        logits = np.zeros((tokens.shape[0], self.vocab_size), np.float32)
        logits[np.arange(tokens.shape[0]), tokens] = _PEAK
        wanted = {} if batch.want_logits is None else {int(i): logits[i] for i in np.flatnonzero(batch.want_logits)}
        if sampled:
            drawn, _ = sample(logits, tokens, logprobs, batch.sampling)
            tokens = np.where(drawn == FAILED_TOKEN, FAILED_TOKEN, tokens).astype(np.int32)
        return StepOutput(tokens, logprobs, logits=wanted)
