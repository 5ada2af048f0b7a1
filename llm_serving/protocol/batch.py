"""The per-step batch that the master hands to device agents.

Plain numpy arrays in a ragged, token-flat layout (as in vLLM): the scheduler fills it, shared memory
carries it, and the agent's model runner pads it into one of its compiled shape buckets.
Kept free of MindSpore: both sides import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from llm_serving.protocol.arrays import AnyArray, Bools, Float32s, Int32s, Integers
from llm_serving.protocol.step import StepDescriptor, StepKind, check_kind, part_kind, step_kind

# Logit adjustments of one sequence in one step at most (its logit_bias entries, and while it is short of its
# min_tokens its end ids banned): the shared-memory channel holds this many per sequence
MAX_LOGIT_ADJUSTMENTS = 384

# Token id of a sequence whose sampling or post-processing failed on the agent: that sequence fails, the other
# sequences of its step go on (the reason travels in rank 0's DONE frame, ``wire.done_payload``).
FAILED_TOKEN = -1


@overload
def needs_logits(temperature: float, repetition_penalty: float, presence_penalty: float, frequency_penalty: float,
                 min_p: float, adjusted: bool, constrained: bool) -> bool: ...
@overload
def needs_logits(temperature: Float32s, repetition_penalty: Float32s, presence_penalty: Float32s,
                 frequency_penalty: Float32s, min_p: Float32s, adjusted: Bools, constrained: Bools) -> Bools: ...
def needs_logits(temperature: Any, repetition_penalty: Any, presence_penalty: Any, frequency_penalty: Any,
                 min_p: Any, adjusted: Any, constrained: Any) -> Any:
    """Whether a sequence needs its logits read (sampled, penalised or adjusted) instead of the in-graph greedy
    argmax: the one rule, for one request's parameters (``SamplingParams.needs_logits``, the master) and for a
    step's rows (``SamplingBatch.special_rows``, the agents). ``adjusted``: logit adjustments (logit_bias, the end
    ids banned short of min_tokens); ``constrained``: a grammar's mask. min_p only narrows sampling: a greedy row
    keeps its argmax, which min_p never drops."""
    return ((temperature > 0) | (repetition_penalty != 1.0) | (presence_penalty != 0) | (frequency_penalty != 0)
            | ((min_p > 0) & (temperature > 0)) | adjusted | constrained)


@dataclass
class SamplingBatch:
    """Per-sequence sampling parameters of one step (absent from all-greedy steps).

    ``temperature`` 0 means greedy. The random draw of a sequence depends only on ``(seeds[i], draw_index[i])``
    (``draw_index`` = tokens generated so far), so a seeded request samples the same tokens whatever else is in
    its batch and across preemption. ``penalty_token_ids[penalty_offsets[i]:penalty_offsets[i+1]]`` are the
    prompt + generated token ids of sequence ``i`` that its penalties apply to (empty without any).

    ``extras`` is absent (None) from steps where no sequence uses them: OpenAI's ``presence_penalty`` and
    ``frequency_penalty`` (over the generated ids, from ``output_start[i]`` among its penalty ids), vLLM's
    ``min_p``, and per-sequence logit adjustments added to the logits before anything else (``logit_bias``, and
    -inf for the end ids a sequence short of its ``min_tokens`` may not produce yet). ``token_masks`` (structured
    output) is a bitmask row per sequence of the tokens it may produce (bit ``t % 32`` of word ``t // 32``; all bits
    set for an unconstrained row): the others' logits become -inf after the adjustments, before the penalties.
    """

    temperature: npt.NDArray[np.float32]  # float32 [B]
    top_k: npt.NDArray[np.int32]  # int32 [B], 0 = no limit
    top_p: npt.NDArray[np.float32]  # float32 [B], 1.0 = no limit
    repetition_penalty: npt.NDArray[np.float32]  # float32 [B], 1.0 = none
    seeds: npt.NDArray[np.int64]  # int64 [B]
    draw_index: npt.NDArray[np.int32]  # int32 [B]
    penalty_offsets: npt.NDArray[np.int32]  # int32 [B + 1]
    penalty_token_ids: npt.NDArray[np.int32]  # int32 [penalty_offsets[-1]]
    extras: SamplingExtras | None = None  # None: no sequence of the step uses them

    @property
    def needs_logits(self) -> bool:
        """Whether any sequence needs more than the in-graph greedy argmax."""
        return bool(np.any(self.special_rows()))

    def special_rows(self) -> Bools:
        """bool [B]: the sequences sampled, penalised or adjusted (``needs_logits``; the others keep the in-graph
        greedy pick)."""
        x = self.extras
        if x is None:
            zeros, no = np.zeros(len(self.temperature), np.float32), np.zeros(len(self.temperature), np.bool_)
            return needs_logits(self.temperature, self.repetition_penalty, zeros, zeros, zeros, no, no)
        return needs_logits(self.temperature, self.repetition_penalty, x.presence_penalty, x.frequency_penalty,
                            x.min_p, np.diff(x.adjust_offsets) > 0, x.constrained())

    def take(self, indices: Integers) -> SamplingBatch:
        """The parameters of the sequences at ``indices``, in that order."""
        offsets, ids = _take_ragged(self.penalty_offsets, self.penalty_token_ids, indices)
        return SamplingBatch(self.temperature[indices], self.top_k[indices], self.top_p[indices],
                             self.repetition_penalty[indices], self.seeds[indices], self.draw_index[indices],
                             offsets, ids, self.extras.take(indices) if self.extras is not None else None)


@dataclass
class SamplingExtras:
    """The sampling controls most steps lack (see ``SamplingBatch``); every array has a row per sequence."""

    presence_penalty: npt.NDArray[np.float32]  # float32 [B], 0 = none
    frequency_penalty: npt.NDArray[np.float32]  # float32 [B], 0 = none
    min_p: npt.NDArray[np.float32]  # float32 [B], 0 = none
    output_start: npt.NDArray[np.int32]  # int32 [B]: where its generated ids start among its penalty ids
    adjust_offsets: npt.NDArray[np.int32]  # int32 [B + 1]
    adjust_ids: npt.NDArray[np.int32]  # int32 [adjust_offsets[-1]]
    adjust_values: npt.NDArray[np.float32]  # float32 [adjust_offsets[-1]]: added to the logits (-inf bans the token)
    token_masks: npt.NDArray[np.int32] | None = None  # int32 [B, ceil(vocab / 32)]; None: no sequence is constrained

    def constrained(self) -> Bools:
        """bool [B]: the sequences whose token mask bans some token."""
        if self.token_masks is None:
            return np.zeros(self.min_p.shape[0], np.bool_)
        banned: Bools = (self.token_masks != -1).any(axis=1)
        return banned

    def take(self, indices: Integers) -> SamplingExtras:
        offsets, ids = _take_ragged(self.adjust_offsets, self.adjust_ids, indices)
        _, values = _take_ragged(self.adjust_offsets, self.adjust_values, indices)
        return SamplingExtras(self.presence_penalty[indices], self.frequency_penalty[indices], self.min_p[indices],
                              self.output_start[indices], offsets, ids, values,
                              self.token_masks[indices] if self.token_masks is not None else None)


def _take_ragged(offsets: Int32s, values: AnyArray, indices: Integers) -> tuple[Int32s, AnyArray]:
    """The runs ``values[offsets[i]:offsets[i+1]]`` of the rows at ``indices``, with their new offsets."""
    starts, ends = offsets[indices], offsets[indices + 1]
    parts = [values[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
    new = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32)
    return new, (np.concatenate(parts).astype(values.dtype) if parts else values[:0])


def kv_slots(block_tables: Integers, rows: Integers, positions: Integers, block_size: int) -> Integers:
    """Flat KV-cache slots of tokens at ``positions`` of the sequences whose block-table rows are ``rows``."""
    slots: Integers = block_tables[rows, positions // block_size] * block_size + positions % block_size
    return slots


KV_DIRECTIONS = ("export", "import")
# the longest adapter directory path an ``AdapterStep`` carries (UTF-8 bytes; the shared memory holds as many)
MAX_ADAPTER_PATH_BYTES = 4096


class _NoSequences:
    """A step that is not a model step (a KV copy, an adapter load): no sequences, one round, an empty answer."""

    @property
    def batch_size(self) -> int:
        return 0

    @property
    def num_steps(self) -> int:
        return 1


@dataclass
class KvCopyStep(_NoSequences):
    """Not a model step but a copy of whole KV blocks (prefill/decode disaggregation,
    ``llm_serving.engine.kv_transfer``): ``export`` copies the blocks ``block_ids``, in that order, out of every
    rank's KV cache into the rank's region of the pool's KV segment (``protocol.kv_segment``); ``import`` copies the
    segment's blocks into them. It has no sequences and its answer no tokens."""

    direction: str
    block_ids: npt.NDArray[np.int32]  # int32 [n]

    def __post_init__(self) -> None:
        if self.direction not in KV_DIRECTIONS:
            raise ValueError(f"KV copy direction {self.direction!r} is not one of {KV_DIRECTIONS}")
        self.block_ids = np.asarray(self.block_ids, np.int32)


