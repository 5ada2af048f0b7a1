"""The engine: config mapping, default-model cache, the step loop with stand-in agents (ordering, continuous
batching, aborts, async cancellation, failures), and greedy results of a real tiny Llama on 2 agents against
one-request-at-a-time runs and Hugging Face transformers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from agents.agent_main import fed_inputs
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.engine import wiring
from llm_serving.engine.llm import LLM
from llm_serving.engine.loop import Engine, EngineError
from llm_serving.engine.request_stream import NO_TOKEN
from llm_serving.engine.wiring import agent_spec, resolve_model, runner_config_dict, scheduler_config
from llm_serving.executor.agent_pool import AgentDiedError, AgentPool, AgentStepError
from llm_serving.models.default_model import default_model_dir, ensure_default_model
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.shm_channel import NAME_PREFIX
from llm_serving.protocol.wire import AgentSpec
from llm_serving.request_errors import QueueFull, RequestRejected
from llm_serving.tokenization.tokenizer import Tokenizer
from tests.stand_in_pool import StandInPool

VOCAB = 1000
EOS = 2
TINY_MODEL = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "vocab_size": VOCAB, "seed": 3}


def tiny_config(data_dir: Path, **sections) -> ServingConfig:
    d = {"default_model": {"data_dir": str(data_dir), **TINY_MODEL},
         "model_config": {"seq_length": [32], "prefill_batch_size": [4], "decode_batch_size": [32]},
         "pa_config": {"num_blocks": 256, "block_size": 8, "decode_seq_length": 64},
         "scheduler": {"policy": "fcfs"}}
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return ServingConfig.from_dict(d)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine_models")


def standin_expected(prompt: list[int], params: SamplingParams, vocab: int = VOCAB) -> tuple[list[int], str]:
    """The stand-in agent's documented rule applied to a whole generation."""
    tokens, out = list(prompt), []
    while True:
        t = (tokens[-1] * 31 + len(tokens)) % vocab
        tokens.append(t)
        out.append(t)
        if t == EOS and not params.ignore_eos:
            return out, "eos"
        if len(out) >= params.max_new_tokens:
            return out, "length"


def standin_output(batch: StepBatch, vocab: int = VOCAB) -> StepOutput:
    last = np.cumsum(batch.query_lens) - 1
    tokens = (batch.input_ids[last].astype(np.int64) * 31 + batch.context_lens) % vocab
    return StepOutput(tokens.astype(np.int32), np.full(batch.batch_size, -1.0, np.float32))


class StandinFeeder:
    """The stand-in rule run as the agents run steps: one sent ahead is fed the picks of the step before
    (``agents.agent_main.fed_inputs``), and a failed step leaves nothing to feed."""

    def __init__(self, vocab: int = VOCAB) -> None:
        self.vocab = vocab
        self.picked: np.ndarray | None = None

    def run(self, batch: StepBatch, fails: Exception | None = None) -> StepOutput:
        """The answer to ``batch``, or ``fails`` raised (the agents then have no picks)."""
        picked, self.picked = self.picked, None
        if fails is not None:
            raise fails
        if batch.feeds_previous:
            try:
                batch = dataclasses.replace(batch, input_ids=fed_inputs(picked, batch), fed_rows=None)
            except RuntimeError as exc:  # as an agent reports it
                raise AgentStepError(f"agent rank 0 failed the step: {exc}", rank=0) from None
        output = standin_output(batch, self.vocab)
        self.picked = output.token_ids
        return output


def our_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"{NAME_PREFIX}{os.getpid()}_")}


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class GatedPool(StandInPool):
    """In-process stand-in pool whose steps the test releases one at a time (``step()``)."""

    def __init__(self, spec: AgentSpec) -> None:
        self.vocab = spec.llama_config["vocab_size"]
        self.alive = True
        self.batches: list[StepBatch] = []
        self.entered = threading.Semaphore(0)
        self.gate = threading.Semaphore(0)
        self.fail_next: Exception | None = None
        self.feeder = StandinFeeder(self.vocab)

    def submit(self, batch: StepBatch) -> int:
        self.batches.append(batch)
        self.entered.release()
        return len(self.batches)

    def collect(self, step: int, batch_size: int) -> StepOutput:
        batch = self.batches[step - 1]
        while not self.gate.acquire(timeout=0.05):
            if not self.alive:
                raise AgentDiedError("the gated pool was closed during a step")
        exc, self.fail_next = self.fail_next, None
        return self.feeder.run(batch, exc)

    def step(self) -> StepBatch:
        """Wait until the engine has submitted a step, then let that step finish."""
        assert self.entered.acquire(timeout=10), "the engine did not start a step"
        batch = self.batches[-1]
        self.gate.release()
        return batch

    def close(self, graceful: bool = True) -> None:
        self.alive = False


