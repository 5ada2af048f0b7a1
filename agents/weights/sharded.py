"""A tensor-parallel rank's weights: only its slice of every tensor is read from the checkpoint.

Why not load and cut: the point of tensor parallelism is a model larger than one device, and on the host a
full load per rank would take ``tp`` times the model's memory at start-up. So each source is opened for
slicing (``SliceSource``: shape and dtype from the file's header, rows or columns read through a memory map):
- safetensors, one file or an index with shards: the header gives every tensor's dtype and byte span;
- our (MindSpore) ``.ckpt``: a scan of its protobuf messages gives every tensor's chunks (MindSpore writes a
  large tensor as consecutive row slices); a file the scan does not understand (e.g. encrypted) is loaded
  whole by MindSpore and cut, with a warning.
Names, their alternatives (Hugging Face, MindFormers, canonical) and the shape checks against the config are
``agents.weights.checkpoints``'; the cut of every canonical tensor is ``llm_serving.protocol.parallel.ShardPlan``'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from agents.weights import checkpoints as w
from agents.weights.int8_checkpoint import Int8Slices
from agents.weights.moe_weights import (
    down_absmax,
    moe_shapes,
    projection_names,
    read_moe_layer,
    shared_down_absmax,
)
from agents.weights.packed import quantize_rows
from agents.weights.slice_source import SliceSource, Span, cut
from llm_serving.protocol.model_config import HF_INDEX_FILE, HF_SINGLE_FILE, LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_SAFETENSORS_INTS = {"I8": "i1", "I32": "<i4", "I64": "<i8"}  # an int8 checkpoint's (agents.weights.int8_checkpoint)
_CKPT_DTYPES = {"Float64": "<f8", "Float32": "<f4", "Float16": "<f2", "BFloat16": "<u2"}


def _widen(arr: np.ndarray, dtype: str) -> np.ndarray:
    """bf16 bits (read as uint16) to float32; other dtypes as read."""
    return (arr.astype(np.uint32) << 16).view(np.float32) if dtype == "<u2" else arr


class SafetensorsSlices(SliceSource):
    """One ``.safetensors`` file (validated by ``safe_open`` first, as ``agents.weights.checkpoints`` does)."""

    def __init__(self, path: Path) -> None:
        file = w.SafetensorsFile(path)
        self.path = path
        self.spans = file._byte_spans()
        self.dtypes: dict[str, str] = {}
        shapes = {}
        for name in file:
            view = file._file.get_slice(name)
            shapes[name] = tuple(view.get_shape())
            self.dtypes[name] = view.get_dtype()
        super().__init__(shapes, str(path))

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        code = self.dtypes[name]
        if code not in _SAFETENSORS_DTYPES:
            raise w.WeightLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {code} "
                                    f"(supported: {', '.join(_SAFETENSORS_DTYPES)})")
        dtype = _SAFETENSORS_DTYPES[code]
        begin, _ = self.spans[name]
        shape = self.shapes[name]
        if not int(np.prod(shape)):
            return np.zeros(shape, np.float32 if dtype == "<u2" else dtype)
        view = np.memmap(self.path, dtype=dtype, mode="r", offset=begin, shape=shape)
        return _widen(np.array(cut(view, rows, cols)), dtype)

    def read_ints(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        code = self.dtypes[name]
        if code not in _SAFETENSORS_INTS:
            raise w.WeightLoadError(f"{self.path}: tensor {name!r} has dtype {code}, expected one of "
                                    f"{', '.join(_SAFETENSORS_INTS)}")
        shape, (begin, _) = self.shapes[name], self.spans[name]
        if not int(np.prod(shape)):
            return np.zeros(shape, _SAFETENSORS_INTS[code])
        return np.array(cut(np.memmap(self.path, dtype=_SAFETENSORS_INTS[code], mode="r", offset=begin, shape=shape),
                             rows, cols))


class ShardedSafetensorsSlices(SliceSource):
    """The shards of an HF index (``weight_map``), each tensor read from its shard."""

    def __init__(self, index_path: Path) -> None:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise w.WeightLoadError(f"{index_path}: not a valid safetensors index ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise w.WeightLoadError(f"{index_path}: weight_map must map tensor names to shard file names")
        files = {}
        for shard in sorted(set(weight_map.values())):
            path = index_path.parent / shard
            if not path.is_file():
                raise w.WeightLoadError(f"{index_path}: missing shard file {path}")
            files[shard] = SafetensorsSlices(path)
        self.files = {}
        for tensor, shard in weight_map.items():
            if tensor not in files[shard].shapes:
                raise w.WeightLoadError(f"{index_path}: index maps {tensor!r} to {files[shard].path}, "
                                        "which does not contain it")
            self.files[tensor] = files[shard]
        super().__init__({t: f.shapes[t] for t, f in self.files.items()}, str(index_path))

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        return self.files[name].read(name, rows, cols)

    def read_ints(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        return self.files[name].read_ints(name, rows, cols)


class _Unparsed(ValueError):
    """A ``.ckpt`` the scan does not understand (it is then loaded by MindSpore)."""


def _varint(buf: np.ndarray, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise _Unparsed("truncated varint")
        byte = int(buf[pos])
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: np.ndarray, start: int, end: int):
    """(field number, wire type, value or (offset, length)) of a protobuf message's fields."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise _Unparsed("a field runs past its message")
            yield field, wire, (pos, length)
            pos += length
        else:
            raise _Unparsed(f"unexpected wire type {wire}")


