"""What the agent serves through, as a type: ``ModelRunner``, ``SpeculativeRunner`` (a target and its draft),
MindFormers' runner and the instant stand-in all are one, so ``agent_main`` asks none of them what it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llm_serving.protocol.batch import StepBatch, StepOutput


class StepRunner(Protocol):
    """One rank's model: warmed once, then one step at a time."""

    @property
    def step_costs(self) -> dict[tuple, float]: ...  # seconds per warmed shape: the master's step timeout's base

    @property
    def num_blocks(self) -> int | None: ...  # the KV blocks its cache holds (None: it has no cache)

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        """Compile every shape (those in ``known_costs``, a warm compile cache's, loaded with those costs)."""
        ...

    def step(self, batch: StepBatch) -> StepOutput: ...
