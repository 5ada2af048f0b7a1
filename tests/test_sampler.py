"""Sampling: empirical distributions against numpy references, allowed sets, seeds, and HF's penalty rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.runtime.sampler import sample, sample_row, take_failures
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import FAILED_TOKEN, SamplingBatch, StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import load_hf
from tests.paged_driver import PagedDriver

DRAWS = 3000
CONFIG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = build_random_model(tmp_path_factory.mktemp("sampler"), CONFIG, seed=5, std=0.2)
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), RunnerConfig(
        num_blocks=200, block_size=4, max_model_len=64, prefill_batch_sizes=(1, 8), prefill_seq_lengths=(16,),
        decode_batch_sizes=(8,), decode_block_widths=(16,)))
    runner.warmup()
    return runner, model_dir


@pytest.fixture(scope="module")
def context_logits(model) -> tuple[list[int], np.ndarray]:
    runner, _ = model
    prompt = [1, 17, 33, 5, 60, 17, 9]
    n = len(prompt)
    batch = StepBatch(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                      np.arange(4, 4 + n, dtype=np.int32), np.array([n], np.int32), np.array([n], np.int32),
                      np.zeros((1, 1), np.int32))
    return prompt, runner.step_logits(batch)[0]


def reference_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    penalty: float = 1.0, seen: list[int] = ()) -> np.ndarray:
    """Hugging Face's processors written out in float64: penalty, temperature, top-k, top-p."""
    x = logits.astype(np.float64).copy()
    for t in set(seen):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    x /= temperature
    if top_k:
        x[x < np.sort(x)[-top_k]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        p[order[(cum - p[order]) >= top_p]] = 0.0
        p /= p.sum()
    return p


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Pearson chi-square at significance 0.001 (bins with expected count < 5 merged)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    z = 3.09  # upper 0.001 quantile of N(0, 1); Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, stat, critical


def draw(logits: np.ndarray, n: int = DRAWS, **kw) -> np.ndarray:
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "penalty": 1.0, "penalty_ids": np.zeros(0, np.int32)}
    params.update(kw)
    return np.array([sample_row(logits, params["temperature"], params["top_k"], params["top_p"], params["penalty"],
                                params["penalty_ids"], seed, 0)[0] for seed in range(n)])


@pytest.mark.parametrize("case", [
    {"temperature": 0.7},
    {"temperature": 1.3},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.9, "top_k": 12, "top_p": 0.8},
    {"temperature": 1.0, "penalty": 2.0, "seen": True},
], ids=["t0.7", "t1.3", "topk5", "topp0.6", "topk12-topp0.8", "penalty2"])
def test_empirical_distribution_matches_reference(context_logits, case):
    prompt, logits = context_logits
    seen = prompt if case.get("seen") else []
    kw = {k: v for k, v in case.items() if k != "seen"}
    tokens = draw(logits, penalty_ids=np.array(seen, np.int32), **kw)
    probs = reference_probs(logits, case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                            case.get("penalty", 1.0), seen)
    counts = np.bincount(tokens, minlength=CONFIG.vocab_size)
    assert np.all(counts[probs == 0] == 0), "sampled a token outside the allowed set"
    ok, stat, critical = chi_square_ok(counts, probs)
    assert ok, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_chi_square_check_detects_a_wrong_distribution(context_logits):
    """The statistical check itself has power: temperature 1.0 samples fail against the 0.7 reference."""
    _, logits = context_logits
    counts = np.bincount(draw(logits, temperature=1.0), minlength=CONFIG.vocab_size)
    assert not chi_square_ok(counts, reference_probs(logits, 0.7))[0]


def test_top_k_and_top_p_stay_inside_their_sets(context_logits):
    _, logits = context_logits
    allowed_k = set(np.argsort(-logits)[:3].tolist())
    assert set(draw(logits, 500, top_k=3).tolist()) <= allowed_k
    nucleus = set(np.nonzero(reference_probs(logits, top_p=0.3))[0].tolist())
    assert set(draw(logits, 500, top_p=0.3).tolist()) <= nucleus
    assert set(draw(logits, 200, top_p=1e-6).tolist()) == {int(np.argmax(logits))}


