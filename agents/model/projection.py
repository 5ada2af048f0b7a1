"""A projection's weight as the backend's ops read it (``ProjectionWeight``): the dense layers' projections
(``agents.model.llama``) and the MoE block's shared expert (``agents.model.moe``) hold theirs alike, so
``model_config.precision`` and ``model_config.quantization`` reach both through one code path."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindspore.common.initializer import initializer

from agents.weights import packed as packed_weights


class ProjectionWeight(nn.Cell):
    """A projection's ``W [out, in]`` (Hugging Face's layout), held as the backend's ops read it: as is, or
    in the native GEMM's panel layout (``panels``; ``swiglu`` for the fused ``[gate; up]`` weight, see
    ``agents.weights.packed``), in the model's dtype or, for a faster precision mode (``panel_dtype``), as
    float16 panels or int32 bfloat16 pairs. ``quantization`` w8a16: int8 with a scale per output row, as int8
    panels with the scales inside (native CPU) or as an int8 ``[out, in]`` weight beside a ``scale [out]`` in the
    model's dtype (the Ascend weight-quant matmul's operands). The ops take ``operands()``: the weight, or
    ``(weight, scale)``. Loaders go through ``load`` and ``unstored`` (the held values back as float32)."""

    def __init__(self, in_dim: int, out_dim: int, dtype: ms.Type, panels: bool = False, swiglu: bool = False,
                 panel_dtype: str | None = None, quantization: str = "none") -> None:
        super().__init__()
        if panel_dtype is not None and not panels:
            raise ValueError(f"{panel_dtype} projection weights exist only in the native panel layout")
        self.shape = (out_dim, in_dim)
        self.panels = panels
        self.swiglu = swiglu
        self.quantized = quantization != "none"
        self.panel_dtype = "int8" if self.quantized and panels else panel_dtype
        self.scale = None
        if self.quantized and not panels:
            stored = self.shape
            self.scale = Parameter(initializer("zeros", (out_dim,), dtype), name="scale")
            dtype = ms.int8
        elif self.panel_dtype == "bfloat16":
            stored, dtype = packed_weights.packed_shape_bf16(out_dim, in_dim, swiglu), ms.int32
        elif self.panel_dtype == "int8":
            stored, dtype = packed_weights.packed_shape_int8(out_dim, in_dim, swiglu), ms.int8
        else:
            stored = packed_weights.packed_shape(out_dim, in_dim, swiglu) if panels else self.shape
            dtype = ms.float16 if panel_dtype == "float16" else dtype
        self.dtype = dtype
        self.weight = Parameter(initializer("zeros", stored, dtype), name="weight")

    def operands(self) -> Tensor | tuple[Tensor, Tensor]:
        """What the backend's projection ops take: the weight, or (int8 weight, scale)."""
        if self.scale is None:
            return self.weight
        return self.weight, self.scale

    def load(self, w: np.ndarray, scale: np.ndarray | None = None) -> None:
        """Set the ``[out, in]`` weight: float (quantized here, per output row, where this projection is), or int8
        with its ``scale [out]`` (``agents.weights.packed.quantize_rows``: a quantized checkpoint or a
        tensor-parallel slice scaled by its whole rows)."""
        if scale is not None and not self.quantized:
            raise ValueError("int8 weights with scales (a quantized checkpoint) need model_config.quantization "
                             f"w8a16; this projection holds {self.panel_dtype or 'float'} weights")
        if self.quantized and scale is None:
            w, scale = packed_weights.quantize_rows(w)
        if self.scale is not None:
            self.weight.set_data(Tensor(np.ascontiguousarray(w, np.int8), ms.int8))
            self.scale.set_data(Tensor(np.asarray(scale, np.float32)).astype(self.scale.dtype))
            return
        if self.panel_dtype == "int8":
            held = packed_weights.pack_int8(w, scale, self.swiglu)
        elif self.panel_dtype == "bfloat16":
            held = packed_weights.pack_bf16(w, self.swiglu)
        elif self.panel_dtype == "float16":
            held = packed_weights.pack(w.astype(np.float32), self.swiglu).astype(np.float16)
        else:
            held = packed_weights.pack(w, self.swiglu) if self.panels else w
        self.weight.set_data(Tensor(np.ascontiguousarray(held), self.dtype))

    def unstored(self, held: np.ndarray) -> np.ndarray:
        """The ``[out, in]`` weight back from what ``weight`` holds (int8: dequantized, as the ops form it)."""
        if self.scale is not None:
            return packed_weights.dequantize_rows(held, self.scale.astype(ms.float32).asnumpy())
        if self.panel_dtype == "int8":
            return packed_weights.dequantize_rows(*packed_weights.unpack_int8(held, *self.shape, self.swiglu))
        if self.panel_dtype == "bfloat16":
            return packed_weights.unpack_bf16(held, self.shape[0], self.shape[1], self.swiglu)
        if self.panel_dtype == "float16":
            return packed_weights.unpack(held.astype(np.float32), self.shape[0], self.swiglu)
        return packed_weights.unpack(held, self.shape[0], self.swiglu) if self.panels else held