class CkptSlices(SliceSource):
    """A MindSpore ``.ckpt``: consecutive ``Checkpoint`` messages, each ``value {tag, tensor {dims,
    tensor_type, tensor_content}}``; a tensor larger than MindSpore's slice size spans several messages with
    the same tag, its rows split between them in order. A CRC trailer (``crc_num``) ends the scan."""

    def __init__(self, path: Path) -> None:
        self.path = path
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self.dtypes: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        pos = 0
        while pos < len(buf):
            if bytes(buf[pos: pos + 7]) == b"crc_num":
                break
            key, body = _varint(buf, pos)
            if key != (1 << 3 | 2):
                raise _Unparsed(f"unexpected top-level field {key >> 3} at byte {pos}")
            length, body = _varint(buf, body)
            self._value(buf, body, body + length, shapes)
            pos = body + length
        for name, shape in shapes.items():
            size = int(np.prod(shape)) * np.dtype(self.dtypes[name]).itemsize
            if sum(n for _, n in self.chunks[name]) != size:
                raise _Unparsed(f"tensor {name!r}: its chunks do not add up to its shape {shape}")
        super().__init__(shapes, str(path))

    def _value(self, buf: np.ndarray, start: int, end: int, shapes: dict) -> None:
        tag, dims, dtype, content = None, [], None, None
        for field, _, value in _fields(buf, start, end):
            if field == 1:
                tag = bytes(buf[value[0]: value[0] + value[1]]).decode()
            elif field == 3:
                raise _Unparsed("map tensors are not Llama weights")
            elif field == 2:
                for f2, wire, v2 in _fields(buf, value[0], value[0] + value[1]):
                    if f2 == 1 and wire == 0:
                        dims.append(v2)
                    elif f2 == 1:  # packed dims
                        p = v2[0]
                        while p < v2[0] + v2[1]:
                            d, p = _varint(buf, p)
                            dims.append(d)
                    elif f2 == 2:
                        dtype = bytes(buf[v2[0]: v2[0] + v2[1]]).decode()
                    elif f2 == 3:
                        content = v2
        if tag is None or content is None or dtype not in _CKPT_DTYPES:
            raise _Unparsed(f"tensor {tag!r}: no content or an unsupported type {dtype!r}")
        if tag in shapes and shapes[tag] != tuple(dims):
            raise _Unparsed(f"tensor {tag!r}: chunks of different shapes")
        shapes[tag] = tuple(dims)
        self.dtypes[tag] = _CKPT_DTYPES[dtype]
        self.chunks.setdefault(tag, []).append(content)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        shape, dtype = self.shapes[name], self.dtypes[name]
        row_items = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        itemsize = np.dtype(dtype).itemsize
        want = rows if rows is not None else (0, shape[0] if shape else 1)
        parts, first = [], 0
        for offset, length in self.chunks[name]:
            n = length // (itemsize * row_items)
            lo, hi = max(want[0], first), min(want[1], first + n)
            if lo < hi:
                view = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=(n, *shape[1:]))
                parts.append(np.array(cut(view, (lo - first, hi - first), cols)))
            first += n
        return _widen(np.concatenate(parts) if parts else np.zeros((0, *shape[1:]), dtype), dtype)


