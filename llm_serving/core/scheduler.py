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

The step's batch is written by ``core.step_builder`` (tokens, slots, sampling arrays).

Logits back: a step marks in ``want_logits`` the sequences still short of their ``logits_tokens`` rows (a logits
dump) and those that report alternatives (``top_logprobs``, computed from the row: ``core.output_rows``); the
row it returns for a sequence is that of the token the step produces, so a recompute's prefill adds one row, never
the rows of tokens generated before its preemption. Steps where no sequence asks carry None (checked in O(1)
for decode while no running sequence reads logits), and the agents then read no logits back.

Multi-step decoding (``decode_steps`` k > 1, ``_steps_ahead``): while no request waits to be admitted and every running
sequence is greedy with nothing to report between tokens, a decode batch asks the agents for up to k steps at once
(``StepBatch.num_steps``), its blocks reserved for all of them; ``postprocess`` appends the later tokens up to an
end (EOS, a stop id, the limit), discarding the rest. The master's turnaround is then paid once per k tokens.

Asynchronous scheduling (``schedule_ahead``): while a step runs whose every row reaches its sequence's end (a decode
step of one step or several, or a prefill or mixed step whose chunks all end their prompts), the next step of the
same sequences is scheduled and sent before the step's results are known, their input tokens the agents' own picks
(``StepBatch.fed_rows``), so the agents never wait for the master between steps. With chunked prefill that step ahead
also admits waiting requests, their first chunks after the fed rows (a mixed step; vLLM v1 admits in its step ahead
too), so a steady stream of arrivals keeps the pipeline full. Only where nothing can change between the two steps:
every running sequence is in the step, greedy without logits to report, and the next positions' blocks are free
(admission never preempts); a sequence the step gives its last token is left out. Without chunked prefill, or when
none of the waiting fits, a waiting request makes the master wait for the step's results. A sequence that ends
otherwise with the step (EOS, a stop string, an abort) has its token of the step ahead discarded, its blocks freed
as usual.

When a decode step needs a KV block and none is free, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of the queue; its next prefill
covers prompt + generated tokens, so it resumes exactly where it stopped (greedy results do not change).

