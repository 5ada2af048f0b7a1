"""Chunked prefill in the scheduler: a step's token budget shared by decode tokens and prompt chunks, against a
fake model that reads its context back through the KV cache it was told to write (tests.test_scheduler)."""

from __future__ import annotations

import numpy as np
import pytest

from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.protocol.batch import StepBatch
from tests.test_scheduler import EOS, FakeKVModel, expected_output

MAX_LEN = 64


def chunked(**kw) -> SchedulerConfig:
    base = {"num_blocks": 80, "block_size": 4, "max_num_seqs": 4, "max_prefill_batch": 2,
            "max_num_batched_tokens": 16, "max_model_len": MAX_LEN, "eos_token_id": EOS, "chunked_prefill": True}
    return SchedulerConfig(**{**base, **kw})


def prompt(n: int, salt: int = 0) -> list[int]:
    return [10 + (7 * i + salt) % 29 for i in range(n)]


def check_batch(batch: StepBatch, seqs: list[Sequence], budget: int) -> None:
    """Each sequence's tokens are the ones after its computed ones, at their positions and slots."""
    assert batch.num_tokens <= budget
    start = 0
    for i, seq in enumerate(seqs):
        q, ctx = int(batch.query_lens[i]), int(batch.context_lens[i])
        assert q == seq.num_scheduled_tokens and ctx == seq.num_computed_tokens + q <= seq.num_tokens
        assert batch.input_ids[start:start + q].tolist() == seq.token_ids(ctx - q, ctx)
        assert batch.positions[start:start + q].tolist() == list(range(ctx - q, ctx))
        start += q


def run(s: Scheduler, model: FakeKVModel, steps: list[StepBatch] | None = None) -> None:
    while s.has_unfinished():
        seqs, batch = s.schedule()
        check_batch(batch, seqs, s.config.max_num_batched_tokens)
        if steps is not None:
            steps.append(batch)
        s.postprocess(seqs, model.step(batch))


def test_every_prompt_up_to_the_model_length_is_served_in_chunks():
    cfg = chunked()
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    lengths = (1, 3, 15, 16, 17, 40, 63)  # around the budget and block edges, up to max_model_len - 1
    seqs = [Sequence(f"r{n}", prompt(n, n), SamplingParams(MAX_LEN - n, ignore_eos=True)) for n in lengths]
    for seq in seqs:
        s.add(seq)
    steps: list[StepBatch] = []
    run(s, model, steps)
    for seq in seqs:
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.params)[0]
    assert any(b.describe().computes_prompts and np.any(b.context_lens > b.query_lens) and np.any(b.query_lens > 1)
               for b in steps)  # chunks over cached context
    assert s.num_used_blocks == 0


def test_running_streams_get_a_token_every_step_while_a_long_prompt_prefills():
    cfg = chunked(max_num_seqs=8)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    streams = [Sequence(f"d{i}", prompt(5, i), SamplingParams(40, ignore_eos=True)) for i in range(3)]
    for seq in streams:
        s.add(seq)
    while any(seq.num_output_tokens < 2 for seq in streams):
        seqs, batch = s.schedule()
        s.postprocess(seqs, model.step(batch))
    long = Sequence("long", prompt(60, 1), SamplingParams(3, ignore_eos=True))
    s.add(long)
    chunk_steps = 0
    while long.num_output_tokens == 0:
        before = [seq.num_output_tokens for seq in streams]
        seqs, batch = s.schedule()
        check_batch(batch, seqs, cfg.max_num_batched_tokens)
        assert seqs[:3] == streams and batch.query_lens[:3].tolist() == [1, 1, 1]  # decode tokens first
        assert seqs[3] is long and batch.query_lens[3] == min(13, 60 - long.num_computed_tokens)
        s.postprocess(seqs, model.step(batch))
        assert [seq.num_output_tokens for seq in streams] == [n + 1 for n in before]
        chunk_steps += 1
    assert chunk_steps == 5  # 60 tokens in chunks of 13 (the budget of 16 less 3 decode tokens)
    run(s, model)
    for seq in streams + [long]:
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.params)[0]


def test_prompt_chunks_per_step_are_bounded_by_max_prefill_batch():
    cfg = chunked(max_num_batched_tokens=64, max_prefill_batch=2)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    for i in range(4):
        s.add(Sequence(f"p{i}", prompt(50, i), SamplingParams(2, ignore_eos=True)))
    steps: list[StepBatch] = []
    run(s, model, steps)
    for batch in steps:
        assert int(np.sum(batch.query_lens > 1)) <= 2
    first = steps[0]
    assert first.query_lens.tolist() == [50, 14] and first.context_lens.tolist() == [50, 14]


def test_a_preempted_sequence_is_recomputed_in_chunks_with_the_same_results():
    cfg = chunked(num_blocks=20, max_num_batched_tokens=12)  # 19 blocks of 4 for 4 sequences of up to 40 tokens
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    seqs = [Sequence(f"r{i}", prompt(10 + 3 * i, i), SamplingParams(24, ignore_eos=True)) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    run(s, model)
    assert s.num_preemptions > 0
    for seq in seqs:
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.params)[0]


@pytest.mark.parametrize("bad", [{"max_num_batched_tokens": 3}, {"chunked_prefill": False}])
def test_the_budget_must_hold_a_decode_batch_or_without_chunks_a_whole_sequence(bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        chunked(**bad)
