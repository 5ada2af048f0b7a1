"""Megatron-style tensor parallelism: which slice of every weight and of the KV cache each rank holds.

Both sides use this: the master to refuse a tensor-parallel size the model's head counts do not allow (before
any agent starts) and to size the KV cache, the agents to cut the checkpoint and build their graph. No
MindSpore here.

The plan for ``tp`` ranks, rank ``r``:
- attention: query heads split evenly (``heads / tp`` each, rank r takes the r-th run); kv heads split evenly
  when there are at least ``tp`` of them, else each rank keeps the one kv head its query heads read (a kv head
  is then replicated on ``tp / kv_heads`` ranks). The fused QKV projection is column-parallel (its rows for
  those heads), the output projection row-parallel (its columns for them) and followed by an all-reduce;
- MLP: gate and up column-parallel (``intermediate / tp`` rows each), down row-parallel + all-reduce;
- vocabulary: the embedding and the lm_head split by rows into contiguous ranges of ``ceil(vocab / tp)``
  (the last range may be shorter); the embedding's lookups are all-reduced, the greedy pick combines each
  rank's best token, max logit and log-sum-exp;
- q/k/v biases are cut as the QKV rows are; norms (and Qwen3's per-head q/k norms) are replicated;
- a MoE layer's router is replicated; its experts are either each cut as the dense MLP is (gate/up rows and down
  columns of every expert: tensor parallel) or, with ``expert_parallel``, held whole, ``num_experts / tp`` per
  rank. Either way a rank's block gives a partial sum of the layer's output, which the all-reduce that ends the
  dense MLP sums (docs/model.md "Mixture of experts" says why not an all-to-all). A shared expert is cut as the
  dense MLP in both modes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm_serving.protocol.model_config import LlamaConfig


def tensor_parallel_problems(config: LlamaConfig, tp: int, expert_parallel: bool = False) -> list[str]:
    """What makes ``tp`` ranks impossible for this model ([] when it is fine), each naming the head count."""
    if tp < 1:
        return [f"the tensor-parallel size must be >= 1, got {tp}"]
    moe = config.moe
    if expert_parallel and moe is None:
        return ["model_config.expert_parallel: the model has no experts (not a mixture-of-experts architecture)"]
    problems = []
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        problems.append(f"num_attention_heads {heads} is not divisible by {tp} ranks")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads {kv} neither divides among {tp} ranks nor divides {tp} "
                        "(for replication on fewer kv heads than ranks)")
    if moe is not None:
        if expert_parallel and moe.num_experts % tp:
            problems.append(f"num_experts {moe.num_experts} is not divisible by {tp} ranks "
                            "(model_config.expert_parallel holds num_experts / ranks whole experts on each)")
        if not expert_parallel and moe.moe_intermediate_size % tp:
            problems.append(f"moe_intermediate_size {moe.moe_intermediate_size} is not divisible by {tp} ranks")
        if moe.shared_expert_intermediate_size % tp:
            problems.append(f"shared_expert_intermediate_size {moe.shared_expert_intermediate_size} is not "
                            f"divisible by {tp} ranks")
    dense_layers = moe is None or len(moe.sparse_layers) < config.num_hidden_layers
    if dense_layers and config.intermediate_size % tp:
        problems.append(f"intermediate_size {config.intermediate_size} is not divisible by {tp} ranks")
    per_rank = -(-config.vocab_size // tp)
    if config.vocab_size <= (tp - 1) * per_rank:
        problems.append(f"vocab_size {config.vocab_size} leaves a rank without vocabulary at {tp} ranks")
    return problems


def kv_shards(config: LlamaConfig, tp: int) -> int:
    """Into how many parts the kv heads are split (each rank's cache holds one part): ``tp`` where the kv heads
    divide among the ranks, else the kv head count (each rank keeps one whole kv head)."""
    return min(tp, config.num_key_value_heads)


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``tp``: its head, FFN and vocabulary ranges. ``tp == 1`` is the whole model."""

    config: LlamaConfig
    tp: int = 1
    rank: int = 0
    expert_parallel: bool = False  # a MoE layer's experts split whole over the ranks (else each cut as the MLP)

    def __post_init__(self) -> None:
        problems = tensor_parallel_problems(self.config, self.tp, self.expert_parallel)
        if problems:
            raise ValueError(f"tensor parallelism over {self.tp} ranks: {'; '.join(problems)}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is not in [0, {self.tp})")

    @property
    def heads(self) -> int:
        """Query heads of this rank."""
        return self.config.num_attention_heads // self.tp

    @property
    def kv_heads(self) -> int:
        """Kv heads of this rank (1 when the kv heads are replicated)."""
        return self.config.num_key_value_heads // kv_shards(self.config, self.tp)

    @property
    def kv_head_start(self) -> int:
        """The first kv head of this rank: its query heads read kv heads ``kv_head_start + i``."""
        first_query = self.rank * self.heads
        return first_query // (self.config.num_attention_heads // self.config.num_key_value_heads)

    @property
    def ffn(self) -> int:
        return self.config.intermediate_size // self.tp

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's vocabulary range but maybe the last (the width the full logits gather uses)."""
        return -(-self.config.vocab_size // self.tp)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = self.rank * self.vocab_per_rank
        return start, min(self.config.vocab_size, start + self.vocab_per_rank)

    @property
    def attention_config(self) -> LlamaConfig:
        """The model as one rank's attention sees it: its query and kv heads, ``hidden_size`` their width."""
        if self.tp == 1 and self.config.q_dim == self.config.hidden_size:
            return self.config
        return dataclasses.replace(self.config, hidden_size=self.heads * self.config.head_dim,
                                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   explicit_head_dim=self.config.head_dim)

    def qkv_rows(self) -> list[tuple[int, int]]:
        """``[start, end)`` rows of the fused ``[q; k; v]`` weight this rank holds, in order."""
        hd, q_width, kv_dim = self.config.head_dim, self.config.q_dim, self.config.kv_dim
        q = (self.rank * self.heads * hd, (self.rank + 1) * self.heads * hd)
        k = (q_width + self.kv_head_start * hd, q_width + (self.kv_head_start + self.kv_heads) * hd)
        return [q, k, (k[0] + kv_dim, k[1] + kv_dim)]

    def attention_columns(self) -> tuple[int, int]:
        """Columns of the output projection (``wo``) this rank holds: its query heads' outputs."""
        hd = self.config.head_dim
        return self.rank * self.heads * hd, (self.rank + 1) * self.heads * hd

    def ffn_range(self) -> tuple[int, int]:
        """Rows of gate and of up (each), and columns of down, this rank holds."""
        return self.rank * self.ffn, (self.rank + 1) * self.ffn

    def expert_range(self) -> tuple[int, int]:
        """The experts ``[start, end)`` this rank holds (all of them, cut, without expert parallelism)."""
        count = self.config.moe.num_experts if self.config.moe else 0
        if not self.expert_parallel:
            return 0, count
        return self.rank * count // self.tp, (self.rank + 1) * count // self.tp

    def expert_ffn_range(self) -> tuple[int, int]:
        """Rows of each held expert's gate and up, and columns of its down, this rank holds."""
        f = self.config.moe.moe_intermediate_size if self.config.moe else 0
        if self.expert_parallel:
            return 0, f
        return self.rank * f // self.tp, (self.rank + 1) * f // self.tp

    def shared_ffn_range(self) -> tuple[int, int]:
        """Rows of the shared expert's gate and up, and columns of its down, this rank holds."""
        s = self.config.moe.shared_expert_intermediate_size if self.config.moe else 0
        return self.rank * s // self.tp, (self.rank + 1) * s // self.tp


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes of one value, by protocol DTYPES


def kv_block_bytes(shard: ShardPlan, block_size: int, dtype: str, kv_cache_dtype: str = "auto",
                   device_target: str = "CPU") -> int:
    """One block of a rank's KV cache: K and V of ``block_size`` tokens over its kv heads, every layer; an int8
    cache row is head_dim bytes, on CPU with its own float32 scale (``kv_cache_dtype`` int8; on Ascend the scales
    are per channel, outside the cache)."""
    config = shard.config
    if kv_cache_dtype == "int8":
        row = config.head_dim + (4 if device_target == "CPU" else 0)
    else:
        row = config.head_dim * DTYPE_BYTES[dtype]
    return 2 * config.num_hidden_layers * block_size * shard.kv_heads * row
