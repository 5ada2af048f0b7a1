"""A checkpoint's tensors by name and full shape, each read by slices (rows or columns) on request: what a
tensor-parallel rank loads from (``agents.weights.sharded``) and what an int8 checkpoint is seen through
(``agents.weights.int8_checkpoint``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from agents.weights.errors import WeightLoadError

Span = tuple[int, int] | None  # [start, end) of rows or columns; None: all


def cut(view: np.ndarray, rows: Span, cols: Span) -> np.ndarray:
    if rows is not None:
        view = view[rows[0]: rows[1]]
    if cols is not None:
        view = view[:, cols[0]: cols[1]]
    return view


class SliceSource(Mapping):
    """Tensor name -> full shape, with ``read(name, rows, cols)`` reading only that slice (a copy)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], label: str) -> None:
        self.shapes = shapes
        self.label = label

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        raise NotImplementedError

    def read_ints(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        """An integer tensor's slice as stored (int8 weights and their layout tensors)."""
        raise WeightLoadError(f"{self.label}: tensor {name!r}: integer tensors are read from safetensors only")

    def is_int8(self, name: str) -> bool:
        """Whether ``name`` is stored as int8 values with scales (``agents.weights.int8_checkpoint``)."""
        return False

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