def stop(engine: Engine, pool: GatedPool) -> None:
    pool.close()  # a step waiting at the gate fails instead of holding up shutdown
    engine.shutdown()


def gated_engine(data_dir: Path, **sections) -> tuple[Engine, GatedPool]:
    pools: list[GatedPool] = []

    def factory(spec):
        pools.append(GatedPool(spec))
        return pools[-1]

    engine = Engine(tiny_config(data_dir, **sections), pool_factory=factory)
    engine.start(progress=None)
    return engine, pools[0]


def standin_factory(pools: list, step_delay_s: float = 0.0):
    def factory(spec):
        pools.append(AgentPool(dataclasses.replace(spec, step_delay_s=step_delay_s)))
        return pools[-1]
    return factory


# ---- configuration -----------------------------------------------------------------------------------------
def test_config_maps_to_scheduler_runner_and_agent_spec(data_dir):
    cfg = tiny_config(data_dir, model_config={"prefill_batch_size": [1, 4], "decode_batch_size": [8, 32]},
                      scheduler={"policy": "longest_output_first", "max_wait_s": 2.0,
                                 "min_decode_steps_between_prefills": 3})
    sc = scheduler_config(cfg, eos_token_id=EOS)
    assert (sc.max_num_seqs, sc.max_prefill_batch, sc.max_model_len, sc.max_prompt_len) == (32, 4, 64, 32)
    assert (sc.num_blocks, sc.block_size, sc.eos_token_id, sc.policy) == (256, 8, EOS, "longest_output_first")
    assert (sc.max_wait_s, sc.min_decode_steps_between_prefills) == (2.0, 3)
    assert sc.max_num_batched_tokens == 4 * 32  # max(prefill batch x longest bucket, max_model_len)
    assert sc.chunked_prefill and sc.prefix_caching  # both on by default
    rc = runner_config_dict(cfg)
    expected = {"num_blocks": 256, "block_size": 8, "max_model_len": 64, "prefill_batch_sizes": [1, 4],
                "prefill_seq_lengths": [32], "decode_batch_sizes": [8, 32], "dtype": "float32",
                "kernels": "auto", "mixed_steps": True, "max_num_batched_tokens": 128}
    assert {key: rc[key] for key in expected} == expected
    model = resolve_model(cfg)
    spec = agent_spec(cfg, model, standin=True)
    assert spec.kind == "standin" and spec.llama_config["vocab_size"] == VOCAB
    assert (spec.max_tokens, spec.max_batch, spec.max_blocks_per_seq) == (128, 32, 8)
    assert spec.max_penalty_tokens == min(255 * 8, 32 * 64)  # KV slots vs. batch x max_model_len
    assert spec.tensor_parallel_size == cfg.num_agents == 1


def test_resolve_model_errors_name_the_key(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="model_config.model_path: .*does not exist"):
        resolve_model(tiny_config(data_dir, model_config={"model_path": str(tmp_path / "nope")}))
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="model_config.model_path: no config.json"):
        resolve_model(tiny_config(data_dir, model_config={"model_path": str(tmp_path / "m")}))
    with pytest.raises(ConfigError, match="model_config.vocab_size: 999 does not match .* vocab_size 1000"):
        resolve_model(tiny_config(data_dir, model_config={"vocab_size": 999}))
    with pytest.raises(ConfigError, match="tokenizer.vocab_file: no tokenizer at"):
        resolve_model(tiny_config(data_dir, tokenizer={"vocab_file": str(tmp_path / "x.model")}))


