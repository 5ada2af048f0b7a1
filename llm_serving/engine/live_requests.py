"""The engine's requests in progress: each one's scheduler state and its stream, and the ways a request ends.

Every method runs under the engine lock. A request ends exactly once: finished (eos, length, a stop string,
abort) or failed with an ``EngineError``; either way the scheduler frees its KV blocks at once. Failing one
request touches no other, which is what keeps a fault with the request that caused it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import Sequence, SequenceStatus
from llm_serving.engine.request_stream import EngineError, RequestStream, Wakeups

log = logging.getLogger(__name__)


class SequenceError(EngineError):
    """One request failed on its own (its sampling or post-processing, its step failed whenever it ran alone,
    or the agents failed during too many of its steps); the other requests went on."""


@dataclass(slots=True)
class _Live:
    """A request in progress: its scheduler state (which tells a reused id apart), its stream, and how many of
    its tokens the stream has (a step that computes a prompt chunk short of its end gives it none)."""

    sequence: Sequence
    stream: RequestStream
    delivered: int = 0


class LiveRequests:
    """Requests by id; ``counters`` is the engine's stats dict (tokens and requests by outcome)."""

    def __init__(self, scheduler: Scheduler, counters: dict[str, int]) -> None:
        self._scheduler = scheduler
        self._counters = counters
        self._live: dict[str, _Live] = {}

    def add(self, seq: Sequence, stream: RequestStream) -> None:
        self._live[seq.request_id] = _Live(seq, stream)

    def sequences(self) -> list[Sequence]:
        return [entry.sequence for entry in self._live.values()]

    def deliver(self, seqs: list[Sequence]) -> None:
        """Hand each sequence's new tokens to its stream (one, or several after a multi-step batch); one wake-up
        per event loop.

        A request whose stream saw a stop string complete ends here, its blocks freed before the next step; one
        whose post-processing raises (detokenizing, stop strings) fails alone.
        """
        now, live, running = time.monotonic(), self._live, SequenceStatus.RUNNING
        wakeups = Wakeups()
        delivered = finished = 0
        for seq in seqs:
            entry = live.get(seq.request_id)
            if entry is None or entry.sequence is not seq:
                continue  # ended from outside while the step was in flight (its id may be reused already)
            if len(seq.output_ids) == entry.delivered:
                ended = seq.finish_reason  # set once finished
                if ended is not None:  # ended without a token: a scored prompt with nothing to generate
                    del live[seq.request_id]
                    entry.stream.push_end(ended, now, wakeups)
                    finished += 1
                continue  # else its step computed a prompt chunk short of the end: no new token
            first, last = entry.delivered, len(seq.output_ids)  # several after a multi-step batch
            entry.delivered = last
            for i in range(first, last):
                reason = None if seq.status is running or i < last - 1 else seq.finish_reason
                try:
                    top = seq.output_top[i] if seq.params.top_logprobs else None
                    ended = entry.stream.push_token(seq.output_ids[i], seq.output_logprobs[i], reason, now,
                                                    wakeups, top)
                except Exception as exc:
                    log.exception("post-processing request %s failed", seq.request_id)
                    self.fail([seq], SequenceError(f"post-processing its output failed: {type(exc).__name__}: "
                                                   f"{exc}"), wakeups)
                    break
                delivered += 1
                if ended is not None:
                    del live[seq.request_id]
                    finished += 1
                    if reason is None and seq.status is running:  # a stop string: still running in the scheduler
                        self._scheduler.finish_request(seq.request_id, ended)
                    break
        self._counters["tokens_generated"] += delivered
        self._counters["requests_finished"] += finished
        wakeups.send()

    def finish(self, request_id: str, reason: str) -> bool:
        """End a request with ``reason``; False if it already ended."""
        entry = self._live.pop(request_id, None)
        self._scheduler.finish_request(request_id, reason)
        if entry is None:
            return False
        self._counters["requests_aborted"] += reason == "abort"
        wakeups = Wakeups()
        entry.stream.push_end(reason, time.monotonic(), wakeups)
        wakeups.send()
        return True

    def finish_all(self, reason: str) -> None:
        for rid in list(self._live):
            self.finish(rid, reason)

    def fail(self, seqs: list[Sequence], err: EngineError, wakeups: Wakeups | None = None) -> None:
        """End these requests with ``err`` (those still in progress); the others go on."""
        wake = wakeups if wakeups is not None else Wakeups()
        for seq in seqs:
            entry = self._live.get(seq.request_id)
            if entry is None or entry.sequence is not seq:
                continue
            del self._live[seq.request_id]
            try:
                self._scheduler.finish_request(seq.request_id, "abort")  # frees its blocks
            except Exception:  # after a bug in the loop: the request must still get its error
                log.debug("finish_request(%r) failed", seq.request_id, exc_info=True)
            entry.stream.push_error(err, wake)
            self._counters["requests_failed"] += 1
        if wakeups is None:
            wake.send()

    def fail_rows(self, seqs: list[Sequence], errors: dict[int, str]) -> None:
        """Fail the sequences of a step that the agents marked as failed on their own (row -> reason)."""
        for row, reason in errors.items():
            log.error("request %s failed on the agent: %s", seqs[row].request_id, reason)
            self.fail([seqs[row]], SequenceError(f"generating it failed: {reason}"))
