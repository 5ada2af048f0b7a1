"""``pa_config.num_blocks: auto``: each agent sizes its KV cache from its device's memory (``memory_utilization``
of it, less its weights and a step's working memory) and reports the count; the master's scheduler plans with it
and restarted agents get the same count. On CPU the device memory is the host's available memory."""

from __future__ import annotations

import re

import numpy as np
import pytest

from agents.runtime import kv_budget
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import agent_spec, resolve_model, runner_config_dict
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_block_bytes
from llm_serving.protocol.wire import parse_ready_payload, ready_payload

GIB = kv_budget.GIB
LLAMA_7B = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)


def test_a_block_holds_k_and_v_of_every_layer_and_ranks_hold_their_share_of_the_kv_heads():
    assert kv_block_bytes(ShardPlan(LLAMA_7B), 16, "float16") == 2 * 32 * 16 * 4096 * 2  # 8 MiB
    assert kv_block_bytes(ShardPlan(LLAMA_7B, 2, 1), 16, "float16") == 2 * 32 * 16 * 2048 * 2


def test_llama2_7b_on_32_and_64_gb_910bs():
    """The arithmetic the agents do at start-up, for the 13.5 GB of Llama-2-7B float16 weights."""
    shard, weights = ShardPlan(LLAMA_7B), 6_738_415_616 * 2
    reserve = kv_budget.step_reserve_bytes(shard, 8192 + 128, 129, "float16", "Ascend")
    per_block = kv_block_bytes(shard, 16, "float16")
    small = kv_budget.plan_blocks(32 * GIB, 0.9, weights, reserve, per_block, 16, 4096)
    large = kv_budget.plan_blocks(64 * GIB, 0.9, weights, reserve, per_block, 16, 4096)
    assert 1500 < small.num_blocks < 1800 and 5100 < large.num_blocks < 5500  # not the 5376 a 32 GB one OOMs on
    assert small.num_blocks * per_block + weights + reserve <= 0.9 * 32 * GIB
    assert "KV cache: " in small.describe() and "of weights" in small.describe()
    with pytest.raises(ValueError, match=r"pa_config.memory_utilization 0.5 of 32.0 GiB .* fewer than the 257 one "
                                         r"4096-token sequence needs"):
        kv_budget.plan_blocks(32 * GIB, 0.5, weights, reserve, per_block, 16, 4096)


def test_the_keys_are_checked_where_they_are_read(tmp_path):
    cfg = ServingConfig.from_dict({"pa_config": {"num_blocks": "auto"}})
    assert cfg.pa_config.auto_blocks and cfg.pa_config.utilization == 0.9
    assert runner_config_dict(cfg)["num_blocks"] is None and runner_config_dict(cfg)["memory_utilization"] == 0.9
    auto = ServingConfig.from_dict({"pa_config": {"num_blocks": "auto", "memory_utilization": 0.5}})
    assert runner_config_dict(auto)["memory_utilization"] == 0.5
    for pa, message in (({"memory_utilization": 0.5}, "sizes the cache only with pa_config.num_blocks: auto"),
                        ({"num_blocks": "auto", "memory_utilization": 1.5}, r"must be in \(0, 1\]"),
                        ({"num_blocks": "many"}, "expected an integer or auto")):
        with pytest.raises(ConfigError, match=message):
            ServingConfig.from_dict({"pa_config": pa})


def test_the_ready_frame_carries_the_count():
    assert parse_ready_payload(ready_payload(0.25, 300)) == (0.25, 300)
    assert parse_ready_payload(ready_payload(None)) == (None, None)
    assert parse_ready_payload("not json") == (None, None)


TINY = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "vocab_size": 1000, "seed": 3}


def tiny(tmp_path, utilization: float) -> ServingConfig:
    return ServingConfig.from_dict({
        "default_model": {"data_dir": str(tmp_path), **TINY},
        "model_config": {"seq_length": [32], "prefill_batch_size": [4], "decode_batch_size": [8]},
        "pa_config": {"num_blocks": "auto", "memory_utilization": utilization, "block_size": 8,
                      "decode_seq_length": 64},
        "scheduler": {"policy": "fcfs"},
        "serving_config": {"compile_cache": False}})  # never the user's cache


def utilization_for(cfg: ServingConfig, blocks: int) -> float:
    """The share of this host's available memory that leaves about ``blocks`` blocks for the tiny model."""
    from agents.weights.checkpoints import load_weights

    model = resolve_model(cfg, None)
    fields = agent_spec(cfg, model).runner_config
    shard = ShardPlan(model.llama_config)
    need = (kv_budget.weight_bytes(load_weights(model.model_path, model.llama_config), "float32")
            + kv_budget.step_reserve_bytes(shard, max(fields["max_num_batched_tokens"] or 0, 4 * 32, 64) + 8, 9,
                                           "float32", "CPU")
            + blocks * kv_block_bytes(shard, 8, "float32"))
    return need / kv_budget.device_memory_bytes("CPU", 0)


def test_an_engine_serves_with_the_count_its_agent_sized_from_memory(tmp_path):
    lines: list[str] = []
    cfg = tiny(tmp_path, 0.5)
    cfg = tiny(tmp_path, utilization_for(cfg, 64))
    with Engine(cfg) as engine:
        engine.start(progress=lines.append)
        reported = [int(m.group(1)) for line in lines if (m := re.search(r"agent 0: KV cache: (\d+) blocks", line))]
        assert len(reported) == 1 and 32 <= reported[0] <= 128, lines  # the host's memory moves a little
        assert engine.stats()["kv_blocks_total"] == reported[0] - 1  # block 0 is the dummy block
        assert any(f"KV cache: {reported[0]} blocks of 8 tokens" in line for line in lines)
        result = engine.submit([1, 5, 9, 14], None).result(timeout=60)
        assert len(result.token_ids) > 0 and np.isfinite(result.logprobs).all()
        assert engine._agents._spec.runner_config["num_blocks"] == reported[0]  # what a restarted agent gets


def test_too_little_memory_fails_the_start_naming_the_key(tmp_path):
    with Engine(tiny(tmp_path, 1e-9)) as engine, pytest.raises(Exception, match="pa_config.memory_utilization"):
        engine.start(progress=None)
