"""Self-healing: what the engine does when a sequence, a step or an agent fails, so that a fault stays with
the request that caused it and the service heals itself.

- A sequence that fails on its own (its sampling on the agent, its post-processing here) fails alone: the
  agents mark it in the step's answer and the step's other sequences go on.
- A step that fails as a whole (``AgentStepError``; the agents still serve) is run again in halves
  (``run_isolated``): the KV cache writes of a step are idempotent and sampling draws depend only on
  (seed, draw index), so re-running a sequence gives the same token. Only a sequence whose step fails when
  it runs alone is failed; the others get their tokens, so a transient fault fails nobody.
- An agent that dies, or does not answer a step within the timeout derived from its warm-up timings
  (``RecoveryConfig.step_timeout``), costs the whole pool: the engine kills what is left, puts the running
  sequences back in the queue to be recomputed by fresh agents (queued ones stay queued), and starts new
  agents; the first restart at once, the next ones after a doubling back-off (``RestartPolicy``). A
  sequence in flight during ``MAX_STRIKES`` agent failures is failed instead, so a request that kills the
  agent cannot take the service down in a loop. After ``agent_restart_limit`` failures in a row (no step
  succeeded in between) the engine gives up and ``llm-serving serve`` exits non-zero for a supervisor.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import Sequence
from llm_serving.engine.request_stream import EngineError
from llm_serving.engine.standby import Standby, memory_shortfall
from llm_serving.executor.agent_pool import AgentStepError
from llm_serving.executor.step_pool import StepPool
from llm_serving.protocol.batch import FAILED_TOKEN, StepBatch, StepOutput
from llm_serving.protocol.wire import AgentSpec

log = logging.getLogger(__name__)

BACKOFF_CAP_S = 30.0  # the longest wait between two restarts
MAX_STRIKES = 2  # agent failures a sequence may be in flight for; at this many it fails instead


@dataclass(frozen=True)
class RecoveryConfig:
    """The ``serving_config`` keys of self-healing (documented in configs/example.yaml)."""

    step_timeout_factor: float = 20.0
    step_timeout_min_s: float = 5.0
    restart_limit: int = 5
    backoff_s: float = 1.0

    @classmethod
    def from_config(cls, config: ServingConfig) -> RecoveryConfig:
        s = config.serving_config
        return cls(s.step_timeout_factor, s.step_timeout_min_s, s.agent_restart_limit, s.agent_restart_backoff_s)

    def step_timeout(self, slowest_warmup_step_s: float | None) -> float | None:
        """Seconds a step may take before its agents count as stuck; None: no limit.

        A multiple of the slowest step timed at warm-up (a step runs one or a few warmed graph calls, plus
        host-side sampling), with a floor for machines whose load varies (a shared CPU).
        """
        if self.step_timeout_factor <= 0:
            return None
        return max(self.step_timeout_min_s, self.step_timeout_factor * (slowest_warmup_step_s or 0.0))


class RestartPolicy:
    """Counts agent failures in a row and says how long to wait before the next restart (None: give up)."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config
        self.failures_in_a_row = 0
        self._strikes: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def next_delay(self) -> float | None:
        """Record one more failure (a death, a stuck step or a failed restart); the wait before restarting."""
        self.failures_in_a_row += 1
        n = self.failures_in_a_row
        if n > self.config.restart_limit:
            return None
        return 0.0 if n == 1 else min(BACKOFF_CAP_S, self.config.backoff_s * 2.0 ** (n - 2))

    def step_succeeded(self) -> None:
        self.failures_in_a_row = 0

    def strike(self, in_flight: Iterable[Sequence]) -> list[Sequence]:
        """Count an agent failure against the sequences of the step it interrupted; those that reach
        ``MAX_STRIKES`` are returned (to be failed rather than recomputed again)."""
        out = []
        for seq in in_flight:
            self._strikes[seq] = self._strikes.get(seq, 0) + 1
            if self._strikes[seq] >= MAX_STRIKES:
                out.append(seq)
        return out


def run_isolated(pool: StepPool, batch: StepBatch, error: AgentStepError) -> StepOutput:
    """The answer to a step that failed as a whole with ``error``, obtained by running it again in halves.

    Each half that fails again is split again; a sequence whose run alone fails is marked ``FAILED_TOKEN``
    with the agent's message. A step of one sequence is retried once alone. Raises ``AgentDiedError`` when
    the agents die meanwhile.
    """
    n = batch.batch_size
    ids, logprobs = np.full(n, FAILED_TOKEN, np.int32), np.zeros(n, np.float32)
    errors: dict[int, str] = {}
    logits: dict[int, np.ndarray] = {}
    more = batch.num_steps - 1  # a multi-step batch's later tokens
    more_ids, more_logprobs = np.full((n, more), FAILED_TOKEN, np.int32), np.zeros((n, more), np.float32)

    def run(rows: np.ndarray, failure: AgentStepError, alone_already: bool) -> None:
        if len(rows) == 1 and alone_already:
            errors[int(rows[0])] = f"its model step failed when it ran alone: {failure}"
            return
        for part in np.array_split(rows, 2) if len(rows) > 1 else [rows]:
            try:
                out = pool.collect(pool.submit(batch.take(part)), len(part))
            except AgentStepError as exc:
                run(part, exc, len(part) == 1)
                continue
            ids[part], logprobs[part] = out.token_ids, out.logprobs
            if more:
                more_ids[part], more_logprobs[part] = out.more_token_ids, out.more_logprobs
            errors.update({int(part[row]): reason for row, reason in out.errors.items()})
            logits.update({int(part[row]): values for row, values in out.logits.items()})

    run(np.arange(n), error, False)
    return StepOutput(ids, logprobs, errors, logits, *((more_ids, more_logprobs) if more else (None, None)))


