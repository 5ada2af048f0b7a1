"""What the agent serves through, as a type: ``ModelRunner``, ``SpeculativeRunner`` (a target and its draft),
MindFormers' runner and the instant stand-in all are one, so ``agent_main`` asks none of them what it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class AdapterSlots(Protocol):
    """A runner built with LoRA adapter slots (``AgentSpec.lora``): ``batch.AdapterStep`` loads one."""

    def load_adapter(self, slot: int, path: str | None) -> None:
        """Put the adapter in directory ``path`` into ``slot`` (None: empty it); raise, naming the problem, when
        it does not fit the slots (rank, slot index) or cannot be read. The slot is left as it was on an error."""
        ...
