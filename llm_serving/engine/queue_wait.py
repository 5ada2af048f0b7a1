"""Admission by expected wait: a request that would wait in the queue longer than ``serving_config.max_queue_wait_s``
is refused at once (HTTP 503 with Retry-After) instead of queued.

Why: past saturation a queue limited only in count (``max_queue_size``) grows until each request waits longer than
its client will; clients time out and leave, often after their request was started, and the steps computed for them
are wasted, so fewer requests complete per second than at saturation (docs/reliability.md, "Overload"). A bound in
time keeps the queue as short as the clients' patience, and every admitted request's time to first token within
about the bound plus its prefill.

The estimate: the budgets (prompt + max_new_tokens, ``Sequence.budget``) of the requests queued ahead, over the rate
the queue drains at: the budgets of the requests started per second, measured only while requests waited (the engine
then starts a request whenever capacity frees, so the rate is its capacity for this workload, early ends on EOS
included). Order is taken as first come, first served. Until a rate has been measured nothing is refused on time.
"""

from __future__ import annotations

import math

from llm_serving.request_errors import QueueFull

MIN_STARTS = 8  # requests started in a measuring window: a window spans several admissions, not one lucky step
SMOOTHING = 0.3  # weight of a new window in the drain rate's moving average


class QueueWait:
    """The queue's drain rate, measured from the scheduler's counters after every step, and the admission check.

    Not thread-safe: the engine calls it under its lock. Times are passed in (seconds on one monotonic clock).
    """

    def __init__(self, bound_s: float | None) -> None:
        self.bound_s = bound_s  # None: no bound in time (the count limit alone)
        self.rate: float | None = None  # budget tokens started per second while requests waited; None: not yet
        self._last: float | None = None  # the last observation: when, whether requests waited, the counters
        self._waited = False
        self._starts = self._tokens = 0
        self._window_s = 0.0  # the measuring window so far: waiting time, starts and their budgets
        self._window_starts = self._window_tokens = 0

    def observe(self, now: float, num_waiting: int, num_started: int, started_tokens: int) -> None:
        """Note the scheduler's state after a step was scheduled: requests waiting, and its running counts of
        requests started and their budgets (``Scheduler.num_started``, ``started_tokens``). The time since the last
        observation counts when requests waited then."""
        if self._last is not None and self._waited and now > self._last:
            self._window_s += now - self._last
            self._window_starts += num_started - self._starts
            self._window_tokens += started_tokens - self._tokens
            if self._window_starts >= MIN_STARTS:
                sample = self._window_tokens / self._window_s
                self.rate = sample if self.rate is None else self.rate + SMOOTHING * (sample - self.rate)
                self._window_s, self._window_starts, self._window_tokens = 0.0, 0, 0
        self._last, self._waited = now, num_waiting > 0
        self._starts, self._tokens = num_started, started_tokens

    @property
    def active(self) -> bool:
        """Whether ``check`` can refuse: a bound is set and a rate measured (else the caller need not count the
        queue)."""
        return self.bound_s is not None and self.rate is not None

    def expected_wait(self, queued_tokens: int) -> float | None:
        """Seconds a request behind ``queued_tokens`` budget tokens waits to start; None before a rate is known."""
        if self.rate is None or self.rate <= 0:
            return None
        return queued_tokens / self.rate

    def check(self, queued_tokens: int) -> None:
        """Raise QueueFull (with the seconds to retry after) when a request behind ``queued_tokens`` would wait
        longer than the bound."""
        if self.bound_s is None:
            return
        wait = self.expected_wait(queued_tokens)
        if wait is None or wait <= self.bound_s:
            return
        raise QueueFull(f"a new request would wait about {wait:.1f} s to start ({queued_tokens} tokens queued ahead, "
                        f"drained at {self.rate:.0f} tokens/s), more than serving_config.max_queue_wait_s "
                        f"{self.bound_s:g}", retry_after=max(1, math.ceil(wait - self.bound_s)))
