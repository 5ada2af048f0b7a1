"""The engine: the scheduler and the agent pool driven by one loop thread, with a stream per request.

One step is in flight at a time: the loop thread takes the engine lock to ``schedule()`` a step, releases
it while the agents run the step, and takes it again to ``postprocess()`` the answer and schedule the next
step, which goes to the agents before this step's new tokens are handed to their streams (so the streams'
consumers work while the agents compute). ``submit`` and ``abort`` take the same lock from any thread, so new
requests join between steps (continuous batching) and an abort frees the request's KV blocks at once; a
request aborted while its step is in flight drops that step's token and is never scheduled again.

If a step fails (an agent died, a broken answer), every in-flight and queued request gets ``EngineError``,
the pool is closed (its shared memory unlinked) and the engine stays not ready; a new Engine can be started.
While idle the loop checks that the agents are still alive, so ``ready`` turns False without traffic too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.model_config import LlamaConfig, ModelConfigError
from llm_serving.agent_pool import AgentPool, AgentSpec, AgentStepError
from llm_serving.batch import StepBatch
from llm_serving.config import ConfigError, ServingConfig
from llm_serving.default_model import ensure_default_model
from llm_serving.request_stream import (
    NO_TOKEN,
    EngineError,
    GenerationResult,
    QueueFull,
    RequestStream,
    TokenEvent,
)
from llm_serving.scheduler import RequestRejected, Scheduler, SchedulerConfig
from llm_serving.sequence import SamplingParams, Sequence, SequenceStatus
from llm_serving.tokenizer import Tokenizer

__all__ = ["Engine", "EngineError", "GenerationResult", "ModelFiles", "QueueFull", "RequestRejected",
           "RequestStream", "SamplingParams", "TokenEvent", "agent_spec_fields", "resolve_model",
           "runner_config_dict", "scheduler_config"]

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

IDLE_CHECK_S = 0.5  # while idle, how often the loop checks that the agents are alive
SHUTDOWN_JOIN_S = 30.0  # shutdown waits this long for the step in flight before stopping the agents


@dataclass(frozen=True)
class ModelFiles:
    """What the agents load and the master tokenizes with."""

    model_path: Path  # HF/converted model directory or checkpoint file
    llama_config: LlamaConfig
    tokenizer_path: Path


# ---- configuration mapping --------------------------------------------------------------------------------
def resolve_model(config: ServingConfig, progress: Callable[[str], None] | None = None) -> ModelFiles:
    """The model to serve: ``model_config.model_path``, or the embedded default model (built if needed)."""
    src = config.source
    if config.uses_default_model:
        path = ensure_default_model(config.default_model, config.max_model_len, progress)
        config_dir = path
    else:
        path = Path(config.model_config.model_path)
        if not path.exists():
            raise ConfigError(f"{src}: model_config.model_path: {path} does not exist",
                              key="model_config.model_path", source=src)
        config_dir = path if path.is_dir() else path.parent
    try:
        llama = LlamaConfig.from_model_dir(config_dir)
    except (ModelConfigError, ValueError) as exc:
        raise ConfigError(f"{src}: model_config.model_path: {exc}", key="model_config.model_path",
                          source=src) from None
    want_vocab = config.model_config.vocab_size
    if want_vocab is not None and want_vocab != llama.vocab_size:
        raise ConfigError(f"{src}: model_config.vocab_size: {want_vocab} does not match the model's "
                          f"vocab_size {llama.vocab_size} ({config_dir / 'config.json'})",
                          key="model_config.vocab_size", source=src)
    vocab_file = config.vocab_file
    tokenizer_path = Path(vocab_file) if vocab_file is not None else path / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise ConfigError(f"{src}: tokenizer.vocab_file: no tokenizer model at {tokenizer_path}",
                          key="tokenizer.vocab_file", source=src)
    return ModelFiles(path, llama, tokenizer_path)


def scheduler_config(config: ServingConfig, eos_token_id: int | None) -> SchedulerConfig:
    m, pa, sc = config.model_config, config.pa_config, config.scheduler
    return SchedulerConfig(
        num_blocks=pa.num_blocks, block_size=pa.block_size,
        max_num_seqs=m.decode_batch_size[-1], max_prefill_batch=m.prefill_batch_size[-1],
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
        eos_token_id=eos_token_id, policy=sc.policy, max_wait_s=sc.max_wait_s,
        min_decode_steps_between_prefills=sc.min_decode_steps_between_prefills,
        max_prompt_len=config.max_prompt_len,
    )


def runner_config_dict(config: ServingConfig) -> dict[str, Any]:
    """``agents.runner.RunnerConfig`` fields (JSON-able); the runner adds a 1 x max_model_len recompute
    shape itself."""
    m, pa = config.model_config, config.pa_config
    return {
        "num_blocks": pa.num_blocks, "block_size": pa.block_size, "max_model_len": config.max_model_len,
        "prefill_batch_sizes": list(m.prefill_batch_size), "prefill_seq_lengths": list(m.seq_length),
        "decode_batch_sizes": list(m.decode_batch_size), "dtype": m.dtype, "kernels": m.kernels,
    }


def agent_spec_fields(config: ServingConfig, model: ModelFiles, standin: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``AgentSpec`` for this configuration (shared-memory capacities included)."""
    m, pa = config.model_config, config.pa_config
    return {
        "kind": "standin" if standin else "llama",
        "model_path": str(model.model_path),
        "llama_config": dataclasses.asdict(model.llama_config),
        "runner_config": runner_config_dict(config),
        "max_tokens": max(config.max_num_batched_tokens, m.decode_batch_size[-1]),
        "max_batch": max(m.prefill_batch_size[-1], m.decode_batch_size[-1]),
        "max_blocks_per_seq": -(-config.max_model_len // pa.block_size),
        # every penalty id of a step is a token whose KV is cached: bounded by the cache and the batch
        "max_penalty_tokens": min((pa.num_blocks - 1) * pa.block_size,
                                  max(m.prefill_batch_size[-1], m.decode_batch_size[-1]) * config.max_model_len),
        "start_device_id": config.serving_config.start_device_id,
    }


def _default_pool_factory(fields: dict[str, Any], num_agents: int) -> AgentPool:
    return AgentPool(AgentSpec(**fields), num_agents=num_agents)


# ---- the engine -------------------------------------------------------------------------------------------
class Engine:
    """See the module docstring. ``pool_factory(spec_fields, num_agents)`` lets tests supply a pool."""

    def __init__(self, config: ServingConfig, standin_agents: bool = False,
                 pool_factory: Callable[[dict[str, Any], int], Any] | None = None) -> None:
        self.config = config
        self.standin_agents = standin_agents
        self.ready = False
        self.tokenizer: Tokenizer | None = None
        self.model: ModelFiles | None = None
        self.eos_token_id: int | None = None
        self._pool_factory = pool_factory or _default_pool_factory
        self._pool: Any = None
        self._scheduler: Scheduler | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._started = self._stopping = False
        self._error: EngineError | None = None
        self._ids = itertools.count()
        self._counters = dict.fromkeys(
            ("steps", "prefill_steps", "decode_steps", "tokens_generated", "requests_finished",
             "requests_aborted"), 0)
        self._run_step_s = 0.0  # in AgentPool.submit/collect: sending steps and waiting for the agents
        self._loop_started: float | None = None
        self._idle_s = 0.0  # waits for work, finished ones
        self._idle_since: float | None = None  # the wait for work going on now

    @classmethod
    def from_config(cls, config: ServingConfig, standin_agents: bool = False) -> Engine:
        return cls(config, standin_agents=standin_agents)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = print) -> None:
        """Prepare the model, start the agents (waits for their warm-up) and the loop thread."""
        if self._started:
            raise RuntimeError("Engine.start: an engine starts once; create a new Engine to restart")
        self._started = True
        cfg = self.config
        for note in cfg.notes:
            if progress:
                progress(f"config note: {note}")
        self.model = resolve_model(cfg, progress)
        self.tokenizer = Tokenizer(self.model.tokenizer_path)
        if self.tokenizer.vocab_size > self.model.llama_config.vocab_size:
            raise ConfigError(f"{cfg.source}: tokenizer {self.model.tokenizer_path} has "
                              f"{self.tokenizer.vocab_size} pieces, more than the model's vocab_size "
                              f"{self.model.llama_config.vocab_size}",
                              key="tokenizer.vocab_file", source=cfg.source)
        end = cfg.model_config.end_token
        self.eos_token_id = end if end is not None else self.model.llama_config.eos_token_id
        self._scheduler = Scheduler(scheduler_config(cfg, self.eos_token_id))
        pool = self._pool_factory(agent_spec_fields(cfg, self.model, self.standin_agents), cfg.num_agents)
        pool.start(progress)  # raises (after cleaning up) when an agent cannot start
        self._pool = pool
        self.ready = True
        self._thread = threading.Thread(target=self._loop, name="llm-serving-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort every request left, stop the loop and the agents (shared memory unlinked). Idempotent."""
        with self._lock:
            self.ready = False
            self._stopping = True
            self._work.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(SHUTDOWN_JOIN_S)
            if thread.is_alive() and self._pool is not None:
                self._pool.close()  # a step that does not come back: stopping the agents ends it
                thread.join()
        with self._lock:
            for rid in list(self._streams):
                self._finish_locked(rid, "abort")
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests -------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Queue a request. Raises RequestRejected (bad request), QueueFull, or EngineError (not running)."""
        params = params if params is not None else SamplingParams()
        self._check_ready()
        tok = self.tokenizer
        if isinstance(prompt, str):
            text, ids = prompt, tok.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            vocab = min(self.model.llama_config.vocab_size, tok.vocab_size)  # ids the tokenizer can decode
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        limit = self.config.model_config.max_generate_length
        if params.max_new_tokens > limit:
            raise RequestRejected(f"max_new_tokens {params.max_new_tokens} exceeds "
                                  f"model_config.max_generate_length {limit}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, ids, params)
        stream = RequestStream(rid, text, ids, tok, self.abort)
        stream._seq = seq
        with self._lock:
            self._check_ready()
            limit = self.config.serving_config.max_queue_size
            if self._scheduler.num_waiting >= limit:
                raise QueueFull(f"{self._scheduler.num_waiting} requests are waiting "
                                f"(serving_config.max_queue_size {limit})")
            self._scheduler.add(seq)
            self._streams[rid] = stream
            self._work.notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a request from any thread; False if it already ended."""
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str = "stop") -> bool:
        """End a request now with ``reason`` (e.g. "stop" when a stop string appeared); frees its blocks."""
        with self._lock:
            return self._finish_locked(request_id, reason)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._scheduler
            out: dict[str, Any] = {"ready": self.ready, "num_agents": self.config.num_agents}
            if s is not None:
                out.update(num_waiting=s.num_waiting, num_running=s.num_running,
                           kv_blocks_total=s.block_manager.num_usable_blocks,
                           kv_blocks_used=s.num_used_blocks, kv_blocks_free=s.num_free_blocks,
                           kv_usage=s.block_usage,
                           num_preemptions=s.num_preemptions)
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
        """Schedule, run and deliver steps until stopped.

        The next step is scheduled and sent to the agents right after a step's results are applied, before its
        tokens are delivered: the streams' consumers (HTTP writes, detokenizing) then run while the agents
        compute, instead of holding the GIL the scheduler needs while the agents wait for the next step.
        """
        sched, pool, counters = self._scheduler, self._pool, self._counters
        self._loop_started = time.perf_counter()
        try:
            in_flight = None  # (seqs, batch, step number) submitted to the agents, not yet collected
            while True:
                if in_flight is None:
                    step = self._wait_for_step()
                    if step is None:
                        return
                    in_flight = self._submit(step)
                seqs, batch, number = in_flight
                t0 = time.perf_counter()
                try:
                    output = pool.collect(number, batch.batch_size)
                except AgentStepError as exc:
                    in_flight = None
                    self._fail_step(seqs, exc)  # the agents are fine; only this step's requests fail
                    continue
                self._run_step_s += time.perf_counter() - t0
                with self._lock:
                    sched.postprocess(seqs, output)
                    step = None if self._stopping else sched.schedule()
                try:
                    in_flight = None if step is None else self._submit(step)
                finally:  # this step's tokens reach their streams also when the next step cannot be sent
                    with self._lock:
                        self._deliver(seqs)
                        counters["steps"] += 1
                        counters["prefill_steps" if batch.is_prefill else "decode_steps"] += 1
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting requests
            self._fail(exc)

    def _wait_for_step(self) -> tuple[list[Sequence], StepBatch] | None:
        """The next step, waiting (idle) while there is no work; None once stopping."""
        with self._lock:
            step = None if self._stopping else self._scheduler.schedule()
            while step is None:
                if self._stopping:
                    return None
                self._idle_since = time.perf_counter()
                self._work.wait(IDLE_CHECK_S)
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
                if not self._stopping and not self._pool.alive:
                    raise EngineError("an agent process exited while the engine was idle")
                step = None if self._stopping else self._scheduler.schedule()
            return step

    def _submit(self, step: tuple[list[Sequence], StepBatch]) -> tuple[list[Sequence], StepBatch, int]:
        """Send a scheduled step to the agents: ``(seqs, batch, step number)`` for ``AgentPool.collect``."""
        seqs, batch = step
        t0 = time.perf_counter()
        number = self._pool.submit(batch)
        self._run_step_s += time.perf_counter() - t0
        return seqs, batch, number

    def _deliver(self, seqs: list[Sequence]) -> None:
        """Hand each sequence's new token to its stream (under the lock); one wake-up per event loop."""
        now, streams, running = time.monotonic(), self._streams, SequenceStatus.RUNNING
        loops: dict[Any, list[RequestStream]] = {}
        delivered = finished = 0
        for seq in seqs:
            stream = streams.get(seq.request_id)
            if stream is None or stream._seq is not seq:
                continue  # ended from outside while the step was in flight (its id may be reused already)
            reason = None if seq.status is running else seq.finish_reason
            if reason is not None:
                del streams[seq.request_id]
                finished += 1
            delivered += 1
            _push(loops, stream, (seq.output_ids[-1], seq.output_logprobs[-1], reason, now))
        self._counters["tokens_generated"] += delivered
        self._counters["requests_finished"] += finished
        _wake_loops(loops)

    def _finish_locked(self, request_id: str, reason: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if self._scheduler is not None:
            self._scheduler.finish_request(request_id, reason)
        if stream is None:
            return False
        self._counters["requests_aborted"] += reason == "abort"
        loops: dict[Any, list[RequestStream]] = {}
        _push(loops, stream, (NO_TOKEN, 0.0, reason, time.monotonic()))
        _wake_loops(loops)
        return True

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> None:
        """An agent could not run this step (e.g. a shape beyond its buckets): its requests end with an
        error; the agents and the other requests go on."""
        err = EngineError(f"the model step failed: {exc}")
        err.__cause__ = exc
        log.error("step failed for %d request(s): %s", len(seqs), exc)
        with self._lock:
            loops: dict[Any, list[RequestStream]] = {}
            for seq in seqs:
                stream = self._streams.pop(seq.request_id, None)
                self._scheduler.finish_request(seq.request_id, "abort")
                if stream is not None:
                    _push(loops, stream, err)
            _wake_loops(loops)

    def _fail(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc}")
        if err is not exc:
            err.__cause__ = exc
        with self._lock:
            self.ready = False
            self._error = err
            loops: dict[Any, list[RequestStream]] = {}
            for rid, stream in self._streams.items():
                try:
                    self._scheduler.finish_request(rid, "abort")  # frees the blocks; nothing runs any more
                except Exception:
                    log.debug("finish_request(%r) failed after an engine failure", rid, exc_info=True)
                _push(loops, stream, err)
            self._streams.clear()
            _wake_loops(loops)
        try:
            self._pool.close()
        except Exception:
            log.warning("closing the agent pool after an engine failure failed", exc_info=True)

    def _check_ready(self) -> None:
        if not self.ready:
            if self._stopping:
                raise EngineError("the engine was shut down; create a new Engine to serve again")
            if self._error is not None:
                raise EngineError(f"the engine has stopped: {self._error}")
            raise EngineError("the engine is not running (call start(); after shutdown create a new Engine)")


def _push(loops: dict[Any, list[RequestStream]], stream: RequestStream, item: Any) -> None:
    """Push ``item`` to ``stream``; note the stream under its consumer's event loop for one batched wake-up."""
    loop = stream._push(item)
    if loop is not None:
        loops.setdefault(loop, []).append(stream)


def _wake_loops(loops: dict[Any, list[RequestStream]]) -> None:
    for loop, streams in loops.items():
        try:
            loop.call_soon_threadsafe(_wake_streams, streams)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to wake
            pass


def _wake_streams(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream._wake_async()
