"""The adapter slots' device memory counted against the KV cache (``protocol.lora_budget``)."""

from __future__ import annotations

from llm_serving.protocol.lora_budget import lora_pool_bytes, lora_slot_values
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

CONFIG = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def test_a_slot_holds_every_projection_s_a_and_b_at_the_largest_rank():
    r, h, qkv, ffn = 8, 64, 64 + 2 * 32, 96
    per_layer = 3 * r * (h + qkv) + r * (h + h) + 2 * r * (h + 2 * ffn) + r * (ffn + h)
    assert lora_slot_values(ShardPlan(CONFIG), r) == 3 * per_layer
    assert lora_pool_bytes(ShardPlan(CONFIG), {"max_loras": 4, "max_lora_rank": r}, "bfloat16") == 4 * 3 * per_layer * 2
    assert lora_pool_bytes(ShardPlan(CONFIG), None, "float32") == 0


def test_tensor_parallel_ranks_hold_their_slices_and_the_replicated_parts_whole():
    r = 16
    whole, half = lora_slot_values(ShardPlan(CONFIG), r), lora_slot_values(ShardPlan(CONFIG, 2, 1), r)
    # each rank: A of the column-parallel projections and B of the row-parallel ones whole (h x R, every layer)
    replicated = 3 * (3 * r * 64 + 2 * r * 64 + r * 64 + r * 64)
    assert 2 * half - replicated == whole


def test_the_auto_kv_budget_holds_the_slots_like_weights(monkeypatch):
    from agents import agent_main
    from agents.runtime import device, kv_budget

    monkeypatch.setattr(device, "setup_device", lambda *a, **k: None)
    monkeypatch.setattr(kv_budget, "device_memory_bytes", lambda target, device_id: 1 << 30)
    fields = {"device_target": "CPU", "device_id": 0, "dtype": "float32", "block_size": 8, "max_model_len": 64,
              "decode_batch_sizes": [4], "prefill_batch_sizes": [2], "prefill_seq_lengths": [32],
              "max_num_batched_tokens": 64}
    lora = {"max_loras": 8, "max_lora_rank": 64}
    plain = agent_main.size_kv_cache(fields, ShardPlan(CONFIG), {}, 0.5)
    with_slots = agent_main.size_kv_cache(fields, ShardPlan(CONFIG), {}, 0.5, lora=lora)
    assert with_slots.weight_bytes - plain.weight_bytes == lora_pool_bytes(ShardPlan(CONFIG), lora, "float32")
    free = (1 << 29) - plain.reserve_bytes  # 0.5 of 1 GiB, no model weights
    assert (plain.num_blocks, with_slots.num_blocks) == (free // plain.block_bytes,
                                                         (free - with_slots.weight_bytes) // plain.block_bytes)
    assert with_slots.num_blocks < plain.num_blocks
