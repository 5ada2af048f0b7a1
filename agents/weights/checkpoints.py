"""Load Llama weights (HF safetensors or MindSpore ``.ckpt``) into the canonical fused layout.

The model consumes one flat ``dict[str, np.ndarray]`` with q/k/v and gate/up already fused, so every
projection is a single matmul over token-flat activations. Matrices keep the HF ``[out, in]`` orientation:
``embed_tokens``, ``layers.{i}.{attention_norm, w_qkv, wo, ffn_norm, w_gate_up, w_down}``, ``norm``,
``lm_head``, and where the family has them ``layers.{i}.qkv_bias`` (Qwen2) and ``layers.{i}.{q_norm, k_norm}``
(Qwen3) (see :func:`canonical_shapes`). Safetensors are read with the ``safetensors`` package, one
tensor at a time as the fusing asks for it, so a checkpoint is never held in memory whole. MindSpore is
imported only by the ``.ckpt`` functions, so a bad HF path fails before that slow import.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

from agents.weights.errors import WeightLoadError
from llm_serving.protocol.model_config import (
    HF_INDEX_FILE,
    HF_SINGLE_FILE,
    SUPPORTED_ARCHITECTURES,
    LlamaConfig,
)

CKPT_FILE = "model.ckpt"

# Source naming conventions: canonical kind -> alternatives, each a list of source names whose tensors
# are concatenated along dim 0 (in order) to give the canonical tensor. "{i}" is the layer index.
_LAYER_PREFIX = "model.layers.{i}."  # layer i's tensors in both HF and MindFormers naming
HF_NAMES: dict[str, list[list[str]]] = {
    "embed_tokens": [["model.embed_tokens.weight"]],
    "attention_norm": [[_LAYER_PREFIX + "input_layernorm.weight"]],
    "w_qkv": [[_LAYER_PREFIX + f"self_attn.{p}_proj.weight" for p in "qkv"]],
    "qkv_bias": [[_LAYER_PREFIX + f"self_attn.{p}_proj.bias" for p in "qkv"]],
    "q_norm": [[_LAYER_PREFIX + "self_attn.q_norm.weight"]],
    "k_norm": [[_LAYER_PREFIX + "self_attn.k_norm.weight"]],
    "wo": [[_LAYER_PREFIX + "self_attn.o_proj.weight"]],
    "ffn_norm": [[_LAYER_PREFIX + "post_attention_layernorm.weight"]],
    "w_gate_up": [[_LAYER_PREFIX + "mlp.gate_proj.weight", _LAYER_PREFIX + "mlp.up_proj.weight"]],
    "w_down": [[_LAYER_PREFIX + "mlp.down_proj.weight"]],
    "norm": [["model.norm.weight"]],
    "lm_head": [["lm_head.weight"]],
}
# MindFormers' Llama names (its legacy Llama model, which MindFormers' own Qwen2 configs reuse with biases on)
MINDFORMERS_NAMES: dict[str, list[list[str]]] = {
    "embed_tokens": [["model.tok_embeddings.embedding_weight"]],
    "attention_norm": [[_LAYER_PREFIX + "attention_norm.weight"]],
    "w_qkv": [[_LAYER_PREFIX + f"attention.{p}.weight" for p in ("wq", "wk", "wv")],
              [_LAYER_PREFIX + "attention.w_qkv.weight"]],
    "qkv_bias": [[_LAYER_PREFIX + f"attention.{p}.bias" for p in ("wq", "wk", "wv")]],
    "wo": [[_LAYER_PREFIX + "attention.wo.weight"]],
    "ffn_norm": [[_LAYER_PREFIX + "ffn_norm.weight"]],
    "w_gate_up": [[_LAYER_PREFIX + "feed_forward.w1.weight", _LAYER_PREFIX + "feed_forward.w3.weight"],
                  [_LAYER_PREFIX + "feed_forward.w_gate_hidden.weight"]],
    "w_down": [[_LAYER_PREFIX + "feed_forward.w2.weight"]],
    "norm": [["model.norm_out.weight"]],
    "lm_head": [["lm_head.weight"]],
}
# a MoE layer's canonical kinds (agents.weights.moe_weights.MOE_KINDS): read from HF per-expert tensors there
_MOE_KINDS = ("router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down", "shared_gate")
CANONICAL_NAMES: dict[str, list[list[str]]] = {
    kind: [[kind if kind in ("embed_tokens", "norm", "lm_head") else "layers.{i}." + kind]]
    for kind in (*HF_NAMES, *_MOE_KINDS)
}
_IGNORED_HF = re.compile(r"rotary_emb\.inv_freq$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def canonical_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name with its expected shape, in a stable order."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, h)}
    for i in range(config.num_hidden_layers):
        shapes[f"layers.{i}.attention_norm"] = (h,)
        shapes[f"layers.{i}.w_qkv"] = (config.qkv_dim, h)
        if config.qkv_bias:
            shapes[f"layers.{i}.qkv_bias"] = (config.qkv_dim,)
        if config.qk_norm:
            shapes.update({f"layers.{i}.q_norm": (config.head_dim,), f"layers.{i}.k_norm": (config.head_dim,)})
        shapes.update({f"layers.{i}.wo": (h, config.q_dim), f"layers.{i}.ffn_norm": (h,)})
        if config.moe is not None and i in config.moe.sparse_layers:
            from agents.weights.moe_weights import moe_shapes

            shapes.update(moe_shapes(config.moe, i, h))
        else:
            shapes.update({f"layers.{i}.w_gate_up": (2 * f, h), f"layers.{i}.w_down": (h, f)})
    shapes.update(norm=(h,), lm_head=(v, h))
    return shapes


def _part_rows(kind: str, n_parts: int, config: LlamaConfig, rows: int) -> list[int]:
    """Output rows of each source tensor that is concatenated into a canonical one."""
    if n_parts == 1:
        return [rows]
    if kind in ("w_qkv", "qkv_bias") and n_parts == 3:
        return [config.num_attention_heads * config.head_dim, config.kv_dim, config.kv_dim]
    if kind == "w_gate_up" and n_parts == 2:
        return [config.intermediate_size] * 2
    raise AssertionError(f"no split rule for {kind} in {n_parts} parts")


def alternatives_for(kind: str, layer: str, names: dict[str, list[list[str]]], source: str) -> list[list[str]]:
    """The source names that may hold canonical ``kind`` of ``layer``; a naming without it (MindFormers' has no
    Qwen3 head norms) is refused by name."""
    if kind not in names:
        raise WeightLoadError(f"{source}: this checkpoint's naming has no {kind} weights (MindFormers' Llama names "
                              "carry no Qwen3 q/k norms nor experts); serve the Hugging Face directory or convert "
                              "it with python -m agents.weights.convert")
    return [[n.format(i=layer) for n in alt] for alt in names[kind]]


def _pick(alternatives: list[list[str]], tensors: Mapping[str, object], source: str) -> list[str]:
    """The first alternative fully present; otherwise name what is missing from the closest one."""
    for names in alternatives:
        if all(n in tensors for n in names):
            return names
    best = max(alternatives, key=lambda names: sum(n in tensors for n in names))
    missing = [n for n in best if n not in tensors]
    others = [" + ".join(a) for a in alternatives if a is not best]
    hint = f" (or {' / '.join(others)})" if others else ""
    raise WeightLoadError(f"{source}: missing tensor {missing[0]!r}{hint}")


def _assemble(tensors: Mapping[str, np.ndarray], names: dict[str, list[list[str]]], config: LlamaConfig,
              source: str, strict: bool) -> dict[str, np.ndarray]:
    """Map, shape-check and fuse source tensors into the canonical layout.

    ``strict`` rejects any unused tensor (an HF file holds only the model); MindSpore training checkpoints
    may carry optimizer state, so there only tensors of layers beyond the config are rejected.
    """
    for name in tensors:
        m = _LAYER_INDEX.search(name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            raise WeightLoadError(
                f"{source}: tensor {name!r} belongs to layer {m.group(1)} but the config has "
                f"num_hidden_layers={config.num_hidden_layers}"
            )
    embed = names["embed_tokens"][0][0]
    if embed not in tensors:
        raise WeightLoadError(
            f"{source}: unexpected architecture: no {embed!r}, so not a Llama checkpoint in the expected "
            f"naming; first tensors: {list(tensors)[:3]}"
        )
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for key, shape in canonical_shapes(config).items():
        kind = key.rsplit(".", 1)[-1]
        layer = key.split(".")[1] if key.startswith("layers.") else ""
        if kind in _MOE_KINDS and names is HF_NAMES:  # per-expert tensors, fused and stacked
            if kind == "router":
                from agents.weights.moe_weights import fuse_moe_layer

                assert config.moe is not None
                fused, taken = fuse_moe_layer(tensors, int(layer), config.architecture, config.moe,
                                              config.hidden_size, source)
                out.update(fused)
                used.update(taken)
            continue
        alternatives = alternatives_for(kind, layer, names, source)
        if kind == "lm_head" and config.tie_word_embeddings:
            used.update(n for n in alternatives[0] if n in tensors)
            out[key] = np.array(out["embed_tokens"])
            continue
        chosen = _pick(alternatives, tensors, source)
        parts = []
        for name, rows in zip(chosen, _part_rows(kind, len(chosen), config, shape[0])):
            arr = tensors[name]
            expected = (rows, *shape[1:])
            if tuple(arr.shape) != expected:
                raise WeightLoadError(
                    f"{source}: shape mismatch for {name!r}: expected {expected} from the config, "
                    f"got {tuple(arr.shape)}"
                )
            parts.append(arr)
            used.add(name)
        out[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    refuse_unused(tensors, used, source, strict)
    return out


def refuse_unused(tensors: Mapping[str, object], used: set[str], source: str, strict: bool) -> None:
    """A tensor the model would not read means another architecture or config (Qwen2 biases under a Llama
    config.json would be dropped silently). ``strict``: any tensor; else (training checkpoints, which carry
    optimizer state under prefixed names) the model's own ``model.*`` tensors only."""
    extra = sorted(n for n in tensors if n not in used and not _IGNORED_HF.search(n)
                   and (strict or n.startswith("model.")))
    if extra:
        raise WeightLoadError(
            f"{source}: {len(extra)} tensor(s) not used by a model with this config, e.g. "
            f"{extra[:3]} (unexpected architecture or config mismatch)"
        )