def test_a_kv_cache_larger_than_the_hosts_free_memory_is_refused(data_dir, monkeypatch):
    """CPU agents back their caches as tokens fill them: a cache that cannot fit is a config error at start-up,
    not an agent killed for memory mid-serving."""
    cfg = tiny_config(data_dir)  # 256 blocks of 8 tokens, float32
    llama = resolve_model(cfg).llama_config
    per_agent = 256 * 8 * 2 * llama.num_key_value_heads * llama.head_dim * llama.num_hidden_layers * 4
    monkeypatch.setattr(wiring, "available_memory_bytes", lambda: per_agent - 1)
    with pytest.raises(ConfigError, match="pa_config.num_blocks: 256 blocks of 8 tokens make .* more than this "
                                          "host's .* available memory: lower it"):
        resolve_model(cfg)
    monkeypatch.setattr(wiring, "available_memory_bytes", lambda: per_agent)
    assert resolve_model(cfg).llama_config == llama
    monkeypatch.undo()
    assert wiring.available_memory_bytes() is None or wiring.available_memory_bytes() > 0


def test_default_model_is_built_once_even_by_concurrent_starts(tmp_path):
    cfg = tiny_config(tmp_path)
    barrier = threading.Barrier(4)

    def build(_):
        barrier.wait()
        return ensure_default_model(cfg.default_model, cfg.max_model_len)

    with ThreadPoolExecutor(4) as ex:
        paths = list(ex.map(build, range(4)))
    assert len(set(paths)) == 1 and paths[0] == default_model_dir(cfg.default_model, cfg.max_model_len)
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths[0].name]  # no temporary dirs left
    stamp = (paths[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(cfg.default_model, cfg.max_model_len) == paths[0]
    assert (paths[0] / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    llama = LlamaConfig.from_model_dir(paths[0])
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads, llama.vocab_size) == (
        64, 2, 2, VOCAB)
    assert Tokenizer(paths[0]).vocab_size == VOCAB
    other = tiny_config(tmp_path, default_model={"seed": 4}).default_model
    assert default_model_dir(other) != paths[0]  # a different recipe never reuses the cache


# ---- scheduler extension: prompt buckets -------------------------------------------------------------------
def test_long_prompts_and_long_recomputes_are_prefilled_alone_without_chunked_prefill():
    cfg = SchedulerConfig(num_blocks=13, block_size=4, max_num_seqs=4, max_prefill_batch=4,
                          max_num_batched_tokens=40, max_model_len=40, eos_token_id=None, max_prompt_len=16)
    s = Scheduler(cfg)
    with pytest.raises(ValueError, match="17 prompt tokens, 41 in all .*admission refuses this"):
        s.add(Sequence("too-long", list(range(3, 20)), SamplingParams(max_new_tokens=24)))
    rng = random.Random(0)
    for i in range(12):  # prompts past max_prompt_len (16) are served too
        s.add(Sequence(f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randint(8, 24))],
                       SamplingParams(max_new_tokens=rng.randint(10, 16))))
    alone = 0
    while s.has_unfinished():
        seqs, batch = s.schedule()
        if batch.describe().computes_prompts and int(batch.query_lens.max()) > 16:
            assert batch.batch_size == 1
            alone += 1
        s.postprocess(seqs, standin_output(batch))
    assert s.num_preemptions > 0 and alone > 0 and s.num_used_blocks == 0


# ---- the loop with stand-in agents -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def standin_engine(data_dir):
    engine = Engine(tiny_config(data_dir), standin_agents=True,
                    pool_factory=standin_factory([], step_delay_s=0.002))  # steps long enough to cancel
    engine.start(progress=None)
    yield engine
    engine.shutdown()


