"""A graph of one op, for calling a kernel's Custom op on its own in tests, and the kernel builds tests run."""

from __future__ import annotations

from pathlib import Path

import pytest
from mindspore.nn import Cell

from agents.model import native_kernels
from agents.model.native_kernels import NativeOps, native_ops


class OpCell(Cell):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def construct(self, *inputs):
        return self.op(*inputs)


def built_ops(build: str, hidden_size: int, generic_dir: Path) -> NativeOps:
    """The native ops as built for this machine (``default``), or built without AVX-512 (``generic``: the plain
    loops other CPUs run) into ``generic_dir`` (conftest's session-wide ``generic_kernel_dir``: built once)."""
    if build == "default":
        return native_ops(hidden_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_kernels, "CXX_FLAGS", native_kernels.CXX_FLAGS + ("-mno-avx512f",))
        patch.setenv("LLM_SERVING_KERNEL_DIR", str(generic_dir))
        return native_ops(hidden_size)