class LoadedSlices(SliceSource):
    """Tensors already in memory (a ``.ckpt`` MindSpore had to load whole), cut on request."""

    def __init__(self, tensors: Mapping[str, np.ndarray], label: str) -> None:
        self.tensors = tensors
        super().__init__({n: tuple(np.shape(tensors[n])) for n in tensors}, label)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        return np.array(cut(np.asarray(self.tensors[name]), rows, cols))


def _ckpt_source(path: Path) -> SliceSource:
    try:
        return CkptSlices(path)
    except _Unparsed as exc:
        log.warning("%s: reading it whole through MindSpore, each rank then keeping its slice (%s)", path, exc)
    import mindspore as ms

    try:
        params = ms.load_checkpoint(str(path))
    except (ValueError, RuntimeError, TypeError) as exc:
        raise w.WeightLoadError(f"{path}: cannot read MindSpore checkpoint: {exc}") from None
    return LoadedSlices(w._MindSporeTensors(params), str(path))


def open_source(path: Path) -> tuple[SliceSource, dict[str, list[list[str]]], bool]:
    """The slicing source of a model directory or checkpoint file, its naming and strictness (as
    ``agents.weights.checkpoints.load_weights`` dispatches)."""
    if path.is_dir():
        w._check_architecture(path)
        single, index, ckpt = path / HF_SINGLE_FILE, path / HF_INDEX_FILE, path / w.CKPT_FILE
        if single.is_file():
            return SafetensorsSlices(single), w.HF_NAMES, True
        if index.is_file():
            return ShardedSafetensorsSlices(index), w.HF_NAMES, True
        if ckpt.is_file():
            return open_source(ckpt)
        raise w.WeightLoadError(f"{path}: no {HF_SINGLE_FILE}, {HF_INDEX_FILE} or {w.CKPT_FILE}")
    if path.is_file() and path.suffix == ".safetensors":
        return SafetensorsSlices(path), w.HF_NAMES, True
    if path.is_file() and path.suffix == ".ckpt":
        source = _ckpt_source(path)
        if "embed_tokens" in source:
            return source, w.CANONICAL_NAMES, True
        if "model.tok_embeddings.embedding_weight" in source:
            if any(n.endswith(("attention.w_qkv.weight", "feed_forward.w_gate_hidden.weight")) for n in source):
                raise w.WeightLoadError(
                    f"{path}: a fused MindFormers checkpoint (qkv_concat: w_qkv / w_gate_hidden rows interleaved "
                    "per head group) cannot be sliced per rank; convert it once with `python -m agents.weights.convert "
                    f"--model {path} --config-from DIR_WITH_CONFIG_JSON --out DIR` and serve DIR")
            return source, w.MINDFORMERS_NAMES, False
        raise w.WeightLoadError(f"{path}: unexpected architecture: neither canonical ('embed_tokens') nor "
                                f"MindFormers Llama names; first tensors: {list(source)[:3]}")
    if path.is_file():
        raise w.WeightLoadError(f"unsupported weights file {path}: expected a directory, .ckpt or .safetensors")
    raise w.WeightLoadError(f"weights not found: {path}")


