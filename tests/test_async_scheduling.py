"""Asynchronous scheduling (issue 31): while a plain decode step runs, the next one of the same sequences is scheduled
and sent, its inputs the agents' own picks (``Scheduler.schedule_ahead``, ``StepBatch.fed_rows``). The tokens
and finish reasons are those of one step at a time (the fake KV model reads every context back through the cache,
driven as the engine loop drives the agents; then the real tiny model with EOS, stop strings and token limits), a
sequence that ends with a step has its token of the step ahead dropped and no block is left held, and no step is
sent ahead whenever the master is needed between the two."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agents.agent_main import fed_inputs, last_picks
from agents.runtime.multi_step import run_decode_steps
from llm_serving.config.serving_config import ConfigError
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.engine.loop import Engine
from llm_serving.executor.agent_pool import AgentStepError
from llm_serving.protocol.batch import StepBatch, StepOutput
from tests.stand_in_pool import StandInPool
from tests.test_engine import StandinFeeder, standin_expected, tiny_config
from tests.test_scheduler import FakeKVModel, config, expected_output
from tests.tiny_engine import tiny_engine_config


class FeedingModel:
    """The fake KV model run as an agent runs steps: in the order sent, a fed step taking the last step's picks."""

    def __init__(self, s: Scheduler) -> None:
        self.model = FakeKVModel(s.config.num_blocks, s.config.block_size)
        self.block_size = s.config.block_size
        self.picked = None

    def run(self, batch: StepBatch) -> StepOutput:
        if batch.feeds_previous:
            batch = replace(batch, input_ids=fed_inputs(self.picked, batch), fed_rows=None)
        step = self.model.step
        out = step(batch) if batch.num_steps == 1 else run_decode_steps(step, batch, self.block_size)
        self.picked = last_picks(out)
        return out


def serve(s: Scheduler, seqs: list[Sequence], end_after: dict[str, int] | None = None,
          arrivals: dict[int, list[Sequence]] | None = None, aborts: dict[int, str] | None = None,
          sent: list[StepBatch] | None = None) -> int:
    """Serve ``seqs`` as the engine loop does with asynchronous scheduling: a step is computed when it is sent, the
    step ahead is sent before the one in flight is postprocessed. ``end_after``: request id -> the number of its
    tokens after which it is finished as a stop string would end it (between postprocess and the next step).
    ``arrivals``: loop turn -> requests that arrive while that turn's step is in flight (before the step ahead is
    scheduled); ``aborts``: loop turn -> a request aborted while that turn's step and the one ahead are in flight;
    ``sent``: collects the steps sent ahead. Returns how many steps were sent ahead."""
    for seq in seqs:
        s.add(seq)
    arrivals, aborts = dict(arrivals or {}), aborts or {}
    model, ahead_steps, in_flight = FeedingModel(s), 0, None
    multi_ahead, turn = 0, 0
    while s.has_unfinished() or in_flight is not None or arrivals:
        for seq in arrivals.pop(turn, []):
            s.add(seq)
        turn += 1
        if in_flight is None:
            step = s.schedule()
            if step is None:
                continue
            in_flight = (*step, model.run(step[1]))
        scheduled, batch, out = in_flight
        nxt = s.schedule_ahead(scheduled, batch)
        ahead = None if nxt is None else (*nxt, model.run(nxt[1]))
        ahead_steps += ahead is not None
        multi_ahead += ahead is not None and ahead[1].num_steps > 1 and batch.num_steps > 1
        if ahead is not None and sent is not None:
            sent.append(ahead[1])
        if turn - 1 in aborts:
            s.abort(aborts[turn - 1])
        s.postprocess(scheduled, out)
        for seq in scheduled:
            if end_after and not seq.is_finished and len(seq.output_ids) >= end_after.get(seq.request_id, 1 << 30):
                s.finish_request(seq.request_id, "stop")
        in_flight = ahead
    assert multi_ahead or s.config.decode_steps == 1  # several steps sent ahead of several steps
    return ahead_steps


def prompts(limits: tuple[int, ...] = (1, 2, 5, 9, 13, 30)) -> list[Sequence]:
    return [Sequence(f"r{i}", [10 + (7 * i + j) % 23 for j in range(3 + i)],
                     SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0)) for i, n in enumerate(limits)]


@pytest.mark.parametrize("kw", [{}, {"chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": True},
                                {"decode_steps": 4}], ids=["whole-prompts", "chunked-cached", "multi-step"])
