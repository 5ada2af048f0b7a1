"""Static per-channel scales of an int8 KV cache (``model_config.kv_cache_dtype: int8`` on Ascend).

The Ascend kernels read an int8 cache with one dequantization scale per channel of the keys and of the values
(PagedAttention's ``antiquant_scale``, ``(2, kv_heads * head_dim)``), fixed before serving: they are calibrated
once from the float model's own keys (after the rotary embedding) and values over sample text
(``agents.tools.calibrate_kv``) and kept in the model directory as ``kv_cache_scales.safetensors``:
``layers.{i}.kv_scale`` float32 ``[2, kv_dim]`` (row 0 keys, row 1 values), each channel's largest magnitude
x ``HEADROOM`` / 127.
The native CPU cache does not need them: it scales each row as it writes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from agents.weights.errors import WeightLoadError
from llm_serving.protocol.model_config import KV_SCALE_HEADROOM, LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

KV_SCALES_FILE = "kv_cache_scales.safetensors"
SMALLEST = 1e-4  # a channel never seen above this keeps this scale (float16 holds it; 0 would divide by zero)
# room above each channel's calibrated largest value before it clips. Measured on the trained model
# (docs/quantization.md): 1.25 keeps every position within 18 per mille whether the calibration text is like the
# served text or not; 1.0 was best on like text (91% of positions within 5 per mille against 83%) but clipped
# values of other text up to 92 per mille off (65% within)
HEADROOM = KV_SCALE_HEADROOM


def kv_scales_path(model_path: str | Path) -> Path:
    """Where a model's calibrated scales are: in its directory, or beside its checkpoint file."""
    path = Path(model_path)
    return (path if path.is_dir() else path.parent) / KV_SCALES_FILE


def scales_of(absmax: np.ndarray, headroom: float = HEADROOM) -> np.ndarray:
    """Each channel's scale: ``headroom`` x its largest magnitude / 127 (at least ``SMALLEST``)."""
    return np.maximum(np.asarray(absmax, np.float32) * np.float32(headroom / 127), np.float32(SMALLEST))


def save_kv_scales(absmax: np.ndarray, path: Path, tokens: int, headroom: float = HEADROOM) -> Path:
    """``absmax [layers, 2, kv_dim]``: each layer's largest key and value magnitudes per channel."""
    save_file({f"layers.{i}.kv_scale": np.ascontiguousarray(s) for i, s in enumerate(scales_of(absmax, headroom))},
              path, metadata={"format": "llm-serving int8 KV cache scales", "calibration_tokens": str(tokens),
                              "headroom": str(headroom)})
    return path


def load_kv_scales(path: Path, config: LlamaConfig, plan: ShardPlan) -> dict[str, np.ndarray]:
    """Every layer's ``layers.{i}.kv_scale`` for this rank (its kv heads' channels)."""
    if not path.is_file():
        raise WeightLoadError(f"{path}: no KV cache scales; an int8 KV cache on Ascend needs them calibrated first: "
                              "`llm-serving calibrate-kv --model MODEL_DIR` (docs/quantization.md)")
    lo, hi = (r - config.q_dim for r in plan.qkv_rows()[1])  # the rank's key channels
    out = {}
    try:
        with safe_open(path, "numpy") as f:
            names = set(f.keys())
            for i in range(config.num_hidden_layers):
                key = f"layers.{i}.kv_scale"
                if key not in names:
                    raise WeightLoadError(f"{path}: no {key!r} (the scales of another model?)")
                value = f.get_tensor(key)
                if value.shape != (2, config.kv_dim):
                    raise WeightLoadError(f"{path}: {key!r} has shape {value.shape}, expected (2, {config.kv_dim})")
                out[key] = np.ascontiguousarray(value[:, lo:hi], np.float32)
    except SafetensorError as exc:
        raise WeightLoadError(f"{path}: not a readable safetensors file: {exc}") from None
    return out


def with_kv_scales(weights: dict[str, np.ndarray], model_path: str | Path, config: LlamaConfig, plan: ShardPlan,
                   runner_config: dict) -> dict[str, np.ndarray]:
    """``weights`` and, where the cache needs static scales (int8 on Ascend), this rank's from the model's file."""
    if runner_config.get("kv_cache_dtype") == "int8" and runner_config.get("device_target") == "Ascend":
        return {**weights, **load_kv_scales(kv_scales_path(model_path), config, plan)}
    return weights