@dataclass
class AdapterStep(_NoSequences):
    """Not a model step: load the PEFT LoRA adapter in directory ``path`` into adapter slot ``slot`` of every rank
    (each its own slice, ``agents.weights.lora_weights``), or empty the slot (``path`` None). A model step's rows
    then name their slot (``StepBatch.lora_slots``). The master checked the adapter (``protocol.lora.LoraConfig``)
    and sends this only while no step in flight uses the slot. It has no sequences and its answer no tokens."""

    slot: int
    path: str | None

    def __post_init__(self) -> None:
        if self.slot < 0:
            raise ValueError(f"adapter slot {self.slot} is negative")
        if self.path is not None and len(self.path.encode()) > MAX_ADAPTER_PATH_BYTES:
            raise ValueError(f"adapter path {self.path!r} is longer than {MAX_ADAPTER_PATH_BYTES} bytes")


@dataclass
class StepBatch:
    """One model step for ``B`` sequences, described by what it computes (``protocol.step``).

    Row ``i`` computes ``query_lens[i]`` tokens (concatenated in row order in the token-flat arrays), the last ones
    of its ``context_lens[i]`` tokens; the K/V of the ones before are in the cache, read through its block table.
    ``kind`` (``protocol.step.StepKind``: whole prompts, mixed, decode, verify) follows from that content
    (``step_kind``) and is derived when not given; the agents run the step on that kind's graphs.

    ``want_logits[i]``: return sequence ``i``'s float32 logits of this step (the distribution its next token is
    picked from) in ``StepOutput.logits``; None when no sequence asks, and then the agents never read logits back.

    ``num_steps`` > 1 (multi-step decoding; all-greedy decode steps only): the agents run that many decode steps
    before answering, each feeding every sequence the token the previous one chose, at the next position (its
    slot from the block table, which covers them all); ``StepOutput.more_token_ids`` holds the later tokens.

    ``draft_lens`` (speculative decoding, a VERIFY step): the last ``draft_lens[i]`` query tokens of sequence ``i``
    are proposed tokens to verify. The agents pick after every query token (greedily, or for a sampled sequence by
    its seeded draw there, ``agents.runtime.sampler.speculative_sample_row``) and accept the proposals up to the
    first that differs: ``token_ids[i]`` is the pick after the sequence's last real token,
    ``more_token_ids[i, :num_more[i]]`` the picks after each accepted proposal.

    ``num_steps`` R > 1 with ``draft_lens`` (verify rounds, greedy only): the agents verify, then propose again after
    the tokens they accepted and verify again, R rounds in all, up to ``round_proposals`` (k, the master's
    ``verify_round_proposals``) proposals a sequence a round, each sequence getting at most ``R * (k + 1)`` tokens
    (its blocks reserved for them); ``more_token_ids`` then holds every
    round's tokens after the first and ``StepOutput.spec_counts`` what was proposed and accepted. For prompt lookup
    the agents propose from ``history_ids[history_offsets[i]:history_offsets[i + 1]]``, sequence ``i``'s prompt
    and output ids up to and including its last token (None for a draft model, which proposes by itself).

    ``fed_rows`` (asynchronous scheduling, sent while the step before is still running): a decode step of sequences
    of the step before, whose ``input_ids`` are placeholders: each agent feeds row ``i`` the token it picked for row
    ``fed_rows[i]`` of the step before (that row's last step's, for a multi-step batch). A mixed step's rows of
    ``fed_rows[i] < 0`` (prompt chunks admitted in the step ahead) carry their own input ids.

    ``lora_slots[i]``: the adapter slot (``AdapterStep``) whose LoRA row ``i`` is computed with, -1 for the base
    model; None when no row uses an adapter (the agents then add nothing).
    """

    input_ids: npt.NDArray[np.int32]  # int32 [num_tokens]
    positions: npt.NDArray[np.int32]  # int32 [num_tokens], position of each token in its sequence
    slot_mapping: npt.NDArray[np.int32]  # int32 [num_tokens], flat KV slot = block_id * block_size + offset
    query_lens: npt.NDArray[np.int32]  # int32 [B], tokens each sequence contributes this step
    context_lens: npt.NDArray[np.int32]  # int32 [B], sequence length after this step (cached + new tokens)
    block_tables: npt.NDArray[np.int32]  # int32 [B, W], block ids of each sequence; unused entries are 0
    sampling: SamplingBatch | None = None  # None: every sequence is greedy
    want_logits: npt.NDArray[np.bool_] | None = None  # bool [B]; None: no sequence wants its logits back
    num_steps: int = 1
    draft_lens: npt.NDArray[np.int32] | None = None  # int32 [B]; None: no proposals to verify
    # int32 [B]: each row's row in the step before, whose pick is its input
    fed_rows: npt.NDArray[np.int32] | None = None
    history_offsets: npt.NDArray[np.int32] | None = None  # int32 [B + 1]: verify rounds of prompt lookup (above)
    history_ids: npt.NDArray[np.int32] | None = None  # int32 [history_offsets[-1]]
    round_proposals: int = 0  # verify rounds: proposals a sequence gets a round (above)
    kind: StepKind = None  # type: ignore[assignment]  # None: derived from the content (step_kind)
    lora_slots: npt.NDArray[np.int32] | None = None  # int32 [B]: each row's adapter slot, -1 none (above)

    def __post_init__(self) -> None:
        if self.kind is None:
            self.kind = step_kind(self.query_lens, self.context_lens, self.draft_lens is not None)

    def describe(self) -> StepDescriptor:
        """The step's descriptor: its kind and the sizes its graph bucket is chosen by."""
        q, ctx = self.query_lens, self.context_lens
        return StepDescriptor(self.kind, self.batch_size, self.num_tokens, int(q.max(initial=0)),
                              int(ctx.max(initial=0)), self.num_steps, self.fed_rows is not None)

    @property
    def feeds_previous(self) -> bool:
        """Whether the inputs are the agents' picks of the step before (``fed_rows``)."""
        return self.fed_rows is not None

    @property
    def batch_size(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, indices: Integers) -> StepBatch:
        """A step of only the sequences at ``indices``, in that order (each keeps all its tokens); this very
        step when that is all of them in order (the usual decode call: no copies). The part keeps its step's
        kind, but for the rows of a prefill or mixed step: whole prompts alone are a PREFILL part (they run on
        the prompt graphs), anything else a MIXED one (``protocol.step.part_kind``)."""
        if len(indices) == self.batch_size and np.array_equal(indices, np.arange(self.batch_size)):
            return self
        lens = self.query_lens[indices]
        starts = (np.cumsum(self.query_lens) - self.query_lens)[indices]  # of each taken sequence's tokens here
        # token t of the result is token t - (its sequence's start there) + (its start here)
        tokens = np.arange(int(lens.sum())) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        want = self.want_logits[indices] if self.want_logits is not None else None
        offsets, history = self.history_offsets, self.history_ids
        if offsets is not None and history is not None:
            offsets, history = _take_ragged(offsets, history, indices)
        context = self.context_lens[indices]
        return StepBatch(self.input_ids[tokens], self.positions[tokens], self.slot_mapping[tokens], lens, context,
                         self.block_tables[indices],
                         self.sampling.take(indices) if self.sampling is not None else None,
                         want if want is not None and want.any() else None, self.num_steps,
                         self.draft_lens[indices] if self.draft_lens is not None else None,
                         self.fed_rows[indices] if self.fed_rows is not None else None, offsets, history,
                         self.round_proposals, kind=part_kind(self.kind, lens, context),
                         lora_slots=self.lora_slots[indices] if self.lora_slots is not None else None)

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
        check_kind(self.kind, self.query_lens, self.context_lens, self.draft_lens is not None)
        verify = self.kind is StepKind.VERIFY
        if self.num_steps > 1 and (self.kind not in (StepKind.DECODE, StepKind.VERIFY) or self.sampling is not None
                                   or self.want_logits is not None):
            raise ValueError("several steps at once are for all-greedy decode or verify steps without logits")
        if self.round_proposals and (not verify or self.num_steps == 1 or self.round_proposals < 0):
            raise ValueError("round_proposals belong to a verify step of several rounds")
        if self.history_ids is not None and (not verify or self.history_offsets is None
                                             or self.history_offsets.shape != (b + 1,)
                                             or int(self.history_offsets[-1]) != self.history_ids.shape[0]):
            raise ValueError("history_ids belong to a verify step, history_offsets one more than its sequences")
        fed = self.fed_rows
        if fed is not None and (fed.shape != (b,) or self.kind not in (StepKind.DECODE, StepKind.MIXED)
                                or np.any(self.query_lens[fed >= 0] != 1)
                                or self.kind is StepKind.DECODE and np.any(fed < 0)):
            raise ValueError("only a decode step, or the decode rows of a mixed one, take their input tokens from "
                             "the step before, one row each")
        if self.want_logits is not None and self.want_logits.shape != (b,):
            raise ValueError(f"want_logits has shape {self.want_logits.shape}, expected ({b},)")
        if self.draft_lens is not None:
            if (self.draft_lens.shape != (b,) or np.any(self.draft_lens < 0)
                    or np.any(self.draft_lens >= self.query_lens)):
                raise ValueError("draft_lens must hold, per sequence, fewer proposals than its query tokens")
            if self.want_logits is not None:
                raise ValueError("proposals are verified in steps without logits to return")
        if self.lora_slots is not None and (self.lora_slots.shape != (b,) or np.any(self.lora_slots < -1)):
            raise ValueError("lora_slots must hold, per sequence, its adapter slot or -1")