def test_the_tokens_are_those_of_one_step_at_a_time(kw):
    s = Scheduler(config(max_num_seqs=8, async_scheduling=True, **kw))
    seqs = prompts((1, 2, 5, 9, 13, 30) if "decode_steps" not in kw else (9, 21, 30, 37, 40, 50))
    assert serve(s, seqs) >= 5
    for seq in seqs:
        assert (seq.output_ids, seq.finish_reason) == expected_output(seq.prompt_ids, seq.params), seq
        assert len(seq.output_logprobs) == len(seq.output_ids)
    assert any(seq.finish_reason == "eos" for seq in seqs)  # an EOS while the step after was in flight
    assert s.num_used_blocks == 0


def test_a_sequence_ended_between_steps_drops_its_token_ahead_and_its_blocks():
    s = Scheduler(config(max_num_seqs=4, async_scheduling=True))
    seqs = [Sequence(f"r{i}", [11 + i, 12, 13], SamplingParams(20, ignore_eos=True)) for i in range(3)]
    assert serve(s, seqs, end_after={"r1": 4}) > 0
    assert seqs[1].finish_reason == "stop" and len(seqs[1].output_ids) == 4  # not the token of the step ahead
    assert seqs[1].output_ids == expected_output(seqs[1].prompt_ids, SamplingParams(4, ignore_eos=True))[0]
    for seq in (seqs[0], seqs[2]):
        assert (seq.output_ids, seq.finish_reason) == expected_output(seq.prompt_ids, seq.params)
    assert s.num_used_blocks == 0


STREAM = {"whole-prompts": {}, "chunked": {"chunked_prefill": True, "max_num_batched_tokens": 16},
          "chunked-cached": {"chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": True},
          "chunked-tight": {"chunked_prefill": True, "max_num_batched_tokens": 16, "num_blocks": 14}}


@pytest.mark.parametrize("kw", STREAM.values(), ids=STREAM.keys())
def test_a_steady_stream_of_arrivals_is_admitted_in_the_steps_ahead(kw):
    """A request arriving every other step: with chunked prefill the step ahead of a decode (or of a step whose
    every row reaches its end) carries the fed decode rows and the new prompt's chunk, so steps keep being sent
    ahead; the tokens are those of one step at a time, prefix hits (a shared prompt start) and preemptions (few
    blocks) included, an abort while a step is ahead loses nothing, and every block comes back."""
    s = Scheduler(config(max_num_seqs=4, async_scheduling=True, **kw))
    shared = [10 + j % 23 for j in range(8)]  # two blocks every arrival may hit in the prefix cache
    stream = [Sequence(f"r{i}", shared[: 4 * (i % 3)] + [11 + (5 * i + j) % 19 for j in range(2 + i % 7)],
                       SamplingParams(max_new_tokens=4 + (3 * i) % 11, ignore_eos=i % 3 == 0)) for i in range(16)]
    sent: list[StepBatch] = []
    serve(s, stream[:1], arrivals={2 * i: [seq] for i, seq in enumerate(stream[1:], 1)}, aborts={9: "r4"}, sent=sent)
    for seq in stream:
        want = expected_output(seq.prompt_ids, seq.params)
        if seq.request_id == "r4":
            assert seq.finish_reason == "abort" and seq.output_ids == want[0][: len(seq.output_ids)]
            continue
        assert (seq.output_ids, seq.finish_reason) == want, seq
        assert len(seq.output_logprobs) == len(seq.output_ids)
    assert s.num_used_blocks == 0 and not s.has_unfinished()
    mixed = [b for b in sent if b.describe().computes_prompts]
    if "chunked_prefill" in kw:  # arrivals admitted in steps ahead, beside fed rows, and steps sent ahead of those
        assert any(b.fed_rows.min() < 0 <= b.fed_rows.max() for b in mixed)
        assert len(sent) > 3 * len(mixed) > 0
    else:  # whole prompts: an arrival waits for a step of the master's
        assert not mixed and sent
    if "num_blocks" in kw:
        assert s.num_preemptions > 0
    if "prefix_caching" in kw:
        assert s.prefix_cache_stats()["prefix_cache_hit_tokens"] > 0


