"""A standby agent pool (``serving_config.standby_agents``): a second, fully started set of agent ranks that
waits, so that a failed pool is replaced by promoting it rather than by starting new processes.

Why: replacing a tensor-parallel pool costs new processes, the MindSpore import, the weights, a new collectives'
cluster (MindSpore 2.10's ``init()``, seconds of fixed waits) and the graph loads: 8-12 s on the 2-core machine
(docs/reliability.md, "Tensor-parallel recovery"). A standby has done all of that before the failure, with its
own processes, step segments and cluster (its own scheduler port): promoting it is a swap of objects.

One ``Standby`` is one background thread: it starts a pool (``factory(spec)``; ``AgentPool`` or a test's), then
watches it; a standby that dies while it waits, or fails to start, is closed and started again after a doubling
back-off, and given up after ``restart_limit`` such failures (``state`` says why). ``take`` hands the pool over,
waiting for one still starting (it started before the failure, so it is ready before a fresh start would be);
the ``Standby`` is spent after ``take``. Before each start ``fits`` may refuse it (the host's memory).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from llm_serving.executor.step_pool import StepPool
from llm_serving.protocol.wire import AgentSpec

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often a waiting standby's processes are checked
BACKOFF_CAP_S = 30.0
MEMORY_MARGIN = 1.25  # a standby is started only where MemAvailable holds this many times the serving ranks' RSS


class Standby:
    """A pool started and kept ready in the background until ``take`` or ``close``."""

    def __init__(self, factory: Callable[[AgentSpec], StepPool], spec: AgentSpec,
                 fits: Callable[[], str | None] = lambda: None, restart_limit: int = 5,
                 backoff_s: float = 1.0) -> None:
        self._factory, self._spec, self._fits = factory, spec, fits
        self._restart_limit, self._backoff_s = restart_limit, backoff_s
        self._cond = threading.Condition()
        self._pool: StepPool | None = None
        self._spent = False  # taken or closed: the thread ends and closes whatever it still holds
        self._wanted = False  # take() waits for this standby's start
        self.state = "starting"  # starting -> ready (-> starting after a death); refused/failed: ...; taken; closed
        self.deaths = 0  # standbys that died while waiting (each replaced)
        self._thread = threading.Thread(target=self._run, name="llm-serving-standby", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        with self._cond:
            return list(self._pool.pids) if self._pool is not None and not self._spent else []

    def take(self) -> StepPool | None:
        """The standby pool, ready and alive, waiting for one that is starting; None when there is none (refused,
        failed to start, died, or closed meanwhile). Spends this ``Standby`` either way."""
        with self._cond:
            self._wanted = True
            self._cond.wait_for(lambda: self._spent or self.state != "starting")
            pool = self._pool if self.state == "ready" and not self._spent else None
            self._spent = True
            self._pool = None
            if pool is not None and pool.alive:
                self.state = "taken"
                self._cond.notify_all()
                return pool
            if self.state in ("starting", "ready"):  # else it says why there is none
                self.state = "closed"
            self._cond.notify_all()
        if pool is not None:  # died between two checks
            pool.close(graceful=False)
        return None

    def close(self) -> None:
        """Stop the standby (also while it starts: its pool's start-up is ended); idempotent."""
        with self._cond:
            pool, self._pool = self._pool, None
            if not self._spent:
                self._spent = True
                self.state = "closed"
            self._cond.notify_all()
        if pool is not None:
            pool.close(graceful=False)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        failures = 0  # failed starts and deaths over this standby's life: each restart waits longer
        while True:
            refusal = self._fits()
            with self._cond:
                if self._spent:
                    return
                if refusal is not None:
                    self._stop(f"refused: {refusal}")
                    return
                self.state = "starting"
                self._pool = pool = self._factory(self._spec)
            try:
                pool.start(None)
            except Exception as exc:  # noqa: BLE001 - a failed standby start is retried, then given up
                pool.close(graceful=False)
                failures += 1
                if not self._retry_after(failures, f"failed to start: {exc}"):
                    return
                continue
            with self._cond:
                if self._spent:  # closed while it started
                    break
                self.state = "ready"
                self._cond.notify_all()
                while not self._spent and pool.alive:
                    self._cond.wait(WATCH_S)
                if self._spent:
                    return
            self.deaths += 1
            failures += 1
            pool.close(graceful=False)
            if not self._retry_after(failures, "a standby agent exited while waiting"):
                return
        pool.close(graceful=False)

    def _retry_after(self, failures: int, why: str) -> bool:
        """Forget the failed pool and wait out the back-off; False (given up) once spent, past the limit, or
        when ``take`` is waiting (a fresh start is as quick as another try)."""
        with self._cond:
            self._pool = None
            if self._spent:
                return False
            log.warning("standby agents (%d failures): %s", failures, why)
            if failures > self._restart_limit or self._wanted:
                self._stop(f"failed: {why}")
                return False
            self.state = "starting"
            delay = 0.0 if failures <= 1 else min(BACKOFF_CAP_S, self._backoff_s * 2.0 ** (failures - 2))
            self._cond.wait_for(lambda: self._spent, delay)
            return not self._spent

    def _stop(self, state: str) -> None:
        """(Lock held.) Give up: ``take`` finds nothing from now on."""
        self.state = state
        self._spent = True
        self._cond.notify_all()


def memory_shortfall(pids: list[int], meminfo: str = "/proc/meminfo") -> str | None:
    """Why a standby for the agents ``pids`` does not fit in this host's memory, else None: it needs what they
    hold (their resident memory: weights, KV cache, MindSpore), with a margin, out of ``MemAvailable``. Hosts
    without /proc (and pools of no processes) are not checked."""
    try:
        available = _kib(Path(meminfo).read_text(), "MemAvailable:")
        held = sum(_kib(Path(f"/proc/{pid}/status").read_text(), "VmRSS:") for pid in pids)
    except (OSError, ValueError):
        return None
    if held * MEMORY_MARGIN <= available:
        return None
    return (f"the serving agents hold {held / 2**20:.1f} GiB and a standby needs as much ({MEMORY_MARGIN:g}x with "
            f"the margin), the host has {available / 2**20:.1f} GiB available")


def _kib(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise ValueError(f"no {key} line")
