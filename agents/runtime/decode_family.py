"""The decode graph family (``agents.runtime.graph_family``): one token per sequence over its cached context,
``("decode", batch, block-table width)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agents.runtime.bucket_plan import plan_groups
from agents.runtime.graph_family import CostTable, fit, required_shape
from agents.runtime.prefill_families import padded_inputs
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import blocks_needed

if TYPE_CHECKING:
    from agents.model.backends import OpsBackend
    from agents.runtime.runner_config import RunnerConfig


class Decode:
    """Decode buckets: batch size x block-table width."""

    graph, unit, tag = "decode", "blocks", "w"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable) -> None:
        self.rc, self.backend, self.costs = rc, backend, costs
        self.skips_padding = backend is not None and backend.skips_padding
        self.batch_sizes = rc.decode_batch_sizes  # the batch buckets warmed

    def shapes(self) -> list[tuple]:
        return [("decode", b, w) for b in self.batch_sizes for w in self.rc.decode_block_widths]

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """Contexts of one token."""
        _, b, n = shape
        arrays = padded_inputs(b, b, n)
        arrays[3][:] = 1
        return arrays

    def shape_for(self, count: int, longest: int) -> tuple | None:
        """The shape of ``count`` sequences of contexts up to ``longest`` tokens, or None."""
        b = fit(count, self.batch_sizes)
        w = fit(blocks_needed(longest, self.rc.block_size), self.rc.decode_block_widths)
        return ("decode", b, w) if b and w else None

    def cost(self, count: int, longest: int) -> float:
        return self.costs.of(("decode", count, longest), lambda: self.shape_for(count, longest))

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Sequences sorted by context, cut into the groups of least measured cost (``bucket_plan``); where padding
        rows cost nothing (``OpsBackend.skips_padding``), as few calls as the largest bucket allows."""
        lengths = batch.context_lens
        try:
            if self.skips_padding:
                return self._chunks(lengths)
            return plan_groups(lengths, self.batch_sizes, self.cost)
        except ValueError:
            raise ValueError(self.too_long(int(lengths.max()))) from None

    def too_long(self, context: int) -> str:
        """Why a context of ``context`` tokens has no call."""
        return (f"context length {context} exceeds the largest compiled bucket "
                f"{self.rc.decode_block_widths[-1] * self.rc.block_size} (single sequences up to max_model_len "
                f"{self.rc.max_model_len} can be prefilled alone)")

    def _chunks(self, context_lens: np.ndarray) -> list[np.ndarray]:
        """Sequences in context order (the attention op reads each row's own context, so the table's width costs
        nothing)."""
        if self.shape_for(1, int(context_lens.max())) is None:
            raise ValueError("no compiled width holds the longest context")
        calls = -(-len(context_lens) // self.batch_sizes[-1])
        if calls == 1:  # in batch order: the call takes the step as it is (StepBatch.take copies nothing)
            return [np.arange(len(context_lens))]
        return np.array_split(np.argsort(context_lens, kind="stable"), calls)

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """The sequences' rows first; padding rows of the backend's padding length over the dummy block."""
        longest = int(part.context_lens.max())
        shape = required_shape(self.shape_for(part.batch_size, longest), part.batch_size, longest)
        _, b, w = shape
        arrays = padded_inputs(b, b, w)
        ids, pos, slots, lens, tables, _ = arrays
        n = part.batch_size
        ids[:n], pos[:n], slots[:n], lens[:n] = part.input_ids, part.positions, part.slot_mapping, part.context_lens
        lens[n:] = self.backend.decode_padding_length
        cols = min(w, part.block_tables.shape[1])
        tables[:n, :cols] = part.block_tables[:, :cols]
        return shape, arrays
