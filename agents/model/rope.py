"""Rotary position embedding tables, with the ``rope_scaling`` types a Hugging Face ``config.json`` may name,
computed as transformers computes them (``transformers.modeling_rope_utils``): ``linear`` (position
interpolation), ``llama3`` (Llama 3.1's smoothed per-frequency factor) and ``yarn`` (NTK-by-parts with an
attention factor on cos/sin). ``dynamic`` and unknown types are refused when the config is read
(``llm_serving.protocol.model_config``), so no table here silently differs from the model's.
"""

from __future__ import annotations

import math

import numpy as np

from llm_serving.protocol.model_config import LlamaConfig


def _default(dim: int, base: float) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return np.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, p: dict, max_positions: int) -> tuple[np.ndarray, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        both = p.get("mscale") and p.get("mscale_all_dim")
        attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]) if both else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def inverse_frequencies(config: LlamaConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim / 2], attention_factor)``: the factor multiplies cos and sin (yarn's; 1 otherwise)."""
    dim, base, p = config.head_dim, config.rope_theta, config.rope_scaling or {}
    kind = p.get("rope_type", "default")
    inv_freq = _default(dim, base)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "dynamic":  # up to max_position_embeddings, where transformers keeps the plain frequencies
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(dim, base, p, config.max_position_embeddings)
    raise ValueError(f"rope_scaling type {kind!r} has no implementation")  # refused when the config was read


def rotary_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[max_positions, head_dim]`` in Hugging Face's rotate-half layout (frequencies repeated twice)."""
    limit = config.rope_position_limit
    if limit is not None and max_positions > limit:
        raise ValueError(f"rope_scaling dynamic: {max_positions} positions exceed max_position_embeddings {limit}, "
                         "beyond which transformers rescales every position's frequencies by the sequence's length")
    inv_freq, attention = inverse_frequencies(config)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * attention).astype(np.float32), (np.sin(angles) * attention).astype(np.float32)
