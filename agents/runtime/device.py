"""One place that puts MindSpore into graph mode on the chosen device, once per process, and holds the graph
settings each device serves with.

Ascend runs as every working 910B stack does (MindFormers 1.8 predict mode, vllm-mindspore): kernel by kernel
(``jit_level`` O0) with ``infer_boost`` on. Without ``infer_boost``, MindSpore 2.10 selects no internal kernels:
graph-mode ReshapeAndCache then has no kernel at all and PagedAttention and FlashAttentionScore go to ACLNN paths
with other contracts (``agents.tools.contracts`` checks the internal ones). ``MsContext::IsEnableInferBoost``
reads it from the context or from the graph's jit config, so both are set: the context one also reaches what
runs before any graph compiles (the choice of LCCL for tensor-parallel collectives). 2.10 marks the key
deprecated and logs a warning; it is still what selects the kernels in 2.10. ``MS_ENABLE_INTERNAL_BOOST=on``
(vllm-mindspore's setting; the default when unset) keeps the internal fused kernels enabled. The rest of the
stacks' environment (which PagedAttention kernel, the allocator, the collectives' settings) and the memory pool
cap are one table, ``llm_serving.protocol.ascend_env``, resolved by the master from the config. CPU graphs keep
MindSpore's defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import mindspore as ms
from mindspore import nn

from llm_serving.protocol.ascend_env import ascend_environment
from llm_serving.protocol.model_config import DEVICE_TARGETS

_configured: tuple[str, int] | None = None

# device target -> the jit config of the context and of every step graph; absent: MindSpore's defaults
JIT_CONFIGS = {"Ascend": {"jit_level": "O0", "infer_boost": "on"}}


def setup_device(target: str = "CPU", device_id: int = 0, environment: Mapping[str, str] | None = None,
                 max_device_memory: str | None = None) -> None:
    """Graph mode on ``target`` ("CPU" or "Ascend") with its settings; later calls with the same device are no-ops.
    On Ascend only (a CPU export of Ascend graphs keeps MindSpore's defaults): ``environment``, set (each variable
    unless the user set it) before MindSpore selects kernels, None: the table's defaults for one rank;
    ``max_device_memory``: the memory pool's cap."""
    global _configured
    if _configured == (target, device_id):
        return
    if _configured is not None:
        raise RuntimeError(f"MindSpore is already set up for {_configured}, cannot switch to {(target, device_id)}")
    if target not in DEVICE_TARGETS:
        raise ValueError(f"device_target {target!r} is not one of {list(DEVICE_TARGETS)}")
    if target == "Ascend":
        for key, value in (ascend_environment(1, {}) if environment is None else environment).items():
            os.environ.setdefault(key, value)
    ms.set_context(mode=ms.GRAPH_MODE)
    if target in JIT_CONFIGS:
        ms.set_context(jit_config=dict(JIT_CONFIGS[target]))
    if target == "CPU":
        try:
            ms.set_device(target)
        except RuntimeError:  # kernels already ran in this process (a test's cells) on MindSpore's default device
            if ms.get_context("device_target") != "CPU":
                raise
    else:
        ms.set_device(target, device_id)
        if max_device_memory is not None:  # MindSpore takes it for the device set (before its pool is made)
            ms.set_context(max_device_memory=max_device_memory)
    _configured = (target, device_id)


def apply_jit_config(cell: nn.Cell, target: str) -> None:
    """Give a step graph the jit config its device target serves with (``JIT_CONFIGS``); others unchanged."""
    config = JIT_CONFIGS.get(target)
    if config is not None:
        cell.set_jit_config(ms.JitConfig(**config))
