"""Write a Hugging Face Llama directory's int8 checkpoint: the decoder layers' projections (a mixture-of-experts
layer's: every expert's and the shared expert's) as int8 with a float32 scale per output channel
(``agents.weights.packed.quantize_rows``), in compressed-tensors' ``int-quantized`` W8A16 layout
(``agents.weights.int8_checkpoint``), everything else (the routers and shared-expert gates too) copied byte for
byte.

    llm-serving quantize --model <HF dir> --out <dir>

Served with ``model_config.quantization: w8a16`` it holds the numbers quantizing at load holds, at every
tensor-parallel degree (a row's scale is the whole row's in both), from a quarter of the projections' bytes on
disk and in host memory. Hugging Face transformers (with the compressed-tensors package) and vLLM load a dense
model's too; transformers 5.24 does not load a mixture-of-experts one (its per-expert int8 tensors are not merged
into its fused experts: docs/quantization.md).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from agents.weights.checkpoints import HF_NAMES
from agents.weights.convert import copy_tokenizer_files
from agents.weights.errors import WeightLoadError
from agents.weights.int8_checkpoint import SCALE
from agents.weights.moe_weights import projection_names
from agents.weights.packed import quantize_rows
from agents.weights.sharded import SafetensorsSlices, ShardedSafetensorsSlices, open_source
from llm_serving.protocol.model_config import (
    HF_INDEX_FILE,
    HF_SINGLE_FILE,
    INT8_CHECKPOINT_WEIGHTS,
    LlamaConfig,
)

# the projections model_config.quantization w8a16 holds as int8 (agents.weights.sharded.QUANTIZED_KINDS), by HF name;
# a sparse layer's experts by ``moe_weights.projection_names``
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# the float linears of a sparse layer, by compressed-tensors' ``ignore`` patterns: the router and Qwen2-MoE's
# shared-expert gate (agents.model.moe.SharedExpert says why)
MOE_FLOAT = ["re:.*mlp\\.gate$", "re:.*mlp\\.shared_expert_gate$", "re:.*block_sparse_moe\\.gate$"]
MAX_SHARD_BYTES = 5 << 30  # Hugging Face's default shard size
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "I64": 8,
              "F64": 8}


def quantized_names(config: LlamaConfig) -> Callable[[str], bool]:
    """Whether a checkpoint name is one that w8a16 holds int8: a dense projection, or a sparse layer's expert's."""
    moe = config.moe
    experts = {n for layer in moe.sparse_layers for n in projection_names(layer, config.architecture, moe)} \
        if moe is not None else set()
    return lambda name: bool(QUANTIZED.match(name)) or name in experts


def quantization_config(moe: bool = False) -> dict:
    """config.json's ``quantization_config`` for this layout (compressed-tensors' own keys); ``moe``: the routers
    and shared-expert gates are ignored (float) too."""
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
                                          "weights": {**INT8_CHECKPOINT_WEIGHTS, "dynamic": False,
                                                      "group_size": None},
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", *(MOE_FLOAT if moe else [])], "kv_cache_scheme": None}


class _Tensor:
    """One output tensor: its safetensors dtype and shape, and how to produce its bytes when written."""

    def __init__(self, dtype: str, shape: tuple[int, ...], data) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[dtype]


def _plan(source: SafetensorsSlices | ShardedSafetensorsSlices, quantized: Callable[[str], bool]) -> dict[str, _Tensor]:
    """Every output tensor in the source's order; quantized ones computed one at a time as they are written."""
    out: dict[str, _Tensor] = {}
    for name in source:
        file = source.files[name] if isinstance(source, ShardedSafetensorsSlices) else source
        shape = tuple(source[name])
        if quantized(name):
            pair = {}  # the int8 values and the scales of one read, whichever is written first

            def computed(part: int, name: str = name, pair: dict = pair) -> np.ndarray:
                if not pair:
                    pair["q"], pair["scale"] = quantize_rows(source.read(name).astype(np.float32))
                return pair.pop("q") if part == 0 else pair.pop("scale").reshape(-1, 1)

            out[name] = _Tensor("I8", shape, lambda f=computed: f(0))
            out[name[: -len("weight")] + SCALE] = _Tensor("F32", (shape[0], 1), lambda f=computed: f(1))
        else:
            begin, end = file.spans[name]
            out[name] = _Tensor(file.dtypes[name], shape, lambda p=file.path, b=begin, n=end - begin:
                                np.fromfile(p, dtype=np.uint8, count=n, offset=b))
    return out


def _shards(tensors: dict[str, _Tensor], limit: int) -> Iterator[list[str]]:
    group, size = [], 0
    for name, tensor in tensors.items():
        if group and size + tensor.nbytes > limit:
            yield group
            group, size = [], 0
        group.append(name)
        size += tensor.nbytes
    if group:
        yield group


def _write_safetensors(path: Path, tensors: dict[str, _Tensor]) -> None:
    """The safetensors layout written directly: safetensors.numpy cannot write bfloat16 (numpy has no such dtype),
    which the copied tensors of a bfloat16 checkpoint are; one tensor's bytes are in memory at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors.items():
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                           offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, tensor in tensors.items():
            data = np.ascontiguousarray(tensor.data())
            if data.nbytes != tensor.nbytes:
                raise WeightLoadError(f"{name!r}: {data.nbytes} bytes read, {tensor.nbytes} expected")
            f.write(data.tobytes())


def quantize_checkpoint(model_dir: Path, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``out`` (config.json with ``quantization_config``, the int8 safetensors, the tokenizer files)."""
    model_dir, out = Path(model_dir), Path(out)
    if out.resolve() == model_dir.resolve():
        raise WeightLoadError(f"{out}: the int8 checkpoint goes to another directory than its source")
    config = LlamaConfig.from_model_dir(model_dir)
    if config.int8_weights:
        raise WeightLoadError(f"{model_dir}: its weights are int8 already")
    source, names, _ = open_source(model_dir)
    if names is not HF_NAMES:
        raise WeightLoadError(f"{model_dir}: a Hugging Face safetensors directory is quantized (this one holds a "
                              "MindSpore checkpoint)")
    quantized = quantized_names(config)
    tensors = _plan(source, quantized)
    if not any(quantized(name) for name in tensors):
        raise WeightLoadError(f"{model_dir}: no decoder projection ({QUANTIZED.pattern}) to quantize")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / HF_INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous run's shards would mix with these
    groups = list(_shards(tensors, max_shard_bytes))
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        file = HF_SINGLE_FILE if len(groups) == 1 else f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(out / file, {name: tensors[name] for name in group})
        weight_map.update(dict.fromkeys(group, file))
    if len(groups) > 1:
        total = sum(t.nbytes for t in tensors.values())
        (out / HF_INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2) + "\n")
    raw = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization_config(
        config.moe is not None)},
                                                indent=2) + "\n")
    copy_tokenizer_files(model_dir, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m agents.weights.quantize_checkpoint --model DIR --out DIR`` (``llm-serving quantize`` runs it)."""
    import argparse
    import sys

    from llm_serving.protocol.config_errors import ModelConfigError

    parser = argparse.ArgumentParser(prog="python -m agents.weights.quantize_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        out = quantize_checkpoint(args.model, args.out)
    except (WeightLoadError, ModelConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"{out}: int8 checkpoint, {size / 2**20:.1f} MiB of safetensors; serve it with model_config.quantization: "
          "w8a16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