def shard_shapes(config: LlamaConfig, plan: ShardPlan) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of this rank with its shape (``agents.weights.checkpoints.canonical_shapes``, cut)."""
    h, start_end = config.hidden_size, plan.vocab_range
    vocab, qkv = start_end[1] - start_end[0], plan.attention_config.qkv_dim
    out = {}
    for key, shape in w.canonical_shapes(config).items():
        kind = key.rsplit(".", 1)[-1]
        if kind in w._MOE_KINDS:
            assert config.moe is not None
            out[key] = moe_shapes(config.moe, int(key.split(".")[1]), h, plan.expert_range(),
                                  plan.expert_ffn_range(), plan.shared_ffn_range())[key]
            continue
        out[key] = {"embed_tokens": (vocab, h), "lm_head": (vocab, h), "w_qkv": (qkv, h),
                    "wo": (h, plan.heads * config.head_dim), "w_gate_up": (2 * plan.ffn, h),
                    "w_down": (h, plan.ffn), "qkv_bias": (qkv,)}.get(kind, shape)
    return out


def _cuts(kind: str, parts: int, config: LlamaConfig, plan: ShardPlan) -> list[tuple[int, Span, Span]]:
    """(source part, rows, cols) read for one canonical tensor, in the order they are concatenated."""
    vocab = plan.vocab_range
    if kind in ("embed_tokens", "lm_head"):
        return [(0, vocab, None)]
    if kind == "wo":
        return [(0, None, plan.attention_columns())]
    if kind == "w_down":
        return [(0, None, plan.ffn_range())]
    if kind in ("w_qkv", "qkv_bias"):
        rows = plan.qkv_rows()
        if parts == 1:
            return [(0, r, None) for r in rows]
        starts = [0, config.q_dim, config.q_dim + config.kv_dim]
        return [(i, (r[0] - s, r[1] - s), None) for i, (r, s) in enumerate(zip(rows, starts))]
    if kind == "w_gate_up":
        lo, hi = plan.ffn_range()
        f = config.intermediate_size
        return [(0, (lo, hi), None), (0, (f + lo, f + hi), None)] if parts == 1 else [(0, (lo, hi), None),
                                                                                     (1, (lo, hi), None)]
    return [(0, None, None)]  # norms (and q/k head norms): replicated


def _moe_slices(source: SliceSource, names: dict[str, list[list[str]]], config: LlamaConfig, plan: ShardPlan,
                layer: int, quantize: bool = False) -> tuple[dict[str, np.ndarray], set[str]]:
    """Sparse layer ``layer``'s tensors of this rank (``ShardPlan.expert_range`` and its siblings), read as float:
    from HF per-expert tensors (fused and stacked as they are read) or from our ``.ckpt``'s stacked ones.
    ``quantize`` (w8a16): the experts and the shared expert int8 with a ``<key>.scale`` each, per output row, a
    down projection's column slice scaled by its whole rows (``moe_weights.down_absmax``); from an int8 checkpoint
    whose layer is int8 throughout, its values and scales as stored (``_moe_stored_int8``)."""
    spec, p = config.moe, f"layers.{layer}."
    assert spec is not None
    if quantize and isinstance(source, Int8Slices) and all(
            source.is_int8(n) for n in projection_names(layer, config.architecture, spec)):
        return _moe_stored_int8(source, config, plan, layer)
    moe, used = _moe_float_slices(source, names, config, plan, layer)
    if not quantize:
        return moe, used
    hf, h = names is w.HF_NAMES, config.hidden_size
    absmax = shared_absmax = None
    if plan.expert_ffn_range() != (0, spec.moe_intermediate_size):  # a column slice of each down row
        absmax = down_absmax(_checked_take(source), layer, config.architecture, spec, h, plan.expert_range()) \
            if hf else np.abs(source.read(p + "experts_down", plan.expert_range()).astype(np.float32)).max(2)
    if plan.shared_ffn_range() != (0, spec.shared_expert_intermediate_size):  # the shared expert's, likewise
        shared_absmax = shared_down_absmax(_checked_take(source), layer, config.architecture, spec, h) if hf \
            else _row_absmax(source, p + "shared_down")
    tops = {"experts_gate_up": None, "experts_down": absmax, "shared_gate_up": None, "shared_down": shared_absmax}
    for kind, top in tops.items():
        if p + kind not in moe:  # no shared expert
            continue
        value = moe[p + kind]
        q, scale = quantize_rows(value.astype(np.float32).reshape(-1, value.shape[-1]),
                                 None if top is None else top.reshape(-1))
        moe[p + kind], moe[f"{p}{kind}.scale"] = q.reshape(value.shape), scale.reshape(value.shape[:-1])
    return moe, used


def _moe_stored_int8(source: Int8Slices, config: LlamaConfig, plan: ShardPlan,
                     layer: int) -> tuple[dict[str, np.ndarray], set[str]]:
    """Sparse layer ``layer``'s tensors of this rank from an int8 checkpoint, its projections' int8 values and
    scales as stored (a down column slice keeps its whole rows' scales), so it holds what quantizing the float
    checkpoint at load holds; the router and the shared expert's gate as stored (float)."""
    spec, p = config.moe, f"layers.{layer}."
    assert spec is not None
    cuts = (plan.expert_range(), plan.expert_ffn_range(), plan.shared_ffn_range())

    def values(name: str, rows: Span, cols: Span) -> np.ndarray:
        return source.read_int8(name, rows, cols) if source.is_int8(name) else source.read(name, rows, cols)

    def scales(name: str, rows: Span, cols: Span) -> np.ndarray:
        return source.scale(name, rows) if source.is_int8(name) else source.read(name, rows, cols)

    moe, used = read_moe_layer(_checked_take(source, values), layer, config.architecture, spec,
                               config.hidden_size, *cuts)
    scale = read_moe_layer(_checked_take(source, scales), layer, config.architecture, spec, config.hidden_size,
                           *cuts)[0]
    for kind in (*EXPERT_KINDS, *SHARED_EXPERT_KINDS):
        if p + kind in moe:
            moe[f"{p}{kind}.scale"] = scale[p + kind].astype(np.float32)
    return moe, used


def _checked_take(source: SliceSource, read: Callable[[str, Span, Span], np.ndarray] | None = None):
    """``moe_weights.Take`` over ``source``: each tensor's presence and full shape checked before its slice is read
    (by ``read``: the source's own by default)."""
    label, read = source.label, read or source.read

    def take(name: str, shape: tuple[int, ...], rows: Span, cols: Span) -> np.ndarray:
        if name not in source:
            raise w.WeightLoadError(f"{label}: missing tensor {name!r}")
        if tuple(source[name]) != shape:
            raise w.WeightLoadError(f"{label}: {name}: expected shape {shape}, got {tuple(source[name])}")
        return read(name, rows, cols)
    return take


def _moe_float_slices(source: SliceSource, names: dict[str, list[list[str]]], config: LlamaConfig,
                      plan: ShardPlan, layer: int) -> tuple[dict[str, np.ndarray], set[str]]:
    spec, h, label = config.moe, config.hidden_size, source.label
    assert spec is not None
    experts, ffn, shared = plan.expert_range(), plan.expert_ffn_range(), plan.shared_ffn_range()
    if names is w.HF_NAMES:
        return read_moe_layer(_checked_take(source), layer, config.architecture, spec, h, experts, ffn, shared)
    full = moe_shapes(spec, layer, h)
    for name, shape in full.items():
        if name not in source:
            raise w.WeightLoadError(f"{label}: missing tensor {name!r}")
        if tuple(source[name]) != shape:
            raise w.WeightLoadError(f"{label}: {name}: expected shape {shape}, got {tuple(source[name])}")
    p, f, s = f"layers.{layer}.", spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    gate_up = source.read(p + "experts_gate_up", experts)
    out = {p + "router": source.read(p + "router"),
           p + "experts_gate_up": np.concatenate([gate_up[:, ffn[0]:ffn[1]], gate_up[:, f + ffn[0]:f + ffn[1]]], 1),
           p + "experts_down": source.read(p + "experts_down", experts)[:, :, ffn[0]:ffn[1]]}
    if s:
        rows = source.read(p + "shared_gate_up")
        out[p + "shared_gate_up"] = np.concatenate([rows[shared[0]:shared[1]], rows[s + shared[0]:s + shared[1]]])
        out[p + "shared_down"] = source.read(p + "shared_down", None, shared)
        out[p + "shared_gate"] = source.read(p + "shared_gate")
    return out, set(full)


def bf16_bits(arr: np.ndarray) -> np.ndarray:
    """bfloat16 values as numpy holds them (uint16 bits; numpy has no bfloat16), rounded to nearest even."""
    if arr.dtype == np.uint16:
        return arr
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def as_host_dtype(arr: np.ndarray, dtype: npt.DTypeLike | str) -> np.ndarray:
    """One tensor in the dtype the rank holds it in: a numpy float dtype, or ``"bfloat16"`` (``bf16_bits``)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return bf16_bits(arr)
    return np.ascontiguousarray(arr, dtype=dtype)


# the decoder layers' projections that model_config.quantization w8a16 holds as int8 (agents.weights.packed)
QUANTIZED_KINDS = ("w_qkv", "wo", "w_gate_up", "w_down")
# a sparse layer's routed experts, which w8a16 holds as int8 too (agents.model.moe.ExpertsHeld), and its shared
# expert's projections (agents.model.moe.SharedExpert, as the dense MLP's); the router and the shared expert's gate
# stay float
EXPERT_KINDS = ("experts_gate_up", "experts_down")
SHARED_EXPERT_KINDS = ("shared_gate_up", "shared_down")
ROW_PARALLEL_KINDS = ("wo", "w_down")  # cut by columns: a rank holds part of each output row
ABSMAX_ROWS = 1024  # rows of a whole tensor read at a time to find each row's largest magnitude


def _row_absmax(source: SliceSource, name: str) -> np.ndarray:
    """Each row's largest magnitude over the whole tensor, read ``ABSMAX_ROWS`` rows at a time."""
    rows = source[name][0]
    return np.concatenate([np.abs(source.read(name, (r, min(r + ABSMAX_ROWS, rows)), None).astype(np.float32)).max(1)
                           for r in range(0, rows, ABSMAX_ROWS)])


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)


