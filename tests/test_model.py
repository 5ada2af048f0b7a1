"""The MindSpore paged-attention Llama against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import numpy as np
import pytest

from agents.model.llama import model_weights
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf
from tests.paged_driver import PagedDriver, contiguous_prefill

STEPS = 32
PROMPT_LENS = (5, 9, 17, 3, 30, 12, 7, 21)


def tiny_config(kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       rope_theta=10000.0)


def runner_config(**overrides) -> RunnerConfig:
    base = {"num_blocks": 160, "block_size": 4, "max_model_len": 128, "prefill_batch_sizes": (4, 8),
                "prefill_seq_lengths": (32,), "decode_batch_sizes": (8,), "decode_block_widths": (16,)}
    base.update(overrides)
    return RunnerConfig(**base)


@pytest.fixture(scope="module", params=[(4, "native"), (2, "native"), (4, "portable"), (2, "portable")],
                ids=["mha-native", "gqa-native", "mha-portable", "gqa-portable"])
def model_pair(request, tmp_path_factory):
    """Both decode attention implementations (native C++ kernel and portable graph ops) against transformers."""
    kv_heads, attention = request.param
    config = tiny_config(kv_heads)
    model_dir = build_random_model(tmp_path_factory.mktemp(f"llama_kv{kv_heads}"), config, seed=7, std=0.2)
    runner = ModelRunner(config, load_weights(model_dir, config), runner_config(kernels=attention))
    assert runner.kernels == attention
    runner.warmup()
    return config, runner, load_hf(model_dir)


def prompts(config: LlamaConfig, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[config.bos_token_id] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in PROMPT_LENS]


def test_greedy_matches_transformers(model_pair):
    config, runner, hf = model_pair
    batch_prompts = prompts(config)
    tokens, logprobs = PagedDriver(runner, seed=1).generate(batch_prompts, STEPS)
    for prompt, got, got_lp in zip(batch_prompts, tokens, logprobs):
        ref, ref_lp = hf_greedy(hf, prompt, STEPS)
        assert got == ref
        np.testing.assert_allclose(got_lp, ref_lp, atol=1e-4)


def test_block_placement_does_not_change_results(model_pair):
    config, runner, _ = model_pair
    batch_prompts = prompts(config, seed=3)
    first, _ = PagedDriver(runner, seed=11).generate(batch_prompts, 12)
    second, _ = PagedDriver(runner, seed=12).generate(batch_prompts, 12)
    alone = [PagedDriver(runner, seed=13).generate([p], 12)[0][0] for p in batch_prompts[:3]]
    assert first == second
    assert first[:3] == alone


def test_logits_switch_matches_transformers(model_pair):
    config, runner, hf = model_pair
    batch_prompts = prompts(config)[:4]
    logits = runner.step_logits(contiguous_prefill(batch_prompts, runner.rc.block_size))
    assert logits.shape == (4, config.vocab_size)
    for row, prompt in zip(logits, batch_prompts):
        np.testing.assert_allclose(row, hf_last_logits(hf, prompt).numpy(), atol=1e-4)


def test_runner_refuses_shapes_it_did_not_warm(model_pair):
    config, runner, _ = model_pair
    too_long = np.zeros(260, np.int32)  # beyond max_model_len 128: no compiled shape, even alone
    batch = StepBatch(too_long, np.tile(np.arange(130, dtype=np.int32), 2), too_long,
                      np.array([130, 130], np.int32), np.array([130, 130], np.int32), np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="prompt length 130 exceeds (the largest compiled bucket 32|max_model_len)"):
        runner.step(batch)
    cold = ModelRunner(config, model_weights(runner.model), runner_config())
    with pytest.raises(RuntimeError, match="not warmed up"):
        cold.step(StepBatch(np.ones(3, np.int32), np.arange(3, dtype=np.int32), np.arange(4, 7, dtype=np.int32),
                            np.array([3], np.int32), np.array([3], np.int32), np.zeros((1, 1), np.int32)))


def test_batches_larger_than_the_biggest_bucket_are_split(model_pair):
    config, runner, hf = model_pair
    many = prompts(config, seed=5) + prompts(config, seed=6)[:3]  # 11 prompts, decode bucket is 8
    tokens, _ = PagedDriver(runner, seed=2).generate(many, 4)
    for prompt, got in zip(many, tokens):
        assert got == hf_greedy(hf, prompt, 4)[0]


def test_decode_is_split_only_by_the_largest_bucket_where_padding_rows_are_free(model_pair):
    """With the native projections a bucket's padding rows are skipped, so 11 decode sequences of uneven contexts
    run as two calls of about equal size in context order (results against HF: the test above)."""
    _, runner, _ = model_pair
    contexts = np.array([40, 3, 17, 64, 5, 9, 33, 2, 50, 21, 12], np.int32)
    width = runner.rc.decode_block_widths[-1]
    batch = StepBatch(np.ones(11, np.int32), contexts - 1, np.arange(11, dtype=np.int32) + 4, np.ones(11,
                      np.int32), contexts, np.arange(11 * width, dtype=np.int32).reshape(11, width) % 100 + 1)
    groups = runner.plan(batch)
    assert sorted(np.concatenate(groups).tolist()) == list(range(11))
    if runner.skips_padding:
        order = np.argsort(contexts, kind="stable").tolist()
        assert [g.tolist() for g in groups] == [order[:6], order[6:]]
    assert runner.step(batch).token_ids.shape == (11,)


def shape_tokens(shape: tuple) -> int:
    """Token rows a warm-up shape computes: ragged and mixed shapes count tokens, padded ones batch x length."""
    kind, batch, n = shape[:3]
    return n if kind in ("ragged", "mixed") else batch * n


def test_mixed_lengths_are_split_into_cheaper_calls_with_the_same_results(model_pair):
    """Padded prefill: a prompt longer than the buckets is prefilled alone while the others share a call.
    Ragged prefill (native attention): all four fit one call, padded only at the end."""
    config, runner, hf = model_pair
    rng = np.random.default_rng(8)
    batch_prompts = [[config.bos_token_id] + rng.integers(3, config.vocab_size, n).tolist() for n in (6, 50, 9, 12)]
    batch = contiguous_prefill(batch_prompts, runner.rc.block_size)
    expected = [[0, 1, 2, 3]] if runner.ragged_prefill else [[0, 2, 3], [1]]
    measured = runner.step_costs
    try:  # the plan follows warm-up's timings, noisy on a loaded machine: give it costs that grow with the tokens
        runner.step_costs = {shape: 1e-3 + 1e-5 * shape_tokens(shape) for shape in measured}  # plans re-read them
        assert sorted(sorted(g.tolist()) for g in runner.plan(batch)) == expected
    finally:
        runner.step_costs = measured
    tokens, _ = PagedDriver(runner, seed=6).generate(batch_prompts, 6)
    for prompt, got in zip(batch_prompts, tokens):
        assert got == hf_greedy(hf, prompt, 6)[0]


def test_long_single_prefill_uses_the_recompute_shape(model_pair):
    """A preempted sequence is recomputed in one prefill longer than the prompt buckets."""
    config, runner, hf = model_pair
    rng = np.random.default_rng(9)
    prompt = [config.bos_token_id] + rng.integers(3, config.vocab_size, 59).tolist()  # 60 > bucket 32
    tokens, logprobs = PagedDriver(runner, seed=4).generate([prompt], 3)
    ref, ref_lp = hf_greedy(hf, prompt, 3)
    assert tokens[0] == ref
    np.testing.assert_allclose(logprobs[0], ref_lp, atol=1e-4)
