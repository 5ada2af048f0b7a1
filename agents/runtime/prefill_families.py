"""The prefill graph families (``agents.runtime.graph_family``): whole prompts from position 0.

Padded: each prompt padded to its length bucket, ``("prefill", batch, seq)``, plus one shape batch 1 x
``max_model_len`` for the recompute of a preempted sequence (prompt + generated tokens can outgrow the prompt
buckets; the scheduler sends such a prefill alone). Ragged (``agents.runtime.ragged_prefill``): the prompts back to
back, ``("ragged", max prefill batch, tokens)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agents.runtime.bucket_plan import plan_groups
from agents.runtime.graph_family import CostTable, fit, required_shape
from agents.runtime.ragged_prefill import plan_ragged, ragged_arrays, token_buckets
from llm_serving.protocol.batch import StepBatch

if TYPE_CHECKING:
    from agents.model.backends import OpsBackend
    from agents.runtime.runner_config import RunnerConfig


def padded_inputs(batch: int, tokens: int, width: int) -> list[np.ndarray]:
    """All-padding inputs ``[ids, positions, slots, lengths, block tables, last indices]``: token 0 at position 0
    writing to slot 0 of the dummy block."""
    last = (np.arange(batch, dtype=np.int32) * (tokens // batch)).astype(np.int32)
    return [np.zeros(tokens, np.int32) for _ in range(3)] + [
        np.zeros(batch, np.int32), np.zeros((batch, width), np.int32), last]


class PaddedPrefill:
    """``("prefill", batch, seq)`` buckets and the ``(1, max_model_len)`` recompute shape."""

    graph, unit, tag = "prefill", "seq", "s"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable) -> None:
        self.rc, self.costs = rc, costs

    def shapes(self) -> list[tuple]:
        rc = self.rc
        shapes = [("prefill", b, s) for b in rc.prefill_batch_sizes for s in rc.prefill_seq_lengths]
        if rc.max_model_len > rc.prefill_seq_lengths[-1]:
            shapes.append(("prefill", 1, rc.max_model_len))  # recompute of one preempted sequence
        return shapes

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """Prompts filling the bucket."""
        _, b, n = shape
        arrays = padded_inputs(b, b * n, 1)
        arrays[3][:] = n
        arrays[5][:] = np.arange(b) * n + n - 1
        return arrays

    def shape_for(self, count: int, longest: int) -> tuple | None:
        """The shape of ``count`` prompts of up to ``longest`` tokens, or None."""
        rc = self.rc
        b = fit(count, rc.prefill_batch_sizes)
        if count == 1 and rc.prefill_seq_lengths[-1] < longest <= rc.max_model_len:
            return ("prefill", 1, rc.max_model_len)  # a preempted sequence recomputing prompt + output
        s = fit(longest, rc.prefill_seq_lengths)
        return ("prefill", b, s) if b and s else None

    def cost(self, count: int, longest: int) -> float:
        return self.costs.of(("prefill", count, longest), lambda: self.shape_for(count, longest))

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Prompts sorted by length, cut into the groups of least measured cost (``bucket_plan``)."""
        try:
            return plan_groups(batch.query_lens, self.rc.prefill_batch_sizes, self.cost)
        except ValueError:
            raise ValueError(f"prompt length {int(batch.query_lens.max())} exceeds the largest compiled bucket "
                             f"{self.rc.prefill_seq_lengths[-1]} (single sequences up to max_model_len "
                             f"{self.rc.max_model_len} can be prefilled alone)") from None

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """Each prompt at row ``i * seq``; padding tokens after a prompt write to slot 0 (the dummy block)."""
        longest = int(part.query_lens.max())
        shape = required_shape(self.shape_for(part.batch_size, longest), part.batch_size, longest)
        _, b, s = shape
        arrays = padded_inputs(b, b * s, 1)
        ids, pos, slots, lens, _, last = arrays
        start = 0
        for i, n in enumerate(part.query_lens.tolist()):
            ids[i * s: i * s + n] = part.input_ids[start: start + n]
            pos[i * s: i * s + n] = part.positions[start: start + n]
            slots[i * s: i * s + n] = part.slot_mapping[start: start + n]
            lens[i] = n
            last[i] = i * s + n - 1
            start += n
        return shape, arrays


class RaggedPrefill:
    """``("ragged", max prefill batch, tokens)``: prompts back to back, bucketed by their total."""

    graph, unit, tag = "ragged", "tokens", "t"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable) -> None:
        self.rc, self.backend, self.costs = rc, backend, costs
        self.max_seqs = rc.prefill_batch_sizes[-1]
        self.buckets = token_buckets(rc.prefill_batch_sizes, rc.prefill_seq_lengths, rc.max_model_len)

    def shapes(self) -> list[tuple]:
        return [("ragged", self.max_seqs, t) for t in self.buckets]

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """The bucket's tokens split evenly among its sequences."""
        _, b, n = shape
        arrays = padded_inputs(b, n, 1)
        arrays[3][:] = [len(part) for part in np.array_split(np.arange(n), b)]
        arrays[5][:] = np.cumsum(arrays[3]) - 1
        arrays[3] = self.backend.ragged_lengths(arrays[3], n)
        return arrays

    def shape_for(self, tokens: int) -> tuple | None:
        """The shape holding ``tokens`` tokens, or None."""
        t = fit(tokens, self.buckets)
        return None if t is None else ("ragged", self.max_seqs, t)

    def cost(self, tokens: int) -> float:
        return self.costs.of(("ragged", tokens), lambda: self.shape_for(tokens))

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Consecutive groups of least measured cost (``ragged_prefill.plan_ragged``)."""
        lengths = batch.query_lens
        if int(lengths.max()) > self.rc.max_model_len:
            raise ValueError(f"prompt length {int(lengths.max())} exceeds max_model_len {self.rc.max_model_len}")
        return plan_ragged(lengths, self.max_seqs, self.cost)

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        total = int(part.query_lens.sum())
        shape = self.shape_for(total)
        if shape is None or part.batch_size > shape[1]:
            raise ValueError(f"no ragged prefill bucket holds {part.batch_size} prompts of {total} tokens")
        arrays = ragged_arrays(part, shape[1], shape[2])
        arrays[3] = self.backend.ragged_lengths(arrays[3], shape[2])
        return shape, arrays