def random_requests(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..32 tokens (bos first), 1..30 new tokens, some ignoring eos."""
    return [([1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 31))],
             SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3))
            for _ in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "longest_output_first", "priority"])
def test_standin_results_in_order_with_arrivals_during_decode(data_dir, policy):
    pools: list[AgentPool] = []
    engine = Engine(tiny_config(data_dir, pa_config={"num_blocks": 48}, scheduler={"policy": policy}),
                    standin_agents=True, pool_factory=standin_factory(pools))
    engine.start(progress=None)
    segment = pools[0].shm_name
    try:
        rng = random.Random(policy)
        reqs = random_requests(rng, 80)
        if policy == "priority":  # preemption then picks by priority: every result still exact
            reqs = [(p, dataclasses.replace(params, priority=rng.randint(-2, 2))) for p, params in reqs]
        streams = [engine.submit(p, params) for p, params in reqs[:40]]
        wait_for(lambda: engine.stats()["decode_steps"] >= 3, what="decoding")
        streams += [engine.submit(p, params) for p, params in reqs[40:]]
        results = [s.result(timeout=30) for s in streams]
        for (prompt, params), res in zip(reqs, results):
            assert (res.token_ids, res.finish_reason) == standin_expected(prompt, params)
            assert res.prompt_ids == prompt and res.logprobs == [-1.0] * len(res.token_ids)
        stats = engine.stats()
        assert stats["num_preemptions"] > 0  # 48 blocks of 8 cannot hold 32 sequences
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
        assert stats["requests_finished"] == 80
        assert stats["tokens_generated"] == sum(len(r.token_ids) for r in results)
    finally:
        engine.shutdown()
    assert segment not in our_segments()


def test_text_streams_and_thread_iteration(standin_engine):
    tok = standin_engine.tokenizer
    stream = standin_engine.submit("The sea was calm that morning.", SamplingParams(max_new_tokens=20,
                                                                                    ignore_eos=True))
    events = list(stream)
    res = stream.result()
    assert [e.token_id for e in events] == res.token_ids and len(events) == 20
    assert [e.finished for e in events] == [False] * 19 + [True] and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == res.text
    assert res.prompt_ids == tok.encode("The sea was calm that morning.")
    assert res.arrival_time <= res.first_token_time <= res.finish_time


def test_async_streams_and_cancellation_aborts(standin_engine):
    async def run():
        long = standin_engine.submit([1, 7, 9], SamplingParams(max_new_tokens=60, ignore_eos=True))
        short = standin_engine.submit([1, 8, 9], SamplingParams(max_new_tokens=40, ignore_eos=True))
        seen: list = []

        async def consume():
            async for ev in long:
                seen.append(ev)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        short_events = [ev async for ev in short]
        return long, short, short_events

    aborted_before = standin_engine.stats()["requests_aborted"]
    long, short, short_events = asyncio.run(run())
    assert standin_engine.stats()["requests_aborted"] == aborted_before + 1
    assert standin_engine._scheduler.get(long.request_id) is None
    assert long.result().finish_reason == "abort" and len(long.result().token_ids) < 60
    want, _ = standin_expected([1, 8, 9], SamplingParams(max_new_tokens=40))
    assert [e.token_id for e in short_events] == want and short.result().finish_reason == "length"


def stop_across_tokens(texts: list[str]) -> tuple[str, str, int]:
    """A stop string spanning two tokens' texts: (stop, text before it, tokens up to the one completing it)."""
    k = next(i for i in range(2, len(texts) - 1) if texts[i] and texts[i + 1])
    full = "".join(texts)
    stop = texts[k][-1] + texts[k + 1][0]
    end = full.index(stop) + len(stop)
    n_tokens = next(j + 1 for j in range(len(texts)) if len("".join(texts[: j + 1])) >= end)
    return stop, full[: full.index(stop)], n_tokens


def test_stop_strings_end_the_request_at_the_stop_token(standin_engine):
    prompt, no_stop = "The river ran past the old mill and", SamplingParams(max_new_tokens=30, ignore_eos=True)
    events = list(standin_engine.submit(prompt, no_stop))
    stop, expected, n_tokens = stop_across_tokens([e.text for e in events])
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop, "never seen"])
    assert params.stop == (stop, "never seen")
    before = standin_engine.stats()
    res = standin_engine.submit(prompt, params).result(timeout=30)  # read once, at the end
    after = standin_engine.stats()
    assert (res.text, res.finish_reason) == (expected, "stop")
    assert res.token_ids == [e.token_id for e in events[:n_tokens]]
    # ended at that token: the token of the step in flight meanwhile was never delivered, the blocks are free
    assert after["tokens_generated"] - before["tokens_generated"] == n_tokens
    assert after["requests_finished"] == before["requests_finished"] + 1 and after["kv_blocks_used"] == 0
    streamed = list(standin_engine.submit(prompt, params))
    assert "".join(e.text for e in streamed) == expected and all(stop not in e.text for e in streamed)
    assert streamed[-1].finish_reason == "stop" and streamed[-1].token_id == events[n_tokens - 1].token_id


