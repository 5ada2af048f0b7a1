"""The batch of a step the scheduler chose: each row's tokens, positions and KV slots, and what the agents need
beyond the in-graph greedy pick (sampling parameters, logits rows to return).

The scheduler decides who runs and how much (``num_scheduled_tokens``, proposals, rounds); this module only writes
that down as a ``StepBatch``, once: nothing edits a batch after it is built. Its kind (``protocol.step``) follows
from the rows it holds.

Sampling: all-greedy steps carry no ``SamplingBatch`` (the agents keep the in-graph argmax). A step with a
sampled or penalised sequence carries every sequence's parameters, its seed (fixed at admission, so a
preempted and recomputed sequence draws the same) and its draw index (tokens generated so far).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from llm_serving.core.sequence import Sequence
from llm_serving.protocol.arrays import Bools, Int32s
from llm_serving.protocol.batch import SamplingBatch, SamplingExtras, StepBatch, kv_slots, verify_batch


class StepBuilder:
    """Builds step batches for a cache of ``block_size``-token blocks; ``eos_ids`` end a request (a sequence short
    of its ``min_tokens`` has them banned)."""

    def __init__(self, block_size: int, eos_ids: set[int]) -> None:
        self.block_size = block_size
        self.eos_ids = eos_ids

    def model_step(self, seqs: list[Sequence], block_tables: Int32s, *, one_token_each: bool,
                   any_sampled: bool, any_reads_logits: bool, any_adapted: bool = False, ahead: int = 0,
                   num_steps: int = 1,
                   fed_rows: Int32s | None = None) -> StepBatch:
        """A step of each sequence's scheduled tokens after its computed ones (prompt chunks, decode tokens).

        ``one_token_each``: every sequence decodes its next token (vectorized: this runs every step for the whole
        decode batch); ``ahead``: the decode step after one in flight that gives each sequence that many tokens
        (``Scheduler.schedule_ahead``): that many positions further, its input ids placeholders the agents fill
        from ``fed_rows`` (in a mixed step the rows of ``fed_rows[i] >= 0``, the others prompt chunks).
        ``any_sampled`` / ``any_reads_logits`` / ``any_adapted``: whether some running sequence samples, reads logits
        back, or runs with a LoRA adapter (False lets a decode step skip looking at each sequence)."""
        n = len(seqs)
        if one_token_each:
            context_lens = np.fromiter((seq.num_tokens + ahead for seq in seqs), np.int32, n)
            ids = np.zeros(n, np.int32) if ahead else np.fromiter((seq.last_token_id for seq in seqs), np.int32, n)
            query_lens = np.ones(n, dtype=np.int32)
            positions = context_lens - 1
            rows = np.arange(n)
        else:
            # a row fed by the step in flight (``fed_rows[i] >= 0``) decodes ``ahead`` positions past its last token
            fed = [False] * n if fed_rows is None else (fed_rows >= 0).tolist()
            starts = np.fromiter((seq.num_tokens + ahead - 1 if f else seq.num_computed_tokens
                                  for seq, f in zip(seqs, fed)), np.int32, n)
            query_lens = np.fromiter((1 if f else seq.num_scheduled_tokens for seq, f in zip(seqs, fed)), np.int32, n)
            context_lens = starts + query_lens
            total = int(query_lens.sum())
            ids = np.fromiter(chain.from_iterable([0] if f else seq.token_ids(a, b) for seq, f, a, b in
                                                  zip(seqs, fed, starts.tolist(), context_lens.tolist())),
                              np.int32, total)
            rows = np.repeat(np.arange(n), query_lens)
            positions = np.arange(total, dtype=np.int32) - (np.cumsum(query_lens) - context_lens)[rows]
        slots = kv_slots(block_tables, rows, positions, self.block_size)
        sampled = (not one_token_each or any_sampled) and any(seq.params.needs_logits for seq in seqs)
        return StepBatch(ids, positions.astype(np.int32, copy=False), slots.astype(np.int32, copy=False),
                         query_lens, context_lens, block_tables,
                         sampling=self.sampling(seqs) if sampled else None,
                         want_logits=want_logits(seqs) if any_reads_logits else None,
                         num_steps=num_steps, fed_rows=fed_rows,
                         lora_slots=lora_slots(seqs) if any_adapted else None)

    def verify_step(self, seqs: list[Sequence], drafts: list[list[int]], block_tables: Int32s,
                    rounds: int = 1, round_proposals: int = 0, with_history: bool = False) -> StepBatch:
        """A step of each sequence's last token followed by its proposals, over its cached context, of ``rounds``
        verify rounds of up to ``round_proposals`` proposals; ``with_history``: with each sequence's tokens, for
        the agents' prompt lookup."""
        n = len(seqs)
        lens = np.fromiter((seq.num_tokens for seq in seqs), np.int32, n)
        history = None
        if with_history:
            history = (np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                       np.fromiter(chain.from_iterable(seq.prompt_ids + seq.output_ids for seq in seqs), np.int32,
                                   int(lens.sum())))
        sampled = any(seq.params.needs_logits for seq in seqs)
        return verify_batch((seq.last_token_id for seq in seqs), drafts, lens, block_tables, self.block_size,
                            sampling=self.sampling(seqs) if sampled else None, num_steps=rounds, history=history,
                            round_proposals=round_proposals)

    def sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        """Per-sequence sampling arrays; penalty ids are prompt + generated tokens of penalised sequences only."""
        n, params = len(seqs), [seq.params for seq in seqs]
        penalised = [p.penalises_history for p in params]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([seq.num_tokens if pen else 0 for seq, pen in zip(seqs, penalised)], out=offsets[1:])
        lists = chain.from_iterable((seq.prompt_ids, seq.output_ids) for seq, pen in zip(seqs, penalised) if pen)
        return SamplingBatch(
            temperature=np.fromiter((p.temperature for p in params), np.float32, n),
            top_k=np.fromiter((p.top_k for p in params), np.int32, n),
            top_p=np.fromiter((p.top_p for p in params), np.float32, n),
            repetition_penalty=np.fromiter((p.repetition_penalty for p in params), np.float32, n),
            seeds=np.fromiter((seq.seed for seq in seqs), np.int64, n),
            draw_index=np.fromiter((seq.num_output_tokens for seq in seqs), np.int32, n),
            penalty_offsets=offsets,
            penalty_token_ids=np.fromiter(chain.from_iterable(lists), np.int32, int(offsets[-1])),
            extras=self._extras(seqs) if any(p.uses_extras for p in params) else None,
        )

    def _extras(self, seqs: list[Sequence]) -> SamplingExtras:
        """The rarer controls: presence/frequency penalties over the generated ids (which start after the prompt
        among the penalty ids), min_p, each sequence's logit adjustments (its logit_bias; while it is short of
        min_tokens, -inf on the ids that would end it), and the token masks of the sequences held to a grammar."""
        n, params = len(seqs), [seq.params for seq in seqs]
        adjustments = []
        for seq, p in zip(seqs, params):
            entries = dict(p.logit_bias)
            if seq.num_output_tokens < p.min_tokens:
                ends = (set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids)
                entries.update(dict.fromkeys(ends, -np.inf))
            adjustments.append(entries)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(a) for a in adjustments], out=offsets[1:])
        return SamplingExtras(
            presence_penalty=np.fromiter((p.presence_penalty for p in params), np.float32, n),
            frequency_penalty=np.fromiter((p.frequency_penalty for p in params), np.float32, n),
            min_p=np.fromiter((p.min_p for p in params), np.float32, n),
            output_start=np.fromiter((seq.num_prompt_tokens if p.penalises_history else 0
                                      for seq, p in zip(seqs, params)), np.int32, n),
            adjust_offsets=offsets,
            adjust_ids=np.fromiter(chain.from_iterable(adjustments), np.int32, int(offsets[-1])),
            adjust_values=np.fromiter(chain.from_iterable(a.values() for a in adjustments), np.float32,
                                      int(offsets[-1])),
            token_masks=token_masks(seqs),
        )


def want_logits(seqs: list[Sequence]) -> Bools | None:
    """Which sequences' logits rows to return (``Sequence.wants_logits_row``: a dump short of this step's row,
    alternatives to report, a prompt position to score); None when none."""
    want = np.fromiter((seq.wants_logits_row() for seq in seqs), np.bool_, len(seqs))
    return want if want.any() else None


def lora_slots(seqs: list[Sequence]) -> Int32s | None:
    """Each sequence's adapter slot (-1: the base model); None when none has one (the agents then add nothing)."""
    slots = np.fromiter((seq.lora_slot for seq in seqs), np.int32, len(seqs))
    return slots if (slots >= 0).any() else None


def token_masks(seqs: list[Sequence]) -> Int32s | None:
    """Each constrained sequence's allowed next tokens (``grammar.TokenMatcher.fill_mask``), the others' rows all
    ones; None when no sequence is constrained."""
    constrained = [(i, seq.constraint) for i, seq in enumerate(seqs) if seq.constraint is not None]
    if not constrained:
        return None
    masks = np.full((len(seqs), constrained[0][1].mask_words), -1, np.int32)
    for i, matcher in constrained:
        matcher.fill_mask(masks[i])
    return masks
