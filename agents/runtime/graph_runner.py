"""``FamilyRunner``: what every graph-family runner shares, apart from the model it builds.

A runner owns compiled step graphs and a registry ``StepKind -> GraphFamily`` (``agents.runtime.graph_family``)
that decides each step kind's shapes, plans and inputs. Warming every family's shapes, refusing a shape that was
not warmed, checking a step's cache indices and running its planned calls are the same whichever model the graphs
hold, so they live here once: ``agents.runtime.runner.ModelRunner`` (our Llama) and
``agents.mindformers.runner.MindFormersRunner`` (MindFormers' Llama) add only their model, their graphs and their
families. Imports no model code, so MindFormers' environment (MindSpore 2.7.2) loads it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from mindspore import Tensor

from agents.runtime.graph_family import (
    CostTable,
    GraphFamily,
    by_graph,
    check_cache_indices,
    planned_calls,
    warmup_shapes_of,
)
from agents.runtime.sampler import step_output
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.step import StepKind


class CacheShape(Protocol):
    """The runner-config fields the cache-index check reads (``RunnerConfig``, ``MindFormersRunnerConfig``)."""

    num_blocks: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int: ...


class FamilyRunner:
    """Warm-up, plans and steps over ``graphs`` (graph name -> callable step graph) as ``families`` decide them.

    ``label`` names the model whose graphs they are, where not ours: it prefixes the warm-up progress lines and
    the exported graphs' names (``agents.tools.mindir.export_shapes``).
    """

    label = ""

    def __init__(self, rc: CacheShape, graphs: Mapping[str, Any],
                 families_of: Callable[[CostTable], dict[StepKind, GraphFamily]]) -> None:
        """``families_of``: the registry planning by the given cost table, which warm-up fills."""
        self.rc = rc
        self.graphs = graphs
        self.costs = CostTable()  # the warmed shapes and their measured costs, which the families plan by
        self.families = families_of(self.costs)
        self._by_graph = by_graph(self.families)
        self.warmed = self.costs.warmed
        self.compile_times: dict[tuple, float] = {}

    @property
    def num_blocks(self) -> int:
        return self.rc.num_blocks

    @property
    def step_costs(self) -> dict[tuple, float]:
        """Steady-state seconds per call of each shape, measured in warm-up (the plans' costs)."""
        return self.costs.measured

    @step_costs.setter
    def step_costs(self, costs: dict[tuple, float]) -> None:
        self.costs.set_measured(costs)

    # ---- shapes and warm-up -----------------------------------------------------------------------------------
    def graph_shapes(self) -> list[tuple]:
        """Every family's warm-up shapes, in the registry's order."""
        return warmup_shapes_of(self.families)

    def family(self, graph: str) -> GraphFamily:
        """The family whose shapes run on ``graph`` (a shape's first entry)."""
        return self._by_graph[graph]

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """The inputs ``warmup()`` runs ``shape`` with (the export tools export each graph with them)."""
        return self.family(shape[0]).warmup_inputs(shape)

    def graph(self, kind: str) -> Any:
        """The step graph that shapes of ``kind`` run on."""
        return self.graphs[kind]

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        """Compile every graph shape and time one more call of it, every row a real token of dummy block 0.

        The timed call gives the per-shape costs the families' plans split batches by. Shapes in ``known_costs``
        (a warm compile cache's, ``agents.runtime.compile_cache``) are compiled (loaded) with those costs and not
        run: on the largest buckets the two calls cost more than loading the graph.
        """
        for shape in self.graph_shapes():
            kind, b, n = shape
            t0 = time.perf_counter()
            inputs = self.warmup_inputs(shape)
            self.warmed.add(shape)
            if known_costs and shape in known_costs:
                self.graph(kind).compile(*[Tensor(a) for a in inputs])
                self.compile_times[shape] = time.perf_counter() - t0
                self.step_costs[shape] = known_costs[shape]
            else:
                self._run(shape, inputs)[0].asnumpy()
                self.compile_times[shape] = time.perf_counter() - t0
                t1 = time.perf_counter()
                self._run(shape, inputs)[0].asnumpy()
                self.step_costs[shape] = time.perf_counter() - t1
            if progress:
                named = f"{self.label} {kind}" if self.label else kind
                progress(f"warmed {named} batch={b} {self.family(kind).unit}={n} in {self.compile_times[shape]:.2f}s")
        self.costs.set_measured(self.step_costs)  # plans made before re-read them
        return self.compile_times

    def _run(self, shape: tuple, arrays: list[np.ndarray]) -> Any:
        self.costs.check_warmed(shape)
        return self.graph(shape[0])(*[Tensor(a) for a in arrays])

    # ---- steps --------------------------------------------------------------------------------------------
    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Sequence index groups, one graph call each, as the family of the batch's kind plans them."""
        return self.families[batch.kind].plan(batch)

    def bucket_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """The batch (one planned part) padded to its bucket: ``((kind, batch, n), graph input arrays)``."""
        return self.families[batch.kind].inputs(batch)

    def _check_cache_indices(self, batch: StepBatch) -> None:
        rc = self.rc
        check_cache_indices(batch, rc.num_blocks, rc.block_size, rc.max_blocks_per_seq)

    def _parts(self, batch: StepBatch) -> Iterator[tuple[np.ndarray, StepBatch, Any]]:
        """(indices, sub-batch, graph outputs) of each planned call."""
        return planned_calls(self.families, batch, self._check_cache_indices, self._run)

    def step(self, batch: StepBatch) -> StepOutput:
        """One step as its planned calls; all-greedy parts use the in-graph argmax, parts with sampled or
        penalised sequences (and ``want_logits`` rows) read the logits (``agents.runtime.sampler``)."""
        return step_output(batch.batch_size, self._parts(batch))
