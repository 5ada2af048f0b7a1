"""OpenAI's and vLLM's further sampling controls: ``presence_penalty``/``frequency_penalty`` over the generated
tokens, ``logit_bias``, ``min_p``, ``min_tokens`` (the end ids banned until then) and ``stop_token_ids`` (finish
reason "stop"): the agent's arithmetic against plain numpy, the step arrays the scheduler builds for them and their
trip through shared memory, refusals named, and the routes serving them."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from agents.runtime.sampler import RowExtras, adjusted_logits, apply_min_p, sample, sample_row
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.core.step_builder import StepBuilder
from llm_serving.protocol.batch import SamplingBatch
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from llm_serving.request_errors import InvalidParameter
from tests.test_prefix_cache import chunked_prefix, step_once
from tests.test_scheduler import EOS, FakeKVModel
from tests.tiny_engine import openai_client, tiny_engine_config

RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal(50).astype(np.float32)


def test_penalties_bias_and_bans_are_openais_arithmetic():
    prompt, generated = np.array([3, 4, 4], np.int32), np.array([7, 7, 9, 3], np.int32)
    ids = np.concatenate([prompt, generated])
    extras = RowExtras(presence_penalty=0.5, frequency_penalty=0.25, output_start=3,
                       adjust_ids=np.array([11, 2], np.int32), adjust_values=np.array([5.0, -np.inf], np.float32))
    got = adjusted_logits(LOGITS, 1.0, ids, extras)
    want = LOGITS.astype(np.float64).copy()
    want[11] += 5.0
    want[2] = -np.inf
    for token, count in ((7, 2), (9, 1), (3, 1)):  # generated only: the prompt's 4s are not penalised
        want[token] -= 0.25 * count + 0.5
    np.testing.assert_array_equal(got, want)
    assert sample_row(LOGITS, 0.0, 0, 1.0, 1.0, ids, 0, 0, extras)[0] == int(np.argmax(want))  # greedy, adjusted


def test_min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_best():
    scaled = LOGITS.astype(np.float64)
    probs = np.exp(scaled - scaled.max())
    kept = np.isfinite(apply_min_p(scaled, 0.3))
    np.testing.assert_array_equal(kept, probs >= 0.3)
    draws = {sample_row(LOGITS, 1.0, 0, 1.0, 1.0, np.zeros(0, np.int32), 5, d, RowExtras(min_p=0.3))[0]
             for d in range(300)}
    assert draws <= set(np.flatnonzero(kept).tolist()) and len(draws) > 1


def test_a_banned_token_is_never_drawn_and_the_logprob_stays_the_raw_ones():
    banned = int(np.argmax(LOGITS))
    extras = RowExtras(adjust_ids=np.array([banned], np.int32), adjust_values=np.array([-np.inf], np.float32))
    for d in range(200):
        token, logprob = sample_row(LOGITS, 1.5, 0, 1.0, 1.0, np.zeros(0, np.int32), 1, d, extras)
        assert token != banned
        raw = LOGITS.astype(np.float64)
        assert logprob == pytest.approx(raw[token] - raw.max() - np.log(np.exp(raw - raw.max()).sum()))


def test_the_values_are_checked_and_named():
    for kwargs, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"min_p": -0.1}, "min_p"),
                          ({"logit_bias": {5: 101}}, "logit_bias"), ({"min_tokens": 20}, "min_tokens"),
                          ({"stop_token_ids": (-1,)}, "stop_token_ids"),
                          ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias")]:
        with pytest.raises(InvalidParameter, match=field):
            SamplingParams(max_new_tokens=16, **kwargs)
    params = SamplingParams(logit_bias={9: 1, 2: -3.5}, stop_token_ids=(5, 5, 6))
    assert params.logit_bias == ((2, -3.5), (9, 1.0)) and params.stop_token_ids == (5, 6) and params.needs_logits
    assert not SamplingParams(min_p=0.5).needs_logits  # min_p only narrows sampling; greedy stays in the graph


def test_the_master_and_the_agents_decide_alike_which_rows_read_logits():
    """``protocol.batch.needs_logits`` is the one rule: a request's parameters and its row of a step agree (a greedy
    min_p row beside rows with extras was read back and resampled on the agents, though the master counts it
    greedy)."""
    cases = {"greedy": SamplingParams(4), "temperature": SamplingParams(4, temperature=0.5),
             "repetition": SamplingParams(4, repetition_penalty=1.2),
             "presence": SamplingParams(4, presence_penalty=0.3),
             "frequency": SamplingParams(4, frequency_penalty=-0.2), "greedy min_p": SamplingParams(4, min_p=0.5),
             "sampled min_p": SamplingParams(4, temperature=0.7, min_p=0.5),
             "bias": SamplingParams(4, logit_bias={3: 1.5}), "min_tokens": SamplingParams(4, min_tokens=2)}
    seqs = [Sequence(name, [5, 6, 7 + i], p) for i, (name, p) in enumerate(cases.items())]
    for i, seq in enumerate(seqs):
        seq.seed = i  # as Scheduler.add fixes it
    sampling = StepBuilder(block_size=4, eos_ids={EOS}).sampling(seqs)  # what the scheduler sends the agents
    assert sampling.extras is not None  # the greedy row's min_p travels with the others' extras
    rows = dict(zip(cases, sampling.special_rows().tolist()))
    assert rows == {name: p.needs_logits for name, p in cases.items()}
    assert [name for name, special in rows.items() if not special] == ["greedy", "greedy min_p"]


def test_min_tokens_bans_the_end_ids_until_then_and_stop_token_ids_stop():
    cfg = chunked_prefix(prefix_caching=False)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    seq = Sequence("a", [5, 6, 7], SamplingParams(6, min_tokens=2, stop_token_ids=(40,), logit_bias={30: 2}))
    s.add(seq)
    seqs, batch = s.schedule()
    extras = batch.sampling.extras
    row = dict(zip(extras.adjust_ids.tolist(), extras.adjust_values.tolist()))
    assert row == {30: 2.0, EOS: -np.inf, 40: -np.inf}
    s.postprocess(seqs, model.step(batch))
    seqs, batch = s.schedule()
    s.postprocess(seqs, model.step(batch))
    seqs, batch = s.schedule()  # two generated: only the bias is left
    assert dict(zip(batch.sampling.extras.adjust_ids.tolist(), batch.sampling.extras.adjust_values.tolist())) \
        == {30: 2.0}
    stop = Sequence("b", [5, 6, 7], SamplingParams(6, stop_token_ids=(int(model.step(batch).token_ids[0]),)))
    s.abort("a")
    s.add(stop)
    while s.has_unfinished():
        step_once(s, model)
    assert stop.finish_reason == "stop" and stop.output_ids[-1] in stop.params.stop_token_ids


def test_the_extras_cross_shared_memory_and_a_step_without_them_carries_none():
    params = [SamplingParams(4, temperature=0.7, presence_penalty=0.3, logit_bias={3: 1.5}),
              SamplingParams(4, frequency_penalty=-0.5, min_tokens=1)]
    s = Scheduler(chunked_prefix(prefix_caching=False))
    for i, p in enumerate(params):
        s.add(Sequence(f"r{i}", [5, 6, 7 + i], p))
    _, batch = s.schedule()
    channel = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=16))
    try:
        channel.write_step(1, batch)
        _, got = channel.read_step()
        sent, read = batch.sampling.extras, got.sampling.extras
        for name in ("presence_penalty", "frequency_penalty", "min_p", "output_start", "adjust_offsets",
                     "adjust_ids", "adjust_values"):
            np.testing.assert_array_equal(getattr(read, name), getattr(sent, name), err_msg=name)
        assert got.sampling.special_rows().tolist() == [True, True]
        plain = Scheduler(chunked_prefix(prefix_caching=False))
        plain.add(Sequence("g", [5, 6], SamplingParams(4, temperature=0.5)))
        _, sampled = plain.schedule()
        channel.write_step(2, sampled)
        assert sampled.sampling.extras is None and channel.read_step()[1].sampling.extras is None
    finally:
        channel.close()


def test_sample_applies_them_per_row_and_keeps_greedy_rows():
    logits = np.stack([LOGITS, LOGITS])
    best = int(np.argmax(LOGITS))
    batch = SamplingBatch(np.zeros(2, np.float32), np.zeros(2, np.int32), np.ones(2, np.float32),
                          np.ones(2, np.float32), np.zeros(2, np.int64), np.zeros(2, np.int32),
                          np.zeros(3, np.int32), np.zeros(0, np.int32))
    from llm_serving.protocol.batch import SamplingExtras

    batch.extras = SamplingExtras(np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32),
                                  np.zeros(2, np.int32), np.array([0, 1, 1], np.int32), np.array([best], np.int32),
                                  np.array([-np.inf], np.float32))
    ids, _ = sample(logits, np.full(2, best, np.int32), np.zeros(2, np.float32), batch)
    assert ids[0] != best and ids[1] == best  # row 0 banned its argmax; row 1 kept the in-graph pick


def test_the_routes_serve_them(standin_server):
    """Accepted and checked on both routes (the stand-in agents' tokens follow their own rule, so the effect on
    tokens is shown by the engine test below)."""
    client = openai_client(standin_server)
    assert client.completions.create(model="llama2", prompt="hello", max_tokens=4, temperature=0,
                                     logit_bias={"77": 100}, presence_penalty=1.0).choices
    assert client.chat.completions.create(
        model="llama2", messages=[{"role": "user", "content": "hi"}], max_tokens=3, presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"min_p": 0.1, "min_tokens": 2, "stop_token_ids": [2]}).choices
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="llama2", prompt="x", max_tokens=2, logit_bias={"999999": 1})
    with pytest.raises(openai.BadRequestError, match="min_tokens must be in 0..max_new_tokens"):
        client.completions.create(model="llama2", prompt="x", max_tokens=2, extra_body={"min_tokens": 3})


def test_on_the_model_a_bias_decides_and_a_stop_token_id_stops(tmp_path):
    from llm_serving.engine.loop import Engine

    cfg = tiny_engine_config(tmp_path)
    prompt = [1, 17, 230, 45, 9, 301]
    with Engine(cfg) as engine:
        engine.start(progress=None)
        free = engine.submit(prompt, SamplingParams(8, ignore_eos=True)).result(timeout=120).token_ids
        biased = engine.submit(prompt, SamplingParams(8, ignore_eos=True, logit_bias={77: 100})).result(timeout=120)
        stopped = engine.submit(prompt, SamplingParams(8, ignore_eos=True, stop_token_ids=(free[3],))
                                ).result(timeout=120)
        banned = engine.submit(prompt, SamplingParams(8, ignore_eos=True, logit_bias={free[0]: -100})
                               ).result(timeout=120)
    assert biased.token_ids == [77] * 8 and free != biased.token_ids
    cut = free.index(free[3])
    assert stopped.token_ids == free[: cut + 1] and stopped.finish_reason == "stop"
    assert banned.token_ids[0] != free[0]
