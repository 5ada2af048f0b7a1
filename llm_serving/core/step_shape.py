"""What a step costs the device, summed from its batch: the features a step-time model is fitted on.

A step's time grows with the tokens it multiplies by the weights (``num_tokens``), the sequences whose last token
is sampled and returned (``num_seqs``), the prompts it starts or continues (``prefill_seqs``: a step with any
runs another graph and the master admits them), the cached positions its attention reads (``context_tokens``: decode is
bound by reading them) and the query-by-key pairs it scores (``attention_pairs``: a long prefill's quadratic
part); ``shared_context_tokens`` counts those of its positions that another sequence of the step reads from
the same KV block (a shared prompt prefix): on a CPU they come from cache, so a step over shared blocks costs
less than its positions say (docs/simulator.md). Rows computed with a LoRA adapter add their low-rank updates:
``adapter_tokens`` query tokens through ``adapter_slots`` distinct adapters' A and B (``core.adapters``). The engine
records these per step (``Engine.step_trace``;
``llm-serving serve --record-steps`` writes them) and the simulator's cost models are fitted to them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from llm_serving.protocol.arrays import Integers
from llm_serving.protocol.batch import StepBatch


@dataclass(frozen=True)
class StepShape:
    num_seqs: int
    num_tokens: int  # query tokens of one step (prompt chunks, decode tokens, proposals)
    prefill_tokens: int  # of which belong to sequences with more than one query token
    prefill_seqs: int  # sequences with more than one query token (a prompt or a chunk of one)
    context_tokens: int  # sum of context lengths after the step: the cached positions attention reads
    attention_pairs: int  # sum over sequences of query tokens x context length
    num_steps: int = 1  # decode steps run in one round trip (multi-step decoding)
    shared_context_tokens: int = 0  # of context_tokens, those in a KV block that an earlier sequence reads too
    adapter_tokens: int = 0  # of num_tokens, those of rows computed with a LoRA adapter
    adapter_slots: int = 0  # distinct adapters (slots) the step's rows use

    @classmethod
    def of(cls, batch: StepBatch, block_size: int) -> StepShape:
        q = batch.query_lens.astype("int64")
        ctx = batch.context_lens.astype("int64")
        lora = batch.lora_slots
        adapted = lora >= 0 if lora is not None else np.zeros(len(q), bool)
        return cls(num_seqs=batch.batch_size, num_tokens=batch.num_tokens,
                   prefill_tokens=int(q[q > 1].sum()), prefill_seqs=int((q > 1).sum()), context_tokens=int(ctx.sum()),
                   attention_pairs=int((q * ctx).sum()), num_steps=batch.num_steps,
                   shared_context_tokens=int(ctx.sum()) - distinct_positions(batch.block_tables, ctx, block_size),
                   adapter_tokens=int(q[adapted].sum()),
                   adapter_slots=len(np.unique(lora[adapted])) if lora is not None else 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def distinct_positions(block_tables: Integers, context_lens: Integers, block_size: int) -> int:
    """Cached positions read counting each KV block once: per distinct block id, the most positions any sequence
    reads from it (sequences sharing a prefix share its full blocks; the last, partly filled block is their own)."""
    if len(context_lens) < 2:
        return int(context_lens.sum())
    width = -(-context_lens // block_size)  # blocks each sequence reads
    cols = np.arange(block_tables.shape[1])
    used = cols[None, :] < width[:, None]
    filled = np.minimum(block_size, context_lens[:, None] - cols[None, :] * block_size)
    ids, counts = block_tables[used], filled[used]
    order = np.lexsort((-counts, ids))  # per block id, its fullest use first
    ids, counts = ids[order], counts[order]
    first = np.ones(len(ids), bool)
    first[1:] = ids[1:] != ids[:-1]
    return int(counts[first].sum())


def step_rows(samples: list[tuple[StepShape, float]]) -> list[dict[str, float]]:
    """Measured steps as JSON-able rows (a step profile's ``steps``)."""
    return [{**shape.as_dict(), "seconds": seconds} for shape, seconds in samples]


def steps_from_rows(rows: list[dict[str, float]]) -> list[tuple[StepShape, float]]:
    """``step_rows`` read back; KeyError/TypeError/ValueError on a malformed row."""
    return [(StepShape(**{k: int(v) for k, v in row.items() if k != "seconds"}), float(row["seconds"]))
            for row in rows]
