"""One place that puts MindSpore into graph mode on the chosen device, once per process, and holds the graph
settings each device serves with.

Ascend graphs run kernel by kernel (``jit_level`` O0), as MindFormers' predict mode does: the fused inference
kernels (PagedAttention, FlashAttentionScore, ReshapeAndCache) are launched one by one with host-side lengths,
rather than sunk into one whole-graph (GE, O2) execution. MindFormers' predict configs also set ``infer_boost:
on``; MindSpore 2.10 deprecates that key, so it is left out. CPU graphs keep MindSpore's defaults.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

from llm_serving.protocol.model_config import DEVICE_TARGETS

_configured: tuple[str, int] | None = None

JIT_LEVELS = {"Ascend": "O0"}  # device target -> jit_level of every step graph; absent: MindSpore's default


def setup_device(target: str = "CPU", device_id: int = 0) -> None:
    """Graph mode on ``target`` ("CPU" or "Ascend"); later calls with the same device are no-ops."""
    global _configured
    if _configured == (target, device_id):
        return
    if _configured is not None:
        raise RuntimeError(f"MindSpore is already set up for {_configured}, cannot switch to {(target, device_id)}")
    if target not in DEVICE_TARGETS:
        raise ValueError(f"device_target {target!r} is not one of {list(DEVICE_TARGETS)}")
    ms.set_context(mode=ms.GRAPH_MODE)
    if target == "CPU":
        ms.set_device(target)
    else:
        ms.set_device(target, device_id)
    _configured = (target, device_id)


def apply_jit_config(cell: nn.Cell, target: str) -> None:
    """Give a step graph the ``jit_level`` its device target serves with (``JIT_LEVELS``); others unchanged."""
    level = JIT_LEVELS.get(target)
    if level is not None:
        cell.set_jit_config(ms.JitConfig(jit_level=level))
