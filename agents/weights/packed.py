"""The panel layout of projection weights for the native linear ops (``agents/model/kernels/linear.cc``).

Why a layout of our own: the kernel's inner loop reads 32 output columns of one input row at a time, so a weight
stored in that order is read front to back once per row tile, and nothing is repacked per call (MindSpore's CPU
MatMul repacks its weight operand on every call). ``W [out, in]`` (Hugging Face's layout) becomes
``[panels * in, 32]``: panel ``p`` is an ``in x 32`` block holding outputs ``32p..32p+31``, zero past ``out``.
The SwiGLU weight ``[gate; up]`` puts gate and up rows of the same 16 outputs into one panel, so that the kernel
can finish ``silu(gate) * up`` without a second pass.

The fast precision mode (``model_config.precision: fast``) holds the same panels in bfloat16: each int32 of
``[panels * ceil(in / 2), 32]`` packs the weights of inputs ``2k`` (low half) and ``2k + 1`` (high half) of one
output, the operand order of AVX512_BF16's ``vdpbf16ps``. int32 rather than a bfloat16 tensor: MindSpore passes it
to the op untouched on any build.

Int8 weights (``model_config.quantization: w8a16``) are the float32 panels' layout in int8 with each panel's
scales appended (``pack_int8``, below).
"""

from __future__ import annotations

import numpy as np

PANEL = 32