def _assemble_shard(source: SliceSource, names: dict[str, list[list[str]]], config: LlamaConfig,
                    plan: ShardPlan, strict: bool, dtype: npt.DTypeLike | str = np.float32,
                    quantize: bool = False) -> dict[str, np.ndarray]:
    """This rank's canonical tensors: names and full shapes checked as ``agents.weights.checkpoints`` does, then only
    the slices read, each turned into ``dtype`` as it is read (so no wider copy of the whole slice exists).
    ``quantize``: the layers' projections as int8 with a ``<key>.scale`` each
    (``agents.weights.packed.quantize_rows``), a row-parallel slice scaled by its whole rows, so that every
    tensor-parallel degree holds the same numbers."""
    label = source.label
    for name in source:
        m = w._LAYER_INDEX.search(name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            raise w.WeightLoadError(f"{label}: tensor {name!r} belongs to layer {m.group(1)} but the config has "
                                    f"num_hidden_layers={config.num_hidden_layers}")
    if names["embed_tokens"][0][0] not in source:
        raise w.WeightLoadError(f"{label}: unexpected architecture: no {names['embed_tokens'][0][0]!r}, so not a "
                                f"Llama checkpoint in the expected naming; first tensors: {list(source)[:3]}")
    out, used = {}, set()
    for key, shape in w.canonical_shapes(config).items():
        kind = key.rsplit(".", 1)[-1]
        layer = key.split(".")[1] if key.startswith("layers.") else ""
        if kind in w._MOE_KINDS:  # a sparse layer's, all read with its router (as float: the block's weights)
            if kind == "router":
                moe, taken = _moe_slices(source, names, config, plan, int(layer), quantize)
                out.update({k: v if v.dtype == np.int8 or k.endswith(".scale")
                            else as_host_dtype(v, np.float32 if quantize else dtype) for k, v in moe.items()})
                used.update(taken)
            continue
        alternatives = w.alternatives_for(kind, layer, names, label)
        if kind == "lm_head" and config.tie_word_embeddings:
            used.update(n for n in alternatives[0] if n in source)
            out[key] = out["embed_tokens"].copy()
            continue
        chosen = w._pick(alternatives, source, label)
        for name, rows in zip(chosen, w._part_rows(kind, len(chosen), config, shape[0])):
            if tuple(source[name]) != (rows, *shape[1:]):
                raise w.WeightLoadError(f"{label}: shape mismatch for {name!r}: expected {(rows, *shape[1:])} "
                                        f"from the config, got {tuple(source[name])}")
            used.add(name)
        quantized = quantize and kind in QUANTIZED_KINDS  # quantized from float32 (not from bfloat16 bits)
        cuts = _cuts(kind, len(chosen), config, plan)
        if quantized and all(source.is_int8(name) for name in chosen):  # a checkpoint's int8 values, as stored
            out[key] = _joined([source.read_int8(chosen[part], rows, cols) for part, rows, cols in cuts])
            out[f"{key}.scale"] = _joined([source.scale(chosen[part], rows) for part, rows, _ in cuts])
            continue
        # float, or int8 read dequantized (a float model, the lm_head, a projection partly int8)
        out[key] = _joined([as_host_dtype(source.read(chosen[part], rows, cols), np.float32 if quantized else dtype)
                            for part, rows, cols in cuts])
        if quantized:
            absmax = _row_absmax(source, chosen[0]) if kind in ROW_PARALLEL_KINDS else None
            out[key], out[f"{key}.scale"] = quantize_rows(out[key], absmax)
    w.refuse_unused(source, used, label, strict)
    return out


def load_shard(model_dir_or_file: str | Path, config: LlamaConfig, plan: ShardPlan,
               dtype: npt.DTypeLike | str = np.float32, quantize: bool = False) -> dict[str, np.ndarray]:
    """This rank's canonical weights (``shard_shapes``), as owned ``dtype`` arrays (``"bfloat16"``: uint16 bits),
    reading only its slices; ``quantize``: the layers' projections int8 with scales (``_assemble_shard``)."""
    source, names, strict = open_source(Path(model_dir_or_file))
    if config.int8_weights:
        source = Int8Slices(source)
    weights = _assemble_shard(source, names, config, plan, strict, dtype, quantize)
    for key, shape in shard_shapes(config, plan).items():
        if tuple(weights[key].shape) != shape:
            raise w.WeightLoadError(f"shape mismatch for {key!r} of rank {plan.rank}: expected {shape}, "
                                    f"got {tuple(weights[key].shape)}")
    return {k: v if v.dtype == np.int8 or k.endswith(".scale") else as_host_dtype(v, dtype)
            for k, v in weights.items()}


def load_rank_weights(model_dir_or_file: str | Path, config: LlamaConfig, plan: ShardPlan,
                      dtype: npt.DTypeLike | str = np.float32, quantize: bool = False) -> dict[str, np.ndarray]:
    """The whole model's weights at ``tp == 1`` (``agents.weights.checkpoints.load_weights``, bfloat16 through
    float32; ``quantize`` happens as the model packs them), else this rank's slice read straight into ``dtype``
    (``quantize``: int8 with scales, see ``_assemble_shard``). An int8 checkpoint is read by slices at every
    degree: with ``quantize`` its values and scales as stored, without dequantized."""
    if config.int8_weights or (plan.tp > 1 and quantize):  # an int8 checkpoint: its numbers as stored
        return load_shard(model_dir_or_file, config, plan, dtype, quantize)
    if plan.tp == 1:
        if isinstance(dtype, str) and dtype == "bfloat16":
            return {k: bf16_bits(v) for k, v in w.load_weights(model_dir_or_file, config).items()}
        return w.load_weights(model_dir_or_file, config, dtype)
    return load_shard(model_dir_or_file, config, plan, dtype)
