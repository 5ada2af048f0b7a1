"""Continuous-batching scheduler: picks each model step (a prefill or a decode) and applies its result.

Modelled on nano-vllm / vLLM: the scheduler decides *which* sequences run, the BlockManager decides *where*
their KV lives. A step is either a prefill (whole prompts of newly admitted sequences, concatenated) or a
decode (one token for every running sequence); they are never mixed, which keeps the agents' compiled
shape buckets simple. One step is in flight at a time: ``schedule()``, run the model, ``postprocess()``.

Sampling: all-greedy steps carry no ``SamplingBatch`` (the agents keep the in-graph argmax). A step with a
sampled or penalised sequence carries every sequence's parameters, its seed (fixed at admission, so a
preempted and recomputed sequence draws the same) and its draw index (tokens generated so far).

Logits dump: a step marks in ``want_logits`` the sequences still short of their ``logits_tokens`` rows; the row
it returns for a sequence is that of the token the step produces, so a recompute's prefill adds one row, never
the rows of tokens generated before its preemption. Steps where no sequence asks carry None (checked in O(1)
for decode while no running sequence dumps), and the agents then read no logits back.

When a decode step needs a KV block and none is free, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of the queue; its next prefill
covers prompt + generated tokens, so it resumes exactly where it stopped (greedy results do not change).

Prompt buckets: the agents compile prefill shapes up to ``max_prompt_len`` tokens per sequence, plus one shape
of a single sequence up to ``max_model_len`` for recompute. So a new prompt longer than ``max_prompt_len`` is
rejected at admission, and a preempted sequence that has grown past it is prefilled alone.

Prefill vs decode interleaving (``min_decode_steps_between_prefills``):
  0 (default, as vLLM): prefill whenever something can be admitted. Best time-to-first-token and fastest
    ramp-up of the decode batch, but every prefill stalls the running streams (inter-token latency spikes
    under a steady stream of arrivals).
  k > 0: at least k decode steps between two prefills while sequences are running. Smoother inter-token
    latency for running streams, at the cost of queueing delay (TTFT) for new requests.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np

from llm_serving.block_manager import DUMMY_BLOCK, BlockManager
from llm_serving.protocol.batch import SamplingBatch, StepBatch, StepOutput
from llm_serving.protocol.model_config import blocks_needed
from llm_serving.sequence import FINISH_REASONS, Sequence, SequenceStatus

POLICIES = ("fcfs", "longest_output_first")


class RequestRejected(ValueError):
    """A request that can never be served with this configuration (rejected at admission)."""


@dataclass
class SchedulerConfig:
    num_blocks: int  # KV cache blocks on the agents, dummy block 0 included
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 8  # running sequences = largest decode batch
    max_prefill_batch: int = 4  # sequences admitted by one prefill step
    max_num_batched_tokens: int = 2048  # token budget of one prefill step
    max_model_len: int = 2048  # prompt + max_new_tokens limit per request
    eos_token_id: int | None = 2  # None: only max_new_tokens ends a request
    policy: str = "fcfs"  # admission order, see POLICIES
    max_wait_s: float | None = 30.0  # longest_output_first: admit requests queued this long first
    min_decode_steps_between_prefills: int = 0  # interleaving knob, see module docstring
    max_prompt_len: int | None = None  # longest new prompt (largest prefill bucket); None: max_model_len

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_prefill_batch",
                     "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"scheduler config: {name} must be a positive int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(f"scheduler config: num_blocks must be >= 2 (block 0 is reserved), got "
                             f"{self.num_blocks}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler config: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a preempted sequence is recomputed in one prefill"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler config: policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_wait_s is not None and self.max_wait_s < 0:
            raise ValueError(f"scheduler config: max_wait_s must be >= 0 or None, got {self.max_wait_s}")
        if self.min_decode_steps_between_prefills < 0:
            raise ValueError("scheduler config: min_decode_steps_between_prefills must be >= 0, got "
                             f"{self.min_decode_steps_between_prefills}")
        if self.max_prompt_len is not None and not 1 <= self.max_prompt_len <= self.max_model_len:
            raise ValueError(f"scheduler config: max_prompt_len must be in 1..max_model_len "
                             f"({self.max_model_len}) or None, got {self.max_prompt_len}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self._clock = clock
        self._waiting: deque[Sequence] = deque()  # new requests, arrival order
        self._preempted: deque[Sequence] = deque()  # re-admitted before any new request
        self._running: list[Sequence] = []  # admission order; the last one is preempted first
        self._live: dict[str, Sequence] = {}
        self._decodes_since_prefill = 0
        self.num_preemptions = 0
        # Block tables of running sequences mirrored in one array (a row each), updated a block at a time, so
        # a step's table is one gather instead of converting every Python list again on every step.
        self._tables = np.zeros((config.max_num_seqs, blocks_needed(config.max_model_len, config.block_size)), np.int32)
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._row: dict[str, int] = {}
        self._running_sampled = 0  # running sequences whose params need logits; 0 keeps decode on the fast path
        self._running_dumps = 0  # running sequences with a logits dump; 0: no step asks for logits

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request admitted against the served limits (``llm_serving.admission``: prompt length,
        context, vocabulary); raises RequestRejected for what only the scheduler knows (a duplicate id, a KV
        cache too small for the request) and ValueError for a request that skipped admission."""
        cfg, rid = self.config, seq.request_id
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.output_ids:
            raise ValueError(f"request {rid!r}: only a fresh waiting sequence can be added, got {seq!r}")
        if rid in self._live:
            raise RequestRejected(f"request {rid!r}: a request with this id is already in progress")
        total = seq.num_prompt_tokens + seq.params.max_new_tokens
        longest = cfg.max_prompt_len if cfg.max_prompt_len is not None else cfg.max_model_len
        if not 0 < seq.num_prompt_tokens <= longest or total > cfg.max_model_len:
            raise ValueError(f"request {rid!r} was not admitted: {seq.num_prompt_tokens} prompt tokens, "
                             f"{total} in all (admission refuses this)")
        need = self.block_manager.blocks_needed(total - 1)  # the last generated token is never fed back
        if need > self.block_manager.num_usable_blocks:
            raise RequestRejected(
                f"request {rid!r}: needs up to {need} KV blocks of {cfg.block_size} tokens, but the KV cache "
                f"has only {self.block_manager.num_usable_blocks}"
            )
        if seq.arrival_time is None:
            seq.arrival_time = self._clock()
        if seq.seed is None:  # fixed now, so preemption and recompute never change the request's draws
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(64)
            seq.seed = (seed + 2**63) % 2**64 - 2**63  # as int64: the agents' RNG reads it modulo 2**64
        self._waiting.append(seq)
        self._live[rid] = seq

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request now (reason "abort"); False if it is not in progress."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: str) -> bool:
        """Finish a request from outside (e.g. "stop" on a stop string); frees its blocks at once.

        Safe while its step is in flight: postprocess() ignores it and it is never scheduled again.
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish_reason {reason!r}; expected one of {FINISH_REASONS}")
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def get(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    def requeue_running(self) -> list[Sequence]:
        """Preempt every running sequence (by recompute) and return them: replaced agents hold no KV cache."""
        victims = list(reversed(self._running))  # newest first, so the oldest ends up at the front
        for seq in victims:
            self._preempt(seq)
        return victims

    # ---- stepping -------------------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], StepBatch] | None:
        """The next step (its sequences in batch order and its batch), or None when there is nothing to run."""
        prefill_turn = (
            not self._running or self._decodes_since_prefill >= self.config.min_decode_steps_between_prefills
        )
        if prefill_turn and (self._waiting or self._preempted):
            seqs = self._admit()
            if seqs:
                self._decodes_since_prefill = 0
                return seqs, self._build(seqs, prefill=True)
        if not self._running:
            return None
        seqs = self._reserve_decode_slots()
        self._decodes_since_prefill += 1
        return seqs, self._build(seqs, prefill=False)

    def postprocess(self, seqs: list[Sequence], output: StepOutput) -> list[Sequence]:
        """Append each sequence's new token; return the sequences that finished with this step."""
        tokens, logprobs = np.asarray(output.token_ids), np.asarray(output.logprobs)
        if tokens.shape != (len(seqs),) or logprobs.shape != (len(seqs),):
            raise ValueError(
                f"step output has token_ids {tokens.shape} and logprobs {logprobs.shape} for {len(seqs)} sequences"
            )
        eos = self.config.eos_token_id
        finished = []
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step was in flight
            if seq.num_output_tokens < seq.logits_tokens:  # the step asked for this row (``_want_logits``)
                if row not in output.logits:
                    raise ValueError(f"step output has no logits for row {row} ({seq.request_id!r}), which "
                                     "want_logits asked for")
                seq.logits.append(output.logits[row])
            seq.append_token(token, logprob)
            if eos is not None and token == eos and not seq.params.ignore_eos:
                reason = "eos"
            elif seq.num_output_tokens >= seq.params.max_new_tokens:
                reason = "length"
            else:
                continue
            self._finish(seq, reason)
            finished.append(seq)
        return finished

    # ---- introspection --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def block_usage(self) -> float:
        return self.block_manager.usage

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        """Waiting sequences; preempted ones first, new ones in arrival order (not policy order)."""
        return tuple(self._preempted) + tuple(self._waiting)

    # ---- internals ------------------------------------------------------------------------------------
    def _admission_order(self) -> Iterator[Sequence]:
        yield from self._preempted
        if self.config.policy == "fcfs":
            yield from self._waiting
            return
        max_wait, now = self.config.max_wait_s, self._clock()
        starving = [s for s in self._waiting if max_wait is not None and now - s.arrival_time >= max_wait]
        yield from starving
        starving_ids = {id(s) for s in starving}
        rest = [s for s in self._waiting if id(s) not in starving_ids]
        yield from sorted(rest, key=lambda s: -s.params.max_new_tokens)  # stable: ties keep arrival order

    def _admit(self) -> list[Sequence]:
        """Pick the sequences of a prefill step, in policy order; stop at the first that does not fit.

        Besides its prompt, each admitted sequence must leave room for the next decode step of itself and
        of the running sequences, so a fresh prefill is not preempted (wasted) right away. A recompute
        longer than ``max_prompt_len`` goes alone (the agents' single long prefill shape).
        """
        cfg, bm = self.config, self.block_manager
        slots = min(cfg.max_prefill_batch, cfg.max_num_seqs - len(self._running))
        budget = cfg.max_num_batched_tokens
        free = bm.num_free_blocks - sum(bm.blocks_needed(s.num_tokens) - len(s.block_table)
                                        for s in self._running)
        long_limit = cfg.max_prompt_len if cfg.max_prompt_len is not None else cfg.max_model_len
        chosen: list[Sequence] = []
        for seq in self._admission_order():
            if len(chosen) >= slots:
                break
            alone = seq.num_tokens > long_limit
            last_fed = seq.num_prompt_tokens + seq.params.max_new_tokens - 1
            need = bm.blocks_needed(min(seq.num_tokens + 1, last_fed))
            if seq.num_tokens > budget or need > free or (alone and chosen):
                break
            budget -= seq.num_tokens
            free -= need
            chosen.append(seq)
            if alone:
                break
        for seq in chosen:
            self._dequeue(seq)
            bm.allocate(seq)
            row = self._row[seq.request_id] = self._free_rows.pop()
            self._tables[row] = DUMMY_BLOCK
            self._tables[row, : len(seq.block_table)] = seq.block_table
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            self._running_sampled += seq.params.needs_logits
            self._running_dumps += seq.logits_tokens > 0
        return chosen

    def _reserve_decode_slots(self) -> list[Sequence]:
        """Give every running sequence a slot for its next token, preempting the newest when blocks run out."""
        bm, scheduled, bs = self.block_manager, [], self.config.block_size
        running = SequenceStatus.RUNNING
        for seq in list(self._running):
            if seq.status is not running:
                continue  # preempted below, to make room for an older sequence
            if len(seq.block_table) * bs >= seq.num_tokens:  # fast path: its next slot is already held
                scheduled.append(seq)
                continue
            while not bm.can_append(seq) and self._running[-1] is not seq:
                self._preempt(self._running[-1])
            if bm.can_append(seq):
                bm.append_slot(seq)  # exactly one new block: the fast path above took the others
                self._tables[self._row[seq.request_id], len(seq.block_table) - 1] = seq.block_table[-1]
                scheduled.append(seq)
            else:  # seq is the newest left: it waits, the older ones (already given slots) go on
                self._preempt(seq)
        if not scheduled:  # add() guarantees that any one sequence fits the whole cache
            raise RuntimeError("KV cache too small for a single running sequence")
        return scheduled

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence off the running list and give back its KV blocks and table row."""
        self._running.remove(seq)
        self._running_sampled -= seq.params.needs_logits
        self._running_dumps -= seq.logits_tokens > 0
        self.block_manager.free(seq)
        self._free_rows.append(self._row.pop(seq.request_id))

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._preempted.appendleft(seq)  # victims go newest-first, so the oldest ends up at the front
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        else:
            self._dequeue(seq)
        seq.finish(reason)
        del self._live[seq.request_id]

    def _dequeue(self, seq: Sequence) -> None:
        (self._preempted if seq.num_preemptions and seq in self._preempted else self._waiting).remove(seq)

    def _build(self, seqs: list[Sequence], prefill: bool) -> StepBatch:
        bs, n = self.config.block_size, len(seqs)
        width = max(len(seq.block_table) for seq in seqs)
        table_rows = np.fromiter((self._row[seq.request_id] for seq in seqs), np.intp, n)
        block_tables = self._tables[table_rows, :width]  # a copy: later steps do not change this batch
        context_lens = np.fromiter((seq.num_tokens for seq in seqs), np.int32, n)
        if prefill:
            ids = np.fromiter((t for seq in seqs for t in seq.all_token_ids), np.int32, int(context_lens.sum()))
            query_lens = context_lens.copy()
            positions = np.concatenate([np.arange(k, dtype=np.int32) for k in context_lens.tolist()])
            rows = np.repeat(np.arange(n), context_lens)
        else:  # one token per sequence: vectorized, this runs every step for the whole decode batch
            ids = np.fromiter((seq.last_token_id for seq in seqs), np.int32, n)
            query_lens = np.ones(n, dtype=np.int32)
            positions = context_lens - 1
            rows = np.arange(n)
        slots = block_tables[rows, positions // bs] * bs + positions % bs
        return StepBatch(
            is_prefill=prefill,
            input_ids=ids,
            positions=positions.astype(np.int32, copy=False),
            slot_mapping=slots.astype(np.int32, copy=False),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            sampling=self._sampling(seqs, prefill),
            want_logits=self._want_logits(seqs),
        )

    def _want_logits(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Which sequences' next-token logits to return: those whose dump still lacks the row of the token this
        step produces; None when none (O(1) while no running sequence dumps)."""
        if not self._running_dumps:
            return None
        want = np.fromiter((seq.num_output_tokens < seq.logits_tokens for seq in seqs), np.bool_, len(seqs))
        return want if want.any() else None

    def _sampling(self, seqs: list[Sequence], prefill: bool) -> SamplingBatch | None:
        """None for an all-greedy step (checked in O(1) for decode); else the per-sequence arrays."""
        if not prefill and not self._running_sampled:
            return None
        if not any(seq.params.needs_logits for seq in seqs):
            return None
        return _sampling_batch(seqs)


def _sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Per-sequence sampling arrays; penalty ids are prompt + generated tokens of penalised sequences only."""
    n, params = len(seqs), [seq.params for seq in seqs]
    penalised = [p.repetition_penalty != 1.0 for p in params]
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
    )
