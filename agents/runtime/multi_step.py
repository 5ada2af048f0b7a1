"""Multi-step decoding on the agent: a batch with ``num_steps`` k > 1 runs k decode steps before the master hears
back, each step's greedy tokens the next one's inputs, so the master's turnaround and the round trip are paid
once per k tokens instead of once per token.

Every rank runs the same loop: the greedy pick is exact across tensor-parallel ranks (``model.parallel.greedy``),
so each feeds the same tokens. The scheduler sends such batches only for all-greedy decode steps without logits
and with the blocks of all k positions already in the block tables; a sequence that ends on the way (its EOS, a
stop string) is cut by the master, its later tokens and their KV slots discarded with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from llm_serving.protocol.batch import StepBatch, StepOutput, kv_slots


def run_decode_steps(step: Callable[[StepBatch], StepOutput], batch: StepBatch,
                     block_size: int | None) -> StepOutput:
    """``batch.num_steps`` decode steps through ``step`` (a runner's); the first step's tokens in ``token_ids``,
    the later ones' in ``more_token_ids``. ``block_size``: the KV cache's (the spec's runner_config)."""
    if not block_size:
        raise ValueError("a batch of several decode steps needs the KV block size (runner_config block_size)")
    k = batch.num_steps
    first = step(replace(batch, num_steps=1))
    more_ids = np.zeros((batch.batch_size, k - 1), np.int32)
    more_logprobs = np.zeros((batch.batch_size, k - 1), np.float32)
    ids, current = first.token_ids, batch
    rows = np.arange(batch.batch_size)
    for j in range(k - 1):
        positions = current.positions + 1
        slots = kv_slots(current.block_tables, rows, positions, block_size)
        current = replace(current, input_ids=np.maximum(ids, 0).astype(np.int32), positions=positions,
                          slot_mapping=slots.astype(np.int32), context_lens=current.context_lens + 1, num_steps=1)
        out = step(current)
        ids = more_ids[:, j] = out.token_ids
        more_logprobs[:, j] = out.logprobs
    first.more_token_ids, first.more_logprobs = more_ids, more_logprobs
    return first