def test_a_mixed_step_ahead_feeds_only_its_decode_rows():
    """The agents' side of a step ahead with a prompt chunk: the fed rows take the picks, the chunk keeps its ids;
    written out for a re-run in parts (``Engine._unfed``) the same."""
    s = Scheduler(config(max_num_seqs=4, chunked_prefill=True, max_num_batched_tokens=16, async_scheduling=True))
    plain = SamplingParams(max_new_tokens=6, ignore_eos=True)
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], plain), Sequence("b", [14, 15], plain))
    s.add(Sequence("c", [16, 17, 18, 19, 20], plain))
    seqs, ahead = s.schedule_ahead(scheduled, batch)
    assert [q.request_id for q in seqs] == ["a", "b", "c"] and ahead.fed_rows.tolist() == [0, 1, -1]
    ahead.validate()
    assert ahead.query_lens.tolist() == [1, 1, 5] and ahead.positions[:2].tolist() == (batch.positions + 1).tolist()
    picked = np.array([7, 8], np.int32)
    assert fed_inputs(picked, ahead).tolist() == [7, 8, 16, 17, 18, 19, 20]
    s.postprocess(scheduled, StepOutput(picked, np.zeros(2, np.float32)))
    assert Engine._unfed(seqs, ahead).input_ids.tolist() == [7, 8, 16, 17, 18, 19, 20]
    with pytest.raises(ValueError, match="take their input tokens"):
        replace(ahead, fed_rows=np.array([0, 1, 2], np.int32)).validate()  # a chunk cannot be fed


def decode_in_flight(s: Scheduler, *seqs: Sequence) -> tuple[list[Sequence], StepBatch]:
    """Admit ``seqs`` and run until a plain decode step is scheduled (returned, not run)."""
    model = FakeKVModel(s.config.num_blocks, s.config.block_size)
    for seq in seqs:
        s.add(seq)
    while True:
        scheduled, batch = s.schedule()
        if not batch.describe().computes_prompts:
            return scheduled, batch
        out = model.step(batch)
        wanted = [] if batch.want_logits is None else np.flatnonzero(batch.want_logits).tolist()
        out.logits = {row: np.zeros(64, np.float32) for row in wanted}  # the rows asked for (zeros will do)
        s.postprocess(scheduled, out)


