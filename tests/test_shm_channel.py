"""The step channel's fixed layout in one process: sampled and greedy batches round-trip exactly."""

from __future__ import annotations

import numpy as np
import pytest

from llm_serving.protocol.batch import AdapterStep, SamplingBatch, StepBatch
from llm_serving.protocol.shm_channel import ChannelError, ChannelLayout, StepChannel
from llm_serving.protocol.step import StepKind
from tests.paged_driver import sampling_batch

LAYOUT = ChannelLayout(max_tokens=64, max_batch=8, max_blocks_per_seq=4, max_penalty_tokens=100)


@pytest.fixture
def channels():
    master = StepChannel.create(LAYOUT)
    agent = StepChannel.attach(master.name, LAYOUT)
    yield master, agent
    agent.close()
    master.close()


def decode_batch(rng: np.random.Generator, b: int, sampling: SamplingBatch | None) -> StepBatch:
    return StepBatch(rng.integers(0, 1000, b).astype(np.int32), rng.integers(0, 60, b).astype(np.int32),
                     rng.integers(0, 500, b).astype(np.int32), np.ones(b, np.int32),
                     rng.integers(1, 60, b).astype(np.int32), rng.integers(0, 99, (b, 3)).astype(np.int32), sampling,
                     kind=StepKind.DECODE)


def random_sampling(rng: np.random.Generator, b: int) -> SamplingBatch:
    params = [{"temperature": float(rng.choice([0.0, 0.7, 1.3])), "top_k": int(rng.integers(0, 50)),
               "top_p": float(rng.choice([1.0, 0.9])), "repetition_penalty": float(rng.choice([1.0, 1.2])),
               "seed": int(rng.integers(-2**63, 2**63 - 1))} for _ in range(b)]
    histories = [rng.integers(0, 1000, int(rng.integers(1, 12))).tolist() for _ in range(b)]
    return sampling_batch(params, histories, rng.integers(0, 40, b).tolist())


def assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "seeds", "draw_index", "penalty_offsets",
                 "penalty_token_ids"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_sampled_and_greedy_batches_round_trip(channels):
    master, agent = channels
    rng = np.random.default_rng(0)
    # big sampled, greedy, small sampled: stale rows or a stale flag from an earlier step would show up
    for step, (b, sampled) in enumerate([(8, True), (5, False), (3, True), (8, False), (1, True)], start=1):
        sampling = random_sampling(rng, b) if sampled else None
        batch = decode_batch(rng, b, sampling)
        master.write_step(step, batch)
        seen, got = agent.read_step()
        assert seen == step
        np.testing.assert_array_equal(got.block_tables, batch.block_tables)
        if sampled:
            assert_same(got.sampling, sampling)
            assert got.sampling.needs_logits == sampling.needs_logits
            for i in range(b):  # per-row slices (what the agent's sampler reads) agree too
                lo, hi = got.sampling.penalty_offsets[i:i + 2]
                want_lo, want_hi = sampling.penalty_offsets[i:i + 2]
                assert got.sampling.penalty_token_ids[lo:hi].tolist() == \
                    sampling.penalty_token_ids[want_lo:want_hi].tolist()
        else:
            assert got.sampling is None
        del got


def test_penalty_ids_beyond_capacity_are_refused(channels):
    master, agent = channels
    rng = np.random.default_rng(1)
    params = [{"temperature": 1.0, "repetition_penalty": 1.5}] * 2
    too_many = sampling_batch(params, [list(range(60)), list(range(41))], [0, 0])  # 101 ids > 100
    with pytest.raises(ValueError, match="repetition-penalty token count 101 exceeds .* capacity 100"):
        master.write_step(1, decode_batch(rng, 2, too_many))
    fits = sampling_batch(params, [list(range(60)), list(range(40))], [0, 0])
    master.write_step(2, decode_batch(rng, 2, fits))
    _, got = agent.read_step()
    assert_same(got.sampling, fits)
    del got
    wrong_rows = sampling_batch(params, [[1], [2]], [0, 0])
    with pytest.raises(ValueError, match="penalty_offsets has shape"):
        master.write_step(3, decode_batch(rng, 3, wrong_rows))


def test_layouts_must_agree_on_the_penalty_capacity():
    assert ChannelLayout(64, 8, 4).max_penalty_tokens == 64  # default: one sequence of max_tokens
    with pytest.raises(ValueError, match="max_penalty_tokens must be positive"):
        ChannelLayout(64, 8, 4, 0)
    master = StepChannel.create(LAYOUT)
    try:
        with pytest.raises(ChannelError, match="max_penalty_tokens"):
            StepChannel.attach(master.name, ChannelLayout(64, 8, 4, 99))
    finally:
        master.close()


def test_adapter_steps_and_rows_adapter_slots_round_trip(channels):
    """An adapter step's slot and path (or none), then model steps with and without rows' adapter slots: a stale
    slot array from an earlier step would show up as slots on the step that has none."""
    master, agent = channels
    rng = np.random.default_rng(1)
    steps = [AdapterStep(2, "/tmp/adapters/ünïcode-sql"), decode_batch(rng, 5, None), AdapterStep(0, None),
             decode_batch(rng, 3, None)]
    steps[1].lora_slots = np.array([-1, 2, 0, 2, -1], np.int32)
    for number, step in enumerate(steps, start=1):
        master.write_step(number, step)
        seen, got = agent.read_step()
        assert seen == number
        if isinstance(step, AdapterStep):
            assert got == step
            continue
        assert isinstance(got, StepBatch)
        if step.lora_slots is None:
            assert got.lora_slots is None
        else:
            assert got.lora_slots.tolist() == step.lora_slots.tolist()
        del got


def test_rows_adapter_slots_follow_the_rows_a_part_takes():
    rng = np.random.default_rng(2)
    batch = decode_batch(rng, 4, None)
    batch.lora_slots = np.array([3, -1, 0, 1], np.int32)
    assert batch.take(np.array([2, 0])).lora_slots.tolist() == [0, 3]
    batch.lora_slots = np.array([3, -2, 0, 1], np.int32)
    with pytest.raises(ValueError, match="lora_slots"):
        batch.validate()
    with pytest.raises(ValueError, match="longer than"):
        AdapterStep(0, "x" * 5000)
