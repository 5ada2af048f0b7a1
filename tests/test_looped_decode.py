"""Looped decode (issue 53, ``agents.runtime.looped_decode``): k greedy decode steps in one graph call give the ids
and logprobs of k single decode steps and of transformers' greedy generation, on the native and portable CPU
backends, across block boundaries and with padding rows in the bucket; a batch whose blocks do not cover its later
steps is refused before any graph runs; a k without a looped graph (or on Ascend) is left to the host loop."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agents.runtime.multi_step import run_decode_steps
from agents.runtime.runner import ModelRunner, RunnerConfig, warmup_shapes
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.paged_driver import PagedDriver
from tests.test_model_families import hf_greedy_auto

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
BLOCK = 8


def looped_generate(runner: ModelRunner, prompts: list[list[int]], steps: int, k: int,
                    lora_slots: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of ``prompts``: a prefill, then decode batches of ``k`` steps through ``runner.decode_steps``;
    ``lora_slots``: each prompt's adapter slot (-1: none)."""
    adapters = None if lora_slots is None else np.array(lora_slots, np.int32)
    block = runner.rc.block_size
    free = list(range(1, runner.rc.num_blocks))[::-1]
    tables = [[free.pop() for _ in range(-(-(len(p) + steps + k) // block))] for p in prompts]
    width = max(len(t) for t in tables)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)

    def slot(i: int, pos: int) -> int:
        return tables[i][pos // block] * block + pos % block

    lens = np.array([len(p) for p in prompts], np.int32)
    out = runner.step(StepBatch(
        np.concatenate(prompts).astype(np.int32), np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
        np.array([slot(i, j) for i, n in enumerate(lens) for j in range(n)], np.int32), lens, lens.copy(),
        block_tables, lora_slots=adapters))
    tokens = [[int(t)] for t in out.token_ids]
    logprobs = [[float(lp)] for lp in out.logprobs]
    while len(tokens[0]) < steps:
        ctx = np.array([len(p) + len(g) for p, g in zip(prompts, tokens)], np.int32)
        batch = StepBatch(np.array([g[-1] for g in tokens], np.int32), ctx - 1,
                          np.array([slot(i, int(c) - 1) for i, c in enumerate(ctx)], np.int32),
                          np.ones(len(prompts), np.int32), ctx, block_tables, num_steps=k, lora_slots=adapters)
        out = runner.decode_steps(batch)
        assert out is not None  # the looped graph ran
        ids = np.concatenate([out.token_ids[:, None], out.more_token_ids], 1)
        lps = np.concatenate([out.logprobs[:, None], out.more_logprobs], 1)
        for g, lp, row, lrow in zip(tokens, logprobs, ids, lps):
            g.extend(int(t) for t in row)
            lp.extend(float(x) for x in lrow)
    return [g[:steps] for g in tokens], [lp[:steps] for lp in logprobs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("looped"), CONFIG, seed=5, std=0.25)


def make_runner(model_dir, kernels: str, k: int) -> ModelRunner:
    config = LlamaConfig.from_model_dir(model_dir)
    rc = RunnerConfig(num_blocks=40, block_size=BLOCK, max_model_len=128, prefill_batch_sizes=(4,),
                      prefill_seq_lengths=(32,), decode_batch_sizes=(4,), decode_block_widths=(8,),
                      kernels=kernels, decode_steps=k)
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    return runner


@pytest.mark.parametrize("kernels, k", [("native", 4), ("portable", 4), ("native", 8), ("portable", 8)])
def test_k_steps_in_one_call_are_those_of_single_steps_and_of_transformers(model_dir, kernels, k):
    runner = make_runner(model_dir, kernels, k)
    assert (f"loop{k}", 4, 8) in runner.graph_shapes()
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 256, n - 1).tolist() for n in (5, 14, 23)]  # 3 rows in a bucket of 4
    steps = 2 * k + 3  # crosses block boundaries inside calls
    looped, looped_lps = looped_generate(runner, prompts, steps, k)
    single, single_lps = PagedDriver(runner, seed=2).generate(prompts, steps)
    assert looped == single
    np.testing.assert_allclose(looped_lps, single_lps, rtol=1e-4, atol=1e-4)
    assert looped == [hf_greedy_auto(model_dir, p, steps) for p in prompts]


def test_blocks_short_of_the_later_steps_are_refused_and_other_ks_go_to_the_host_loop(model_dir):
    runner = make_runner(model_dir, "portable", 4)
    assert ("loop4", 4, 8) in warmup_shapes(runner.rc, runner.ragged_prefill)
    ascend = replace(runner.rc, device_target="Ascend", dtype="float16")  # see looped_families: host loop there
    assert not [s for s in warmup_shapes(ascend, True) if s[0].startswith("loop")]
    table = np.array([[3, 0x7FFF]], np.int32)  # the second step's block is outside the cache
    batch = StepBatch(np.array([5], np.int32), np.array([6], np.int32), np.array([3 * BLOCK + 6], np.int32),
                      np.ones(1, np.int32), np.array([7], np.int32), table, num_steps=4)
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner.decode_steps(batch)
    assert runner.decode_steps(replace(batch, num_steps=3)) is None
    fine = replace(batch, block_tables=np.array([[3, 4]], np.int32))
    host = run_decode_steps(runner.step, fine, BLOCK)
    out = runner.decode_steps(fine)
    assert out is not None and out.token_ids.tolist() == host.token_ids.tolist()
    assert out.more_token_ids.tolist() == host.more_token_ids.tolist()


def test_through_the_engine_the_looped_batches_give_the_ids_of_single_steps(tmp_path):
    """decode_steps 8 on the portable backend: the agents run each multi-step batch as one looped call."""
    from llm_serving.core.sequence import SamplingParams
    from llm_serving.engine.loop import Engine
    from tests.tiny_engine import tiny_engine_config

    prompts = [[1, 17, 230, 45, 9, 301], [1, 5, 6, 7], [1, 400, 401, 402, 403, 404, 405, 406, 407]]
    limits = [9, 21, 14]
    results = {}
    for k in (1, 8):
        cfg = tiny_engine_config(tmp_path, scheduler={"decode_steps": k}, model_config={"kernels": "portable"})
        with Engine(cfg) as engine:
            engine.start(progress=None)
            out = [s.result(timeout=120) for s in [engine.submit(p, SamplingParams(n, ignore_eos=True))
                                                    for p, n in zip(prompts, limits)]]
            stats = engine.stats()
        assert stats["kv_blocks_used"] == 0
        results[k] = [r.token_ids for r in out], [r.logprobs for r in out], stats["multi_step_batches"]
    assert results[8][0] == results[1][0] and [len(t) for t in results[8][0]] == limits
    np.testing.assert_allclose(np.concatenate(results[8][1]), np.concatenate(results[1][1]), atol=1e-4)
    assert results[1][2] == 0 and results[8][2] >= 2
