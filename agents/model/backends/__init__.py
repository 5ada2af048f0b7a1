"""Ops backends: one per device (and dtype), chosen once per runner; the interface is ``base.OpsBackend``.

``kernels`` (``RunnerConfig.kernels``): ``portable`` takes the graph-op backend; ``native`` the device's own
backend, raising where there is none or it cannot be built; ``auto`` the device's own where it applies, else the
portable one (with a warning when a build failed). On Ascend the device's own are MindSpore's fused NPU primitives
(``ascend``). Adding a device: one module with an ``OpsBackend`` subclass
and a ``create(dtype, hidden_size)``, and one entry in ``NATIVE``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agents.model.backends import ascend, native_cpu
from agents.model.backends.base import Attention, OpsBackend
from agents.model.backends.portable import PortableBackend
from agents.model.native_kernels import KernelBuildError

__all__ = ["Attention", "OpsBackend", "PortableBackend", "select_backend"]

log = logging.getLogger(__name__)

# device target -> create(dtype, hidden_size): ValueError where the dtype does not apply, a build error where
# the kernels cannot be built
NATIVE: dict[str, Callable[[str, int], OpsBackend]] = {"CPU": native_cpu.create, "Ascend": ascend.create}


def select_backend(kernels: str, device_target: str, dtype: str, hidden_size: int) -> OpsBackend:
    """The backend for this ``kernels`` choice on ``device_target`` with ``dtype`` (see the module doc)."""
    if kernels == "portable":
        return PortableBackend()
    try:
        create = NATIVE.get(device_target)
        if create is None:
            raise ValueError(f"no native kernels for device {device_target} (have {sorted(NATIVE)}); use auto or "
                             "portable")
        return create(dtype, hidden_size)
    except ValueError:
        if kernels == "native":
            raise
        return PortableBackend()
    except KernelBuildError as exc:
        if kernels == "native":
            raise
        log.warning("native kernels are unavailable, using the portable graph ops: %s", exc)
        return PortableBackend()
