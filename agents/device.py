"""One place that puts MindSpore into graph mode on the chosen device, once per process."""

from __future__ import annotations

import mindspore as ms

_configured: tuple[str, int] | None = None


def setup_device(target: str = "CPU", device_id: int = 0) -> None:
    """Graph mode on ``target`` ("CPU" or "Ascend"); later calls with the same device are no-ops."""
    global _configured
    if _configured == (target, device_id):
        return
    if _configured is not None:
        raise RuntimeError(f"MindSpore is already set up for {_configured}, cannot switch to {(target, device_id)}")
    ms.set_context(mode=ms.GRAPH_MODE)
    if target == "CPU":
        ms.set_device(target)
    else:
        ms.set_device(target, device_id)
    _configured = (target, device_id)