# What the agents run: a model step, a copy of KV blocks, or an adapter loaded into a slot.
Step = StepBatch | KvCopyStep | AdapterStep


@dataclass
class StepOutput:
    """Rank 0's answer: the next token of every sequence in the batch, in batch order.

    A row whose token is ``FAILED_TOKEN`` failed on its own; ``errors`` maps such rows to their reason.
    ``logits`` holds the rows the batch's ``want_logits`` asked for, and only those.
    """

    token_ids: npt.NDArray[np.int32]  # int32 [B]
    logprobs: npt.NDArray[np.float32]  # float32 [B]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why that sequence failed
    logits: dict[int, Float32s] = field(default_factory=dict)  # row -> float32 [vocab] logits of this step
    # a batch of num_steps > 1: the tokens (and logprobs) of its later steps, int32/float32 [B, num_steps - 1]
    more_token_ids: Int32s | None = None
    more_logprobs: Float32s | None = None
    # a batch with draft_lens: how many leading entries of each more_token_ids row are tokens (accepted proposals'
    # picks); None: every entry is
    num_more: Int32s | None = None
    # a verify step of several rounds: per sequence (drafts verified, tokens proposed, proposals accepted), int32
    # [B, 3]; None: the step's own draft_lens were all (one round)
    spec_counts: Int32s | None = None


