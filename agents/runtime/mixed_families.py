"""The mixed-step graph families (``agents.runtime.graph_family``; the steps: ``agents.runtime.mixed_steps``).

Ragged: consecutive rows, tokens back to back, ``("mixed", max_seqs, tokens)``. Padded: rows split by their
``RowKind``, one-token queries planned and padded by the decode family, whole prompts by the prefill family (as
PREFILL parts they reach it through the registry), chunks in ``("chunk", batch, seq)`` buckets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agents.runtime.bucket_plan import plan_groups
from agents.runtime.graph_family import CostTable, GraphFamily
from agents.runtime.mixed_steps import (
    chunk_arrays,
    consecutive_groups,
    mixed_arrays,
    padded_kinds,
    warmup_arrays,
)
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.step import RowKind

if TYPE_CHECKING:
    from agents.model.backends import OpsBackend
    from agents.runtime.runner_config import RunnerConfig

_NO_MIXED = "a step with queries over cached context needs the mixed-step graphs (mixed_steps)"


class RaggedMixed:
    """``("mixed", max_seqs, tokens)``: a step's rows back to back, as few calls as the largest bucket allows
    (padding rows cost next to nothing on the ragged backends)."""

    graph, unit, tag = "mixed", "tokens", "m"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable) -> None:
        self.rc, self.backend = rc, backend
        self._shapes = rc.mixed_shapes(ragged=True)
        if backend is not None:
            self._check_padding_reach()

    def _check_padding_reach(self) -> None:
        """Where a mixed call's padding rows form a sequence of their own (``mixed_padding_slots``), that sequence
        reads as many positions through its table row as it has rows: at most a bucket's step up from the one
        below plus the appended rows, which must stay within one table's reach."""
        buckets = [s[2] for s in self._shapes]
        if not self.backend.mixed_padding_slots or not buckets:
            return
        reach = self.rc.max_blocks_per_seq * self.rc.block_size
        worst = max(t - below for t, below in zip(buckets, [0] + buckets[:-1])) + self.rc.mixed_max_seqs
        if worst > reach:
            raise ValueError(f"scheduler.max_num_batched_tokens: the mixed-step buckets {buckets} leave up to {worst} "
                             f"padding rows, more than one block table reaches ({reach} positions, max_model_len): "
                             "lower the token budget or raise max_model_len")

    def shapes(self) -> list[tuple]:
        return list(self._shapes)

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        _, b, n = shape
        arrays = warmup_arrays("mixed", b, n, self.rc.max_blocks_per_seq, self.rc.max_model_len,
                               b - self.backend.mixed_padding_slots)
        arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], n)
        return arrays

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        if not self.rc.mixed_steps:
            raise ValueError(_NO_MIXED)
        return consecutive_groups(batch.query_lens, self.rc.mixed_max_seqs - self.backend.mixed_padding_slots,
                                  self._shapes[-1][2])

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        total = int(part.query_lens.sum())
        shape = next((s for s in self._shapes if s[2] >= total), None)
        if shape is None or part.batch_size > shape[1] - self.backend.mixed_padding_slots:
            raise ValueError(f"no mixed-step bucket holds {part.batch_size} sequences of {total} tokens")
        arrays = mixed_arrays(part, shape[1], shape[2], self.rc.max_blocks_per_seq)
        arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], shape[2])
        return shape, arrays


class PaddedMixed:
    """``("chunk", batch, seq)`` buckets for chunks; a step's decode rows and whole prompts go to those families."""

    graph, unit, tag = "chunk", "seq", "c"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable, prefill: GraphFamily,
                 decode: GraphFamily) -> None:
        self.rc, self.backend, self.costs = rc, backend, costs
        self.prefill, self.decode = prefill, decode
        self._shapes = rc.mixed_shapes(ragged=False)

    def shapes(self) -> list[tuple]:
        return list(self._shapes)

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        _, b, n = shape
        return warmup_arrays("chunk", b, n, self.rc.max_blocks_per_seq, self.rc.max_model_len,
                             b - self.backend.mixed_padding_slots)

    def shape_for(self, count: int, longest: int) -> tuple | None:
        """The smallest chunk shape holding ``count`` chunks of up to ``longest`` tokens, or None."""
        fits = [s for s in self._shapes if s[1] >= count and s[2] >= longest]
        return min(fits, key=lambda s: (s[1] * s[2], s)) if fits else None

    def cost(self, count: int, longest: int) -> float:
        return self.costs.of(("chunk", count, longest), lambda: self.shape_for(count, longest))

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """One-token queries, whole prompts and chunks each planned as their own graphs do."""
        if not self.rc.mixed_steps:
            raise ValueError(_NO_MIXED)
        groups = []
        for kind, rows in padded_kinds(batch).items():
            part = batch.take(rows)
            if kind is RowKind.CHUNK:
                planned = plan_groups(part.query_lens, self.rc.prefill_batch_sizes, self.cost)
            else:
                planned = (self.decode if kind is RowKind.DECODE else self.prefill).plan(part)
            groups += [rows[g] for g in planned]
        return groups

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """A group of one-token queries on the decode graphs, else chunks each at row ``i * seq``."""
        if np.all(part.query_lens == 1):
            return self.decode.inputs(part)
        shape = self.shape_for(part.batch_size, int(part.query_lens.max()))
        if shape is None:
            raise ValueError(f"no chunk bucket holds {part.batch_size} chunks of up to "
                             f"{int(part.query_lens.max())} tokens")
        return shape, chunk_arrays(part, shape, self.rc.max_blocks_per_seq)
