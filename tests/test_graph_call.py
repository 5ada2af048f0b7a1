"""CompiledCell: later calls of a compiled shape skip Cell.__call__ and give what it gives, side effects included."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agents.runtime import graph_call
from agents.runtime.graph_call import CompiledCell


class Accumulate(nn.Cell):
    """Adds its input into a Parameter in place and returns (new total, input doubled): a KV-cache-like write."""

    def __init__(self) -> None:
        super().__init__()
        self.total = Parameter(Tensor(np.zeros(4, np.float32)), name="total")
        self.compiles = 0

    def compile(self, *args, **kwargs):
        self.compiles += 1
        return super().compile(*args, **kwargs)

    def construct(self, x: Tensor):
        written = ops.assign_add(self.total, x[:4])
        return ops.depend(self.total, written) * 1.0, x * 2.0


def setup_module() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)


def test_later_calls_of_a_compiled_shape_skip_the_compile_check_and_keep_side_effects() -> None:
    cell = Accumulate()
    graph = CompiledCell(cell)
    x = Tensor(np.arange(4, dtype=np.float32))
    first_total, doubled = graph(x)
    assert cell.compiles == 1
    for _ in range(3):
        total, doubled = graph(x)
    assert cell.compiles == 1, "a compiled shape went through Cell.__call__ again"
    np.testing.assert_array_equal(first_total.asnumpy(), np.arange(4))
    np.testing.assert_array_equal(total.asnumpy(), 4 * np.arange(4))  # every call's in-place write kept
    np.testing.assert_array_equal(doubled.asnumpy(), 2 * np.arange(4))
    np.testing.assert_array_equal(cell.total.asnumpy(), 4 * np.arange(4))


def test_a_new_shape_compiles_through_the_cell_and_then_runs_direct() -> None:
    cell = Accumulate()
    graph = CompiledCell(cell)
    graph.compile(Tensor(np.zeros(4, np.float32)))
    graph(Tensor(np.ones(4, np.float32)))
    assert cell.compiles == 1  # compiled by compile(), run direct
    wide = Tensor(np.ones(8, np.float32))
    _, doubled = graph(wide)
    assert cell.compiles == 2
    _, doubled = graph(wide)
    assert cell.compiles == 2
    np.testing.assert_array_equal(doubled.asnumpy(), np.full(8, 2.0))
    np.testing.assert_array_equal(cell.total.asnumpy(), np.full(4, 3.0))


def test_without_the_private_executor_every_call_takes_the_public_path(monkeypatch) -> None:
    monkeypatch.setattr(graph_call, "_executor", None)
    cell = Accumulate()
    graph = CompiledCell(cell)
    x = Tensor(np.ones(4, np.float32))
    graph(x)
    total, _ = graph(x)
    assert cell.compiles == 2
    np.testing.assert_array_equal(total.asnumpy(), np.full(4, 2.0))
