"""A checkpoint with int8 weights (compressed-tensors W8A16) read as the float checkpoint it stands for, with its
int8 values and scales at hand for a model that serves them as they are.

The format is llm-compressor's and vLLM's (``quantization_config.quant_method: compressed-tensors``; config.json
is checked by ``llm_serving.protocol.model_config.checkpoint_int8``). A quantized linear ``X`` is stored as
- ``X.weight_scale``: ``[out, 1]`` (or ``[out]``), any float dtype: one scale per output channel;
- its int8 values ``q [out, in]`` either as ``X.weight`` (int8, format ``int-quantized``) or as ``X.weight_packed``
  (int32 ``[out, ceil(in / 4)]``, format ``pack-quantized``: four values a word, each ``q + 128`` in one byte,
  the lowest byte first, so on a little-endian host the words' bytes are the columns in order) with
  ``X.weight_shape`` (``[out, in]``);
- optionally ``X.weight_zero_point``, all zeros (symmetric).
The weight is ``q * scale`` (in float32, as the int8 projections form it). Which linears are quantized is seen
from their ``weight_scale``; the usual recipes leave the lm_head float.
"""

from __future__ import annotations

import numpy as np

from agents.weights.errors import WeightLoadError
from agents.weights.slice_source import SliceSource, Span

SCALE, PACKED, SHAPE, ZERO = "weight_scale", "weight_packed", "weight_shape", "weight_zero_point"
PER_WORD = 4  # int8 values in one packed int32


class Int8Slices(SliceSource):
    """``source`` with every quantized linear's tensors seen as one ``X.weight`` of its float shape: ``read`` gives
    it dequantized (float32), ``read_int8`` and ``scale`` its stored numbers."""

    def __init__(self, source: SliceSource) -> None:
        self.source = source
        self.int8: dict[str, tuple[str, tuple[int, int]]] = {}  # X.weight -> (tensor holding q, (out, in))
        hidden: set[str] = set()
        for name in source:
            if not name.endswith("." + SCALE):
                continue
            base = name[: -len(SCALE)]
            stored, shape = self._values(base)
            if tuple(source[name]) not in ((shape[0], 1), (shape[0],)):
                raise WeightLoadError(f"{source.label}: {name!r} has shape {tuple(source[name])}: only one scale "
                                      f"per output channel ({shape[0]}) is served (group-wise scales are not)")
            if base + ZERO in source:
                if source.read_ints(base + ZERO).any():
                    raise WeightLoadError(f"{source.label}: {base + ZERO!r} is not zero: asymmetric int8 weights "
                                          "are not served")
                hidden.add(base + ZERO)
            hidden.update({name, stored, base + SHAPE})
            self.int8[base + "weight"] = (stored, shape)
        shapes = {n: tuple(source[n]) for n in source if n not in hidden}
        shapes.update({weight: shape for weight, (_, shape) in self.int8.items()})
        super().__init__(shapes, source.label)

    def _values(self, base: str) -> tuple[str, tuple[int, int]]:
        """The tensor holding ``base``'s int8 values and the weight's ``(out, in)``."""
        source = self.source
        if base + PACKED in source:
            if base + SHAPE not in source:
                raise WeightLoadError(f"{source.label}: {base + PACKED!r} has no {base + SHAPE!r}")
            shape = tuple(int(v) for v in source.read_ints(base + SHAPE).reshape(-1))
            words = tuple(source[base + PACKED])
            if len(shape) != 2 or words != (shape[0], -(-shape[1] // PER_WORD)):
                raise WeightLoadError(f"{source.label}: {base + PACKED!r} has shape {words}, which does not hold "
                                      f"8-bit values of shape {shape}")
            return base + PACKED, shape
        if base + "weight" in source and len(source[base + "weight"]) == 2:
            return base + "weight", tuple(source[base + "weight"])
        raise WeightLoadError(f"{source.label}: {base + SCALE!r} has no int8 weight ({base + 'weight'!r} or "
                              f"{base + PACKED!r})")

    def is_int8(self, name: str) -> bool:
        return name in self.int8

    def read_int8(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        """The int8 values ``q`` of ``name``'s slice."""
        stored, (_, inner) = self.int8[name]
        if not stored.endswith(PACKED):
            q = self.source.read_ints(stored, rows, cols)
        else:
            lo, hi = cols if cols is not None else (0, inner)
            first = lo // PER_WORD
            words = self.source.read_ints(stored, rows, (first, -(-hi // PER_WORD)))
            if words.dtype != np.dtype("<i4"):
                raise WeightLoadError(f"{self.label}: {stored!r} has dtype {words.dtype}, expected int32")
            offset_bytes = np.ascontiguousarray(words).view(np.uint8)  # little-endian words: columns in order
            start = lo - first * PER_WORD
            q = (offset_bytes[:, start: start + hi - lo].astype(np.int16) - 128).astype(np.int8)
        if q.dtype != np.int8:
            raise WeightLoadError(f"{self.label}: {stored!r} has dtype {q.dtype}, expected int8")
        return q

    def scale(self, name: str, rows: Span = None) -> np.ndarray:
        """The float32 scales of ``name``'s output channels ``rows``."""
        return self.source.read(name[: -len("weight")] + SCALE, rows, None).reshape(-1).astype(np.float32)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        if name in self.int8:
            return self.read_int8(name, rows, cols).astype(np.float32) * self.scale(name, rows)[:, None]
        return self.source.read(name, rows, cols)

    def read_ints(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        return self.source.read_ints(name, rows, cols)
