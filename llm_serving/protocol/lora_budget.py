"""The device memory of a rank's LoRA adapter slots, which ``pa_config.num_blocks: auto`` takes out of the KV
cache's share (``agents.runtime.kv_budget``) as it does the weights: the slots exist for the agents' whole life.

A slot holds, per decoder layer, each fused projection's ``A [R, in]`` and ``B [out, R]`` on this rank
(``agents.weights.lora_weights``), ``R`` the sum of its parts' ranks: up to 3 x ``max_lora_rank`` for ``w_qkv``
(q, k, v), 2x for ``w_gate_up``, 1x for ``wo`` and ``w_down``. So slots x layers x (in + out) x rank x dtype bytes,
each projection with its parts and this rank's slice of its rows (column-parallel) or columns (row-parallel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llm_serving.protocol.parallel import DTYPE_BYTES, ShardPlan


def lora_slot_values(shard: ShardPlan, max_lora_rank: int) -> int:
    """Values (A and B) one adapter slot holds on ``shard``'s rank, every layer."""
    config, r = shard.config, max_lora_rank
    hidden, hd = config.hidden_size, config.head_dim
    qkv_out = (shard.heads + 2 * shard.kv_heads) * hd
    per_layer = (3 * r * (hidden + qkv_out)  # w_qkv: A whole, this rank's rows of B
                 + r * (shard.heads * hd + hidden)  # wo: this rank's columns of A, B whole
                 + 2 * r * (hidden + 2 * shard.ffn)  # w_gate_up
                 + r * (shard.ffn + hidden))  # w_down
    return config.num_hidden_layers * per_layer


def lora_pool_bytes(shard: ShardPlan, lora: Mapping[str, Any] | None, dtype: str) -> int:
    """Bytes of the slots ``lora`` (``AgentSpec.lora``: ``max_loras``, ``max_lora_rank``) asks for, in ``dtype``;
    0 without adapters."""
    if not lora:
        return 0
    return int(lora["max_loras"]) * lora_slot_values(shard, int(lora["max_lora_rank"])) * DTYPE_BYTES[dtype]
