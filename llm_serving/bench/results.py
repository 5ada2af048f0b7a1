"""What one request of a load test did: its times, tokens and text (the contest's per-request fields and ours)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """What one request did; times are seconds on the benchmark clock (0 = first request sent)."""

    index: int
    prompt: str
    prompt_tokens: int
    max_new_tokens: int
    streamed: bool = True
    success: bool = False
    error: str = ""
    text: str = ""
    output_tokens: int = 0
    finish_reason: str | None = None
    send_time: float = 0.0
    end_time: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each output chunk
    full_text_checked: bool | None = None  # stream + return_full_text: the last line equalled the chunks

    @property
    def latency(self) -> float | None:
        return self.end_time - self.send_time if self.success else None

    @property
    def itl(self) -> list[float]:
        if not self.streamed:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not (self.success and self.streamed and self.ttft is not None and self.latency is not None
                and self.output_tokens > 1):
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The contest's fields (input, resp_text, res_time, first_token_time) followed by ours."""
        return {
            "input": self.prompt, "resp_text": self.text, "res_time": self.latency,
            "first_token_time": self.ttft, "index": self.index, "success": self.success, "error": self.error,
            "prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
            "output_tokens": self.output_tokens, "finish_reason": self.finish_reason,
            "send_time": self.send_time, "end_time": self.end_time, "tpot": self.tpot, "itl": self.itl,
            "full_text_checked": self.full_text_checked,
        }
