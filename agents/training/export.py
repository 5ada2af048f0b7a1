"""Writing a trained model as a Hugging Face Llama directory with bfloat16 safetensors.

numpy has no bfloat16 and ``safetensors.numpy`` cannot write one, so the file is written here: the format is an
8-byte little-endian header length, a JSON header (dtype, shape, byte offsets per tensor) and the raw bytes
(https://github.com/huggingface/safetensors#format). Rounding is to nearest even, as torch's ``.to(bfloat16)``.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from llm_serving.protocol.model_config import HF_SINGLE_FILE, LlamaConfig


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def save_bf16_safetensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = to_bf16_bits(tensors[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.writelines(blobs)


def write_model_dir(out: Path, config: LlamaConfig, tensors: Mapping[str, np.ndarray], tokenizer_model: Path,
                    report: dict) -> Path:
    """config.json (bfloat16), model.safetensors, tokenizer.model and TRAINING.json (how it was made)."""
    out.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_bf16_safetensors(tensors, out / HF_SINGLE_FILE)
    shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    (out / "TRAINING.json").write_text(json.dumps(report, indent=1) + "\n")
    return out
