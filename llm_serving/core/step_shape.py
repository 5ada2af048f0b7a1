"""What a step costs the device, summed from its batch: the features a step-time model is fitted on.

A step's time grows with the tokens it multiplies by the weights (``num_tokens``), the sequences whose last token
is sampled and returned (``num_seqs``), the cached positions its attention reads (``context_tokens``: decode is
bound by reading them) and the query-by-key pairs it scores (``attention_pairs``: a long prefill's quadratic
part). The engine records these per step (``Engine.step_trace``) and the simulator's cost models read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llm_serving.protocol.batch import StepBatch


@dataclass(frozen=True)
class StepShape:
    num_seqs: int
    num_tokens: int  # query tokens of one step (prompt chunks, decode tokens, proposals)
    prefill_tokens: int  # of which belong to sequences with more than one query token
    context_tokens: int  # sum of context lengths after the step: the cached positions attention reads
    attention_pairs: int  # sum over sequences of query tokens x context length
    num_steps: int = 1  # decode steps run in one round trip (multi-step decoding)

    @classmethod
    def of(cls, batch: StepBatch) -> StepShape:
        q = batch.query_lens.astype("int64")
        ctx = batch.context_lens.astype("int64")
        return cls(num_seqs=batch.batch_size, num_tokens=batch.num_tokens,
                   prefill_tokens=int(q[q > 1].sum()), context_tokens=int(ctx.sum()),
                   attention_pairs=int((q * ctx).sum()), num_steps=batch.num_steps)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
