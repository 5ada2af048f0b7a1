"""Verifying proposed tokens (speculative decoding): one mixed step that picks greedily after every query token.

A sequence's query is its last token followed by ``d`` proposals (``StepBatch.draft_lens``), attending to its
cached context as a prompt chunk does; its K/V are written for all of them. The graph returns the greedy pick and
its log-probability after *every* token (``("verify", max_seqs, tokens)``: the mixed step's inputs, the final
norm and lm_head over all token rows), and ``accept`` keeps the picks up to the first proposal that differs from
the pick before it. The kept picks are exactly what plain greedy decoding would produce one step at a time; the
K/V written for rejected proposals lie past the sequence's end, and the master overwrites or frees them. A sampled
sequence keeps its proposals while the token plain sampling draws at each position equals them (rejection sampling
for deterministic proposals), from the logits of every row (read back only then).
Only ragged backends run it (the tokens back to back, as their mixed steps).
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn

from agents.runtime.mixed_steps import mixed_token_buckets, warmup_arrays
from agents.runtime.sampler import raw_logprob, record_failure, sample_verified
from llm_serving.protocol.batch import FAILED_TOKEN, StepBatch, StepOutput


def verify_shapes(max_seqs: int, max_decode_batch: int, proposals: int, step_tokens: int | None = None) -> list[tuple]:
    """Token buckets up to a full decode batch with ``proposals`` proposals each, or ``step_tokens`` if fewer (the
    scheduler's cap on a verify step); none when ``proposals`` is 0."""
    if proposals <= 0:
        return []
    top = max_decode_batch * (proposals + 1)
    return [("verify", max_seqs, t) for t in mixed_token_buckets(min(top, step_tokens or top))]


def verify_warmup_arrays(batch: int, tokens: int, width: int, max_model_len: int, max_real: int) -> list[np.ndarray]:
    """A mixed call's warm-up inputs without the last-token indices (every row's pick is returned)."""
    return warmup_arrays("mixed", batch, tokens, width, max_model_len, max_real)[:6]


class VerifyStep(nn.Cell):
    """The mixed step's inputs (``agents.runtime.mixed_steps.MixedStep`` less ``last_index``); returns the greedy
    ids and log-probabilities ``[tokens]`` and the logits ``[tokens, vocab]`` of every token row."""

    def __init__(self, model: nn.Cell, adapters: bool = False) -> None:
        super().__init__()
        self.model = model
        self.adapters = adapters  # the LoRA adapter graph (LlamaModel.hidden_states)

    def construct(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, q_seq_lens: Tensor,
                  batch_valid_length: Tensor, block_tables: Tensor):
        token_rows, _ = self.model.real_rows(q_seq_lens, True)
        hidden = self.model.hidden_states(input_ids, positions, slot_mapping, q_seq_lens, block_tables,
                                          token_rows, True, batch_valid_length, self.adapters)
        logits = self.model.logits(hidden, token_rows)
        token_ids, logprobs = self.model.greedy(logits)
        return token_ids, logprobs, logits

    def logits_rows(self, *inputs: Tensor) -> int:
        """The rows of the logits these inputs give (one per token), known without running."""
        return int(inputs[0].shape[0])


def accept(batch: StepBatch, picks: np.ndarray, logprobs: np.ndarray, logits: np.ndarray | None = None) -> StepOutput:
    """The step's answer from the greedy picks after every query token (``[num_tokens]``, batch order); a sampled
    sequence's tokens come from its rows of ``logits`` (``[num_tokens, vocab]``, read back for sampled steps only)
    (``sampler.sample_verified``)."""
    n, most = batch.batch_size, int(batch.draft_lens.max(initial=0))
    ends = np.cumsum(batch.query_lens)
    ids, lps = np.zeros(n, np.int32), np.zeros(n, np.float32)
    more_ids, more_lps = np.zeros((n, max(most, 1)), np.int32), np.zeros((n, max(most, 1)), np.float32)
    num_more = np.zeros(n, np.int32)
    sampled = batch.sampling.special_rows() if batch.sampling is not None else np.zeros(n, np.bool_)
    for i, (end, d) in enumerate(zip(ends.tolist(), batch.draft_lens.tolist())):
        first = end - d - 1  # the sequence's last real token: its pick is the next token in any case
        if sampled[i]:
            try:
                tokens = sample_verified(logits[first:end], batch.input_ids[first + 1:end].tolist(), batch.sampling, i)
            except Exception as exc:  # noqa: BLE001 - this row fails alone; the others are unaffected
                ids[i] = FAILED_TOKEN
                record_failure(batch.sampling, i, exc)
                continue
            ids[i], lps[i] = tokens[0], raw_logprob(logits[first], tokens[0])
            for j, token in enumerate(tokens[1:]):
                more_ids[i, j], more_lps[i, j] = token, raw_logprob(logits[first + 1 + j], token)
            num_more[i] = len(tokens) - 1
            continue
        ids[i], lps[i] = picks[first], logprobs[first]
        accepted = 0
        while accepted < d and batch.input_ids[first + accepted + 1] == picks[first + accepted]:
            accepted += 1
        more_ids[i, :accepted] = picks[first + 1: first + 1 + accepted]
        more_lps[i, :accepted] = logprobs[first + 1: first + 1 + accepted]
        num_more[i] = accepted
    return StepOutput(ids, lps, more_token_ids=more_ids, more_logprobs=more_lps, num_more=num_more)
