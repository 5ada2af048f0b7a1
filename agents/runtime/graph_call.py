"""Calling a step Cell's compiled graphs without ``Cell.__call__``'s per-call compile check.

Why: in graph mode every ``Cell.__call__`` goes through ``Cell.compile``, which re-derives the graph's phase key
from the arguments and sets the phase on each of the model's ~100 sub-cells before it finds the graph compiled.
That costs about 1 ms per call (measured with cProfile on the batch-1 decode step of the bench model: 9.3 ms per
call, of which the compile check 1.3 ms), as much as the graph's non-matmul work. Once a shape has been through
``Cell.__call__`` or ``Cell.compile`` its phase is known, and the later calls of that shape hand the arguments to
the same executor call that ``Cell.compile_and_run`` ends with.

This leans on MindSpore's graph executor (``mindspore.graph.api._cell_graph_executor``), a private API: where it
is missing (another MindSpore version) every call takes ``Cell.__call__``, which is slower but the same graph.
"""

from __future__ import annotations

import numpy as np
from mindspore import JitConfig, Tensor, nn

try:
    from mindspore.graph.api import _cell_graph_executor as _executor
except ImportError:  # another MindSpore layout: the public call path only
    _executor = None

_DEFAULT_JIT_CONFIG = JitConfig().jit_config_dict  # what Cell.compile_and_run sets for a Cell without its own


def _signature(inputs: tuple[Tensor, ...]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


def dynamic_inputs(arrays: list[np.ndarray]) -> list[Tensor]:
    """Placeholders of the arrays' ranks and dtypes with every dimension open (``Tensor(shape=[None, ...])``)."""
    return [Tensor(shape=[None] * a.ndim, dtype=Tensor(a[:0]).dtype) for a in arrays]


class CompiledCell:
    """A graph-mode Cell whose calls of an already compiled input signature skip ``Cell.__call__``.

    Only for Cells whose inputs are all Tensors (our step graphs): the phase key then depends on their shapes
    and dtypes alone.
    """

    def __init__(self, cell: nn.Cell) -> None:
        self.cell = cell
        self._phases: dict[tuple, str] = {}
        self._direct = _executor is not None and hasattr(_executor, "_graph_executor")

    def set_dynamic(self, arrays: list[np.ndarray]) -> None:
        """Compile one graph for inputs of these arrays' ranks and dtypes, every dimension open (``set_inputs`` with
        None dims): each later shape runs on it instead of compiling a graph of its own."""
        self.cell.set_inputs(*dynamic_inputs(arrays))

    def compile(self, *inputs: Tensor) -> None:
        self.cell.compile(*inputs)
        self._remember(inputs)

    def __call__(self, *inputs: Tensor):
        phase = self._phases.get(_signature(inputs)) if self._direct else None
        if phase is None:
            outputs = self.cell(*inputs)
            self._remember(inputs)
            return outputs
        executor = _executor._graph_executor
        executor.set_jit_config(self.cell.jit_config_dict or _DEFAULT_JIT_CONFIG)
        return _executor._exec_pip(self.cell, *inputs, phase=phase)

    def _remember(self, inputs: tuple[Tensor, ...]) -> None:
        phase = getattr(self.cell, "current_phase", None)
        if self._direct and isinstance(phase, str):
            self._phases[_signature(inputs)] = phase