def test_rejections_and_queue_limit(data_dir):
    pools: list[GatedPool] = []
    engine = Engine(tiny_config(data_dir, model_config={"max_generate_length": 40},
                                serving_config={"max_queue_size": 3}),
                    pool_factory=lambda spec: pools.append(GatedPool(spec)) or pools[-1])
    with pytest.raises(EngineError, match="not running"):
        engine.submit("hi")
    for part in ("tokenizer", "model", "chat_template", "limits"):  # made by start(): an EngineError before it
        with pytest.raises(EngineError, match="not running"):
            getattr(engine, part)
    engine.start(progress=None)
    try:
        with pytest.raises(RequestRejected, match="64 tokens and leaves no room to generate"):
            engine.submit([1] * 64)
        with pytest.raises(RequestRejected, match=r"= 66 exceeds max_model_len 64"):
            engine.submit([1] * 30, SamplingParams(max_new_tokens=36))
        with pytest.raises(RequestRejected, match="max_new_tokens 41 exceeds .*max_generate_length 40") as err:
            engine.submit("hi", SamplingParams(max_new_tokens=41))
        assert err.value.field == "max_new_tokens"
        with pytest.raises(RequestRejected, match=r"outside the vocabulary 0..999") as err:
            engine.submit([1, 1000])
        assert err.value.field == "prompt"
        with pytest.raises(RequestRejected, match=r"outside the vocabulary 0..999"):
            engine.submit([1, -1])
        with pytest.raises(RequestRejected, match="prompt is empty"):
            engine.submit([])
        engine.submit("blocker")
        assert pools[0].entered.acquire(timeout=10)  # the engine is busy: later requests stay queued
        engine.submit("a", request_id="x")
        with pytest.raises(RequestRejected, match="already in progress"):
            engine.submit("b", request_id="x")
        engine.submit("c")
        engine.submit("d")
        with pytest.raises(QueueFull, match="3 requests are waiting .*max_queue_size 3"):
            engine.submit("e")
    finally:
        stop(engine, pools[0])
    with pytest.raises(EngineError, match="shut down"):
        engine.submit("hi")


def test_a_request_past_the_wait_bound_is_refused_while_the_admitted_complete(data_dir):
    """Admission by expected wait (serving_config.max_queue_wait_s): once the queue's drain rate is measured, a
    request with others queued ahead is refused when their expected wait passes the bound (here any wait at all);
    the requests admitted before complete, and with the queue drained a new one is admitted again."""
    engine, pool = gated_engine(data_dir, model_config={"decode_batch_size": [2], "prefill_batch_size": [2]},
                                serving_config={"max_queue_wait_s": 1e-9})
    try:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        prompts = [[5, 10 + i] for i in range(12)]
        streams = [engine.submit(p, params) for p in prompts]  # no rate measured yet: all queued
        for _ in range(12):  # two steps a wave of two: the 8th start with requests waiting comes by the 5th wave
            pool.step()  # the step released, its successor scheduled: the stats are those after it
            stats = engine.stats()
            if stats["queue_drain_tokens_per_s"] > 0:
                break
        assert stats["queue_drain_tokens_per_s"] > 0 and stats["num_waiting"] > 0 and stats["queue_wait_s"] > 0
        with pytest.raises(QueueFull, match=r"would wait about .*serving_config.max_queue_wait_s 1e-09") as err:
            engine.submit([5, 99], params)
        assert err.value.retry_after >= 1
        for _ in range(100):  # from here on steps run freely
            pool.gate.release()
        for prompt, stream in zip(prompts, streams):
            res = stream.result(timeout=30)
            assert (res.token_ids, res.finish_reason) == standin_expected(prompt, params)
        after = engine.submit([5, 99], params).result(timeout=30)  # nothing queued ahead: admitted
        assert (after.token_ids, after.finish_reason) == standin_expected([5, 99], params)
        stats = engine.stats()
        assert stats["requests_finished"] == 13 and stats["kv_blocks_used"] == 0 and stats["num_waiting"] == 0
    finally:
        stop(engine, pool)