def test_logprob_is_under_the_raw_distribution(context_logits):
    _, logits = context_logits
    token, logprob = sample_row(logits, 1.5, 0, 0.9, 1.0, np.zeros(0, np.int32), 123, 4)
    x = logits.astype(np.float64)
    assert logprob == pytest.approx(x[token] - x.max() - math.log(np.exp(x - x.max()).sum()), abs=1e-5)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[1] + rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (3, 7, 12, 5, 9, 2, 15, 6)]


def test_seeded_requests_are_reproducible_in_any_batch(model):
    runner, _ = model
    batch_prompts = prompts()
    params = [{}, {"temperature": 1.0, "seed": 11}, {}, {"temperature": 0.8, "top_p": 0.9, "seed": 12},
              {"temperature": 1.2, "top_k": 20, "seed": 13}, {}, {"temperature": 1.0, "seed": 14}, {}]
    mixed, mixed_lp = PagedDriver(runner, seed=1).generate(batch_prompts, 12, params)
    greedy, greedy_lp = PagedDriver(runner, seed=2).generate(batch_prompts, 12)
    for i, p in enumerate(params):
        if not p:  # greedy rows of a mixed batch are unchanged
            assert mixed[i] == greedy[i]
            np.testing.assert_allclose(mixed_lp[i], greedy_lp[i], atol=1e-5)
        else:  # the same seed alone gives the same tokens
            alone = PagedDriver(runner, seed=3).generate([batch_prompts[i]], 12, [p])[0][0]
            assert alone == mixed[i]
    other_seed = dict(params[1], seed=99)
    assert PagedDriver(runner, seed=3).generate([batch_prompts[1]], 12, [other_seed])[0][0] != mixed[1]


def test_greedy_repetition_penalty_matches_transformers(model):
    import torch

    runner, model_dir = model
    hf = load_hf(model_dir)
    batch_prompts = prompts()[:4]
    params = [{"repetition_penalty": 1.8}] * len(batch_prompts)
    tokens, _ = PagedDriver(runner, seed=5).generate(batch_prompts, 16, params)
    for prompt, got in zip(batch_prompts, tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref
    assert tokens != PagedDriver(runner, seed=5).generate(batch_prompts, 16)[0]


def test_a_row_whose_sampling_raises_fails_alone():
    """Issue 18 finding 1: top_p 1e-300 is 0 in float32 and raised IndexError for every row of the step."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    n = 3
    sampling = SamplingBatch(np.full(n, 0.8, np.float32), np.zeros(n, np.int32),
                             np.array([0.9, 1e-300, 1.0], np.float32), np.ones(n, np.float32),
                             np.array([11, 12, 13], np.int64), np.array([0, 4, 2], np.int32),
                             np.zeros(n + 1, np.int32), np.zeros(0, np.int32))
    greedy = logits.argmax(axis=1).astype(np.int32)
    ids, logprobs = sample(logits, greedy, np.zeros(n, np.float32), sampling)
    assert ids[1] == FAILED_TOKEN and ids[0] != FAILED_TOKEN and ids[2] != FAILED_TOKEN
    for i, seed, draw in ((0, 11, 0), (2, 13, 2)):  # the other rows draw as they would alone
        alone = sample_row(logits[i], 0.8, 0, float(sampling.top_p[i]), 1.0, np.zeros(0, np.int32), seed, draw)
        assert (ids[i], logprobs[i]) == pytest.approx(alone)
    failures = take_failures(sampling, ids)
    assert list(failures) == [1] and failures[1].startswith("sampling failed: IndexError")
    assert take_failures(sampling, ids) == {1: "failed on the agent (no reason recorded)"}  # taken once