def _panels(w: np.ndarray) -> np.ndarray:
    """``[out, in]`` -> ``[ceil(out / 32) * in, 32]`` (zero columns past ``out``)."""
    out, inner = w.shape
    panels = -(-out // PANEL)
    padded = np.zeros((panels * PANEL, inner), dtype=w.dtype)
    padded[:out] = w
    return np.ascontiguousarray(padded.reshape(panels, PANEL, inner).transpose(0, 2, 1).reshape(panels * inner, PANEL))


def _unpanels(packed: np.ndarray, out: int) -> np.ndarray:
    """Inverse of ``_panels`` for a weight with ``out`` rows."""
    panels = -(-out // PANEL)
    inner = packed.shape[0] // panels
    return np.ascontiguousarray(packed.reshape(panels, inner, PANEL).transpose(0, 2, 1).reshape(panels * PANEL,
                                                                                                 inner)[:out])


def _interleave_halves(w: np.ndarray) -> tuple[np.ndarray, int]:
    """``[gate; up]`` (``2f`` rows) -> rows ordered gate 0..15, up 0..15, gate 16..31, ... (zero rows pad ``f``
    up to a multiple of 16); returns the rows and ``f``."""
    f = w.shape[0] // 2
    half = PANEL // 2
    groups = -(-f // half)
    gate = np.zeros((groups * half, w.shape[1]), dtype=w.dtype)
    up = np.zeros_like(gate)
    gate[:f], up[:f] = w[:f], w[f:]
    rows = np.stack([gate.reshape(groups, half, -1), up.reshape(groups, half, -1)], axis=1)
    return rows.reshape(groups * PANEL, w.shape[1]), f


def swiglu_rows(w: np.ndarray) -> np.ndarray:
    """The rows of ``[gate; up]`` (or of anything added to its output, as a LoRA ``B``) in the order a SwiGLU panel
    weight computes them: gate 0..15, up 0..15, gate 16..31, ... (zero rows pad ``f`` up to a multiple of 16)."""
    return _interleave_halves(w)[0]


def pack(w: np.ndarray, swiglu: bool = False) -> np.ndarray:
    """A ``[out, in]`` weight in the kernel's panel layout; ``swiglu`` for the fused ``[gate; up]`` weight."""
    if swiglu:
        w = _interleave_halves(w)[0]
    return _panels(w)


def unpack(packed: np.ndarray, out: int, swiglu: bool = False) -> np.ndarray:
    """The ``[out, in]`` weight back from ``pack(w, swiglu)`` (``out`` = the weight's rows, ``2f`` for SwiGLU)."""
    if not swiglu:
        return _unpanels(packed, out)
    f, half = out // 2, PANEL // 2
    groups = -(-f // half)
    rows = _unpanels(packed, groups * PANEL).reshape(groups, 2, half, -1)
    return np.concatenate([rows[:, 0].reshape(groups * half, -1)[:f], rows[:, 1].reshape(groups * half, -1)[:f]])


def packed_shape(out: int, inner: int, swiglu: bool = False) -> tuple[int, int]:
    """The shape ``pack`` gives a ``[out, in]`` weight."""
    panels = -(-(out // 2) // (PANEL // 2)) if swiglu else -(-out // PANEL)
    return panels * inner, PANEL


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays a quiet NaN. The kernels round the
    same way (``to_bf16`` in linear.cc), so this is their reference bit for bit."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16, as float32."""
    return from_bf16(to_bf16(x))


def pack_bf16(w: np.ndarray, swiglu: bool = False) -> np.ndarray:
    """``pack(w, swiglu)`` in bfloat16 pairs: int32 ``[panels * ceil(in / 2), 32]`` (see the module doc)."""
    panels = pack(w.astype(np.float32), swiglu)  # [panels * in, 32]
    inner = w.shape[1]
    count = panels.shape[0] // inner
    bits = to_bf16(panels).reshape(count, inner, PANEL)
    if inner % 2:
        bits = np.concatenate([bits, np.zeros((count, 1, PANEL), np.uint16)], axis=1)
    pairs = bits.reshape(count, -1, 2, PANEL)
    packed = pairs[:, :, 0].astype(np.uint32) | (pairs[:, :, 1].astype(np.uint32) << 16)
    return np.ascontiguousarray(packed.reshape(-1, PANEL).view(np.int32))


def unpack_bf16(packed: np.ndarray, out: int, inner: int, swiglu: bool = False) -> np.ndarray:
    """The ``[out, in]`` float32 weight (bfloat16 values) back from ``pack_bf16``."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    pairs = -(-inner // 2)
    count = words.shape[0] // pairs
    words = words.reshape(count, pairs, 1, PANEL)
    bits = np.concatenate([words & 0xFFFF, words >> 16], axis=2).reshape(count, 2 * pairs, PANEL)[:, :inner]
    return unpack(from_bf16(bits.astype(np.uint16)).reshape(count * inner, PANEL), out, swiglu)


def packed_shape_bf16(out: int, inner: int, swiglu: bool = False) -> tuple[int, int]:
    """The shape ``pack_bf16`` gives a ``[out, in]`` weight."""
    rows = packed_shape(out, inner, swiglu)[0] // inner
    return rows * -(-inner // 2), PANEL


# ---- int8 weights (model_config.quantization: w8a16) -------------------------------------------------------------
# Symmetric per-output-channel int8: W[o, :] ~ scale[o] * q[o, :], scale = max |W[o, :]| / 127, q in [-127, 127].
# Held as int8 panels with each panel's 32 float32 scales appended as 4 more rows of 32 bytes:
# ``[panels * (in + 4), 32]`` int8, panel p = ``in`` rows of q (the float32 panel layout) then its scales. One
# tensor per projection, as every other mode, so the ops and the model's wiring do not change with the format.
SCALE_ROWS = 4  # 32 float32 scales = 128 bytes = 4 rows of 32 int8


def quantize_rows(w: np.ndarray, absmax: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``W [out, in]`` -> (int8 ``q``, float32 ``scale [out]``), symmetric per output row. ``absmax``: each row's
    largest magnitude when ``w`` is a slice of the row (a row-parallel shard: its scale is the whole row's, so
    that every tensor-parallel degree holds the same numbers). All-zero rows get scale 0."""
    w = np.asarray(w, dtype=np.float32)
    top = np.abs(w).max(axis=1) if absmax is None else np.asarray(absmax, np.float32)
    scale = (top / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight an int8 ``q`` with ``scale`` stands for (one float32 product each, as the kernel forms
    it)."""
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def pack_int8(q: np.ndarray, scale: np.ndarray, swiglu: bool = False) -> np.ndarray:
    """int8 ``q [out, in]`` and ``scale [out]`` in the kernel's int8 panel layout (see above)."""
    out, inner = q.shape
    panels = pack(np.asarray(q, np.int8), swiglu)
    count = panels.shape[0] // inner
    scales = pack(np.asarray(scale, np.float32).reshape(out, 1), swiglu)  # [count, 32]: each panel's columns
    blocks = np.concatenate([panels.reshape(count, inner, PANEL),
                             scales.view(np.int8).reshape(count, SCALE_ROWS, PANEL)], axis=1)
    return np.ascontiguousarray(blocks.reshape(-1, PANEL))


def unpack_int8(packed: np.ndarray, out: int, inner: int, swiglu: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(``q [out, in]``, ``scale [out]``) back from ``pack_int8``."""
    blocks = np.ascontiguousarray(packed).reshape(-1, inner + SCALE_ROWS, PANEL)
    q = unpack(np.ascontiguousarray(blocks[:, :inner]).reshape(-1, PANEL), out, swiglu)
    scales = np.ascontiguousarray(blocks[:, inner:]).view(np.float32).reshape(-1, 1 * PANEL)
    return q, unpack(scales, out, swiglu)[:, 0]


def packed_shape_int8(out: int, inner: int, swiglu: bool = False) -> tuple[int, int]:
    """The shape ``pack_int8`` gives a ``[out, in]`` weight."""
    return packed_shape(out, inner, swiglu)[0] // inner * (inner + SCALE_ROWS), PANEL
