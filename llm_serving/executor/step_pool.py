"""What the engine asks of its agents, as a type: ``AgentPool`` is one; tests stand in their own.

The engine, its supervisor and the recovery paths are written against this protocol only, so a stand-in that
has every member is a pool to them and nothing is probed for with ``hasattr``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llm_serving.protocol.batch import Step, StepOutput


class StepPool(Protocol):
    """One tensor-parallel group of agents: steps in, rank 0's answers out (``AgentPool`` documents each)."""

    step_timeout_s: float | None  # a step unanswered this long (times its rounds) kills the pool; None: never

    @property
    def alive(self) -> bool: ...

    @property
    def pids(self) -> list[int]: ...

    @property
    def kv_blocks(self) -> int | None: ...  # the KV blocks the ranks sized their caches to (the smallest)

    @property
    def slowest_warmup_step_s(self) -> float | None: ...  # the slowest warmed shape's cost: the timeout's base

    def stopped_pids(self) -> list[int]: ...

    def start(self, progress: Callable[[str], None] | None = None) -> None: ...

    def submit(self, batch: Step) -> int: ...

    def collect(self, step: int, batch_size: int) -> StepOutput: ...

    def export_kv(self, block_ids: list[int]) -> list[bytes]: ...

    def import_kv(self, block_ids: list[int], shards: list[bytes]) -> None: ...

    def close(self, graceful: bool = True) -> None: ...
