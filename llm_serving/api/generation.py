"""One admitted HTTP request: the engine's token events turned into what its client is sent, with metrics.

``Generation`` sits between the engine's ``RequestStream`` and a route. It turns each token event into an
``AnswerDelta`` (the text released, the token, the finish reason on the last one), counts tokens and
latencies into the server's metrics, records the request's outcome once when it ends, and aborts the
request in the engine (freeing its KV blocks at once) when the route stops reading early: the client left,
an error, a sibling choice failed. Stop strings are the engine's: the stream's text is already cut.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from llm_serving.api.metrics import ServerMetrics
from llm_serving.core.logprobs import PromptLogprob, TopLogprobs
from llm_serving.engine.request_stream import NO_TOKEN, EngineError, RequestStream
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer


@dataclass
class TokenInfo:
    id: int
    logprob: float
    text: str  # text this token released (stop strings cut): the texts concatenate to the answer
    special: bool
    top: TopLogprobs | None = None  # its position's most likely tokens, when the request asked

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "logprob": self.logprob, "text": self.text, "special": self.special}


@dataclass
class AnswerDelta:
    """One token event as the client sees it: the text it released and its token (None for a tokenless end,
    an abort); the last delta has the finish reason (engine naming, ``sequence.FINISH_REASONS``)."""

    text: str
    token: TokenInfo | None
    finish_reason: str | None


@dataclass
class FullAnswer:
    """The whole answer of a non-streamed request."""

    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # when the request scored its prompt


class Generation:
    """One admitted request; it is in ``live`` (the server's generations in flight) until ``close``."""

    def __init__(self, stream: RequestStream, tokenizer: AnyTokenizer, metrics: ServerMetrics, arrival: float,
                 live: set[Generation]) -> None:
        self.stream = stream
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival
        self.prompt_len = len(stream.prompt_ids)
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.failed = False  # the engine failed while serving it
        self._last_token_time: float | None = None
        self._live = live
        self._closed = False
        live.add(self)

    async def deltas(self) -> AsyncIterator[AnswerDelta]:
        """The request's deltas, in order; the last one has a finish_reason. Iterate once."""
        try:
            async for ev in self.stream:
                token = None
                if ev.token_id != NO_TOKEN:
                    self._count_token(time.monotonic())
                    token = TokenInfo(ev.token_id, ev.logprob, ev.text, self.tokenizer.is_special(ev.token_id),
                                      ev.top_logprobs)
                if ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                yield AnswerDelta(ev.text, token, ev.finish_reason)
        except EngineError:
            self.failed = True
            raise
        finally:
            self.close()

    async def collect(self) -> FullAnswer:
        """All deltas as one answer."""
        answer = FullAnswer()
        parts = []
        async for delta in self.deltas():
            parts.append(delta.text)
            if delta.token is not None:
                answer.tokens.append(delta.token)
            answer.finish_reason = delta.finish_reason
        answer.text = "".join(parts)
        answer.prompt_logprobs = self.stream.prompt_logprobs
        return answer

    def abort(self) -> None:
        """End the request now (its client gets finish reason "abort"); frees its KV blocks."""
        self.stream.abort()

    def close(self, record: bool = True) -> None:
        """End the request's bookkeeping (idempotent); aborts it in the engine if it has not finished.

        ``record=False`` leaves the outcome to the caller (a multi-prompt request refused as a whole).
        """
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.stream.abort()  # the consumer went away (disconnect, error): free the blocks now
        self._live.discard(self)
        if record:
            self._record()

    def _count_token(self, now: float) -> None:
        m = self.metrics
        self.num_tokens += 1
        m.generation_tokens.inc()
        if self._last_token_time is None:
            m.first_token(now - self.arrival)
        else:
            m.next_token(now - self._last_token_time)
        self._last_token_time = now

    def _record(self) -> None:
        m, reason = self.metrics, self.finish_reason
        if self.failed:
            m.requests.labels("error").inc()
        elif reason is None or reason == "abort":
            m.requests.labels("aborted").inc()
            m.finish_reasons.labels("abort").inc()
        else:
            m.requests.labels("success").inc()
            m.finish_reasons.labels(reason).inc()
            if self._last_token_time is not None:
                m.request_latency(self._last_token_time - self.arrival)
