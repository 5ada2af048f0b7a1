"""The mindformers backend's two graph families (``agents.runtime.graph_family``): the runtime's ragged prefill and
decode families with MindFormers' inputs (``agents.mindformers.inputs``): the same shapes, costs and plans, but
whole prompts only, four inputs a call, and decode plans by measured cost (no padding-skipping projections)."""

from __future__ import annotations

from typing import Any

import numpy as np

from agents.mindformers.inputs import check_whole_prompts, decode_arrays, prefill_arrays, warmup_batch
from agents.runtime.decode_family import Decode
from agents.runtime.graph_family import CostTable, GraphFamily
from agents.runtime.prefill_families import RaggedPrefill
from agents.runtime.ragged_prefill import plan_ragged
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.step import StepKind


class MindFormersPrefill(RaggedPrefill):
    """``("ragged", S, T)``: up to ``S`` whole prompts of ``T`` tokens in all, in ``T + S`` rows (``rc``: a
    ``MindFormersRunnerConfig``, as for the decode family)."""

    def __init__(self, rc: Any, costs: CostTable) -> None:
        super().__init__(rc, None, costs)

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        return prefill_arrays(warmup_batch(*shape), shape[1], shape[2])

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Refuses chunks, cached prefixes and proposals (MindFormers' prefill starts at position 0)."""
        check_whole_prompts(batch)
        return plan_ragged(batch.query_lens, self.max_seqs, self.cost)

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        shape = self.shape_for(int(part.query_lens.sum()))
        if shape is None:
            raise ValueError(f"no prefill bucket holds {part.batch_size} prompts of {int(part.query_lens.sum())} "
                             "tokens")
        return shape, prefill_arrays(part, shape[1], shape[2])


class MindFormersDecode(Decode):
    """``("decode", B, W)``: batch size x block-table width."""

    def __init__(self, rc: Any, costs: CostTable) -> None:
        super().__init__(rc, None, costs)

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        return decode_arrays(warmup_batch(*shape), shape[1], shape[2])

    def too_long(self, context: int) -> str:
        return (f"context length {context} exceeds the widest block table "
                f"{self.rc.decode_block_widths[-1] * self.rc.block_size}")

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        shape = self.shape_for(part.batch_size, int(part.context_lens.max()))
        if shape is None:
            raise ValueError(self.too_long(int(part.context_lens.max())))
        return shape, decode_arrays(part, shape[1], shape[2])


def mindformers_families(rc: Any, costs: CostTable) -> dict[StepKind, GraphFamily]:
    """The registry: every kind but DECODE on the prefill family, whose plan refuses all but whole prompts."""
    prefill = MindFormersPrefill(rc, costs)
    return {StepKind.PREFILL: prefill, StepKind.MIXED: prefill, StepKind.VERIFY: prefill,
            StepKind.DECODE: MindFormersDecode(rc, costs)}