Priority (policy "priority", vLLM's): the queue is admitted by each request's ``params.priority`` (lower first), then
arrival, preempted ones among the rest; the running list is kept in that order (admission order within a priority),
so a step's slots go to the highest priority first and the preempted one is the lowest priority, latest admitted.
A higher priority request that arrives while the cache is full waits for blocks, as in vLLM (SGLang's threshold
preemption of running requests to admit it is not done).

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

import bisect
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

import numpy as np

from llm_serving.core.adapters import AdapterSlots
from llm_serving.core.kv_cache_manager import KVCacheManager
from llm_serving.core.output_rows import OutputRows
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import FINISH_REASONS, Sequence, SequenceStatus
from llm_serving.core.speculation import Speculation
from llm_serving.core.step_builder import StepBuilder
from llm_serving.protocol.arrays import Int32s
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.request_errors import RequestRejected


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        # ids that end a request
        self._eos_ids = {t for t in (config.eos_token_id, *config.other_eos_token_ids) if t is not None}
        self._builder = StepBuilder(config.block_size, self._eos_ids)
        self._outputs = OutputRows(self._eos_ids)
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size, config.max_num_seqs, config.max_model_len,
                                       config.prefix_caching)
        self._clock = clock
        self._waiting: deque[Sequence] = deque()  # new requests, arrival order
        self._preempted: deque[Sequence] = deque()  # re-admitted before any new request
        self._running: list[Sequence] = []  # admission order (by priority first under "priority"); the last one
        # is preempted first
        self._live: dict[str, Sequence] = {}
        self._decodes_since_prefill = 0
        self.num_preemptions = 0
        # sequences started from the queue (a preempted one each time it restarts), and their budgets (prompt +
        # max_new_tokens) in all: how fast the queue drains (``engine.queue_wait``)
        self.num_started = 0
        self.started_tokens = 0
        self._running_sampled = 0  # running sequences whose params need logits; 0 keeps decode on the fast path
        self._running_dumps = 0  # running sequences that read logits back; 0: no step asks for logits
        # speculative decoding's policy and counts (None: plain decode steps only)
        self.speculation = Speculation(config) if config.speculative else None
        # the step last scheduled gives every sequence its next token (a decode or verify step: no prompt chunks),
        # as the steps sent ahead of it do
        self._scheduled_decode = False
        # LoRA adapters (``core.adapters``): the agents' slots, and the running sequences with an adapter
        self.adapters = AdapterSlots(config.max_loras) if config.max_loras else None
        self._running_adapted = 0

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
        if seq.adapter is not None and self.adapters is None:
            raise ValueError(f"request {rid!r} names adapter {seq.adapter.name!r}, but no adapter slots are served")
        if seq.arrival_time is None:
            seq.arrival_time = self._clock()
        if seq.seed is None:  # fixed now, so preemption and recompute never change the request's draws
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(64)
            seq.seed = (seed + 2**63) % 2**64 - 2**63  # as int64: the agents' RNG reads it modulo 2**64
        leader = self._live.get(follows) if follows is not None else None
        if leader is not None and leader.prompt_ids == seq.prompt_ids and leader.adapter is seq.adapter:
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
        if self.adapters is not None:  # the new agents' slots are empty
            self.adapters.reset()
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
        spec = self.speculation
        plan = None if prefill or spec is None else spec.plan(
            seqs, waiting=bool(self._waiting or self._preempted), reads_logits=bool(self._running_dumps),
            master_needed=self._master_needed_between_tokens(), reserve=self._grow_free)
        if spec is not None and plan is not None:
            batch = self._builder.verify_step(seqs, plan.drafts, self.kv_cache.block_tables(seqs), plan.rounds,
                                              plan.round_proposals, with_history=spec.wants_history(plan.rounds))
            spec.sent(seqs, batch)
            return seqs, batch
        return seqs, self._build(seqs, prefill, num_steps=steps)

    def schedule_ahead(self, seqs: list[Sequence], batch: StepBatch) -> tuple[list[Sequence], StepBatch] | None:
        """The step after ``batch`` (sent, not yet postprocessed) for those of its ``seqs`` that ``batch`` does not
        give their last token, fed the agents' picks of ``batch``, with chunked prefill followed by the first chunks
        of the requests it admits (module docstring); None when the next step must wait for ``batch``'s results."""
        cfg = self.config
        if (not cfg.async_scheduling or self.speculation is not None or self._running_sampled
                or self._running_dumps or len(seqs) != len(self._running)):
            return None
        running, given = SequenceStatus.RUNNING, batch.num_steps  # the tokens ``batch`` gives each sequence
        if any(seq.status is not running or seq.num_computed_tokens + seq.num_scheduled_tokens != seq.num_tokens
               for seq in seqs):
            return None  # ended while ``batch`` was in flight (an abort, a stop string), or a chunk short of its end
        waiting = bool(self._waiting or self._preempted)
        if waiting and (not cfg.chunked_prefill
                        or self._decodes_since_prefill < cfg.min_decode_steps_between_prefills):
            return None  # whole prompts go in a prefill step of the master's
        rows = [row for row, seq in enumerate(seqs) if seq.params.max_new_tokens - len(seq.output_ids) > given]
        nxt = [seqs[row] for row in rows]
        if not self._grow_free(nxt, given):  # its input: the position after the last token ``batch`` gives
            return None
        admitted = self._admit(cfg.max_num_batched_tokens - len(nxt), 0, in_flight=given) if waiting else []
        if waiting and not admitted or not nxt and not admitted:
            return None  # the queue waits for ``batch``'s results (blocks, preemption), or nothing to run
        self._decodes_since_prefill = 0 if admitted else self._decodes_since_prefill + 1
        fed = np.array(rows + [-1] * len(admitted), np.int32)
        if admitted:  # decode rows and prompt chunks: a mixed step of one step
            return nxt + admitted, self._build(nxt + admitted, prefill=True, ahead=given, fed_rows=fed)
        steps = self._steps_ahead(nxt, given)  # its blocks grown before the batch copies the block tables
        return nxt, self._build(nxt, prefill=False, ahead=given, num_steps=steps, fed_rows=fed)

    def postprocess(self, seqs: list[Sequence], output: StepOutput) -> list[Sequence]:
        """Append each sequence's new token; return the sequences that finished with this step."""
        tokens, logprobs = np.asarray(output.token_ids), np.asarray(output.logprobs)
        if tokens.shape != (len(seqs),) or logprobs.shape != (len(seqs),):
            raise ValueError(
                f"step output has token_ids {tokens.shape} and logprobs {logprobs.shape} for {len(seqs)} sequences"
            )
        caching = self.kv_cache.prefix_caching
        spec = self.speculation if self._scheduled_decode else None
        generated = sum(len(seq.output_ids) for seq in seqs) if spec is not None else 0
        finished = []
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step was in flight
            n = seq.num_scheduled_tokens
            scoring = seq.scores_prompt
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and (n > 1 or not seq.output_ids):  # prompt blocks now (decoded ones when it ends)
                self.kv_cache.cache_computed(seq)
            self._outputs.score_prompt(seq, row, output, scoring)
            if seq.params.max_new_tokens == 0 and not seq.scores_prompt:  # the prompt scored, nothing to generate
                self._finish(seq, "length")
                finished.append(seq)
                continue
            if computed < len(seq.prompt_ids) + len(seq.output_ids):
                continue  # a prompt chunk short of its end: the token it gives is not the sequence's next
            seq.num_scheduled_tokens = 1  # what a step sent ahead of this one's results gives it (``schedule_ahead``)
            reason = self._outputs.generate(seq, row, output, token, logprob)
            if output.num_more is not None and self.speculation is not None:
                self.speculation.verified(seq, row, output)
            if reason is None:
                if output.num_more is not None:  # blocks grown for rejected proposals go back
                    self.kv_cache.trim(seq, seq.num_tokens)
                continue
            self._finish(seq, reason)
            finished.append(seq)
        if spec is not None:
            spec.decoded(len(seqs), output.num_more is not None, sum(len(seq.output_ids) for seq in seqs) - generated)
        return finished

    def note_step_time(self, seconds: float) -> None:
        """The wall time of the step ``postprocess`` last applied (the engine measures it): a decode step's tokens/s
        feed speculation's measured choice (``Speculation.note_step_time``)."""
        if self.speculation is not None:
            self.speculation.note_step_time(seconds)

    # ---- introspection --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    @property
    def waiting_tokens(self) -> int:
        """The budgets (``Sequence.budget``) of the waiting sequences together."""
        return sum(s.budget for s in self._preempted) + sum(s.budget for s in self._waiting)

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
        # a choice following another of its prompt waits for that one's cached prompt blocks
        waiting = [s for s in self._waiting if not s.waits_for_leader] if self.config.prefix_caching else self._waiting
        if self.config.policy == "priority":  # stable: preempted ones first among equals
            yield from sorted([*self._preempted, *waiting], key=lambda s: (s.params.priority, s.arrival_time or 0.0))
            return
        yield from self._preempted
        if self.config.policy == "fcfs":
            yield from waiting
            return
        max_wait, now = self.config.max_wait_s, self._clock()
        starving = [s for s in waiting
                    if max_wait is not None and s.arrival_time is not None and now - s.arrival_time >= max_wait]
        yield from starving
        starving_ids = {id(s) for s in starving}
        rest = [s for s in waiting if id(s) not in starving_ids]
        yield from sorted(rest, key=lambda s: -s.params.max_new_tokens)  # stable: ties keep arrival order

    def _admit(self, budget: int, chunks: int, in_flight: int = 0) -> list[Sequence]:
        """Start waiting sequences, in policy order, on the blocks of their longest cached prefix and new blocks for
        their first chunk (all their tokens without chunked prefill) out of ``budget`` tokens, ``chunks`` prompt
        chunks being in the step already; stop at the first that does not fit.

        Besides its chunk, each must leave room for the running sequences' next decode step, so a fresh prefill
        is not preempted (wasted) right away (``in_flight``: the tokens a step still in flight gives each of them,
        ``schedule_ahead``). Without chunked prefill a sequence of more than ``max_prompt_len``
        tokens to compute goes alone (the agents' single long prefill shape).
        """
        cfg, kv, bs = self.config, self.kv_cache, self.config.block_size
        slots = min(cfg.max_prefill_batch - chunks, cfg.max_num_seqs - len(self._running))
        ahead = int(cfg.chunked_prefill) + in_flight  # the running hold this step's slots: room for the next one
        free = kv.num_free_blocks - sum(kv.missing_blocks(s, s.num_tokens + ahead)
                                        for s in self._running if not s.is_prefilling)
        long_limit = cfg.max_prompt_len if cfg.max_prompt_len is not None else cfg.max_model_len
        chosen: list[Sequence] = []
        slot_waits = False  # a sequence before found no adapter slot: later ones with adapters wait behind it
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
            if seq.adapter is not None and (slot_waits or not self._pin_adapter(seq, may_load=not in_flight)):
                # every slot is pinned by other adapters' sequences (or no load now): it waits, and so do the
                # adapter sequences after it, so that a busy adapter's newer requests do not keep its slot pinned
                # ahead of it for ever; base sequences go on
                slot_waits = True
                continue
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
        if self.config.policy == "priority":  # after the running ones of its priority and higher
            bisect.insort_right(self._running, seq, key=lambda s: s.params.priority)
        else:
            self._running.append(seq)
        self.num_started += 1
        self.started_tokens += seq.budget
        self._running_sampled += seq.params.needs_logits
        self._running_dumps += seq.reads_logits

    def _pin_adapter(self, seq: Sequence, may_load: bool) -> bool:
        """Pin a slot holding ``seq``'s adapter for it (``AdapterSlots.acquire``); False when it must wait. A load
        is never queued for a step sent ahead (``may_load`` False): the agents keep the picks a fed step reads
        only across model steps, and the step in flight may still read the slot a load would replace."""
        assert self.adapters is not None and seq.adapter is not None  # add() refuses an adapter without slots
        slot = self.adapters.acquire(seq.adapter, may_load)
        if slot is None:
            return False
        seq.lora_slot = slot
        self._running_adapted += 1
        return True

    def _reserve_running(self, budget: int) -> tuple[list[Sequence], int, int]:
        """Give every running sequence, in running order (oldest first), its slots for this step: its decode token,
        or while it is still prefilling its next chunk out of what ``budget`` leaves after the decode tokens (at most
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

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens, preempting the last running sequences (the newest, or
        under "priority" the lowest priority; never one scheduled in this step: those come before it) as needed;
        False when ``seq`` itself had to be preempted."""
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
        if seq.lora_slot >= 0 and self.adapters is not None:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1
            self._running_adapted -= 1
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

    def _build(self, seqs: list[Sequence], prefill: bool, ahead: int = 0, num_steps: int = 1,
               fed_rows: Int32s | None = None) -> StepBatch:
        """The step of ``seqs``' scheduled tokens (``prefill``), or of one decode token each (``StepBuilder``)."""
        return self._builder.model_step(seqs, self.kv_cache.block_tables(seqs), one_token_each=not prefill,
                                        any_sampled=bool(self._running_sampled),
                                        any_reads_logits=bool(self._running_dumps),
                                        any_adapted=bool(self._running_adapted), ahead=ahead,
                                        num_steps=num_steps, fed_rows=fed_rows)
