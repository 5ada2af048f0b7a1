"""Multi-step decoding (issue 31): while nothing waits and every running sequence is plain greedy, a decode batch
asks the agents for up to ``scheduler.decode_steps`` steps at once (``agents.runtime.multi_step``), each feeding the
tokens the previous one chose. The tokens, finish reasons and streamed text are those of one step at a time (the
fake KV model reads every context back through the cache; then the real tiny model, EOS, stop strings and
token limits landing inside a batch); no block is left held; the batches fall back to one step whenever a request
waits, a sequence samples or reports logits, or the blocks are not free."""

from __future__ import annotations

import numpy as np
import pytest

from agents.runtime.multi_step import run_decode_steps
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from tests.test_scheduler import FakeKVModel, config, expected_output
from tests.tiny_engine import tiny_engine_config


def run(s: Scheduler, model: FakeKVModel, seqs: list[Sequence]) -> list[int]:
    """Serve ``seqs`` to the end; the num_steps of every batch."""
    for seq in seqs:
        s.add(seq)
    steps = []
    while s.has_unfinished():
        scheduled, batch = s.schedule()
        steps.append(batch.num_steps)
        out = model.step(batch) if batch.num_steps == 1 else run_decode_steps(model.step, batch, s.config.block_size)
        s.postprocess(scheduled, out)
    return steps


def prompts() -> list[Sequence]:
    limits = [1, 2, 5, 9, 13, 30]  # around and across multiples of 4
    return [Sequence(f"r{i}", [10 + (7 * i + j) % 23 for j in range(3 + i)],
                     SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0)) for i, n in enumerate(limits)]


@pytest.mark.parametrize("kw", [{}, {"chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": True}],
                         ids=["whole-prompts", "chunked-cached"])
def test_the_tokens_are_those_of_one_step_at_a_time(kw):
    cfg = config(decode_steps=4, max_num_seqs=8, **kw)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    seqs = prompts()
    steps = run(s, model, seqs)
    assert 4 in steps and max(steps) == 4
    for seq in seqs:
        assert (seq.output_ids, seq.finish_reason) == expected_output(seq.prompt_ids, seq.params), seq
        assert len(seq.output_logprobs) == len(seq.output_ids)
    assert any(seq.finish_reason == "eos" for seq in seqs)  # an EOS inside a batch cut its sequence there
    assert s.num_used_blocks == 0
    single = Scheduler(config(decode_steps=1, max_num_seqs=8, **kw))
    assert set(run(single, FakeKVModel(cfg.num_blocks, cfg.block_size), prompts())) == {1}


def test_one_step_whenever_the_master_is_needed_between_tokens():
    def first_decode(s: Scheduler) -> int:
        model = FakeKVModel(s.config.num_blocks, s.config.block_size)

        def step(batch: StepBatch) -> StepOutput:  # with the (zero) logits rows a step asks for
            out = model.step(batch)
            wanted = [] if batch.want_logits is None else np.flatnonzero(batch.want_logits).tolist()
            out.logits = {row: np.zeros(64, np.float32) for row in wanted}
            return out

        while True:
            scheduled, batch = s.schedule()
            s.postprocess(scheduled, step(batch) if batch.num_steps == 1
                          else run_decode_steps(step, batch, s.config.block_size))
            if not batch.describe().computes_prompts:
                return batch.num_steps

    cfg = config(decode_steps=4, max_num_seqs=2, max_prefill_batch=1)
    plain = SamplingParams(max_new_tokens=20, ignore_eos=True)
    s = Scheduler(cfg)
    s.add(Sequence("a", [11, 12, 13], plain))
    assert first_decode(s) == 4
    for other, expected in ((SamplingParams(20, ignore_eos=True, temperature=0.5, seed=1), 1),
                            (SamplingParams(20, ignore_eos=True, top_logprobs=2), 1),
                            (SamplingParams(20, ignore_eos=True, repetition_penalty=1.2), 1),
                            (SamplingParams(3, ignore_eos=True), 2)):  # no more than the closest limit
        s = Scheduler(cfg)
        s.add(Sequence("a", [11, 12, 13], plain))
        s.add(Sequence("b", [14, 15], other))
        assert first_decode(s) == expected, other
    waiting = Scheduler(config(decode_steps=4, max_num_seqs=1))
    waiting.add(Sequence("a", [11, 12, 13], plain))
    waiting.add(Sequence("b", [14, 15], plain))  # cannot join: the decode batch holds one
    assert first_decode(waiting) == 1
    tight = Scheduler(config(decode_steps=4, num_blocks=3, block_size=4, max_model_len=8, max_num_seqs=2))
    tight.add(Sequence("a", [11, 12, 13], SamplingParams(5, ignore_eos=True)))  # positions 4..6: a second block
    tight.add(Sequence("b", [14], SamplingParams(3, ignore_eos=True)))  # holds the only other one
    assert first_decode(tight) == 1


def test_the_batch_and_the_later_tokens_cross_shared_memory():
    cfg = config(decode_steps=3)
    s = Scheduler(cfg)
    s.add(Sequence("a", [11, 12, 13], SamplingParams(9, ignore_eos=True)))
    first, prefill = s.schedule()
    s.postprocess(first, FakeKVModel(cfg.num_blocks, cfg.block_size).step(prefill))
    seqs, batch = s.schedule()
    assert batch.num_steps == 3 and batch.block_tables.shape[1] * cfg.block_size >= seqs[0].num_tokens + 2
    channel = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=16,
                                               max_decode_steps=3))
    try:
        channel.write_step(7, batch)
        assert channel.read_step()[1].num_steps == 3
        out = StepOutput(np.array([5], np.int32), np.array([-1.0], np.float32),
                         more_token_ids=np.array([[6, 7]], np.int32), more_logprobs=np.array([[-2, -3]], np.float32))
        channel.write_output(7, out)
        back = channel.read_output(7, 1)
        assert back.more_token_ids.tolist() == [[6, 7]] and back.more_logprobs.tolist() == [[-2, -3]]
        channel.write_output(8, StepOutput(np.array([5], np.int32), np.array([-1.0], np.float32)))
        assert channel.read_output(8, 1).more_token_ids is None
        batch.num_steps = 4
        with pytest.raises(ValueError, match="asks for 4 decode steps; the shared memory holds 1 to 3"):
            channel.write_step(9, batch)
    finally:
        channel.close()


def test_on_the_model_the_tokens_and_text_are_those_of_single_steps(tmp_path):
    from llm_serving.engine.loop import Engine

    prompts = [[1, 17, 230, 45, 9, 301], [1, 5, 6, 7], [1, 400, 401, 402, 403, 404, 405, 406, 407]]
    limits = [7, 13, 10]
    results = {}
    for k in (1, 4):
        cfg = tiny_engine_config(tmp_path, scheduler={"decode_steps": k})
        with Engine(cfg) as engine:
            engine.start(progress=None)
            plain = [engine.submit(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, limits)]
            plain = [s.result(timeout=120) for s in plain]
            if k == 1:
                stop = engine.tokenizer.decode(plain[1].token_ids[5:7])
            cut = engine.submit(prompts[1], SamplingParams(13, ignore_eos=True, stop=(stop,))).result(timeout=120)
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0
        results[k] = ([r.token_ids for r in plain], [r.finish_reason for r in plain], cut.text, cut.finish_reason,
                      cut.token_ids, stats["multi_step_batches"])
    assert results[4][:5] == results[1][:5]
    assert results[4][3] == "stop" and stop not in results[4][2]
    assert results[1][5] == 0 and results[4][5] >= 3  # the decode batches ran up to four steps each
