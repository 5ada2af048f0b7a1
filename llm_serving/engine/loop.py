"""The engine: the scheduler and the agent pool driven by one loop thread, with a stream per request.

The loop thread takes the engine lock to ``schedule()`` a step, releases it while the agents run the step, and
takes it again to ``postprocess()`` the answer and schedule the next step, which goes to the agents before this
step's new tokens are handed to their streams (so the streams' consumers work while the agents compute). With
asynchronous scheduling (``scheduler.async_scheduling``) a greedy decode step's successor is scheduled and sent
while it runs (``Scheduler.schedule_ahead``): two steps in flight, so the agents never wait for the master.
``submit`` and ``abort`` take the same lock from any thread, so new requests join between steps (continuous
batching) and an abort frees the request's KV blocks at once; a request aborted while its steps are in flight
drops their tokens and is never scheduled again. A stop string ends its request the same way, when the token that
completes it is delivered (``push_token``).

Faults stay with the request that caused them and the agents heal (policy and reasons: ``recovery``): a
sequence that fails on its own fails alone; a step that fails as a whole is re-run in halves; when an agent
dies or is stuck (also noticed while idle), ``state`` turns "recovering", the running sequences go back to
the queue, new agents start and recompute them, and ``state`` turns "ready" again. A bug in the loop, or
agents that cannot be restarted, fail every request and leave ``state`` "failed" for good.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.adapters import Adapter, AdapterRegistry
from llm_serving.core.grammar import GrammarCompiler, compiler_for, masked_rows
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.core.step_shape import StepShape
from llm_serving.engine.adapter_serving import adapter_registry, lora_stats, run_adapter_loads
from llm_serving.engine.admission import RequestLimits
from llm_serving.engine.kv_transfer import KvPayload, KvTransfers, kv_layout
from llm_serving.engine.live_requests import LiveRequests, SequenceError
from llm_serving.engine.queue_wait import QueueWait
from llm_serving.engine.recovery import MAX_STRIKES, AgentSupervisor, RecoveryConfig, run_isolated
from llm_serving.engine.request_stream import EngineError, GenerationResult, RequestStream, TokenEvent
from llm_serving.engine.wiring import ModelFiles, agent_spec, resolve_model, scheduler_config
from llm_serving.executor.agent_pool import AgentDiedError, AgentPool, AgentStepError
from llm_serving.executor.step_pool import StepPool
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.wire import AgentSpec
from llm_serving.request_errors import ModelNotFound, QueueFull
from llm_serving.tokenization.chat_template import ServedChatTemplate
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer, load_tokenizer

__all__ = ["Engine", "EngineError", "GenerationResult", "RequestStream", "SamplingParams", "SequenceError",
           "TokenEvent"]

if TYPE_CHECKING:
    from typing_extensions import Self  # noqa: UP035  (typing.Self is 3.11+: mypy checks for 3.10)

log = logging.getLogger(__name__)

_Sent = tuple[list[Sequence], StepBatch, int, float]  # a step sent to the agents: seqs, batch, number, when

_T = TypeVar("_T")

IDLE_CHECK_S = 0.5  # while idle, how often the loop checks that the agents are alive and not stopped
SHUTDOWN_JOIN_S = 30.0  # shutdown waits this long for the step in flight before stopping the agents


# ---- the engine -------------------------------------------------------------------------------------------
def _started(part: _T | None) -> _T:
    """A part of the engine that ``start()`` makes: an EngineError before then, not an AttributeError on None."""
    if part is None:
        raise EngineError("the engine is not running (call start())")
    return part


def speculation_stats(scheduler: Scheduler) -> dict[str, float]:
    """Speculative decoding's counts (all 0 without it)."""
    spec = scheduler.speculation
    steps, drafts, proposed, accepted = (0, 0, 0, 0) if spec is None else (spec.steps, spec.drafts, spec.proposed,
                                                                          spec.accepted)
    return {"spec_verify_steps": steps, "spec_drafts": drafts, "spec_proposed_tokens": proposed,
            "spec_accepted_tokens": accepted, "spec_acceptance_rate": accepted / proposed if proposed else 0.0}