def test_a_prompt_longer_than_the_prefill_buckets_is_served_in_chunks(data_dir):
    """Issue 15's report: a prompt past the largest seq_length bucket (32) but within the model length (64)."""
    pools: list[RecordingPool] = []
    engine = Engine(tiny_config(data_dir, scheduler={"max_num_batched_tokens": 32}), standin_agents=True,
                    pool_factory=lambda spec: pools.append(RecordingPool(spec)) or pools[-1])
    engine.start(progress=None)
    try:
        prompt, params = [1] + list(range(3, 62)), SamplingParams(max_new_tokens=4, ignore_eos=True)
        assert engine.submit(prompt, params).result(timeout=30).token_ids == standin_expected(prompt, params)[0]
        assert [q for prefill, _, q in pools[0].shapes if prefill] == [32, 28]  # 60 tokens in two chunks
    finally:
        engine.shutdown()


def test_abort_in_flight_is_never_computed_again(data_dir):
    engine, pool = gated_engine(data_dir)
    try:
        a = engine.submit([1, 5, 6], SamplingParams(max_new_tokens=50, ignore_eos=True))
        assert pool.entered.acquire(timeout=10)  # prefill of a in flight
        assert pool.entered.acquire(timeout=10)  # and a's first decode step, sent ahead of it (asynchronous)
        b = engine.submit([1, 7, 8], SamplingParams(max_new_tokens=50, ignore_eos=True))
        pool.gate.release()
        # sent ahead of a's decode step: b's prompt beside a's fed row (chunked prefill mixes them)
        mixed = pool.step()
        assert mixed.describe().computes_prompts and mixed.fed_rows.tolist() == [0, -1]
        assert pool.entered.acquire(timeout=10)  # the first decode step of a and b, sent ahead of the mixed one
        ahead = pool.batches[-1]
        assert ahead.batch_size == 2 and ahead.feeds_previous and not ahead.describe().computes_prompts
        used = engine.stats()["kv_blocks_used"]
        a.abort()
        assert engine.stats()["kv_blocks_used"] < used  # freed at once, while the steps are in flight
        pool.gate.release()  # the mixed step
        pool.gate.release()  # the decode step ahead of it: a's row is dropped
        for _ in range(3):
            assert pool.step().batch_size == 1  # only b from now on
        events = list(a)
        assert events[-1].finish_reason == "abort" and events[-1].token_id == NO_TOKEN
        assert [e.token_id for e in events[:-1]] == standin_expected([1, 5, 6], SamplingParams(2))[0]
        seen = len(pool.batches)
        c = engine.submit([1, 9], SamplingParams(max_new_tokens=1))  # joins between steps
        # the engine runs up to one step ahead of the steps let through (the gate was released once more than the
        # steps taken above), so c's prompt may be in the step before the last one submitted: look at all of them
        while not any(batch.describe().computes_prompts for batch in pool.batches[seen:]):
            pool.step()
        pool.step()  # one more: the step that computes c's prompt has finished
        assert c.result(timeout=10).token_ids == standin_expected([1, 9], SamplingParams(1))[0]
        b.abort()
        assert b.result().finish_reason == "abort" and engine.stats()["kv_blocks_used"] == 0
        assert not engine.abort(b.request_id)  # already ended
    finally:
        stop(engine, pool)


def test_stop_in_flight_then_reused_id_gets_only_its_own_tokens(data_dir):
    engine, pool = gated_engine(data_dir)
    try:
        old = engine.submit([1, 5], SamplingParams(max_new_tokens=20), request_id="x")
        pool.step()  # prefill
        # decode steps sent ahead (asynchronous scheduling): one of the prefill, and one of that decode step once the
        # prefill's token is in; both fed, both in flight at the stop: their tokens dropped
        assert pool.entered.acquire(timeout=10) and pool.entered.acquire(timeout=10)
        assert pool.batches[-1].feeds_previous and pool.batches[-2].feeds_previous
        assert engine.finish("x", "stop")
        new = engine.submit([1, 6, 7], SamplingParams(max_new_tokens=2), request_id="x")
        pool.gate.release()
        pool.gate.release()
        pool.step()  # prefill of the new "x"
        pool.step()  # its decode
        assert old.result(timeout=10).finish_reason == "stop" and len(old.result().token_ids) == 1
        assert new.result(timeout=10).token_ids == standin_expected([1, 6, 7], SamplingParams(2))[0]
    finally:
        stop(engine, pool)


