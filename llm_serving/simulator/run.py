"""The project's own scheduler, block manager and prefix cache on a virtual clock.

The loop is the engine's (``engine.loop``) with the agents replaced by a step-time model: requests that arrived by
the end of a step join before the next is scheduled (under asynchronous scheduling a decode step sent ahead
starts as the one before ends, before arrivals join: ``Scheduler.schedule_ahead``), and a step's tokens are
delivered when it ends. Every decision (admission order, chunking, preemption, prefix hits, multi-step) is made
by ``core.Scheduler`` itself. The tokens a step "produces" are a filler id, and the end-of-sequence id where a
request's model would end it (``SimRequest.output_tokens``: a replayed load test replays where its server's
model stopped, ``workload.from_results``), so requests ask for and are ordered by their ``max_new_tokens`` as on
the server. Requests naming a LoRA adapter (``SimRequest.adapter``) take the adapter slots of ``config.max_loras``
as on the server (a request whose adapter finds no slot waits) and their steps cost what the cost model says of
adapter rows (``StepShape.adapter_tokens``). Speculative decoding is refused: what it proposes depends on the real
tokens.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llm_serving.bench.metrics import compute_metrics
from llm_serving.bench.results import RequestResult
from llm_serving.bench.run_files import save_results
from llm_serving.core.adapters import Adapter
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.core.step_shape import StepShape
from llm_serving.protocol.batch import StepOutput
from llm_serving.protocol.lora import LoraConfig, LoraModule
from llm_serving.simulator.costs import StepCost
from llm_serving.simulator.workload import SimRequest


@dataclass
class SimRun:
    results: list[RequestResult]
    duration: float  # first arrival -> last token: the contest's total time
    running: list[tuple[float, float]] = field(default_factory=list)  # (time, running sequences) after each step
    kv_usage: list[tuple[float, float]] = field(default_factory=list)  # (time, share of KV blocks in use)
    steps: int = 0
    prefill_steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0

    @property
    def metrics(self) -> dict:
        m = compute_metrics(self.results, self.duration, self.running)
        m.update(steps=self.steps, prefill_steps=self.prefill_steps, preemptions=self.preemptions,
                 max_kv_usage=max((u for _, u in self.kv_usage), default=0.0),
                 prefix_cache_hit_tokens=self.prefix_hit_tokens)
        return m


def _output(seqs: list[Sequence], num_steps: int, token: int, end: int | None, lengths: dict[str, int]) -> StepOutput:
    """The step's picks: the filler, or the end id at the token where a request ends (without an end id the
    request asked for exactly its length, ``simulate``)."""
    picks = np.full((len(seqs), num_steps), token, np.int32)
    if end is not None:
        for row, seq in enumerate(seqs):
            if seq.request_id not in lengths:
                continue
            at = lengths[seq.request_id] - len(seq.output_ids) - 1  # its last token's index among this step's
            if 0 <= at < num_steps:
                picks[row, at] = end
    more = picks[:, 1:] if num_steps > 1 else None
    return StepOutput(picks[:, 0].copy(), np.zeros(len(seqs), np.float32), more_token_ids=more,
                      more_logprobs=None if more is None else np.zeros(more.shape, np.float32))


def filler_token(config: SchedulerConfig) -> int:
    """An id that ends no request (the simulated model's every pick)."""
    ends = {config.eos_token_id, *config.other_eos_token_ids}
    return next(t for t in range(3, 3 + len(ends) + 1) if t not in ends)


def simulate(config: SchedulerConfig, requests: list[SimRequest], cost: StepCost, request_overhead_s: float = 0.0,
             max_concurrency: int | None = None) -> SimRun:
    """Serve ``requests`` on the virtual clock. ``request_overhead_s``: what a request spends before the engine
    sees it and after its token leaves the engine (HTTP, tokenizing, streaming). ``max_concurrency``: the load
    tool's cap on requests in flight (a request waits for a finished one's slot before it is sent)."""
    if any(r.adapter is not None for r in requests) and not config.max_loras:
        raise ValueError("simulate: requests name LoRA adapters, but the configuration serves none (max_loras 0)")
    if config.speculative:
        raise ValueError("simulate: speculative decoding is not modelled (its proposals depend on the real tokens); "
                         "simulate the configuration without it")
    now = [0.0]
    sched = Scheduler(config, clock=lambda: now[0])
    token, end = filler_token(config), config.eos_token_id
    queue = deque(sorted(requests, key=lambda r: r.arrival_s))  # not sent yet
    free = [0.0] * max_concurrency if max_concurrency else None  # when each free client slot became free
    inbox: list[tuple[float, int, SimRequest]] = []  # sent, not yet seen by the engine: (engine time, index, req)
    results: dict[str, RequestResult] = {}
    lengths: dict[str, int] = {}  # tokens of the requests an end token ends (that token included)
    run = SimRun([], 0.0)
    ahead = None  # the step sent ahead of the one running (config.async_scheduling)
    adapters: dict[str, Adapter] = {}  # by name: what the scheduler sees of one (its weights are not simulated)

    def send_time() -> float | None:  # when the next queued request goes out (None: waits for a slot)
        if not queue or (free is not None and not free):
            return None
        return max(queue[0].arrival_s, free[0]) if free is not None else queue[0].arrival_s

    def send_and_admit() -> None:
        while (at := send_time()) is not None and at <= now[0]:
            req = queue.popleft()
            if free is not None:
                heapq.heappop(free)
            heapq.heappush(inbox, (at + request_overhead_s, req.index, req))
            results[f"sim-{req.index}"] = RequestResult(req.index, req.prompt, len(req.prompt_ids),
                                                        req.max_new_tokens, send_time=at)
        while inbox and inbox[0][0] <= now[0]:
            seen, _, req = heapq.heappop(inbox)
            asked = req.max_new_tokens if end is not None else req.length
            params = SamplingParams(asked, seed=0, priority=req.priority)
            seq = Sequence(f"sim-{req.index}", list(req.prompt_ids), params)
            seq.arrival_time = seen
            if req.adapter is not None:
                seq.adapter = adapters.setdefault(req.adapter, Adapter(
                    req.adapter, "", LoraConfig((LoraModule(0, "q_proj", 1, 1.0),)), len(adapters)))
            sched.add(seq)
            if req.length < asked:  # its model ends it early
                lengths[seq.request_id] = req.length

    while queue or inbox or sched.has_unfinished():
        send_and_admit()
        step, ahead = ahead if ahead is not None else sched.schedule(), None
        if step is None:
            events = [t for t in (send_time(), inbox[0][0] if inbox else None) if t is not None]
            if not events:
                raise RuntimeError("simulate: requests are left but nothing can run or arrive")
            now[0] = max(now[0], min(events))
            continue
        seqs, batch = step
        ahead = sched.schedule_ahead(seqs, batch)  # None unless config.async_scheduling allows one
        before = [len(s.output_ids) for s in seqs]
        now[0] += cost.seconds(StepShape.of(batch, sched.config.block_size))
        sched.postprocess(seqs, _output(seqs, batch.num_steps, token, end, lengths))
        seen = now[0] + request_overhead_s
        for seq, had in zip(seqs, before):
            res = results[seq.request_id]
            got = len(seq.output_ids) - had
            if got > 0:
                if res.ttft is None:
                    res.ttft = seen - res.send_time
                res.chunk_times += [seen] * got
                res.output_tokens += got
            if seq.is_finished and not res.success:
                res.success, res.end_time, res.finish_reason = True, seen, seq.finish_reason
                if free is not None:
                    heapq.heappush(free, seen)
        run.steps += batch.num_steps
        run.prefill_steps += batch.describe().computes_prompts
        run.running.append((now[0], float(sched.num_running)))
        run.kv_usage.append((now[0], sched.block_usage))
    run.results = sorted(results.values(), key=lambda r: r.index)
    run.duration = max((r.end_time for r in run.results), default=0.0) - min(r.arrival_s for r in requests)
    run.preemptions = sched.num_preemptions
    run.prefix_hit_tokens = sched.prefix_cache_stats()["prefix_cache_hit_tokens"]
    return run


def write_run(run: SimRun, out_dir, qps: float, settings: dict, draw: bool = True) -> dict:
    """The load tool's files for a simulated run (result json, summary, report, plots), plus KV use over time."""
    paths = save_results(out_dir, qps, run.results, run.duration, run.running, run.metrics, settings, draw)
    kv = Path(out_dir) / f"kv_usage_{float(qps)}_x.json"
    kv.write_text(json.dumps(run.kv_usage))
    paths["kv_usage"] = kv
    return paths
