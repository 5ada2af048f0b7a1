"""A graph of one op, for calling a kernel's Custom op on its own in tests."""

from __future__ import annotations

from mindspore.nn import Cell


class OpCell(Cell):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def construct(self, *inputs):
        return self.op(*inputs)