def fuse_hf_tensors(tensors: Mapping[str, np.ndarray], config: LlamaConfig,
                    source: str = "<tensors>") -> dict[str, np.ndarray]:
    """Canonical fused weights from in-memory HF-named tensors (e.g. ``random_hf_weights`` for benchmarks)."""
    return _assemble(tensors, HF_NAMES, config, source, strict=True)


def validate_weights(weights: Mapping[str, np.ndarray], config: LlamaConfig) -> None:
    """Raise :class:`WeightLoadError` unless every canonical tensor is present with its expected shape."""
    for key, shape in canonical_shapes(config).items():
        if key not in weights:
            raise WeightLoadError(f"missing tensor {key!r} in the canonical weights")
        if tuple(weights[key].shape) != shape:
            raise WeightLoadError(
                f"shape mismatch for {key!r}: expected {shape}, got {tuple(weights[key].shape)}"
            )


# ---------------------------------------------------------------- Hugging Face safetensors


# Float dtypes numpy reads natively; BF16 is widened to float32 by hand (see SafetensorsFile._read_bf16).
_NUMPY_FLOAT_DTYPES = ("F64", "F32", "F16")
_BF16 = "BF16"


class SafetensorsFile(Mapping):
    """Tensors of one ``.safetensors`` file, each read from disk when looked up and never cached.

    ``safe_open`` validates the header (offsets, sizes, file length) on open, so a corrupt or truncated
    file fails here, named, before any tensor is read.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as exc:
            raise WeightLoadError(f"{path}: not a readable safetensors file: {exc}") from None
        self._names = self._file.offset_keys()  # file order, for messages that list "first tensors"
        self._name_set = set(self._names)
        self._spans: dict[str, tuple[int, int]] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._name_set:
            raise KeyError(name)
        dtype = self._file.get_slice(name).get_dtype()
        if dtype == _BF16:
            return self._read_bf16(name)
        if dtype not in _NUMPY_FLOAT_DTYPES:
            raise WeightLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype} "
                                  f"(supported: {', '.join((*_NUMPY_FLOAT_DTYPES, _BF16))})")
        try:
            return self._file.get_tensor(name)
        except SafetensorError as exc:
            raise WeightLoadError(f"{self.path}: cannot read tensor {name!r}: {exc}") from None

    def _read_bf16(self, name: str) -> np.ndarray:
        """Widen a BF16 tensor to float32 from its raw bits.

        numpy has no bfloat16, so the package's numpy backend raises ``TypeError: data type 'bfloat16'
        not understood`` for BF16 (its torch backend handles it, but the agent does not depend on torch).
        The package gives dtype and shape but not byte offsets, so those come from the header, which
        ``safe_open`` has already validated. bf16 is the top half of an IEEE float32, so shifting the
        bits up 16 widens it exactly.
        """
        begin, end = self._byte_spans()[name]
        count = (end - begin) // 2
        with open(self.path, "rb") as f:
            bits = np.fromfile(f, dtype="<u2", count=count, offset=begin)
        if bits.size != count:  # only if the file shrank after it was opened
            raise WeightLoadError(f"{self.path}: tensor {name!r} is truncated")
        shape = tuple(self._file.get_slice(name).get_shape())
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)

    def _byte_spans(self) -> dict[str, tuple[int, int]]:
        """Absolute ``[begin, end)`` file offsets of every tensor, read once from the header."""
        if self._spans is None:
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))  # the format's 8-byte little-endian prefix
                header = json.loads(f.read(header_len))
            start = 8 + header_len
            self._spans = {name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
                           for name, entry in header.items() if name != "__metadata__"}
        return self._spans

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._name_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _ShardedTensors(Mapping):
    """All tensors of a sharded checkpoint, located through the index's ``weight_map``."""

    def __init__(self, index_path: Path):
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"{index_path}: not a valid safetensors index ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightLoadError(f"{index_path}: weight_map must map tensor names to shard file names")
        shard_paths = {name: index_path.parent / name for name in sorted(set(weight_map.values()))}
        missing = [str(p) for p in shard_paths.values() if not p.is_file()]
        if missing:
            raise WeightLoadError(f"{index_path}: missing shard file(s) {missing}")
        shards = {name: SafetensorsFile(p) for name, p in shard_paths.items()}
        self._files = {}
        for tensor, shard in weight_map.items():
            if tensor not in shards[shard]:
                raise WeightLoadError(f"{index_path}: index maps {tensor!r} to {shard_paths[shard]}, "
                                      "which does not contain it")
            self._files[tensor] = shards[shard]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._files[name][name]

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _check_architecture(model_dir: Path) -> None:
    path = model_dir / "config.json"
    if not path.is_file():
        return
    try:
        archs = json.loads(path.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise WeightLoadError(f"{path}: cannot read config ({exc})") from None
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise WeightLoadError(
            f"{path}: unexpected architecture {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )


def load_hf_weights(model_dir: str | Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Canonical weights from an HF directory (``model.safetensors`` or index + shards).

    A directory holding only a converted ``model.ckpt`` is accepted too.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise WeightLoadError(f"model directory not found: {model_dir}")
    _check_architecture(model_dir)
    single, index, ckpt = model_dir / HF_SINGLE_FILE, model_dir / HF_INDEX_FILE, model_dir / CKPT_FILE
    if single.is_file():
        return _assemble(SafetensorsFile(single), HF_NAMES, config, str(single), strict=True)
    if index.is_file():
        return _assemble(_ShardedTensors(index), HF_NAMES, config, str(index), strict=True)
    if ckpt.is_file():
        return load_mindspore_checkpoint(ckpt, config)
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    hint = f"; found {found} but no {HF_INDEX_FILE}" if found else ""
    raise WeightLoadError(f"{model_dir}: no {HF_SINGLE_FILE}, {HF_INDEX_FILE} or {CKPT_FILE}{hint}")


# ---------------------------------------------------------------- MindSpore checkpoints


class _MindSporeTensors(Mapping):
    """numpy views of loaded MindSpore parameters (bf16 widened to float32, which numpy lacks)."""

    def __init__(self, params: dict):
        self._params = params

    def __getitem__(self, name: str) -> np.ndarray:
        import mindspore as ms

        p = self._params[name]
        return (p.astype(ms.float32) if p.dtype == ms.bfloat16 else p).asnumpy()

    def __contains__(self, name: object) -> bool:  # Mapping's default would decode the tensor
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def load_mindspore_checkpoint(path: str | Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Canonical weights from a ``.ckpt`` with canonical or MindFormers Llama names (fused or not)."""
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(f"MindSpore checkpoint not found: {path}")
    import mindspore as ms

    try:
        params = ms.load_checkpoint(str(path))
    except (ValueError, RuntimeError, TypeError) as exc:
        raise WeightLoadError(f"{path}: cannot read MindSpore checkpoint: {exc}") from None
    if "embed_tokens" in params:
        names, strict = CANONICAL_NAMES, True
    elif "model.tok_embeddings.embedding_weight" in params:
        names, strict = MINDFORMERS_NAMES, False
    else:
        raise WeightLoadError(
            f"{path}: unexpected architecture: neither canonical ('embed_tokens') nor MindFormers Llama "
            f"('model.tok_embeddings.embedding_weight') names; first tensors: {list(params)[:3]}"
        )
    tensors: Mapping[str, np.ndarray] = _MindSporeTensors(params)
    if names is MINDFORMERS_NAMES:  # fused w_qkv / w_gate_hidden rows are interleaved: read them split
        from agents.weights.mindformers_names import SplitView

        tensors = SplitView(tensors, config)
    return _assemble(tensors, names, config, str(path), strict=strict)


def save_mindspore_checkpoint(weights: Mapping[str, np.ndarray], path: str | Path) -> Path:
    """Save ``weights`` (normally the canonical fused dict) as a MindSpore ``.ckpt``, bit-exact."""
    path = Path(path)
    if path.suffix != ".ckpt":
        raise ValueError(f"checkpoint path must end in .ckpt (MindSpore appends it otherwise): {path}")
    import mindspore as ms

    path.parent.mkdir(parents=True, exist_ok=True)
    items = []
    for name, value in weights.items():
        arr = np.asarray(value)
        items.append({"name": name, "data": ms.Tensor(arr.astype(arr.dtype, order="C", copy=False))})
    ms.save_checkpoint(items, str(path))
    return path


# ---------------------------------------------------------------- entry point


def load_weights(model_dir_or_file: str | Path, config: LlamaConfig,
                 dtype: npt.DTypeLike = np.float32) -> dict[str, np.ndarray]:
    """Canonical weights from an HF/converted model directory, a ``.ckpt`` or a ``.safetensors`` file (float; an int8
    checkpoint: ``agents.weights.sharded.load_rank_weights``).

    Every tensor is validated against ``config`` and returned as an owned, writable ``dtype`` array.
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise ValueError(f"weights dtype must be floating point, got {dtype}")
    path = Path(model_dir_or_file)
    if config.int8_weights:
        raise WeightLoadError(f"{path}: an int8 checkpoint (config.json quantization_config): it is read by "
                              "agents.weights.sharded.load_rank_weights (its int8 values, or dequantized)")
    if path.is_dir():
        weights = load_hf_weights(path, config)
    elif path.is_file() and path.suffix == ".ckpt":
        weights = load_mindspore_checkpoint(path, config)
    elif path.is_file() and path.suffix == ".safetensors":
        weights = _assemble(SafetensorsFile(path), HF_NAMES, config, str(path), strict=True)
    elif path.is_file():
        raise WeightLoadError(f"unsupported weights file {path}: expected a directory, .ckpt or .safetensors")
    else:
        raise WeightLoadError(f"weights not found: {path}")
    validate_weights(weights, config)
    out = {}
    for key, arr in weights.items():
        arr = arr.astype(dtype, order="C", copy=False)
        out[key] = arr if arr.flags.writeable else arr.copy()  # never hand out read-only arrays
    return out
