"""Chunked prefill and prefix caching on the real model, both CPU kernel paths (the native mixed-step op and the
portable chunk graph): greedy ids equal to Hugging Face for prompts from 1 token up to max_model_len - 1,
prefilled in chunks alone and mixed with running decodes; and a prefix-cache hit giving exactly the cold run's
tokens and logprobs through the scheduler. head_dim 64, so the native kernels take their AVX-512 loops."""

from __future__ import annotations

import numpy as np
import pytest

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.hf_reference import hf_greedy, load_hf

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
MAX_LEN, BUDGET = 128, 64
RC = RunnerConfig(num_blocks=200, block_size=4, max_model_len=MAX_LEN, prefill_batch_sizes=(4, 8),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(8,), decode_block_widths=(16, 32),
                  mixed_steps=True, max_num_batched_tokens=BUDGET)
# prompt lengths around the prefill bucket (32), the block size (4) and the budget (64), up to max_model_len - 1
LENGTHS = (1, 2, 31, 33, 63, 65, 100, 127)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("chunked"), CONFIG, seed=5, std=0.15)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module", params=["native", "portable"])
def runner(request, model_dir):
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), RunnerConfig(**{**RC.__dict__,
                                                                                 "kernels": request.param}))
    assert runner.kernels == request.param
    runner.warmup()
    kinds = {shape[0] for shape in runner.warmed}
    assert ("mixed" in kinds) == runner.ragged_prefill and ("chunk" in kinds) != runner.ragged_prefill
    return runner


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, n - 1).tolist() for n in LENGTHS]


def test_chunked_prefill_alone_and_mixed_with_decodes_matches_transformers(runner, hf):
    batch_prompts = prompts()
    steps = [min(5, MAX_LEN - len(p)) for p in batch_prompts]
    references = [hf_greedy(hf, p, n) for p, n in zip(batch_prompts, steps)]
    runs = [([i], 24, None) for i in range(len(batch_prompts))]  # each alone, chunks of 24
    runs.append((list(range(len(batch_prompts) - 1)), 7, [0, 0, 1, 3, 2, 6, 4]))  # joining while others decode
    runs.append(([len(batch_prompts) - 1], 5, None))  # max_model_len - 1 tokens in chunks of 5: one new token
    for rows, chunk, starts in runs:
        n = min(steps[i] for i in rows)
        tokens, logprobs = ChunkDriver(runner, seed=rows[0]).generate([batch_prompts[i] for i in rows], n, chunk,
                                                                     starts)
        for i, got, got_lp in zip(rows, tokens, logprobs):
            assert got == references[i][0][:n]
            np.testing.assert_allclose(got_lp, references[i][1][:n], atol=1e-4)


def test_the_runner_refuses_a_context_shorter_than_its_query(runner):
    bad = StepBatch(np.ones(3, np.int32), np.arange(3, dtype=np.int32), np.arange(8, 11, dtype=np.int32),
                    np.array([2, 1], np.int32), np.array([1, 5], np.int32), np.full((2, 2), 2, np.int32))
    with pytest.raises(ValueError, match="context lengths must hold their queries"):
        runner.step(bad)


def serve(scheduler: Scheduler, runner: ModelRunner, seqs: list[Sequence]) -> None:
    """The engine's loop in process: schedule, run, postprocess."""
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_unfinished():
        stepped, batch = scheduler.schedule()
        scheduler.postprocess(stepped, runner.step(batch))


def test_a_prefix_cache_hit_gives_exactly_the_cold_runs_tokens_and_logprobs(runner):
    cfg = SchedulerConfig(num_blocks=RC.num_blocks, block_size=RC.block_size, max_num_seqs=8, max_prefill_batch=8,
                          max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, eos_token_id=None,
                          chunked_prefill=True, prefix_caching=True)
    rng = np.random.default_rng(3)
    system = [CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, 44).tolist()  # 11 full blocks
    prompt = system + rng.integers(3, CONFIG.vocab_size, 10).tolist()
    params = SamplingParams(8)
    cold = Sequence("cold", prompt, params)
    serve(Scheduler(cfg), runner, [cold])  # an empty cache: the prompt in one ragged or padded prefill

    warm = Scheduler(cfg)
    others = [Sequence(f"o{i}", system + rng.integers(3, CONFIG.vocab_size, 3 + i).tolist(), SamplingParams(12))
              for i in range(3)]
    serve(warm, runner, others[:1])  # computes and caches the system prompt
    hit = Sequence("hit", prompt, params)
    serve(warm, runner, others[1:] + [hit])  # with other requests decoding and prefilling around it
    assert warm.prefix_cache_stats()["prefix_cache_hit_tokens"] >= 3 * 44
    assert hit.output_ids == cold.output_ids
    if runner.skips_padding:  # the native ops compute a token bitwise the same in any step
        assert hit.output_logprobs == cold.output_logprobs
    else:  # MindSpore's graph ops sum in an order that depends on the shapes
        np.testing.assert_allclose(hit.output_logprobs, cold.output_logprobs, atol=2e-5)