def test_shutdown_aborts_waiting_and_running(data_dir):
    engine, pool = gated_engine(data_dir)
    a = engine.submit([1, 5], SamplingParams(max_new_tokens=30))
    pool.step()
    b = engine.submit([1, 6], SamplingParams(max_new_tokens=30))
    assert pool.entered.acquire(timeout=10)
    # the step in flight and the one the engine sent ahead of it finish (else shutdown waits SHUTDOWN_JOIN_S for
    # a step the gate holds, then stops the agents)
    threading.Timer(0.05, pool.gate.release, (2,)).start()
    engine.shutdown()
    assert a.result(timeout=5).finish_reason == "abort" and b.result(timeout=5).finish_reason == "abort"
    engine.shutdown()  # idempotent


def test_llm_generate_waits_when_the_queue_is_full(data_dir):
    cfg = tiny_config(data_dir, serving_config={"max_queue_size": 2}, model_config={"decode_batch_size": [4]})
    reqs = random_requests(random.Random(5), 30)
    with LLM(cfg, standin_agents=True, progress=None) as llm:
        results = llm.generate([p for p, _ in reqs], sampling_params=[params for _, params in reqs])
        assert [(r.token_ids, r.finish_reason) for r in results] == [standin_expected(p, params)
                                                                   for p, params in reqs]
        single = llm.generate("Once upon a time", max_new_tokens=4, ignore_eos=True)
        assert len(single) == 1 and len(single[0].token_ids) == 4 and single[0].prompt == "Once upon a time"
        # Stop strings offline: results are read one by one, yet each request ends at its stop token.
        prompts, no_stop = [p for p, _ in reqs[:12]], SamplingParams(30, ignore_eos=True)
        stops = [stop_across_tokens([e.text for e in llm.engine.submit(p, no_stop)]) for p in prompts]
        full = llm.generate(prompts, sampling_params=no_stop)
        before = llm.engine.stats()["tokens_generated"]
        stopped = llm.generate(prompts, sampling_params=[SamplingParams(30, True, stop=s) for s, _, _ in stops])
        for res, ref, (_, expected, n_tokens) in zip(stopped, full, stops):
            assert (res.text, res.finish_reason, res.token_ids) == (expected, "stop", ref.token_ids[:n_tokens])
        stats = llm.engine.stats()
        assert stats["tokens_generated"] - before == sum(n for _, _, n in stops) and stats["kv_blocks_used"] == 0
        assert llm.generate([prompts[0]], max_new_tokens=30, ignore_eos=True, stop=stops[0][0])[0].text == stops[0][1]
    assert not llm.engine.ready
    with pytest.raises(TypeError, match="unknown override"):
        LLM(cfg, standin_agents=True, bogus=1)


# ---- the real tiny Llama on 2 agents -----------------------------------------------------------------------
class RecordingPool(StandInPool):
    """A real AgentPool that also records (whether it computes prompts, batch size, longest query) of every step."""

    def __init__(self, spec: AgentSpec) -> None:
        self.pool = AgentPool(spec)
        self.shapes: list[tuple[bool, int, int]] = []
        self.cached_context = 0  # steps with queries over cached context (chunks, decodes mixed in, cache hits)

    def start(self, progress=None) -> None:
        self.pool.start(progress)

    def submit(self, batch: StepBatch) -> int:
        self.shapes.append((batch.describe().computes_prompts, batch.batch_size, int(batch.query_lens.max())))
        self.cached_context += batch.describe().computes_prompts and bool(np.any(batch.context_lens > batch.query_lens))
        return self.pool.submit(batch)

    def collect(self, step: int, batch_size: int) -> StepOutput:
        return self.pool.collect(step, batch_size)

    def close(self, graceful: bool = True) -> None:
        self.pool.close(graceful)

    @property
    def alive(self) -> bool:
        return self.pool.alive


PROOF_SECTIONS = {
    "serving_config": {"num_agents": 2},
    # 32 running sequences need up to 256 blocks of 8; 100 forces preemptions and long recomputes. The 2 agents
    # are tensor-parallel ranks, each caching 1 of the 2 kv heads: 50 blocks of one device's memory hold 100.
    "pa_config": {"num_blocks": 50, "block_size": 8, "decode_seq_length": 64},
}


