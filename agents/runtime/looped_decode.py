"""Looped decode: ``k`` greedy decode steps in one graph call (issue 53).

Why: a MindSpore graph call costs about 1 ms whatever the model (docs/benchmarks.md), so multi-step decoding as k
host-side calls (``agents.runtime.multi_step``) saves the master's turnaround but still pays k calls. Here the k
steps are unrolled inside one graph: each step's in-graph argmax is the next step's input, positions and context
lengths advance by one on the real rows (length > 0; padding rows stay on dummy block 0), and each step's KV slot
is computed in the graph from the block table with ``protocol.batch.kv_slots``' formula. Only all-greedy batches
without logits rows come here (the scheduler's multi-step conditions); rows that end on the way are cut by the
master as with the host loop.

``LoopedDecode`` is the graph family (``agents.runtime.graph_family``) of one k, ``("loop<k>", batch, width)``:
the decode family's buckets (up to ``max_batch`` sequences where given), its block-table width covering the context
of the last of the k steps. A draft model's rounds of proposals run on it too (``speculative_runner``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from agents.runtime.decode_family import Decode
from agents.runtime.graph_family import CostTable, fit
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import blocks_needed

if TYPE_CHECKING:
    from agents.model.backends import OpsBackend
    from agents.model.llama import LlamaModel
    from agents.runtime.runner_config import RunnerConfig


class LoopedDecodeStep(nn.Cell):
    """``steps`` decode steps of ``model`` in one graph; the inputs are ``LlamaStep``'s decode inputs (the sixth
    unused). Returns token ids and logprobs ``[batch, steps]`` and the last step's logits."""

    def __init__(self, model: LlamaModel, steps: int, block_size: int, adapters: bool = False) -> None:
        super().__init__()
        self.model = model
        self.adapters = adapters  # the LoRA adapter graph (LlamaModel.hidden_states)
        self.steps = steps
        self.block_size = block_size

    def construct(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, batch_valid_length: Tensor,
                  block_tables: Tensor, last_index: Tensor):
        token_rows, sequence_rows = self.model.real_rows(batch_valid_length, False)
        live = (batch_valid_length > 0).astype(ms.int32)
        last_column = block_tables.shape[1] - 1
        ids = ()
        logprobs = ()
        logits = None
        for _ in range(self.steps):
            hidden = self.model.hidden_states(input_ids, positions, slot_mapping, batch_valid_length, block_tables,
                                              token_rows, False, None, self.adapters)
            logits = self.model.logits(hidden, sequence_rows)
            token_ids, token_logprobs = self.model.greedy(logits)
            ids = ids + (token_ids.astype(ms.int32),)
            logprobs = logprobs + (token_logprobs,)
            input_ids = token_ids.astype(ms.int32)
            positions = positions + live
            batch_valid_length = batch_valid_length + live
            column = ops.minimum(positions // self.block_size, last_column).reshape(-1, 1)
            blocks = ops.gather_elements(block_tables, 1, column).reshape(-1)
            slot_mapping = blocks * self.block_size + positions % self.block_size
        return ops.stack(ids, 1), ops.stack(logprobs, 1), logits

    def logits_rows(self, *inputs: Tensor) -> int:
        """The rows of the logits these inputs give (``parallel.ShardedStep.compile``)."""
        return int(inputs[0].shape[0])


class LoopedDecode(Decode):
    """The decode buckets of ``steps`` steps a call: a table width holding the context of the last step."""

    unit, tag = "blocks", "w"

    def __init__(self, rc: RunnerConfig, backend: OpsBackend | None, costs: CostTable, steps: int,
                 max_batch: int | None = None) -> None:
        super().__init__(rc, backend, costs)
        self.steps = steps
        self.graph = f"loop{steps}"
        sizes = rc.decode_batch_sizes
        top = (fit(max_batch, sizes) or sizes[-1]) if max_batch is not None else sizes[-1]
        self.batch_sizes = tuple(b for b in sizes if b <= top)

    def shapes(self) -> list[tuple]:
        return [(self.graph, b, w) for b in self.batch_sizes for w in self.rc.decode_block_widths]

    def holds(self, count: int) -> bool:
        """Whether a warmed bucket takes ``count`` sequences."""
        return count <= self.batch_sizes[-1]

    def shape_for(self, count: int, longest: int) -> tuple | None:
        b = fit(count, self.batch_sizes)
        w = fit(blocks_needed(longest + self.steps - 1, self.rc.block_size), self.rc.decode_block_widths)
        return (self.graph, b, w) if b and w else None

    def cost(self, count: int, longest: int) -> float:
        return self.costs.of((self.graph, count, longest), lambda: self.shape_for(count, longest))

    def last_contexts(self, batch: StepBatch) -> np.ndarray:
        """Each row's context length at the last of the steps (what its block table must cover)."""
        return batch.context_lens + self.steps - 1
