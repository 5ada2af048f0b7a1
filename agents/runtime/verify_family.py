"""The verify graph family (``agents.runtime.graph_family``; the step and its accept: ``agents.runtime.verify_steps``):
each row's last token and its proposals back to back, ``("verify", max_seqs, tokens)``, ragged backends only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agents.runtime.graph_family import CostTable
from agents.runtime.mixed_steps import consecutive_groups, mixed_arrays
from agents.runtime.verify_steps import verify_shapes, verify_warmup_arrays
from llm_serving.protocol.batch import StepBatch

if TYPE_CHECKING:
    from agents.model.backends import OpsBackend
    from agents.runtime.runner_config import RunnerConfig


class Verify:
    """Token buckets up to a full decode batch of proposals (none without ``verify_tokens``)."""

    graph, unit, tag = "verify", "tokens", "v"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable) -> None:
        self.rc, self.backend = rc, backend
        self._shapes = verify_shapes(rc.mixed_max_seqs, rc.decode_batch_sizes[-1], rc.verify_tokens,
                                     rc.verify_step_tokens)

    def shapes(self) -> list[tuple]:
        return list(self._shapes)

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        _, b, n = shape
        arrays = verify_warmup_arrays(b, n, self.rc.max_blocks_per_seq, self.rc.max_model_len,
                                      b - self.backend.mixed_padding_slots)
        arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], n)
        return arrays

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Consecutive groups, one verify call each."""
        if not self._shapes:
            raise ValueError("a step with proposals to verify needs the verify graphs (runner_config verify_tokens)")
        return consecutive_groups(batch.query_lens, self._shapes[0][1] - self.backend.mixed_padding_slots,
                                  self._shapes[-1][2])

    def inputs(self, part: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        used = part.num_tokens
        shape = next(s for s in self._shapes if s[2] >= used)
        arrays = mixed_arrays(part, shape[1], shape[2], self.rc.max_blocks_per_seq)[:6]
        arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], shape[2])
        return shape, arrays
