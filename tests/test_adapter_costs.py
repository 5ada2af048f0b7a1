"""What an adapter step costs: its shape (``StepShape.adapter_tokens/slots``), the fitted model's adapter terms, the
analytic model's low-rank update, and the simulator serving adapters through the scheduler's slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.step_shape import StepShape, step_rows, steps_from_rows
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.simulator.costs import DeviceCost, DeviceProfile, FittedCost
from llm_serving.simulator.run import simulate
from llm_serving.simulator.workload import SimRequest


def test_the_shape_counts_adapter_rows_tokens_and_distinct_adapters():
    q = np.array([1, 5, 1, 3], np.int32)
    batch = StepBatch(np.zeros(10, np.int32), np.zeros(10, np.int32), np.zeros(10, np.int32), q,
                      np.array([4, 5, 9, 3], np.int32), np.arange(8, dtype=np.int32).reshape(4, 2),
                      lora_slots=np.array([1, -1, 1, 0], np.int32))
    shape = StepShape.of(batch, 8)
    assert (shape.adapter_tokens, shape.adapter_slots) == (5, 2)
    base = StepShape.of(dataclasses.replace(batch, lora_slots=None), 8)
    assert (base.adapter_tokens, base.adapter_slots) == (0, 0)
    assert steps_from_rows(step_rows([(shape, 0.1)])) == [(shape, 0.1)]
    old_row = {k: v for k, v in step_rows([(base, 0.1)])[0].items() if not k.startswith("adapter")}
    assert steps_from_rows([old_row]) == [(base, 0.1)]  # profiles from before adapters still read


def test_the_fit_learns_the_adapter_terms_only_from_a_profile_with_adapter_steps():
    rng = np.random.default_rng(0)
    truth = FittedCost((0.0, 2e-3, 5e-5, 3e-5, 4e-7, 1e-3, 2e-4, 1e-8, 3e-4, 1e-4, 2e-6), adapters=True)
    xs = []
    for _ in range(300):
        seqs = int(rng.integers(1, 33))
        slots = int(rng.integers(0, 4))
        adapted = int(rng.integers(1, seqs + 1)) if slots else 0
        xs.append(StepShape(seqs, seqs, 0, 0, int(rng.integers(seqs, 4000)), seqs, adapter_tokens=adapted,
                            adapter_slots=min(slots, adapted)))
    fit = FittedCost.fit([(s, truth.seconds(s)) for s in xs])
    assert fit.adapters and np.allclose(fit.coefficients[-3:], truth.coefficients[-3:], rtol=1e-4)
    assert all(fit.seconds(s) == pytest.approx(truth.seconds(s), rel=1e-6) for s in xs)  # (decode-only: the base
    # terms are collinear here, their sums fitted)
    assert "adapter token" in fit.describe()
    plain = FittedCost.fit([(s, truth.seconds(s)) for s in xs if not s.adapter_tokens])
    assert not plain.adapters and "LoRA rows cost as base rows" in plain.describe()
    one = next(s for s in xs if s.adapter_slots == 1)
    assert plain.seconds(one) == plain.seconds(dataclasses.replace(one, adapter_tokens=0, adapter_slots=0))


def test_the_analytic_model_adds_the_low_rank_update():
    model = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    cost = DeviceCost(DeviceProfile(), model, max_lora_rank=16)
    decode = StepShape(32, 32, 0, 0, 32 * 512, 32 * 512)
    one, three = (dataclasses.replace(decode, adapter_tokens=n, adapter_slots=k) for n, k in ((8, 1), (24, 3)))
    base_s = cost.seconds(decode)
    assert base_s < cost.seconds(one) < cost.seconds(three) < 1.15 * base_s  # rank 16 on 7B: a small extra read


def test_the_simulator_serves_adapters_within_the_slots():
    config = SchedulerConfig(num_blocks=128, block_size=8, max_num_seqs=8, max_prefill_batch=4,
                             max_num_batched_tokens=128, max_model_len=128, chunked_prefill=True,
                             prefix_caching=True, max_loras=2, eos_token_id=None)
    requests = [SimRequest(i, 0.001 * i, "p", tuple(range(5, 5 + 9)), 12, adapter=[None, "a", "b", "c"][i % 4])
                for i in range(16)]
    truth = FittedCost((0.0, 2e-3, 5e-5, 3e-5, 4e-7, 1e-3, 2e-4, 1e-8, 3e-3, 1e-3, 1e-4), adapters=True)
    run = simulate(config, requests, truth)
    assert all(r.success and r.output_tokens == 12 for r in run.results)
    base = simulate(config, [dataclasses.replace(r, adapter=None) for r in requests], truth)
    assert run.duration > base.duration  # the adapter terms, and requests waiting for a slot
    assert run.prefix_hit_tokens < base.prefix_hit_tokens  # the same prompt under 4 models: fewer shared blocks
    with pytest.raises(ValueError, match="max_loras 0"):
        simulate(dataclasses.replace(config, max_loras=0), requests, truth)