def test_no_step_ahead_when_the_master_is_needed_between_steps():
    plain = SamplingParams(max_new_tokens=20, ignore_eos=True)
    s = Scheduler(config(max_num_seqs=2, max_prefill_batch=1, async_scheduling=True))
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], plain))
    seqs, ahead = s.schedule_ahead(scheduled, batch)
    assert ahead.feeds_previous and ahead.positions.tolist() == [batch.positions[0] + 1]
    assert ahead.context_lens.tolist() == [batch.context_lens[0] + 1] and seqs == scheduled
    assert s.schedule_ahead(seqs, ahead) is not None  # the engine sends one ahead of the step in flight only
    for other in (SamplingParams(20, ignore_eos=True, temperature=0.5, seed=1),  # sampled: the master draws
                  SamplingParams(20, ignore_eos=True, top_logprobs=2),  # logits to report
                  SamplingParams(20, ignore_eos=True, repetition_penalty=1.2),
                  SamplingParams(20, ignore_eos=True, min_tokens=3)):  # its EOS banned per step
        s = Scheduler(config(max_num_seqs=2, max_prefill_batch=1, async_scheduling=True))
        scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], plain), Sequence("b", [14, 15], other))
        assert s.schedule_ahead(scheduled, batch) is None, other
    s = Scheduler(config(max_num_seqs=2, async_scheduling=True))
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], SamplingParams(2, ignore_eos=True)))
    assert s.schedule_ahead(scheduled, batch) is None  # the step in flight gives its last token
    s = Scheduler(config(max_num_seqs=2, max_prefill_batch=2, async_scheduling=True))
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], SamplingParams(2, ignore_eos=True)),
                                        Sequence("b", [14, 15], plain))
    seqs, ahead = s.schedule_ahead(scheduled, batch)  # a ends with the step in flight: b goes on alone
    assert [q.request_id for q in scheduled] == ["a", "b"] and seqs == [scheduled[1]]
    assert ahead.fed_rows.tolist() == [1] and ahead.context_lens.tolist() == [batch.context_lens[1] + 1]
    s = Scheduler(config(max_num_seqs=1, async_scheduling=True))
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], plain))
    s.add(Sequence("b", [14, 15], plain))  # waits to be admitted: the next step is the master's to choose
    assert s.schedule_ahead(scheduled, batch) is None
    tight = Scheduler(config(num_blocks=3, block_size=4, max_model_len=8, max_num_seqs=2, async_scheduling=True))
    scheduled, batch = decode_in_flight(tight, Sequence("a", [11, 12, 13], SamplingParams(5, ignore_eos=True)),
                                        Sequence("b", [14, 15, 16], SamplingParams(3, ignore_eos=True)))
    assert tight.schedule_ahead(scheduled, batch) is None  # position 4 of each needs a block; one is free
    s = Scheduler(config(max_num_seqs=2))  # off
    scheduled, batch = decode_in_flight(s, Sequence("a", [11, 12, 13], plain))
    assert s.schedule_ahead(scheduled, batch) is None
    with pytest.raises(ValueError, match="speculative decoding proposes tokens between steps"):
        config(speculative="ngram", async_scheduling=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("async_models")


class FlakyPool(StandInPool):
    """An in-process stand-in pool (the agents' feeding, ``StandinFeeder``) that fails one step as a whole: the
    first one sent ahead (``fed``), or the first one a step was sent ahead of (``before``)."""

    def __init__(self, spec, fail: str) -> None:
        self.feeder, self.fail = StandinFeeder(spec.llama_config["vocab_size"]), fail
        self.batches, self.alive = [], True
        self.failed: list[StepBatch] = []

    def submit(self, batch: StepBatch) -> int:
        self.batches.append(batch)
        return len(self.batches)

    def collect(self, step: int, batch_size: int) -> StepOutput:
        batch = self.batches[step - 1]
        fed_next = len(self.batches) > step and self.batches[step].feeds_previous
        fails = not self.failed and (batch.feeds_previous if self.fail == "fed" else fed_next)
        if fails:
            self.failed.append(batch)
        return self.feeder.run(batch, AgentStepError("a transient fault", rank=0) if fails else None)


@pytest.mark.parametrize("fail", ["fed", "before"])
def test_a_failed_step_with_one_sent_ahead_is_rerun_and_the_tokens_stay_right(data_dir, fail):
    """A step failing as a whole is re-run in parts (``recovery.run_isolated``): a fed one with its inputs written
    out, and one whose successor was sent ahead after that successor is collected and dropped (its agents had no
    picks to feed it) and scheduled again."""
    pools: list[FlakyPool] = []
    engine = Engine(tiny_config(data_dir), standin_agents=True,
                    pool_factory=lambda spec: pools.append(FlakyPool(spec, fail)) or pools[-1])
    engine.start(progress=None)
    try:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        prompts = [[1, 5, 6], [1, 7], [1, 9, 10, 11]]
        streams = [engine.submit(p, params) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=30).token_ids == standin_expected(prompt, params)[0]
        stats = engine.stats()
        assert pools[0].failed and pools[0].failed[0].feeds_previous == (fail == "fed")
        assert stats["steps_sent_ahead"] > 0 and stats["kv_blocks_used"] == 0 and stats["requests_failed"] == 0
        assert stats["agent_restarts"] == 0
    finally:
        engine.shutdown()


def test_the_config_key_and_its_default(tmp_path):
    on = tiny_engine_config(tmp_path)
    assert on.async_scheduling and on.scheduler.async_scheduling is None
    assert not tiny_engine_config(tmp_path, scheduler={"async_scheduling": False}).async_scheduling
    assert not tiny_engine_config(tmp_path, speculative={"method": "ngram"}).async_scheduling
    with pytest.raises(ConfigError, match="scheduler.async_scheduling"):
        tiny_engine_config(tmp_path, scheduler={"async_scheduling": True}, speculative={"method": "ngram"})


def test_on_the_model_the_tokens_and_text_are_those_of_single_steps(tmp_path):
    prompts = [[1, 17, 230, 45, 9, 301], [1, 5, 6, 7], [1, 400, 401, 402, 403, 404, 405, 406, 407]]
    limits = [7, 13, 10]
    results = {}
    # plain async serves every other real-model test (the default); here beside sync, and with multi-step
    variants = {"sync": {"async_scheduling": False}, "async-k4": {"async_scheduling": True, "decode_steps": 4}}
    for name, scheduler in variants.items():
        cfg = tiny_engine_config(tmp_path, scheduler=scheduler)
        with Engine(cfg) as engine:
            engine.start(progress=None)
            plain = [engine.submit(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, limits)]
            plain = [s.result(timeout=120) for s in plain]
            if name == "sync":
                stop = engine.tokenizer.decode(plain[1].token_ids[5:7])
                eos = plain[0].token_ids[3]  # served as the end id: the request ends there, mid-batch
            cut = engine.submit(prompts[1], SamplingParams(13, ignore_eos=True, stop=(stop,))).result(timeout=120)
            ended = engine.submit(prompts[0], SamplingParams(7, stop_token_ids=(eos,))).result(timeout=120)
            sampled = engine.submit(prompts[2], SamplingParams(6, temperature=0.8, seed=3)).result(timeout=120)
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0
        results[name] = ([r.token_ids for r in plain], [r.finish_reason for r in plain], cut.text, cut.finish_reason,
                       cut.token_ids, ended.token_ids, ended.finish_reason, sampled.token_ids,
                       stats["steps_sent_ahead"])
    fast = results["async-k4"]
    assert fast[:8] == results["sync"][:8]
    assert fast[3] == "stop" and stop not in fast[2]
    assert fast[6] == "stop" and len(fast[5]) <= 4
    assert fast[8] >= 3 and results["sync"][8] == 0
