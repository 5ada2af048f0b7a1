"""Graph families: one family of compiled shapes of a step kind, as the runners see it.

A family names its compiled graph, lists its warm-up shapes, makes the inputs warm-up runs each shape with, plans
a step's rows into graph calls (row groups, by the costs warm-up measured) and pads one call's rows into its
bucket's inputs. The runners keep a registry ``StepKind -> GraphFamily`` chosen from their backend and run every
step through one loop (``planned_calls``): the step's family plans it, and each part (``StepBatch.take``) is padded
by the family of the part's own kind (``protocol.step.part_kind``). Families: ``prefill_families`` (padded and
ragged prefill), ``decode_family``, ``mixed_families`` (ragged and padded mixed steps), ``verify_family``;
MindFormers' in ``agents.mindformers.families``; the runners sharing the loop: ``agents.runtime.graph_runner``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import blocks_needed
from llm_serving.protocol.step import StepKind


class GraphFamily(Protocol):
    """One family of compiled shapes ``(graph, batch, n)``."""

    graph: str  # the compiled graph its shapes run on (their first entry)
    unit: str  # what a shape's n counts (warm-up progress lines, the export's graph lines)
    tag: str  # the letter before n in an exported graph's file name (``agents.tools.mindir.graph_file_name``)

    def shapes(self) -> list[tuple]:
        """Its warm-up shapes, in warm-up order."""
        ...

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """The inputs warm-up runs ``shape`` with, every row a real token of dummy block 0."""
        ...

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Row index groups of ``batch``, one graph call each."""
        ...

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """The shape one call of ``part``'s rows runs on and its inputs padded to it."""
        ...


class CostTable:
    """The warmed shapes, their measured steady-state seconds per call, and the memoised per-plan lookups the
    families' plans make (a lookup key names its family: ``(graph, sizes...)``)."""

    def __init__(self) -> None:
        self.warmed: set[tuple] = set()
        self.measured: dict[tuple, float] = {}
        self._memo: dict[tuple, float] = {}

    def set_measured(self, costs: dict[tuple, float]) -> None:
        self.measured = costs
        self._memo.clear()

    def check_warmed(self, shape: tuple) -> None:
        if shape not in self.warmed:
            raise RuntimeError(f"graph shape {shape} was not warmed up; call warmup() first "
                               f"(the runner never compiles while serving)")

    def of(self, key: tuple, shape_of: Callable[[], tuple | None]) -> float:
        """Measured cost of the shape ``shape_of()`` picks (``inf`` for none), memoised under ``key``."""
        if key not in self._memo:
            shape = shape_of()
            if shape is not None:
                self.check_warmed(shape)
            self._memo[key] = float("inf") if shape is None else self.measured.get(shape, 1.0)
        return self._memo[key]


def required_shape(shape: tuple | None, count: int, longest: int) -> tuple:
    """``shape`` (a family's ``shape_for`` of a part), or the ValueError of a part no compiled shape holds."""
    if shape is None:
        raise ValueError(f"no compiled shape fits {count} sequences of length up to {longest}")
    return shape


def fit(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``value``, or None."""
    return next((b for b in buckets if b >= value), None)


def by_graph(families: Mapping[StepKind, GraphFamily]) -> dict[str, GraphFamily]:
    """The registry's families by graph name (a family may serve several kinds)."""
    return {family.graph: family for family in families.values()}


def warmup_shapes_of(families: Mapping[StepKind, GraphFamily]) -> list[tuple]:
    """Every family's shapes, in the registry's order."""
    return [shape for family in by_graph(families).values() for shape in family.shapes()]


def planned_calls(families: Mapping[StepKind, GraphFamily], batch: StepBatch, check: Callable[[StepBatch], None],
                  run: Callable[[tuple, list[np.ndarray]], Any]) -> Iterator[tuple[np.ndarray, StepBatch, Any]]:
    """(indices, part, graph outputs) of each call of ``batch``: planned by its kind's family, ``check``ed, then
    each part padded by the family of its own kind and ``run`` on its shape."""
    groups = families[batch.kind].plan(batch)
    check(batch)
    for group in groups:
        part = batch.take(group)
        shape, arrays = families[part.kind].inputs(part)
        yield group, part, run(shape, arrays)


def check_cache_indices(batch: StepBatch, num_blocks: int, block_size: int, max_blocks_per_seq: int) -> None:
    """Refuse slots and blocks outside the cache before any graph runs: a bad index inside a graph either
    corrupts other sequences' KV or fails the MindSpore executor, which then refuses every later step."""
    num_slots = num_blocks * block_size
    if batch.slot_mapping.size and (batch.slot_mapping.min() < 0 or batch.slot_mapping.max() >= num_slots):
        raise ValueError(f"slot_mapping has slots outside the KV cache [0, {num_slots})")
    if batch.kind is StepKind.PREFILL:
        return
    if batch.kind is not StepKind.DECODE and (np.any(batch.context_lens < batch.query_lens)
                                              or batch.context_lens.max() > max_blocks_per_seq * block_size):
        raise ValueError("context lengths must hold their queries and fit max_model_len")
    used = blocks_needed(batch.context_lens, block_size)
    if batch.context_lens.size and (batch.context_lens.min() < 1 or used.max() > batch.block_tables.shape[1]):
        raise ValueError("decode context lengths must be >= 1 and covered by the block tables")
    in_use = np.arange(batch.block_tables.shape[1]) < used[:, None]
    blocks = batch.block_tables[in_use]
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(f"block tables reference blocks outside the KV cache [0, {num_blocks})")
