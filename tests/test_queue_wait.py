"""Admission by expected wait (``llm_serving.engine.queue_wait``): the drain rate measured from the scheduler's
counters while requests waited, the expected wait, and the refusal past ``serving_config.max_queue_wait_s``. Times are
given, not read from a clock."""

from __future__ import annotations

import pytest

from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.engine.queue_wait import MIN_STARTS, SMOOTHING, QueueWait
from llm_serving.request_errors import QueueFull


def measured(rate_tokens_per_s: float, bound_s: float | None = 2.0) -> QueueWait:
    """A QueueWait that saw one window: MIN_STARTS starts of 100 budget tokens while requests waited."""
    q = QueueWait(bound_s)
    seconds = MIN_STARTS * 100 / rate_tokens_per_s
    q.observe(10.0, 5, 0, 0)
    q.observe(10.0 + seconds, 5, MIN_STARTS, MIN_STARTS * 100)
    return q


def test_no_rate_until_a_window_of_starts_while_requests_waited():
    q = QueueWait(2.0)
    assert q.expected_wait(10**6) is None
    q.check(10**6)  # nothing measured: the count limit alone applies
    q.observe(0.0, 3, 0, 0)
    q.observe(1.0, 3, MIN_STARTS - 1, 700)
    assert q.rate is None
    q.observe(2.0, 0, MIN_STARTS, 800)  # the 8th start: 800 tokens over 2 s of waiting
    assert q.rate == pytest.approx(400.0)


def test_time_without_waiting_requests_does_not_count():
    q = QueueWait(2.0)
    q.observe(0.0, 4, 0, 0)
    q.observe(1.0, 0, 4, 400)  # waited during (0, 1]: counted
    q.observe(101.0, 2, 4, 400)  # idle 100 s (no request waited at 1.0): not counted
    q.observe(102.0, 2, MIN_STARTS, 800)
    assert q.rate == pytest.approx(400.0)  # 800 tokens over 2 s, not over 102 s


def test_later_windows_move_the_rate_by_the_smoothing_weight():
    q = measured(400.0)  # its last observation: 12.0 s, requests waiting
    q.observe(13.0, 5, 2 * MIN_STARTS, 2 * MIN_STARTS * 100)  # a window of 800 tokens in 1 s
    assert q.rate == pytest.approx(400.0 + SMOOTHING * (800.0 - 400.0))


def test_a_clock_standing_still_adds_nothing():
    q = QueueWait(2.0)
    q.observe(5.0, 4, 0, 0)
    q.observe(5.0, 4, MIN_STARTS, 800)  # no time passed: no window, no division by zero
    assert q.rate is None


@pytest.mark.parametrize(("queued", "retry_after"), [(1200, 1), (4000, 8), (4001, 9)])
def test_refused_past_the_bound_with_the_seconds_to_retry_after(queued, retry_after):
    q = measured(400.0, bound_s=2.0)
    assert q.expected_wait(queued) == pytest.approx(queued / 400.0)
    with pytest.raises(QueueFull, match=r"wait about .* s to start .*max_queue_wait_s 2") as err:
        q.check(queued)
    assert err.value.retry_after == retry_after  # the seconds until the queue ahead drains to the bound


def test_admitted_within_the_bound_and_without_one():
    q = measured(400.0, bound_s=2.0)
    assert q.active
    q.check(0)
    q.check(800)  # exactly the bound: admitted
    unbounded = measured(400.0, bound_s=None)
    assert not unbounded.active and not QueueWait(2.0).active
    unbounded.check(10**9)


def test_scheduler_counts_the_starts_and_budgets_and_the_waiting_budget():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_prefill_batch=2,
                                      max_num_batched_tokens=64, max_model_len=64))
    for i, (prompt, new) in enumerate([(3, 5), (4, 6), (2, 7)]):
        sched.add(Sequence(f"r{i}", [5] * prompt, SamplingParams(new, ignore_eos=True)))
    assert (sched.num_started, sched.started_tokens, sched.waiting_tokens) == (0, 0, 8 + 10 + 9)
    assert sched.schedule() is not None  # a prefill of the first two (max_num_seqs 2)
    assert (sched.num_started, sched.started_tokens, sched.waiting_tokens) == (2, 18, 9)
    sched.abort("r2")  # leaves the queue without starting
    assert (sched.num_started, sched.started_tokens, sched.waiting_tokens) == (2, 18, 0)
