"""One place that puts MindSpore into graph mode on the chosen device, once per process, and holds the graph
settings each device serves with.

Ascend runs as every working 910B stack does (MindFormers 1.8 predict mode, vllm-mindspore): kernel by kernel
(``jit_level`` O0) with ``infer_boost`` on. Without ``infer_boost``, MindSpore 2.10 selects no internal kernels:
graph-mode ReshapeAndCache then has no kernel at all and PagedAttention and FlashAttentionScore go to ACLNN paths
with other contracts (``agents.tools.contracts`` checks the internal ones). ``MsContext::IsEnableInferBoost``
reads it from the context or from the graph's jit config, so both are set: the context one also reaches what
runs before any graph compiles (the choice of LCCL for tensor-parallel collectives). 2.10 marks the key
deprecated and logs a warning; it is still what selects the kernels in 2.10. ``MS_ENABLE_INTERNAL_BOOST=on``
(vllm-mindspore's setting; the default when unset) keeps the internal fused kernels enabled. CPU graphs keep
MindSpore's defaults.
"""

from __future__ import annotations

import os

import mindspore as ms
from mindspore import nn

from llm_serving.protocol.model_config import DEVICE_TARGETS

_configured: tuple[str, int] | None = None

# device target -> the jit config of the context and of every step graph; absent: MindSpore's defaults
JIT_CONFIGS = {"Ascend": {"jit_level": "O0", "infer_boost": "on"}}
# device target -> environment set (unless the user set it) before MindSpore selects kernels
DEVICE_ENVIRONMENT = {"Ascend": {"MS_ENABLE_INTERNAL_BOOST": "on"}}


def setup_device(target: str = "CPU", device_id: int = 0) -> None:
    """Graph mode on ``target`` ("CPU" or "Ascend") with its settings; later calls with the same device are no-ops."""
    global _configured
    if _configured == (target, device_id):
        return
    if _configured is not None:
        raise RuntimeError(f"MindSpore is already set up for {_configured}, cannot switch to {(target, device_id)}")
    if target not in DEVICE_TARGETS:
        raise ValueError(f"device_target {target!r} is not one of {list(DEVICE_TARGETS)}")
    for key, value in DEVICE_ENVIRONMENT.get(target, {}).items():
        os.environ.setdefault(key, value)
    ms.set_context(mode=ms.GRAPH_MODE)
    if target in JIT_CONFIGS:
        ms.set_context(jit_config=dict(JIT_CONFIGS[target]))
    if target == "CPU":
        ms.set_device(target)
    else:
        ms.set_device(target, device_id)
    _configured = (target, device_id)


def apply_jit_config(cell: nn.Cell, target: str) -> None:
    """Give a step graph the jit config its device target serves with (``JIT_CONFIGS``); others unchanged."""
    config = JIT_CONFIGS.get(target)
    if config is not None:
        cell.set_jit_config(ms.JitConfig(**config))
