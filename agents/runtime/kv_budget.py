"""The KV cache sized from the device's memory (``pa_config.num_blocks: auto``), as vLLM's and vllm-mindspore's
``gpu_memory_utilization`` does: of ``memory_utilization`` x the device's memory, what this rank's weights and
one step's working memory leave, in whole blocks.

Why an estimate and not a profile: vLLM measures the peak of a profiling run; MindSpore 2.10's graph mode
allocates from its memory pool at compile time, so the peak of a step is only known after the caches (graph
Parameters) exist. The working memory is bounded from the largest step instead (``step_reserve_bytes``), plus a
fixed reserve for the device runtime (CANN workspaces, HCCL buffers on Ascend). The count is reported to the
master in the agent's READY frame; tensor-parallel ranks each size their own cache and the master serves the
smallest count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agents.weights.sharded import EXPERT_KINDS, QUANTIZED_KINDS, SHARED_EXPERT_KINDS
from llm_serving.protocol.parallel import DTYPE_BYTES, ShardPlan

GIB = 1 << 30
RUNTIME_RESERVE_BYTES = {"Ascend": 2 * GIB, "CPU": 0}  # what the device runtime keeps besides our tensors


@dataclass(frozen=True)
class KvBudget:
    """How this rank's cache was sized; ``describe`` is the line the agent reports."""

    device_bytes: int
    utilization: float
    weight_bytes: int
    reserve_bytes: int
    block_bytes: int
    num_blocks: int

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks of {self.block_bytes / (1 << 20):.2f} MiB from "
                f"{self.utilization:g} x {self.device_bytes / GIB:.1f} GiB, less {self.weight_bytes / GIB:.2f} GiB "
                f"of weights and {self.reserve_bytes / GIB:.2f} GiB for steps and the runtime")


def weight_bytes(weights: Mapping[str, np.ndarray], dtype: str, quantized: bool = False) -> int:
    """This rank's weights as the device holds them: in the serving dtype, or (``quantized``, w8a16) the layers'
    projections, routed experts and shared experts as one byte a weight and a float32 scale a row
    (``agents.weights.packed.pack_int8``, ``agents.model.moe.ExpertsHeld``)."""
    total = 0
    for name, w in weights.items():
        if name.endswith(".scale"):
            total += int(w.size) * 4
        elif quantized and name.rsplit(".", 1)[-1] in (*QUANTIZED_KINDS, *EXPERT_KINDS, *SHARED_EXPERT_KINDS):
            total += int(w.size) + (0 if f"{name}.scale" in weights else int(w.size // w.shape[-1]) * 4)
        else:
            total += int(w.size) * DTYPE_BYTES[dtype]
    return total


def step_reserve_bytes(shard: ShardPlan, max_tokens: int, max_batch: int, dtype: str, device_target: str) -> int:
    """A bound on one step's working memory: four live activations of the widest projection for ``max_tokens``
    rows in the compute dtype, the float32 logits of ``max_batch`` sequences twice (the full vocabulary under
    tensor parallelism), and the runtime's own reserve."""
    config = shard.config
    widest = max(config.qkv_dim, 2 * shard.ffn, config.hidden_size)
    activations = 4 * max_tokens * widest * DTYPE_BYTES[dtype]
    logits = 2 * max_batch * config.vocab_size * 4
    return activations + logits + RUNTIME_RESERVE_BYTES[device_target]


def plan_blocks(device_bytes: int, utilization: float, weights: int, reserve: int, per_block: int,
                block_size: int, max_model_len: int) -> KvBudget:
    """Whole blocks in what is left; ``ValueError`` naming the keys when not even one longest sequence (plus the
    reserved dummy block 0) fits."""
    free = int(device_bytes * utilization) - weights - reserve
    blocks = max(free // per_block, 0)
    needed = 1 + -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(f"pa_config.memory_utilization {utilization:g} of {device_bytes / GIB:.1f} GiB leaves "
                         f"{max(free, 0) / GIB:.2f} GiB after {weights / GIB:.2f} GiB of weights and "
                         f"{reserve / GIB:.2f} GiB for steps: {blocks} KV blocks, fewer than the {needed} one "
                         f"{max_model_len}-token sequence needs (pa_config.decode_seq_length): raise "
                         "memory_utilization, shorten the sequences, or use more tensor-parallel ranks")
    return KvBudget(device_bytes, utilization, weights, reserve, per_block, int(blocks))


def device_memory_bytes(device_target: str, device_id: int) -> int:
    """The memory the cache comes from: the NPU's HBM (MindSpore's device properties, read once the device is
    initialised), or on CPU the host's available memory (the cache is host memory there)."""
    if device_target == "CPU":
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise ValueError("pa_config.num_blocks auto: /proc/meminfo has no MemAvailable; set num_blocks")
    import mindspore as ms

    ms.Tensor(np.zeros(1, np.float32)).asnumpy()  # initialises the device: its properties read 0 before
    total = int(ms.hal.get_device_properties(device_id).total_memory)
    if total <= 0:
        raise ValueError(f"pa_config.num_blocks auto: MindSpore reports no memory for {device_target} device "
                         f"{device_id}; set num_blocks")
    return total