def verify_batch(last_ids: Iterable[int], proposals: list[list[int]], num_tokens: Integers,
                 block_tables: Int32s, block_size: int, sampling: SamplingBatch | None = None,
                 num_steps: int = 1, history: tuple[Int32s, Int32s] | None = None,
                 round_proposals: int = 0) -> StepBatch:
    """A verify step: each sequence's last token (at position ``num_tokens - 1``) followed by its
    proposals, over its cached context through ``block_tables`` (a row per sequence), of ``num_steps`` rounds of
    up to ``round_proposals`` proposals (``history``: its ``history_offsets`` and ``history_ids``). The master builds
    a step's first round so, the agents the later ones (``agents.runtime.verify_rounds``)."""
    n = len(proposals)
    draft_lens = np.fromiter(map(len, proposals), np.int32, n)
    query_lens = draft_lens + 1
    context_lens = (num_tokens + draft_lens).astype(np.int32)
    ids = np.fromiter(chain.from_iterable([t, *p] for t, p in zip(last_ids, proposals)), np.int32,
                      int(query_lens.sum()))
    rows = np.repeat(np.arange(n), query_lens)
    positions = (np.arange(len(ids)) - (np.cumsum(query_lens) - context_lens)[rows]).astype(np.int32)
    slots = kv_slots(block_tables, rows, positions, block_size).astype(np.int32)
    offsets, history_ids = history if history is not None else (None, None)
    return StepBatch(ids, positions, slots, query_lens, context_lens, block_tables, sampling, num_steps=num_steps,
                     draft_lens=draft_lens, history_offsets=offsets, history_ids=history_ids,
                     round_proposals=round_proposals if num_steps > 1 else 0)


def verify_round_proposals(num_tokens: int, step_tokens: int, batch_size: int) -> int:
    """Proposals a sequence gets per verify round: ``num_tokens`` (speculative.num_tokens) while a round of the
    batch fits ``step_tokens`` (speculative.max_step_tokens), fewer as the batch grows: speculation backs off."""
    return max(0, min(num_tokens, step_tokens // max(batch_size, 1) - 1))