class StallWatch:
    """Notices agents stopped (SIGSTOP) while the engine is idle, where no step would time out."""

    def __init__(self) -> None:
        self._since: float | None = None

    def check(self, pool: StepPool, timeout_s: float | None) -> str | None:
        """A reason to replace the agents once some have been stopped for ``timeout_s``, else None."""
        stopped = pool.stopped_pids() if timeout_s is not None else []
        if not stopped or timeout_s is None:
            self._since = None
            return None
        now = time.monotonic()
        self._since = self._since if self._since is not None else now
        if now - self._since < timeout_s:
            return None
        self._since = None
        return f"agent process(es) {stopped} stopped (state T) for over {timeout_s:g}s while idle"


class AgentSupervisor:
    """Owns the engine's agent pool: starts it, and replaces it after a failure with back-off; with ``standby``
    (``serving_config.standby_agents``) it keeps a standby pool (``engine.standby``) and replaces a failed pool by
    promoting that, starting new agents only when there is none.

    ``close()`` may be called from any thread, also while new agents start (they are stopped at once).
    """

    def __init__(self, config: RecoveryConfig, factory: Callable[[AgentSpec], StepPool], spec: AgentSpec,
                 standby: bool = False) -> None:
        self.config = config
        self.policy = RestartPolicy(config)
        self.stall = StallWatch()
        self._pool: StepPool | None = None  # made by start(); replaced by replace()
        self.step_timeout_s: float | None = None  # derived from the serving pool's warm-up timings
        self.restarts = 0
        self.promotions = 0  # restarts that promoted the standby
        self._factory, self._spec = factory, spec
        self._keeps_standby = standby
        self._standby: Standby | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self, progress: Callable[[str], None] | None) -> None:
        """Start the first pool (raises when an agent cannot start, nothing left behind)."""
        with self._lock:
            self._pool = pool = self._factory(self._spec)
        pool.start(progress)
        self._adopt(pool)

    @property
    def pool(self) -> StepPool:
        """The agents serving now (EngineError before ``start``)."""
        if self._pool is None:
            raise EngineError("the agents were not started")
        return self._pool

    def fix_kv_blocks(self) -> int:
        """With ``pa_config.num_blocks: auto``: the count the ranks sized their caches to (the smallest), which
        later agents are then given, so a restart allocates the cache the scheduler plans with."""
        blocks = self.pool.kv_blocks
        if blocks is None:
            raise EngineError("pa_config.num_blocks auto: the agents reported no KV block count")
        self._spec = dataclasses.replace(self._spec, runner_config={**self._spec.runner_config, "num_blocks": blocks})
        return blocks

    def replace(self, wait: Callable[[float], bool], failure: str) -> bool:
        """Kill the failed pool and promote the standby or start new agents until one pool is up: True. False
        when ``wait`` (the back-off before each attempt) or ``close()`` says stop; EngineError when the restart
        limit is hit."""
        self.pool.close(graceful=False)
        while True:
            delay = self.policy.next_delay()
            if delay is None:
                raise EngineError(f"the agents failed {self.policy.failures_in_a_row - 1} times in a row "
                                  f"(serving_config.agent_restart_limit {self.config.restart_limit}); "
                                  f"last: {failure}")
            if not wait(delay):
                return False
            try:
                pool = self._promote_standby() or self._start_new()
            except Exception as exc:  # noqa: BLE001 - one more failure in a row
                if self._closed:
                    return False
                failure = f"restarting the agents failed: {exc}"
                log.error("%s", failure)
                continue
            if pool is None or self._closed:
                return False
            self._adopt(pool)
            self.restarts += 1
            self.keep_standby()
            return True

    def keep_standby(self) -> None:
        """Start a standby pool in the background, where configured (after the serving pool is up: it needs the
        KV block count that pool fixed, and the memory check measures that pool)."""
        with self._lock:
            if not self._keeps_standby or self._closed:
                return
            serving, old = self._pool, self._standby
            self._standby = Standby(self._factory, self._spec,
                                    lambda: memory_shortfall(serving.pids if serving is not None else []),
                                    self.config.restart_limit, self.config.backoff_s)
        if old is not None:  # not reached today (a recovery spends the standby); never leave one running
            old.close()

    @property
    def standby(self) -> Standby | None:
        return self._standby

    def _promote_standby(self) -> StepPool | None:
        """The standby pool, now serving (waits for one still starting), or None where there is none."""
        with self._lock:
            standby = self._standby
        if standby is None:
            return None
        pool = standby.take()
        with self._lock:
            self._standby = None
            if pool is not None and not self._closed:
                self._pool = pool
                self.promotions += 1
                return pool
        if pool is not None:
            pool.close(graceful=False)
        return None

    def _start_new(self) -> StepPool | None:
        """New agents, started (None once closed; raises when they fail to start, nothing left behind)."""
        with self._lock:
            if self._closed:
                return None
            self._pool = pool = self._factory(self._spec)
        try:
            pool.start(None)
        except BaseException:
            pool.close(graceful=False)
            raise
        return pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, standby = self._pool, self._standby
        if standby is not None:
            standby.close()
        if pool is not None:
            pool.close()

    def idle_failure(self) -> str | None:
        """Why the pool must be replaced although no step runs (an agent exited or is stopped), else None."""
        pool = self.pool
        if not pool.alive:
            return "an agent process exited while the engine was idle"
        return self.stall.check(pool, self.step_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [] if self._pool is None else list(self._pool.pids)

    def _adopt(self, pool: StepPool) -> None:
        self.step_timeout_s = self.config.step_timeout(pool.slowest_warmup_step_s)
        pool.step_timeout_s = self.step_timeout_s