class Engine:
    """See the module docstring. ``pool_factory(spec)`` lets tests supply a pool."""

    def __init__(self, config: ServingConfig, standin_agents: bool = False,
                 pool_factory: Callable[[AgentSpec], StepPool] | None = None) -> None:
        self.config = config
        self.standin_agents = standin_agents
        self.state = "new"  # new -> starting -> ready <-> recovering; failed or stopped for good
        self.last_failure: str | None = None  # why the agents were last replaced, or why the engine failed
        # start() sets these; the properties of the same name give them (EngineError before start)
        self._tokenizer: AnyTokenizer | None = None
        self._chat_template: ServedChatTemplate | None = None  # the served tokenizer's, loaded on first use
        self._model: ModelFiles | None = None
        self._limits: RequestLimits | None = None
        self.eos_token_id: int | None = None
        self.other_eos_token_ids: tuple[int, ...] = ()
        self._pool_factory = pool_factory or AgentPool
        self._agents: AgentSupervisor | None = None  # set by start(): owns the agent pool
        self._scheduler: Scheduler | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._requests: LiveRequests | None = None  # set by start()
        self._queue_wait = QueueWait(config.serving_config.max_queue_wait_s)  # admission by expected wait
        self._grammars: GrammarCompiler | None = None  # see _grammar_compiler
        self._kv: KvTransfers | None = None  # serving_config.kv_transfer: prompts' KV blocks exported and imported
        self.adapters: AdapterRegistry | None = None  # lora.enable: the LoRA adapters served, by name (start())
        self._grammar_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = self._stopping = False
        self._error: EngineError | None = None
        self._ids = itertools.count()
        self._counters = dict.fromkeys(
            ("steps", "prefill_steps", "decode_steps", "multi_step_batches", "steps_sent_ahead", "tokens_generated",
             "requests_finished", "requests_aborted", "requests_failed", "requests_recomputed"), 0)
        self._in_flight: tuple[Sequence, ...] = ()  # the sequences of the steps the agents are running
        self._run_step_s = 0.0  # in AgentPool.submit/collect: sending steps and waiting for the agents
        self._loop_started: float | None = None
        self._idle_s = 0.0  # waits for work, finished ones
        self._idle_since: float | None = None  # the wait for work going on now
        # a list to record every step in: its shape and seconds from being sent to the next step's scheduling
        # (the loop's whole turn: what the simulator's fitted cost model learns from); None: not recorded
        self.step_trace: list[tuple[StepShape, float]] | None = None

    @classmethod
    def from_config(cls, config: ServingConfig, standin_agents: bool = False) -> Engine:
        return cls(config, standin_agents=standin_agents)

    @property
    def tokenizer(self) -> AnyTokenizer:
        tok = self._tokenizer  # (not _started: mypy joins a union's kinds to object there)
        if tok is None:
            raise EngineError("the engine is not running (call start())")
        return tok

    @property
    def chat_template(self) -> ServedChatTemplate:
        return _started(self._chat_template)

    @property
    def model(self) -> ModelFiles:
        return _started(self._model)

    @property
    def limits(self) -> RequestLimits:
        return _started(self._limits)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def error(self) -> EngineError | None:
        """Why the engine failed for good (``state`` "failed"), else None."""
        return self._error

    @property
    def agent_pids(self) -> list[int]:
        """Process ids of the serving agents, by rank (chaos tests kill them)."""
        return self._agents.pids if self._agents is not None else []

    @property
    def standby(self) -> dict[str, Any] | None:
        """The standby agents (``serving_config.standby_agents``): their state (starting, ready, or why there are
        none) and process ids; None where no standby is kept."""
        standby = self._agents.standby if self._agents is not None else None
        return None if standby is None else {"state": standby.state, "pids": standby.pids}

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = print) -> None:
        """Prepare the model, start the agents (waits for their warm-up) and the loop thread."""
        if self._started:
            raise RuntimeError("Engine.start: an engine starts once; create a new Engine to restart")
        self._started = True
        self.state = "starting"
        cfg = self.config
        for note in cfg.notes:
            if progress:
                progress(f"config note: {note}")
        self._model = model = resolve_model(cfg, progress)
        self._tokenizer = tok = load_tokenizer(model.tokenizer_file)
        if tok.vocab_size > model.llama_config.vocab_size:
            raise ConfigError(f"{cfg.source}: tokenizer {model.tokenizer_path} has "
                              f"{tok.vocab_size} pieces, more than the model's vocab_size "
                              f"{model.llama_config.vocab_size}",
                              key="tokenizer.vocab_file", source=cfg.source)
        self._chat_template = ServedChatTemplate(cfg, model.model_path, tok)
        self._limits = RequestLimits.from_config(cfg, tok.vocab_size)
        self.adapters = adapter_registry(cfg, model.llama_config)  # before the agents: a bad adapter fails fast
        if self.adapters is not None and progress:
            served = ", ".join(f"{a.name} (rank {a.config.max_rank})" for a in self.adapters.adapters) or "none yet"
            progress(f"LoRA adapters: {served}; {cfg.lora.max_loras} slot(s) of rank up to {cfg.lora.max_lora_rank}")
        end = cfg.model_config.end_token
        self.eos_token_id = end if end is not None else model.llama_config.eos_token_id
        # model_config.end_token replaces the model's ids; else every id the model's configs list ends a request, and
        # the tokenizer's eos_token too, as vLLM stops: an instruct model's end of turn (Qwen's <|im_end|>) may be
        # named only in its tokenizer_config.json
        eos = tok.eos_id
        stops = model.llama_config.stop_ids + ((eos,) if eos is not None and eos >= 0 else ())
        self.other_eos_token_ids = () if end is not None else tuple(dict.fromkeys(stops))[1:]
        auto = cfg.pa_config.auto_blocks  # the agents size their caches; the scheduler follows their count
        if not auto:
            self._start_scheduler()
        spec = agent_spec(cfg, model, self.standin_agents)
        self._kv = KvTransfers(kv_layout(spec), self._lock) if spec.kv_transfer else None
        self._agents = agents = AgentSupervisor(RecoveryConfig.from_config(cfg), self._pool_factory, spec,
                                                standby=cfg.serving_config.standby_agents)
        try:
            agents.start(progress)  # raises (after cleaning up) when an agent cannot start
            if auto:
                blocks = agents.fix_kv_blocks()
                if progress:
                    progress(f"KV cache: {blocks} blocks of {cfg.pa_config.block_size} tokens "
                             "(pa_config.num_blocks auto)")
                self._start_scheduler(blocks)
            agents.keep_standby()
        except BaseException:
            self.state = "failed"
            agents.close()
            raise
        self.state = "ready"
        self._thread = threading.Thread(target=self._loop, name="llm-serving-engine", daemon=True)
        self._thread.start()

    def _start_scheduler(self, num_blocks: int | None = None) -> None:
        self._scheduler = Scheduler(scheduler_config(self.config, self.eos_token_id, self.model.llama_config,
                                                     num_blocks, self.other_eos_token_ids))
        self._requests = LiveRequests(self._scheduler, self._counters)

    def shutdown(self) -> None:
        """Abort every request left, stop the loop and the agents (shared memory unlinked). Idempotent."""
        with self._lock:
            recovering = self.state == "recovering"
            self.state = "failed" if self.state == "failed" else "stopped"
            self._stopping = True
            self._work.notify_all()
        if recovering and self._agents is not None:
            self._agents.close()  # new agents starting up: stop them now rather than after their warm-up
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(SHUTDOWN_JOIN_S)
            if thread.is_alive() and self._agents is not None:
                self._agents.close()  # a step that does not come back: stopping the agents ends it
                thread.join()
        self._drop_kv_copies(EngineError("the engine was shut down"))
        with self._lock:
            self.state = "failed" if self.state == "failed" else "stopped"
            if self._requests is not None:
                self._requests.finish_all("abort")
        if self._agents is not None:
            self._agents.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests -------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, clip_to_context: bool = False,
               logits_tokens: int = 0, follows: str | None = None, adapter: str | None = None) -> RequestStream:
        """Queue a request. Raises RequestRejected (AdmissionError: a limit of the configuration, naming the
        field), QueueFull (the queue is full in count, or in expected wait: ``queue_wait``), or EngineError (not
        running).

        ``clip_to_context`` lowers a max_new_tokens beyond the context left after the prompt to fit, instead
        of refusing it (``RequestLimits.admit``). ``logits_tokens`` > 0 dumps the float32 logits of the first
        that many generated positions into ``GenerationResult.logits`` (the steps it is in read logits back).
        ``follows``: the id of another choice of the same prompt, whose prompt KV blocks this one starts on
        (``Scheduler.add``). ``adapter``: the name of the LoRA adapter to compute it with (``load_adapter``; None:
        the base model); ModelNotFound when none of that name is served.
        """
        params = params if params is not None else SamplingParams()
        if isinstance(logits_tokens, bool) or not isinstance(logits_tokens, int) or logits_tokens < 0:
            raise ValueError(f"logits_tokens must be an int >= 0, got {logits_tokens!r}")
        self._check_ready()
        tok = self.tokenizer
        if isinstance(prompt, str):
            text, ids = prompt, tok.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        params = self.limits.admit(ids, params, clip_to_context)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, ids, params, logits_tokens=logits_tokens)
        if params.constraint is not None:
            seq.constraint = self._grammar_compiler().matcher(params.constraint)
        stream = RequestStream(rid, text, ids, tok, self.abort, params.stop,
                               seq.logits if logits_tokens else None, self.model.llama_config.vocab_size,
                               seq.prompt_scores if params.prompt_logprobs is not None else None)
        with self._lock:
            self._check_ready()
            sched = _started(self._scheduler)
            limit = self.config.serving_config.max_queue_size
            if sched.num_waiting >= limit:
                raise QueueFull(f"{sched.num_waiting} requests are waiting (serving_config.max_queue_size {limit})")
            if self._queue_wait.active and sched.num_waiting:
                self._queue_wait.check(sched.waiting_tokens)
            if adapter is not None:
                seq.adapter = self._adapter(adapter)
            sched.add(seq, follows)
            if seq.adapter is not None:
                requested = _started(self.adapters).requests
                requested[seq.adapter.name] = requested.get(seq.adapter.name, 0) + 1
            _started(self._requests).add(seq, stream)
            self._work.notify()
        return stream

    def _adapter(self, name: str) -> Adapter:
        """The served adapter ``name`` (under the lock); ModelNotFound if none."""
        found = self.adapters.get(name) if self.adapters is not None else None
        if found is None:
            raise ModelNotFound(f"model {name!r} is not served here (no LoRA adapter of that name)")
        return found

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Serve the PEFT LoRA adapter in ``path`` as model ``name`` from now on (its weights go to the agents when
        a request first needs it). AdapterError naming the file and key for an adapter that cannot be served,
        ValueError for a name already served, EngineError without adapters (``lora.enable``)."""
        registry = self._check_adapters()
        adapter = registry.check(name, path)  # reads the adapter's configuration: not under the lock
        with self._lock:
            registry.put(adapter)
        return adapter

    def unload_adapter(self, name: str) -> int:
        """Stop serving adapter ``name``: new requests for it are refused at once, those already queued or running
        finish with it (its slot is reused only once none holds it). Returns how many those are; ModelNotFound
        when no adapter of that name is served."""
        registry = self._check_adapters()
        with self._lock:
            if name not in registry:
                raise ModelNotFound(f"no LoRA adapter named {name!r} is loaded")
            adapter = registry.remove(name)
            return sum(seq.adapter is adapter for seq in _started(self._requests).sequences())

    def _check_adapters(self) -> AdapterRegistry:
        self._check_ready()
        if self.adapters is None:
            raise EngineError("this engine serves no LoRA adapters (lora.enable)")
        return self.adapters

    def export_prompt_kv(self, prompt_ids: list[int]) -> Future:
        """A future of the KV blocks this engine holds of ``prompt_ids``' full blocks (``kv_transfer.KvPayload``;
        none when nothing is cached), copied out between steps (``serving_config.kv_transfer``)."""
        with self._lock:
            kv = self._check_kv_transfer()
            future = kv.queue_export(_started(self._scheduler).kv_cache, prompt_ids)
            self._work.notify()
        return future

    def import_prompt_kv(self, payload: KvPayload) -> Future:
        """A future of the number of blocks of ``payload`` (another engine's ``export_prompt_kv``) copied into this
        engine's prefix cache between steps; a request for a prompt they start then computes only the rest. Raises
        ValueError when the payload's layout is not this engine's."""
        with self._lock:
            kv = self._check_kv_transfer()
            future = kv.queue_import(_started(self._scheduler).kv_cache, payload)
            self._work.notify()
        return future

    def _check_kv_transfer(self) -> KvTransfers:
        self._check_ready()
        if self._kv is None:
            raise EngineError("this engine was started without KV transfer (serving_config.kv_transfer)")
        return self._kv

    @property
    def _kv_pending(self) -> bool:
        return self._kv is not None and self._kv.pending

    def _drop_kv_copies(self, error: EngineError) -> None:
        """Fail the KV copies still queued (not under the lock)."""
        if self._kv is not None and self._scheduler is not None:
            self._kv.fail_all(self._scheduler.kv_cache, error)

    def _grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of the served vocabulary, built at the first constrained request (it
        indexes every token: ~0.1 s for 32k tokens)."""
        with self._grammar_lock:
            if self._grammars is None:
                ends = {e for e in (self.eos_token_id, *self.other_eos_token_ids) if e is not None}
                self._grammars = compiler_for(self.tokenizer, ends, self.model.llama_config.vocab_size)
            return self._grammars

    def abort(self, request_id: str) -> bool:
        """Abort a request from any thread; False if it already ended."""
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str = "stop") -> bool:
        """End a request now with ``reason`` from any thread; frees its blocks. False if it already ended.

        Stop strings need no call: the engine ends a request when its stream sees one complete.
        """
        with self._lock:
            return self._requests is not None and self._requests.finish(request_id, reason)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._scheduler
            out: dict[str, Any] = {"ready": self.ready, "state": self.state, "num_agents": self.config.num_agents,
                                   "agent_pids": self.agent_pids}
            if s is not None:
                out.update(num_waiting=s.num_waiting, num_running=s.num_running,
                           kv_blocks_total=s.kv_cache.num_usable_blocks,
                           kv_blocks_used=s.num_used_blocks, kv_blocks_free=s.num_free_blocks,
                           kv_usage=s.block_usage,
                           num_preemptions=s.num_preemptions, **s.prefix_cache_stats(), **speculation_stats(s))
                rate, wait = self._queue_wait.rate, self._queue_wait.expected_wait(s.waiting_tokens)
                out.update(queue_drain_tokens_per_s=rate or 0.0, queue_wait_s=wait or 0.0)
            if self._agents is not None:
                out.update(agent_restarts=self._agents.restarts, step_timeout_s=self._agents.step_timeout_s)
                standby = self._agents.standby
                if standby is not None:
                    out.update(standby=standby.state, standby_pids=standby.pids,
                               standby_promotions=self._agents.promotions, standby_deaths=standby.deaths)
            if self._kv is not None:
                out.update(self._kv.counters)
            if self.adapters is not None and s is not None:
                out.update(lora_stats(s, self.adapters))
            out.update(self._counters, run_step_s=self._run_step_s, busy_s=self._busy_seconds())
            return out

    def _busy_seconds(self) -> float:
        """Seconds the loop has run, less its waits for work."""
        if self._loop_started is None:
            return 0.0
        now = time.perf_counter()
        idle_now = now - self._idle_since if self._idle_since is not None else 0.0
        return now - self._loop_started - self._idle_s - idle_now

    # ---- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Run steps until stopped, replacing the agents whenever they die or get stuck."""
        self._loop_started = time.perf_counter()
        try:
            while not self._run_steps():
                if not self._recover():
                    return
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting requests
            self._fail(exc)

    def _run_steps(self) -> bool:
        """Schedule, run and deliver steps: True once stopping, False when the agents failed.

        The next step is scheduled and sent to the agents right after a step's results are applied, before its
        tokens are delivered: the streams' consumers (HTTP writes, detokenizing) then run while the agents
        compute, instead of holding the GIL the scheduler needs while the agents wait for the next step. Under
        asynchronous scheduling a decode step's successor is sent before the step is collected
        (``Scheduler.schedule_ahead``); it is then the next step, and ``schedule()`` runs only with none ahead.
        """
        sched, agents, requests = _started(self._scheduler), _started(self._agents), _started(self._requests)
        pool, counters = agents.pool, self._counters
        schedules_ahead = sched.config.async_scheduling
        in_flight = None  # the step submitted to the agents, not yet collected (_Sent)
        ahead = None  # the step sent after it (asynchronous scheduling), fed its picks
        done = 0.0  # when the last step was collected: a step sent before that starts then
        try:
            while True:
                if in_flight is None:
                    if self._kv is not None:  # KV copies run between steps, none in flight
                        self._kv.run(pool, sched.kv_cache)
                    step = self._wait_for_step()
                    if step is None:
                        if self._stopping:
                            return True
                        continue  # KV copies to run
                    in_flight = self._submit(step)
                seqs, batch, number, sent_at = in_flight
                if schedules_ahead and ahead is None and not self._kv_pending:
                    with self._lock:
                        step = None if self._stopping else sched.schedule_ahead(seqs, batch)
                    ahead = None if step is None else self._submit(step)
                t0 = time.perf_counter()
                try:
                    output = pool.collect(number, batch.batch_size)
                except AgentStepError as exc:  # the agents serve on: find the sequences it belongs to
                    log.warning("step of %d sequence(s) failed, running it again in parts: %s", len(seqs), exc)
                    self._drop(ahead)
                    ahead = None
                    output = run_isolated(pool, self._unfed(seqs, batch), exc)
                started, done = max(sent_at, done), time.perf_counter()
                self._run_step_s += done - t0
                agents.policy.step_succeeded()
                with self._lock:
                    self._in_flight = () if ahead is None else tuple(ahead[0])
                    requests.fail_rows(seqs, {**output.errors, **masked_rows(seqs, batch, output.token_ids)})
                    sched.postprocess(seqs, output)
                    sched.note_step_time(done - started)  # speculation's measured choice
                    # queued KV copies first: no step is in flight once this one is delivered
                    step = None if self._stopping or ahead is not None or self._kv_pending else sched.schedule()
                    self._queue_wait.observe(time.monotonic(), sched.num_waiting, sched.num_started,
                                             sched.started_tokens)
                    if self.step_trace is not None:
                        self.step_trace.append((StepShape.of(batch, sched.config.block_size),
                                                time.perf_counter() - started))
                try:
                    in_flight = ahead if ahead is not None else None if step is None else self._submit(step)
                    ahead = None
                finally:  # this step's tokens reach their streams also when the next step cannot be sent
                    with self._lock:
                        requests.deliver(seqs)
                        counters["steps"] += batch.num_steps
                        prompts = batch.describe().computes_prompts  # a verify step decodes
                        counters["prefill_steps" if prompts else "decode_steps"] += batch.num_steps
                        counters["multi_step_batches"] += batch.num_steps > 1
                        counters["steps_sent_ahead"] += batch.feeds_previous
        except AgentDiedError as exc:  # died, stuck, or closed by shutdown
            if self._stopping:
                return True
            self.last_failure = str(exc)
            return False

    def _recover(self) -> bool:
        """Replace the agents (see ``recovery``); running requests are recomputed, queued ones kept. False
        once stopping; EngineError when the agents cannot be restarted."""
        log.error("agents failed (%s): recomputing the running requests on new agents", self.last_failure)
        agents = _started(self._agents)
        with self._lock:
            if self._stopping:
                return False
            self.state = "recovering"
            blamed = agents.policy.strike(self._in_flight)
            self._in_flight = ()
            _started(self._requests).fail(blamed, SequenceError(
                f"the agents failed during {MAX_STRIKES} steps of this request; it is not computed again "
                f"(last failure: {self.last_failure})"))
            self._counters["requests_recomputed"] += len(_started(self._scheduler).requeue_running())
        # after the prefix cache was emptied: copies queued until then pinned blocks of the old agents' cache; those
        # queued later find none to export, and import into the new agents
        self._drop_kv_copies(EngineError(f"the agents were replaced ({self.last_failure})"))
        t0 = time.monotonic()
        if not agents.replace(self._wait_unless_stopping, self.last_failure or ""):
            return False
        with self._lock:
            if self._stopping:
                return False
            self.state = "ready"
        log.warning("agents replaced in %.1fs (pids %s)", time.monotonic() - t0, self.agent_pids)
        return True

    def _wait_unless_stopping(self, seconds: float) -> bool:
        with self._lock:
            return not self._work.wait_for(lambda: self._stopping, seconds)

    def _wait_for_step(self) -> tuple[list[Sequence], StepBatch] | None:
        """The next step, waiting (idle) while there is no work; None once stopping or when KV copies wait."""
        sched, agents = _started(self._scheduler), _started(self._agents)
        with self._lock:
            step = None if self._stopping else sched.schedule()
            while step is None and not self._kv_pending:
                if self._stopping:
                    return None
                self._idle_since = time.perf_counter()
                self._work.wait(IDLE_CHECK_S)
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
                failure = None if self._stopping else agents.idle_failure()
                if failure:
                    raise AgentDiedError(failure)
                step = None if self._stopping else sched.schedule()
            return step

    def _submit(self, step: tuple[list[Sequence], StepBatch]) -> _Sent:
        """Send a scheduled step to the agents: ``(seqs, batch, step number, when)`` for ``AgentPool.collect``."""
        seqs, batch = step
        t0 = time.perf_counter()
        pool = _started(self._agents).pool
        if batch.lora_slots is not None:  # adapters its admissions need, loaded first (none for a step sent ahead)
            run_adapter_loads(pool, _started(self._scheduler), _started(self._requests), self._lock)
        self._in_flight = tuple(seqs)  # a step sent ahead has the sequences of the one before it
        number = pool.submit(batch)
        self._run_step_s += time.perf_counter() - t0
        return seqs, batch, number, t0

    def _drop(self, ahead: _Sent | None) -> None:
        """Collect and discard the step sent ahead of one that failed (it was fed that step's picks); its
        sequences are scheduled again from their results."""
        if ahead is not None:
            try:
                _started(self._agents).pool.collect(ahead[2], ahead[1].batch_size)
            except AgentStepError:
                pass  # its agents had no picks to feed it: the expected answer

    @staticmethod
    def _unfed(seqs: list[Sequence], batch: StepBatch) -> StepBatch:
        """``batch`` with its input tokens written out, for running it again in parts (``run_isolated``): a step
        fed the picks of the step before has them in its sequences by now."""
        fed = batch.fed_rows
        if fed is None:
            return batch
        ids = np.array(batch.input_ids, np.int32)
        rows = np.flatnonzero(fed >= 0)  # a mixed step's other rows (prompt chunks) carry their ids
        ids[(np.cumsum(batch.query_lens) - batch.query_lens)[rows]] = [seqs[row].last_token_id for row in rows]
        return replace(batch, input_ids=ids, fed_rows=None)

    def _fail(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc}")
        if err is not exc:
            err.__cause__ = exc
        log.error("engine failed: %s", err)
        try:
            self._drop_kv_copies(err)
        except Exception:
            log.warning("dropping the queued KV copies failed", exc_info=True)
        with self._lock:
            self.state = "failed"
            self.last_failure = str(err)
            self._error = err
            if self._requests is not None:
                self._requests.fail(self._requests.sequences(), err)
        try:
            if self._agents is not None:
                self._agents.close()
        except Exception:
            log.warning("closing the agent pool after an engine failure failed", exc_info=True)

    def _check_ready(self) -> None:
        """Refuse requests unless serving; while the agents are replaced requests queue, to be served after."""
        if self.state not in ("ready", "recovering"):
            if self._stopping:
                raise EngineError("the engine was shut down; create a new Engine to serve again")
            if self._error is not None:
                raise EngineError(f"the engine has stopped: {self._error}")
            raise EngineError("the engine is not running (call start(); after shutdown create a new Engine)")