@pytest.fixture(scope="module")
def proof_workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(11)
    return [([1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2 if i % 3 else 20, 31))],
             SamplingParams(max_new_tokens=rng.randint(1, 30))) for i in range(48)]


@pytest.fixture(scope="module")
def references(data_dir, proof_workload):
    """Hugging Face greedy results on the same weights; the first engine adds one-at-a-time runs."""
    from tests.hf_reference import hf_greedy, load_hf

    cfg = tiny_config(data_dir, **PROOF_SECTIONS)
    hf = load_hf(resolve_model(cfg).model_path)
    return {"hf": [hf_greedy(hf, p, params.max_new_tokens, eos_token_id=EOS) for p, params in proof_workload]}


@pytest.mark.parametrize("policy,chunked", [("longest_output_first", True), ("fcfs", False)],
                         ids=["lof-chunked-prefix-cache", "fcfs-unchunked"])
def test_real_llama_two_agents_match_sequential_and_transformers(data_dir, proof_workload, references,
                                                                 policy, chunked):
    """The serving default (chunked prefill, prefix caching) and neither: the same answers as HF."""
    pools: list[RecordingPool] = []
    cfg = tiny_config(data_dir, scheduler={"policy": policy, "enable_chunked_prefill": chunked,
                                           "enable_prefix_caching": chunked,
                                           "max_num_batched_tokens": 48 if chunked else None}, **PROOF_SECTIONS)
    engine = Engine(cfg, pool_factory=lambda spec: pools.append(RecordingPool(spec)) or pools[-1])
    engine.start(progress=None)
    agents = pools[0].pool
    try:
        assert len(agents.pids) == 2
        if "sequential" not in references:  # one request at a time through the same model
            references["sequential"] = [engine.submit(p, params).result(timeout=60)
                                        for p, params in proof_workload]
            assert max(b for _, b, _ in pools[0].shapes) == 1
        before, first_step = engine.stats(), len(pools[0].shapes)
        streams = [engine.submit(p, params) for p, params in proof_workload[:30]]
        wait_for(lambda: engine.stats()["decode_steps"] >= before["decode_steps"] + 3, what="decoding")
        streams += [engine.submit(p, params) for p, params in proof_workload[30:]]  # arrive during decode
        results = [s.result(timeout=60) for s in streams]
        stats, shapes = engine.stats(), pools[0].shapes[first_step:]
        for res, seq_res, (hf_tokens, hf_logprobs) in zip(results, references["sequential"],
                                                          references["hf"]):
            assert res.token_ids == seq_res.token_ids == hf_tokens
            np.testing.assert_allclose(res.logprobs, hf_logprobs, atol=1e-4)
        assert len({t for res in results for t in res.token_ids}) > 50  # not a degenerate model
        assert max(b for prefill, b, _ in shapes if not prefill) >= 16  # a large continuous decode batch
        assert max(b for prefill, b, _ in shapes if prefill) > 1  # multi-request prefill
        if chunked:  # decode tokens with prompt chunks, chunks over cached context, recomputes hitting the cache
            assert pools[0].cached_context > 0 and max(q for _, _, q in shapes) <= 48
        else:
            assert any(prefill and b == 1 and q > 32 for prefill, b, q in shapes)  # long recompute, alone
        assert stats["num_preemptions"] > before["num_preemptions"] and stats["kv_blocks_used"] == 0

        # An agent killed while steps run: new agents recompute the running requests, whose answers do not
        # change (issue 18, finding 4); the old agents and their shared memory are gone.
        segment, old_pids = agents.shm_name, agents.pids
        streams = [engine.submit(p, params) for p, params in proof_workload]
        wait_for(lambda: engine.stats()["decode_steps"] > stats["decode_steps"] + 2, what="decoding")
        os.kill(old_pids[0], signal.SIGKILL)
        results = [s.result(timeout=180) for s in streams]
        for res, (hf_tokens, hf_logprobs) in zip(results, references["hf"]):
            assert res.token_ids == hf_tokens
            np.testing.assert_allclose(res.logprobs, hf_logprobs, atol=1e-4)
        stats = engine.stats()
        assert engine.ready and stats["agent_restarts"] == 1 and stats["requests_recomputed"] > 0
        assert stats["kv_blocks_used"] == 0 and segment not in our_segments()
        for pid in old_pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        engine.shutdown()
    assert segment not in our_segments()
