"""The per-step batch that the master hands to device agents.

Plain numpy arrays in a ragged, token-flat layout (as in vLLM): the scheduler fills it, shared memory
carries it, and the agent's model runner pads it into one of its compiled shape buckets.
Kept free of MindSpore: both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Token id of a sequence whose sampling or post-processing failed on the agent: that sequence fails, the other
# sequences of its step go on (the reason travels in rank 0's DONE frame, ``wire.done_payload``).
FAILED_TOKEN = -1


@dataclass
class SamplingBatch:
    """Per-sequence sampling parameters of one step (absent from all-greedy steps).

    ``temperature`` 0 means greedy. The random draw of a sequence depends only on ``(seeds[i], draw_index[i])``
    (``draw_index`` = tokens generated so far), so a seeded request samples the same tokens whatever else is in
    its batch and across preemption. ``penalty_token_ids[penalty_offsets[i]:penalty_offsets[i+1]]`` are the
    prompt + generated token ids of sequence ``i`` that its repetition penalty applies to (empty when 1.0).
    """

    temperature: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B], 0 = no limit
    top_p: np.ndarray  # float32 [B], 1.0 = no limit
    repetition_penalty: np.ndarray  # float32 [B], 1.0 = none
    seeds: np.ndarray  # int64 [B]
    draw_index: np.ndarray  # int32 [B]
    penalty_offsets: np.ndarray  # int32 [B + 1]
    penalty_token_ids: np.ndarray  # int32 [penalty_offsets[-1]]

    @property
    def needs_logits(self) -> bool:
        """Whether any sequence needs more than the in-graph greedy argmax."""
        return bool(np.any(self.temperature > 0) or np.any(self.repetition_penalty != 1.0))

    def take(self, indices: np.ndarray) -> SamplingBatch:
        """The parameters of the sequences at ``indices``, in that order."""
        starts, ends = self.penalty_offsets[indices], self.penalty_offsets[indices + 1]
        ids = [self.penalty_token_ids[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32)
        return SamplingBatch(self.temperature[indices], self.top_k[indices], self.top_p[indices],
                             self.repetition_penalty[indices], self.seeds[indices], self.draw_index[indices],
                             offsets, np.concatenate(ids).astype(np.int32) if ids else self.penalty_token_ids[:0])


@dataclass
class StepBatch:
    """One model step for ``B`` sequences.

    Prefill: sequence ``i`` contributes ``query_lens[i]`` tokens (its whole prompt), concatenated in order.
    Decode: every sequence contributes exactly one token.

    ``want_logits[i]``: return sequence ``i``'s float32 logits of this step (the distribution its next token is
    picked from) in ``StepOutput.logits``; None when no sequence asks, and then the agents never read logits back.
    """

    is_prefill: bool
    input_ids: np.ndarray  # int32 [num_tokens]
    positions: np.ndarray  # int32 [num_tokens], position of each token in its sequence
    slot_mapping: np.ndarray  # int32 [num_tokens], flat KV slot = block_id * block_size + offset
    query_lens: np.ndarray  # int32 [B], tokens each sequence contributes this step
    context_lens: np.ndarray  # int32 [B], sequence length after this step (cached + new tokens)
    block_tables: np.ndarray  # int32 [B, W], block ids of each sequence; unused entries are 0
    sampling: SamplingBatch | None = None  # None: every sequence is greedy
    want_logits: np.ndarray | None = None  # bool [B]; None: no sequence wants its logits back

    @property
    def batch_size(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, indices: np.ndarray) -> StepBatch:
        """A step of only the sequences at ``indices``, in that order (each keeps all its tokens); this very
        step when that is all of them in order (the usual decode call: no copies)."""
        if len(indices) == self.batch_size and np.array_equal(indices, np.arange(self.batch_size)):
            return self
        lens = self.query_lens[indices]
        starts = (np.cumsum(self.query_lens) - self.query_lens)[indices]  # of each taken sequence's tokens here
        # token t of the result is token t - (its sequence's start there) + (its start here)
        tokens = np.arange(int(lens.sum())) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        want = self.want_logits[indices] if self.want_logits is not None else None
        return StepBatch(self.is_prefill, self.input_ids[tokens], self.positions[tokens], self.slot_mapping[tokens],
                         self.query_lens[indices], self.context_lens[indices], self.block_tables[indices],
                         self.sampling.take(indices) if self.sampling is not None else None,
                         want if want is not None and want.any() else None)

    def validate(self) -> None:
        """Raise ValueError when the arrays disagree with each other (cheap; for tests and loaders)."""
        n, b = self.num_tokens, self.batch_size
        for name in ("positions", "slot_mapping"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        if self.context_lens.shape != (b,) or self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError("context_lens/block_tables do not match the batch size")
        if int(self.query_lens.sum()) != n:
            raise ValueError(f"query_lens sum to {int(self.query_lens.sum())}, but there are {n} tokens")
        if not self.is_prefill and not np.all(self.query_lens == 1):
            raise ValueError("a decode step takes exactly one token per sequence")
        if self.want_logits is not None and self.want_logits.shape != (b,):
            raise ValueError(f"want_logits has shape {self.want_logits.shape}, expected ({b},)")


@dataclass
class StepOutput:
    """Rank 0's answer: the next token of every sequence in the batch, in batch order.

    A row whose token is ``FAILED_TOKEN`` failed on its own; ``errors`` maps such rows to their reason.
    ``logits`` holds the rows the batch's ``want_logits`` asked for, and only those.
    """

    token_ids: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why that sequence failed
    logits: dict[int, np.ndarray] = field(default_factory=dict)  # row -> float32 [vocab] logits of this step
