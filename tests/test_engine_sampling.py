"""Sampling through the whole engine on a real tiny Llama agent: a seeded request draws the same tokens alone
or in a full mixed batch (with preemptions), greedy requests are unchanged by sampled neighbours, and
different seeds draw differently. The sampler's distributions themselves are checked in test_sampler."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.llm import LLM
from llm_serving.engine.loop import Engine

VOCAB = 1000
MAX_NEW = 12


def config(data_dir: Path) -> ServingConfig:
    return ServingConfig.from_dict({
        "default_model": {"data_dir": str(data_dir), "weights": "random", "hidden_size": 64, "intermediate_size": 160,
                          "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": VOCAB, "seed": 3},
        "model_config": {"seq_length": [32], "prefill_batch_size": [4], "decode_batch_size": [8],
                         "max_generate_length": 32},
        # 8 requests need up to 32 blocks of 8 tokens; 20 forces preemptions (recomputes) in the full batch
        "pa_config": {"num_blocks": 20, "block_size": 8, "decode_seq_length": 48},
        "scheduler": {"policy": "fcfs"},
    })


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(config(tmp_path_factory.mktemp("sampling_engine")))
    eng.start(progress=None)
    yield eng
    eng.shutdown()


def workload() -> list[tuple[list[int], SamplingParams]]:
    """Eight requests, three greedy, one greedy with a repetition penalty, four sampled (two share a seed)."""
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(6, 20))] for _ in range(8)]
    params = [
        SamplingParams(MAX_NEW),
        SamplingParams(MAX_NEW, temperature=0.8, seed=7),
        SamplingParams(MAX_NEW),
        SamplingParams(MAX_NEW, temperature=1.0, top_k=20, top_p=0.9, seed=8),
        SamplingParams(MAX_NEW, repetition_penalty=1.5),
        SamplingParams(MAX_NEW, temperature=0.7, repetition_penalty=1.3, seed=9),
        SamplingParams(MAX_NEW),
        SamplingParams(MAX_NEW, temperature=1.2, top_p=0.8, seed=7),
    ]
    return list(zip(prompts, params))


def test_seeded_requests_draw_the_same_alone_or_in_a_full_mixed_batch(engine):
    reqs = workload()
    alone = [engine.submit(p, params).result(timeout=60) for p, params in reqs]
    before = engine.stats()["num_preemptions"]
    streams = [engine.submit(p, params) for p, params in reqs]
    together = [s.result(timeout=60) for s in streams]
    assert engine.stats()["num_preemptions"] > before  # recomputed sequences resume their draws exactly
    for (_, params), a, t in zip(reqs, alone, together):
        assert t.token_ids == a.token_ids, params
        np.testing.assert_allclose(t.logprobs, a.logprobs, atol=1e-4)
        assert all(lp <= 0 for lp in t.logprobs)
    # Greedy requests ran on the in-graph argmax alone and next to sampled ones together: same tokens, and the
    # same as an all-greedy batch of just them.
    greedy = [i for i, (_, p) in enumerate(reqs) if not p.needs_logits]
    all_greedy = [s.result(timeout=60) for s in [engine.submit(*reqs[i]) for i in greedy]]
    assert [r.token_ids for r in all_greedy] == [together[i].token_ids for i in greedy]
    # The sampled requests really sampled: not their greedy continuation.
    sampled = [i for i, (_, p) in enumerate(reqs) if p.temperature > 0]
    as_greedy = [engine.submit(reqs[i][0], SamplingParams(MAX_NEW)).result(timeout=60) for i in sampled]
    assert sum(g.token_ids != together[i].token_ids for g, i in zip(as_greedy, sampled)) >= 3


def test_different_seeds_draw_differently_and_unseeded_requests_vary(engine):
    prompt = workload()[0][0]
    runs = {seed: [engine.submit(prompt, SamplingParams(MAX_NEW, True, temperature=1.0, seed=seed))
                   for _ in range(2)] for seed in range(6)}
    tokens = {seed: [s.result(timeout=60).token_ids for s in streams] for seed, streams in runs.items()}
    assert all(a == b for a, b in tokens.values())  # the same seed twice in one batch: identical
    assert len({tuple(a) for a, _ in tokens.values()}) >= 5
    unseeded = [engine.submit(prompt, SamplingParams(MAX_NEW, True, temperature=1.0)) for _ in range(4)]
    assert len({tuple(s.result(timeout=60).token_ids) for s in unseeded}) >= 3


def test_llm_generate_takes_sampling_keywords(tmp_path):
    cfg = config(tmp_path)
    with LLM(cfg, standin_agents=True, progress=None) as llm:
        with pytest.raises(ValueError, match="top_p must be in"):
            llm.generate("hi", max_new_tokens=3, temperature=0.5, top_p=0.0)
        with pytest.raises(TypeError, match="not both"):
            llm.generate("hi", sampling_params=SamplingParams(3), temperature=0.5)
        res = llm.generate(["a b", "c"], max_new_tokens=3, ignore_eos=True, temperature=0.9, seed=1)
        assert [len(r.token_ids) for r in res] == [3, 3]
