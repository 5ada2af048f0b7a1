"""Continuous-batching scheduler: picks each model step and applies its result.

Modelled on nano-vllm / vLLM: the scheduler decides *which* sequences run, the KVCacheManager
(``core.kv_cache_manager``) decides *where* their KV lives. A step is ``schedule()``d, run by the model,
``postprocess()``ed (with one more sent ahead of it meanwhile under asynchronous scheduling, below). Each
sequence counts the tokens whose K/V the agents hold (``num_computed_tokens``); a step gives it the next
``num_scheduled_tokens`` of its tokens, and only a step that reaches its last token produces its next one.

Chunked prefill (``chunked_prefill``, as vLLM's and SGLang's schedulers): a step has a token budget
(``max_num_batched_tokens``). It carries the decode token of every running sequence, then the next chunk of the
running sequences still prefilling, then the first chunks of newly admitted ones, as far as the budget goes; a
prompt longer than what is left is prefilled over several steps, each chunk attending to the K/V the earlier
ones wrote. So a long prompt neither waits for a step of its own nor stalls the running streams for a whole
prefill. Without it a step is either a prefill (whole prompts of newly admitted sequences) or a decode.

Prefix caching (``prefix_caching``, ``llm_serving.core.prefix_cache``): a sequence starts on the cached blocks of its
longest cached prefix (computed by any earlier request, or by itself before a preemption) and computes only the
rest. Blocks are registered when the step that completes them comes back; ``requeue_running`` (new agents, an
empty KV cache) forgets them all.

Sampling: all-greedy steps carry no ``SamplingBatch`` (the agents keep the in-graph argmax). A step with a
sampled or penalised sequence carries every sequence's parameters, its seed (fixed at admission, so a
preempted and recomputed sequence draws the same) and its draw index (tokens generated so far).

Logits back: a step marks in ``want_logits`` the sequences still short of their ``logits_tokens`` rows (a logits
dump) and those that report alternatives (``top_logprobs``, computed here from the row: ``core.logprobs``); the
row it returns for a sequence is that of the token the step produces, so a recompute's prefill adds one row, never
the rows of tokens generated before its preemption. Steps where no sequence asks carry None (checked in O(1)
for decode while no running sequence reads logits), and the agents then read no logits back.

Multi-step decoding (``decode_steps`` k > 1, ``_steps_ahead``): while no request waits to be admitted and every running
sequence is greedy with nothing to report between tokens, a decode batch asks the agents for up to k steps at once
(``StepBatch.num_steps``), its blocks reserved for all of them; ``postprocess`` appends the later tokens up to an
end (EOS, a stop id, the limit), discarding the rest. The master's turnaround is then paid once per k tokens.

Asynchronous scheduling (``schedule_ahead``): while a decode step runs (of one step or several), the next one of the
same sequences is scheduled and sent before the step's results are known, its input tokens the agents' own picks
(``StepBatch.fed_rows``), so the agents never wait for the master between steps. Only where nothing can change
between the two steps: nothing waits to be admitted, every running sequence is in the step, greedy without logits to
report, and the next positions' blocks are free; a sequence the step gives its last token is left out. One that ends
otherwise with the step (EOS, a stop string) has its token of the step ahead discarded, its blocks freed as usual.

When a decode step needs a KV block and none is free, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of the queue; its next prefill
covers prompt + generated tokens, so it resumes exactly where it stopped (greedy results do not change).

Prompt buckets: every prompt up to the model length is served. Without chunked prefill, a prompt or recompute
longer than ``max_prompt_len`` (the agents' largest multi-prompt bucket) is prefilled alone, in the agents'
single-sequence shape of up to ``max_model_len`` tokens.

Prefill vs decode interleaving (``min_decode_steps_between_prefills``):
  0 (default, as vLLM): prefill whenever something can be admitted. Best time-to-first-token and fastest
    ramp-up of the decode batch, but every prefill stalls the running streams (inter-token latency spikes
    under a steady stream of arrivals).
  k > 0: at least k decode steps between two prefills while sequences are running. Smoother inter-token
    latency for running streams, at the cost of queueing delay (TTFT) for new requests.
  With chunked prefill the streams are not stalled anyway (a step is bounded by its token budget); k then only
  spaces out the steps that admit new sequences (chunks of admitted ones go on every step).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from llm_serving.core.kv_cache_manager import KVCacheManager
from llm_serving.core.logprobs import prompt_logprob, top_logprobs
from llm_serving.core.sequence import FINISH_REASONS, Sequence, SequenceStatus
from llm_serving.core.speculative import AGENT_METHODS, METHODS, AgentProposer, NgramProposer
from llm_serving.protocol.batch import (
    SamplingBatch,
    SamplingExtras,
    StepBatch,
    StepOutput,
    kv_slots,
    verify_batch,
    verify_round_proposals,
)

POLICIES = ("fcfs", "longest_output_first")
SPEC_PAUSE_STEPS = 8  # decode steps a sequence sits out of speculation after its proposals kept failing
SPEC_PROBE_EVERY = 16  # decode steps of a batch size between two tries of the mode measured slower
SPEC_RATE_WEIGHT = 0.2  # weight of the newest step in a mode's running tokens/s
SPEC_MEAN_WEIGHT = 0.3  # weight of the newest verification in a sequence's running mean of accepted proposals


class RequestRejected(ValueError):
    """A request that can never be served with this configuration (rejected at admission)."""


@dataclass
class SchedulerConfig:
    num_blocks: int  # KV cache blocks on the agents, dummy block 0 included
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 8  # running sequences = largest decode batch
    max_prefill_batch: int = 4  # sequences admitted by one prefill step
    max_num_batched_tokens: int = 2048  # token budget of one step (of one prefill step without chunked prefill)
    max_model_len: int = 2048  # prompt + max_new_tokens limit per request
    eos_token_id: int | None = 2  # None: only max_new_tokens ends a request
    other_eos_token_ids: tuple[int, ...] = ()  # further ids that end a request as eos does (Llama 3's <|eot_id|>)
    policy: str = "fcfs"  # admission order, see POLICIES
    max_wait_s: float | None = 30.0  # longest_output_first: admit requests queued this long first
    min_decode_steps_between_prefills: int = 0  # interleaving knob, see module docstring
    max_prompt_len: int | None = None  # longest prompt prefilled with others (unchunked); None: max_model_len
    chunked_prefill: bool = False  # decode tokens and prompt chunks share steps, see the module docstring
    prefix_caching: bool = False  # reuse the cached KV blocks of a shared prefix
    decode_steps: int = 1  # decode steps one batch may run while nothing waits (``_steps_ahead``)
    async_scheduling: bool = False  # the next plain decode step sent while one runs (``schedule_ahead``)
    speculative: str = ""  # proposer of speculative decoding (``core.speculative.METHODS``); "": none
    num_speculative_tokens: int = 4  # most proposals one sequence has verified in a step
    prompt_lookup_min: int = 1  # n-gram lengths the ngram proposer matches
    prompt_lookup_max: int = 4
    # tokens one verify step carries at most (its sequences' last tokens and proposals): fewer proposals each as the
    # batch grows, none from this many running sequences on (at saturation verifying costs more than it saves)
    speculative_step_tokens: int = 8
    # a sequence whose recent verifications accepted fewer proposals than this on average sits out
    # ``SPEC_PAUSE_STEPS`` decode steps, then tries again (a verify step costs more than a decode step)
    speculative_min_accepted: float = 0.0
    # speculate only at the batch sizes where verify steps measured faster (tokens/s) than plain ones
    speculative_adaptive: bool = False
    speculative_rounds: int = 1  # verify rounds one step may run in the agents while nothing waits (``_rounds``)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_prefill_batch",
                     "max_num_batched_tokens", "max_model_len", "decode_steps", "speculative_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"scheduler config: {name} must be a positive int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(f"scheduler config: num_blocks must be >= 2 (block 0 is reserved), got "
                             f"{self.num_blocks}")
        if self.chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"scheduler config: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence's decode token fits a step"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler config: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): without chunked prefill a preempted sequence is "
                "recomputed in one prefill"
            )
        if self.speculative not in METHODS:
            raise ValueError(f"scheduler config: speculative must be one of {METHODS}, got {self.speculative!r}")
        if self.speculative and self.decode_steps > 1:
            raise ValueError("scheduler config: speculative decoding and decode_steps > 1 both run several tokens per "
                             "step; choose one")
        if self.speculative and self.async_scheduling:
            raise ValueError("scheduler config: speculative decoding proposes tokens between steps, which a step sent "
                             "ahead cannot wait for; choose one")
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
        self._eos_ids = {config.eos_token_id, *config.other_eos_token_ids} - {None}  # ids that end a request
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size, config.max_num_seqs, config.max_model_len,
                                       config.prefix_caching)
        self._clock = clock
        self._waiting: deque[Sequence] = deque()  # new requests, arrival order
        self._preempted: deque[Sequence] = deque()  # re-admitted before any new request
        self._running: list[Sequence] = []  # admission order; the last one is preempted first
        self._live: dict[str, Sequence] = {}
        self._decodes_since_prefill = 0
        self.num_preemptions = 0
        self._running_sampled = 0  # running sequences whose params need logits; 0 keeps decode on the fast path
        self._running_dumps = 0  # running sequences that read logits back; 0: no step asks for logits
        self._proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                          if config.speculative == "ngram" else AgentProposer()
                          if config.speculative in AGENT_METHODS else None)
        # speculative decoding: verify steps, sequences' drafts verified, proposals sent and accepted (engine metrics)
        self.spec_steps = self.spec_drafts = self.spec_proposed = self.spec_accepted = 0
        self._verifying: dict[str, int] = {}  # the step in flight's proposals per request (a verify step's)
        # measured choice (``note_step_time``): running tokens/s of decode steps by (batch size class, speculated),
        # the decode steps seen per class, and what the last step was (class, speculated, tokens appended)
        self._spec_rates: dict[tuple[int, bool], float] = {}
        self._spec_turns: dict[int, int] = {}
        self._last_decode: tuple[int, bool, int] | None = None
        self._scheduled_decode = False  # the step last scheduled is a decode (or verify) step

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, seq: Sequence, follows: str | None = None) -> None:
        """Queue a new request admitted against the served limits (``llm_serving.engine.admission``: prompt length,
        context, vocabulary); raises RequestRejected for what only the scheduler knows (a duplicate id, a KV
        cache too small for the request) and ValueError for a request that skipped admission.

        ``follows``: the id of another choice of the same prompt (OpenAI's ``n``). With prefix caching this one
        waits until that choice has computed the prompt, then starts on its cached blocks and computes only the
        prompt's last partial block: the choices share the prompt's KV blocks (reference-counted, each writing
        its own from the first block they may differ in, as copy-on-write would)."""
        cfg, rid = self.config, seq.request_id
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.output_ids:
            raise ValueError(f"request {rid!r}: only a fresh waiting sequence can be added, got {seq!r}")
        if seq.params.prompt_logprobs is not None and not cfg.chunked_prefill:
            raise RequestRejected(f"request {rid!r}: scoring the prompt (prompt logprobs) needs chunked prefill "
                                  "(scheduler.enable_chunked_prefill), which computes it a token a step")
        if rid in self._live:
            raise RequestRejected(f"request {rid!r}: a request with this id is already in progress")
        total = seq.num_prompt_tokens + seq.params.max_new_tokens
        if seq.num_prompt_tokens < 1 or total > cfg.max_model_len or (total < 2 and not seq.params.max_new_tokens):
            raise ValueError(f"request {rid!r} was not admitted: {seq.num_prompt_tokens} prompt tokens, "
                             f"{total} in all (admission refuses this)")
        need = self.kv_cache.blocks_needed(total - 1)  # the last generated token is never fed back
        if need > self.kv_cache.num_usable_blocks:
            raise RequestRejected(
                f"request {rid!r}: needs up to {need} KV blocks of {cfg.block_size} tokens, but the KV cache "
                f"has only {self.kv_cache.num_usable_blocks}"
            )
        if seq.arrival_time is None:
            seq.arrival_time = self._clock()
        if seq.seed is None:  # fixed now, so preemption and recompute never change the request's draws
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(64)
            seq.seed = (seed + 2**63) % 2**64 - 2**63  # as int64: the agents' RNG reads it modulo 2**64
        leader = self._live.get(follows) if follows is not None else None
        if leader is not None and leader.prompt_ids == seq.prompt_ids:
            seq.follows = leader
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
        """Preempt every running sequence (by recompute) and return them: replaced agents hold no KV cache, so
        the prefix cache is emptied too."""
        victims = list(reversed(self._running))  # newest first, so the oldest ends up at the front
        for seq in victims:
            self._preempt(seq)
        self.kv_cache.reset_prefix_cache()
        return victims

    # ---- stepping -------------------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], StepBatch] | None:
        """The next step (its sequences in batch order and its batch), or None when there is nothing to run."""
        cfg = self.config
        admit = (self._waiting or self._preempted) and (
            not self._running or self._decodes_since_prefill >= cfg.min_decode_steps_between_prefills)
        if cfg.chunked_prefill:  # decode tokens and chunks of the running, then new sequences' chunks
            seqs, budget, chunks = self._reserve_running(cfg.max_num_batched_tokens)
            admitted = self._admit(budget, chunks) if admit else []
            seqs += admitted
            prefill = bool(chunks or admitted)
        else:  # a prefill of whole prompts, else a decode of every running sequence
            seqs = admitted = self._admit(cfg.max_num_batched_tokens, 0) if admit else []
            prefill = bool(seqs)
            if not seqs and self._running:
                seqs = self._reserve_running(0)[0]
        if not seqs:
            return None
        self._decodes_since_prefill = 0 if admitted else self._decodes_since_prefill + 1
        steps = 1 if prefill else self._steps_ahead(seqs)
        self._scheduled_decode = not prefill
        drafts = self._propose(seqs) if not prefill and self._proposer is not None else None
        if drafts is not None:  # several rounds go on in the agents even when this one has no proposals
            rounds = self._rounds(seqs)
            if rounds > 1 or any(drafts):
                return seqs, self._build_verify(seqs, drafts, rounds)
        batch = self._build(seqs, prefill)
        batch.num_steps = steps
        return seqs, batch

    def schedule_ahead(self, seqs: list[Sequence], batch: StepBatch) -> tuple[list[Sequence], StepBatch] | None:
        """The decode step after ``batch`` (sent, not yet postprocessed) for those of its ``seqs`` that ``batch``
        does not give their last token, fed the agents' picks of ``batch`` (module docstring); None when the next
        step must wait for ``batch``'s results."""
        if (not self.config.async_scheduling or batch.is_prefill or self._proposer is not None
                or self._master_needed_between_tokens() or len(seqs) != len(self._running)):
            return None
        running, given = SequenceStatus.RUNNING, batch.num_steps  # the tokens ``batch`` gives each sequence
        if any(seq.status is not running for seq in seqs):
            return None  # ended while ``batch`` was in flight (an abort, a stop string)
        rows = [row for row, seq in enumerate(seqs) if seq.params.max_new_tokens - len(seq.output_ids) > given]
        nxt = [seqs[row] for row in rows]
        if not self._grow_free(nxt, given):  # its input: the position after the last token ``batch`` gives
            return None
        if not nxt:
            return None
        self._decodes_since_prefill += 1
        steps = self._steps_ahead(nxt, given)  # its blocks grown before the batch copies the block tables
        ahead = self._build(nxt, prefill=False, ahead=given)
        ahead.num_steps, ahead.fed_rows = steps, np.array(rows, np.int32)
        return nxt, ahead

    def postprocess(self, seqs: list[Sequence], output: StepOutput) -> list[Sequence]:
        """Append each sequence's new token; return the sequences that finished with this step."""
        tokens, logprobs = np.asarray(output.token_ids), np.asarray(output.logprobs)
        if tokens.shape != (len(seqs),) or logprobs.shape != (len(seqs),):
            raise ValueError(
                f"step output has token_ids {tokens.shape} and logprobs {logprobs.shape} for {len(seqs)} sequences"
            )
        caching = self.kv_cache.prefix_caching
        more, more_logprobs = output.more_token_ids, output.more_logprobs
        decode = self._proposer is not None and self._scheduled_decode
        generated = sum(len(seq.output_ids) for seq in seqs) if decode else 0
        finished = []
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step was in flight
            n = seq.num_scheduled_tokens
            scoring = seq.scores_prompt
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and (n > 1 or not seq.output_ids):  # prompt blocks now (decoded ones when it ends)
                self.kv_cache.cache_computed(seq)
            if scoring and len(seq.prompt_scores) == computed - 1:  # this step's row: prompt token ``computed``'s
                seq.prompt_scores.append(prompt_logprob(self._logits_row(output, row, seq),
                                                        seq.prompt_ids[computed], seq.params.prompt_logprobs))
            if seq.params.max_new_tokens == 0 and not seq.scores_prompt:  # the prompt scored, nothing to generate
                self._finish(seq, "length")
                finished.append(seq)
                continue
            if computed < len(seq.prompt_ids) + len(seq.output_ids):
                continue  # a prompt chunk short of its end: the token it gives is not the sequence's next
            if seq.wants_logits_row():  # the step asked for this row (``_want_logits``)
                logits = self._logits_row(output, row, seq)
                if seq.num_output_tokens < seq.logits_tokens:
                    seq.logits.append(logits)
                if seq.params.top_logprobs:
                    seq.output_top.append(top_logprobs(logits, seq.params.top_logprobs))
            reason = self._append(seq, token, logprob)
            if reason is None and more is not None:  # later tokens (multi-step, accepted proposals), up to an end
                count = more.shape[1] if output.num_more is None else int(output.num_more[row])
                for later, later_logprob in zip(more[row, :count].tolist(), more_logprobs[row, :count].tolist()):
                    seq.num_computed_tokens += 1
                    reason = self._append(seq, later, later_logprob)
                    if reason is not None:
                        break
            if output.num_more is not None:
                self._count_verified(seq, row, output)
            if reason is None:
                if output.num_more is not None:  # blocks grown for rejected proposals go back
                    self.kv_cache.trim(seq, seq.num_tokens)
                continue
            self._finish(seq, reason)
            finished.append(seq)
        if decode:
            self._note_decode(seqs, generated, output.num_more is not None)
        return finished

    def _note_decode(self, seqs: list[Sequence], generated_before: int, speculated: bool) -> None:
        """Remember a decode step's batch size class and tokens for ``note_step_time``."""
        tokens = sum(len(seq.output_ids) for seq in seqs) - generated_before
        self._last_decode = (len(seqs).bit_length(), speculated, tokens)

    def _append(self, seq: Sequence, token: int, logprob: float) -> str | None:
        """Append a generated token; the finish reason it brings, if any."""
        seq.append_token(token, logprob)
        complete = seq.constraint is not None and seq.constraint.advance(token)
        if token in self._eos_ids and not seq.params.ignore_eos:
            return "eos"
        if token in seq.params.stop_token_ids or complete:  # a stop id, or the whole structured answer
            return "stop"
        if seq.num_output_tokens >= seq.params.max_new_tokens:
            return "length"
        return None

    @staticmethod
    def _logits_row(output: StepOutput, row: int, seq: Sequence) -> np.ndarray:
        if row not in output.logits:
            raise ValueError(f"step output has no logits for row {row} ({seq.request_id!r}), which want_logits "
                             "asked for")
        return output.logits[row]

    # ---- introspection --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv_cache.num_used_blocks

    @property
    def block_usage(self) -> float:
        return self.kv_cache.usage

    def prefix_cache_stats(self) -> dict[str, int]:
        """``KVCacheManager.prefix_cache_stats``."""
        return self.kv_cache.prefix_cache_stats()

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
        # a choice following another of its prompt waits for that one's cached prompt blocks
        waiting = [s for s in self._waiting if not s.waits_for_leader] if self.config.prefix_caching else self._waiting
        if self.config.policy == "fcfs":
            yield from waiting
            return
        max_wait, now = self.config.max_wait_s, self._clock()
        starving = [s for s in waiting if max_wait is not None and now - s.arrival_time >= max_wait]
        yield from starving
        starving_ids = {id(s) for s in starving}
        rest = [s for s in waiting if id(s) not in starving_ids]
        yield from sorted(rest, key=lambda s: -s.params.max_new_tokens)  # stable: ties keep arrival order

    def _admit(self, budget: int, chunks: int) -> list[Sequence]:
        """Start waiting sequences, in policy order, on the blocks of their longest cached prefix and new blocks for
        their first chunk (all their tokens without chunked prefill) out of ``budget`` tokens, ``chunks`` prompt
        chunks being in the step already; stop at the first that does not fit.

        Besides its chunk, each must leave room for the running sequences' next decode step, so a fresh prefill
        is not preempted (wasted) right away. Without chunked prefill a sequence of more than ``max_prompt_len``
        tokens to compute goes alone (the agents' single long prefill shape).
        """
        cfg, kv, bs = self.config, self.kv_cache, self.config.block_size
        slots = min(cfg.max_prefill_batch - chunks, cfg.max_num_seqs - len(self._running))
        ahead = int(cfg.chunked_prefill)  # the running already hold this step's slots: room for the next one
        free = kv.num_free_blocks - sum(kv.missing_blocks(s, s.num_tokens + ahead)
                                        for s in self._running if not s.is_prefilling)
        long_limit = cfg.max_prompt_len if cfg.max_prompt_len is not None else cfg.max_model_len
        chosen: list[Sequence] = []
        for seq in list(islice(self._admission_order(), max(slots, 0))):  # a copy: _start dequeues
            if budget < 1:
                break
            scoring = seq.scores_prompt  # a token a step, each position computed here (its logits are wanted)
            hit = [] if scoring else kv.computed_prefix(seq)
            start = len(hit) * bs
            n = min(seq.num_tokens - start, budget) if cfg.chunked_prefill else seq.num_tokens - start
            n = min(n, 1) if scoring else n
            alone = not cfg.chunked_prefill and n > long_limit
            end, last_fed = start + n, seq.num_prompt_tokens + seq.params.max_new_tokens - 1
            need = kv.blocks_to_start(hit, min(end + 1, last_fed) if end == seq.num_tokens else end)
            if n > budget or need > free or (alone and chosen):
                break
            self._start(seq, hit, n)
            budget -= n
            free -= need
            chosen.append(seq)
            if alone:
                break
        return chosen

    def _start(self, seq: Sequence, hit: list[int], n: int) -> None:
        """Make a waiting sequence running on the cached blocks ``hit``, with blocks for its first ``n`` new
        tokens scheduled."""
        self._dequeue(seq)
        seq.follows = None  # started: it no longer waits (nor keeps the other choice alive)
        seq.num_computed_tokens = len(hit) * self.config.block_size
        seq.num_scheduled_tokens = n
        self.kv_cache.start(seq, hit, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)
        self._running_sampled += seq.params.needs_logits
        self._running_dumps += seq.reads_logits

    def _reserve_running(self, budget: int) -> tuple[list[Sequence], int, int]:
        """Give every running sequence, oldest first, its slots for this step: its decode token, or while it is
        still prefilling its next chunk out of what ``budget`` leaves after the decode tokens (at most
        ``max_prefill_batch`` chunks; the rest wait). When blocks run out the newest running sequence is
        preempted. Returns the sequences scheduled, the budget left and the number of chunks."""
        scheduled, bs, chunks, decodes = [], self.config.block_size, 0, 0
        running, max_chunks = SequenceStatus.RUNNING, self.config.max_prefill_batch
        left = None  # the chunks' budget, counted when a chunk first needs it (never in a decode-only step)
        for seq in list(self._running):
            if seq.status is not running:
                continue  # preempted below, to make room for an older sequence
            computed = seq.num_computed_tokens  # ``Sequence.is_prefilling`` inline: this runs for every
            todo = len(seq.prompt_ids) + len(seq.output_ids) - computed  # running sequence at every step
            if todo == 1 and computed:  # decoding
                if len(seq.block_table) * bs > computed or self._grow(seq, computed + 1):
                    seq.num_scheduled_tokens = 1
                    scheduled.append(seq)
                    decodes += 1
                continue  # else it was the newest left and waits; the older ones (already given slots) go on
            if left is None:
                left = budget - sum(1 for s in self._running
                                    if 0 < s.num_computed_tokens == len(s.prompt_ids) + len(s.output_ids) - 1)
            if left < 1 or chunks >= max_chunks:
                continue  # its next chunk waits for a later step
            n = 1 if seq.scores_prompt else min(todo, left)
            if len(seq.block_table) * bs < computed + n and not self._grow(seq, computed + n):
                continue
            left, chunks = left - n, chunks + 1
            seq.num_scheduled_tokens = n
            scheduled.append(seq)
        if not scheduled and self._running:  # add() guarantees that any one sequence fits the whole cache
            raise RuntimeError("KV cache too small for a single running sequence")
        return scheduled, budget - decodes if left is None else left, chunks

    def _master_needed_between_tokens(self) -> bool:
        """Whether the next step must wait for the master (multi-step and steps sent ahead cannot): a request
        waits to be admitted, or a running sequence samples, is penalised or masked, or reports logits."""
        return bool(self._waiting or self._preempted or self._running_sampled or self._running_dumps)

    def _steps_ahead(self, seqs: list[Sequence], in_flight: int = 0) -> int:
        """Decode steps this decode batch runs at once (multi-step decoding): up to ``decode_steps`` while no
        request waits to be admitted and every running sequence is greedy without logits to report (sampling,
        penalties and masks need the master between tokens), no more than any sequence may still generate, and
        only with the blocks of every position free now (it never preempts for them). ``in_flight``: the tokens
        the step before still gives each sequence (a batch sent ahead of it, ``schedule_ahead``)."""
        k = self.config.decode_steps
        if k == 1 or self._master_needed_between_tokens():
            return 1
        k = min(k, min(seq.params.max_new_tokens - len(seq.output_ids) - in_flight for seq in seqs))
        if k == 1:
            return 1
        # the inputs of steps 2..k sit at the positions after each sequence's last token
        return k if self._grow_free(seqs, in_flight + k - 1) else 1

    def _grow_free(self, seqs: list[Sequence], extra: int) -> bool:
        """Grow each sequence's blocks to ``num_tokens + extra`` tokens from the free ones, never
        preempting; False at the first that cannot (the blocks grown so far stay: the next tokens need them,
        or ``kv_cache.trim`` takes back a verify step's)."""
        kv = self.kv_cache
        return all(kv.allocate_slots(seq, seq.num_tokens + extra) for seq in seqs)

    def _propose(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Speculative decoding: each sequence's proposals (``core.speculative``) for a verify step, while nothing
        waits to be admitted and no running sequence reports logits; for the sequences whose sampling allows it
        (``SamplingParams.speculable``: greedy, or plain sampling checked by rejection on the agents), fewer than
        it may still generate and within the blocks that are free now (never preempting for them), possibly all
        empty; None when the step does not speculate. The step's tokens stay within ``speculative_step_tokens``."""
        if self._waiting or self._preempted or self._running_dumps:
            return None
        cfg = self.config
        k = verify_round_proposals(cfg.num_speculative_tokens, cfg.speculative_step_tokens, len(seqs))
        if k < 1 or (cfg.speculative_adaptive and not self._speculation_pays(len(seqs))):
            return None
        kv, drafts = self.kv_cache, []
        for seq in seqs:
            room = min(k, seq.params.max_new_tokens - len(seq.output_ids) - 1)  # the last pick is a token too
            if seq.spec_pause:  # its proposals kept failing: plain decode steps for a while
                seq.spec_pause -= 1
                room = 0
            room = room if seq.params.speculable else 0
            proposal = self._proposer.propose(seq.prompt_ids + seq.output_ids, room) if room > 0 else []
            while proposal and not kv.allocate_slots(seq, seq.num_tokens + len(proposal)):
                proposal.pop()
            drafts.append(proposal)
        return drafts

    def _rounds(self, seqs: list[Sequence]) -> int:
        """Verify rounds this verify step runs in the agents (``agents.runtime.verify_rounds``): up to
        ``speculative_rounds`` while the master is not needed between tokens (as multi-step decoding:
        ``_master_needed_between_tokens``), no more than any sequence may still generate at ``k + 1`` tokens a
        round, and only with the blocks of all those positions free now (never preempting for them)."""
        cfg = self.config
        if cfg.speculative_rounds == 1 or self._master_needed_between_tokens():
            return 1
        per_round = verify_round_proposals(cfg.num_speculative_tokens, cfg.speculative_step_tokens, len(seqs)) + 1
        rounds = min(cfg.speculative_rounds,
                     min(seq.params.max_new_tokens - len(seq.output_ids) for seq in seqs) // per_round)
        # the last round's proposals reach the position before the step's last token at most
        return rounds if rounds > 1 and self._grow_free(seqs, rounds * per_round - 1) else 1

    def _speculation_pays(self, batch_size: int) -> bool:
        """Whether this decode step of ``batch_size`` sequences speculates: by the tokens/s measured for both
        modes at this batch size (its power-of-two class), trying each mode first and the slower one again every
        ``SPEC_PROBE_EVERY`` steps (costs change with the contexts and the acceptance)."""
        size = batch_size.bit_length()
        turn = self._spec_turns[size] = self._spec_turns.get(size, 0) + 1
        spec, plain = self._spec_rates.get((size, True)), self._spec_rates.get((size, False))
        if spec is None or plain is None:
            return spec is None  # measure speculation first, then plain steps
        faster = spec >= plain
        return faster != (turn % SPEC_PROBE_EVERY == 0)

    def note_step_time(self, seconds: float) -> None:
        """The wall time of the step ``postprocess`` last applied (the engine measures it): a decode step's tokens/s
        feed the measured choice of ``_speculation_pays``."""
        if self._last_decode is None or seconds <= 0:
            return
        size, speculated, tokens = self._last_decode
        self._last_decode = None
        rate, key = tokens / seconds, (size, speculated)
        old = self._spec_rates.get(key)
        self._spec_rates[key] = rate if old is None else (1 - SPEC_RATE_WEIGHT) * old + SPEC_RATE_WEIGHT * rate

    def _count_verified(self, seq: Sequence, row: int, output: StepOutput) -> None:
        """Count a verify step's drafts, proposals and accepted proposals of ``seq`` (those of every round: the
        agents' ``spec_counts``; the first round's proposals were counted when the step was built)."""
        first = self._verifying.get(seq.request_id, 0)
        if output.spec_counts is None:
            drafts, accepted = int(first > 0), int(output.num_more[row])
        else:
            drafts, proposed, accepted = output.spec_counts[row].tolist()
            self.spec_drafts += drafts - (first > 0)
            self.spec_proposed += proposed - first
        if drafts:
            self._note_acceptance(seq, accepted, drafts)

    def _note_acceptance(self, seq: Sequence, accepted: int, drafts: int = 1) -> None:
        """Count ``accepted`` proposals of ``drafts`` verified drafts; pause the proposals while they keep failing."""
        self.spec_accepted += accepted
        mean, now = seq.spec_accepted_mean, accepted / drafts
        mean = now if mean == float("inf") else (1 - SPEC_MEAN_WEIGHT) * mean + SPEC_MEAN_WEIGHT * now
        if mean < self.config.speculative_min_accepted:
            seq.spec_pause, mean = SPEC_PAUSE_STEPS, float("inf")  # then a fresh start
        seq.spec_accepted_mean = mean

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens, preempting the newest running sequences (never one
        scheduled in this step: those are older) as needed; False when ``seq`` itself had to be preempted."""
        while not self.kv_cache.allocate_slots(seq, num_tokens):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence off the running list and give back its KV blocks."""
        self._running.remove(seq)
        self._running_sampled -= seq.params.needs_logits
        self._running_dumps -= seq.reads_logits
        self.kv_cache.free(seq)  # its computed blocks stay cached: a recompute or a follow-up hits them
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0

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

    def _build(self, seqs: list[Sequence], prefill: bool, ahead: int = 0) -> StepBatch:
        """``ahead``: the decode step after one in flight that gives each sequence that many tokens
        (``schedule_ahead``): that many positions further, its input ids placeholders."""
        bs, n = self.config.block_size, len(seqs)
        block_tables = self.kv_cache.block_tables(seqs)  # a copy: later steps do not change this batch
        if prefill:  # each sequence's scheduled tokens after its computed ones: chunks, decode tokens
            starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, n)
            query_lens = np.fromiter((seq.num_scheduled_tokens for seq in seqs), np.int32, n)
            context_lens = starts + query_lens
            total = int(query_lens.sum())
            ids = np.fromiter(chain.from_iterable(seq.token_ids(a, b) for seq, a, b in
                                                  zip(seqs, starts.tolist(), context_lens.tolist())), np.int32, total)
            rows = np.repeat(np.arange(n), query_lens)
            positions = np.arange(total, dtype=np.int32) - (np.cumsum(query_lens) - context_lens)[rows]
        else:  # one token per sequence: vectorized, this runs every step for the whole decode batch
            context_lens = np.fromiter((seq.num_tokens + ahead for seq in seqs), np.int32, n)
            ids = np.zeros(n, np.int32) if ahead else np.fromiter((seq.last_token_id for seq in seqs), np.int32, n)
            query_lens = np.ones(n, dtype=np.int32)
            positions = context_lens - 1
            rows = np.arange(n)
        slots = kv_slots(block_tables, rows, positions, bs)
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

    def _build_verify(self, seqs: list[Sequence], drafts: list[list[int]], rounds: int = 1) -> StepBatch:
        """A step of each sequence's last token followed by its proposals, over its cached context; of ``rounds``
        verify rounds (with each sequence's tokens for the agents' prompt lookup)."""
        n = len(seqs)
        lens = np.fromiter((seq.num_tokens for seq in seqs), np.int32, n)
        batch = verify_batch((seq.last_token_id for seq in seqs), drafts, lens,
                             self.kv_cache.block_tables(seqs), self.config.block_size)
        batch.sampling, batch.num_steps = self._sampling(seqs, True), rounds
        draft_lens = batch.draft_lens
        self.spec_steps += 1
        self._verifying = {seq.request_id: len(d) for seq, d in zip(seqs, drafts)}
        self.spec_drafts += int(np.count_nonzero(draft_lens))
        self.spec_proposed += int(draft_lens.sum())
        if rounds > 1 and isinstance(self._proposer, NgramProposer):
            batch.history_offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            batch.history_ids = np.fromiter(chain.from_iterable(seq.prompt_ids + seq.output_ids for seq in seqs),
                                            np.int32, int(lens.sum()))
        return batch

    def _want_logits(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Which sequences' logits rows to return (``Sequence.wants_logits_row``: a dump short of this step's row,
        alternatives to report, a prompt position to score); None when none (O(1) while no running sequence
        reads logits)."""
        if not self._running_dumps:
            return None
        want = np.fromiter((seq.wants_logits_row() for seq in seqs), np.bool_, len(seqs))
        return want if want.any() else None

    def _sampling(self, seqs: list[Sequence], prefill: bool) -> SamplingBatch | None:
        """None for an all-greedy step (checked in O(1) for decode); else the per-sequence arrays."""
        if not prefill and not self._running_sampled:
            return None
        if not any(seq.params.needs_logits for seq in seqs):
            return None
        return _sampling_batch(seqs, self._eos_ids)


def _sampling_batch(seqs: list[Sequence], eos_ids: set[int]) -> SamplingBatch:
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
        extras=_extras(seqs, eos_ids) if any(p.uses_extras for p in params) else None,
    )


def _extras(seqs: list[Sequence], eos_ids: set[int]) -> SamplingExtras:
    """The rarer controls: presence/frequency penalties over the generated ids (which start after the prompt among
    the penalty ids), min_p, each sequence's logit adjustments (its logit_bias; while it is short of min_tokens,
    -inf on the ids that would end it), and the token masks of the sequences held to a grammar."""
    n, params = len(seqs), [seq.params for seq in seqs]
    adjustments = []
    for seq, p in zip(seqs, params):
        entries = dict(p.logit_bias)
        if seq.num_output_tokens < p.min_tokens:
            ends = (set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids)
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
        adjust_values=np.fromiter(chain.from_iterable(a.values() for a in adjustments), np.float32, int(offsets[-1])),
        token_masks=_token_masks(seqs),
    )


def _token_masks(seqs: list[Sequence]) -> np.ndarray | None:
    """Each constrained sequence's allowed next tokens (``grammar.TokenMatcher.fill_mask``), the others' rows all
    ones; None when no sequence is constrained."""
    constrained = [(i, seq.constraint) for i, seq in enumerate(seqs) if seq.constraint is not None]
    if not constrained:
        return None
    masks = np.full((len(seqs), constrained[0][1].mask_words), -1, np.int32)
    for i, matcher in constrained:
        matcher.fill_mask(masks[i])
    return masks
