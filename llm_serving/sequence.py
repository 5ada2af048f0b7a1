"""One generation request as the scheduler sees it: token ids, sampling limits and KV block table.

Preemption is by recompute (as in vLLM): a preempted sequence drops its KV blocks but keeps the tokens it
generated, so its next prefill covers ``all_token_ids`` and only the tokens after that are new output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

FINISH_REASONS = ("eos", "length", "abort", "stop")


@dataclass
class SamplingParams:
    """Per-request generation limits; sampling fields (temperature, top_p, ...) are added here later."""

    max_new_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill; holds no KV blocks
    RUNNING = "running"  # holds KV blocks for its tokens; decoded every step
    FINISHED = "finished"  # done (see finish_reason); never scheduled again


@dataclass(eq=False)
class Sequence:
    """A request's state. Compared by identity: two requests with equal tokens are still different."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None  # scheduler clock; stamped by Scheduler.add when None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (the length the next step's context grows from)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.output_ids.append(int(token_id))
        self.output_logprobs.append(float(logprob))

    def finish(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish_reason {reason!r}; expected one of {FINISH_REASONS}")
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}/{self.params.max_new_tokens}, blocks={len(self.block_table)})"
        )
