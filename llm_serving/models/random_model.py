"""Seeded random Llama checkpoints in Hugging Face format (safetensors), written without torch or MindSpore.

The embedded default model, tests and benchmarks need real-shaped models without downloads. ``std`` is
exposed because tiny random models need well-separated logits for token-exact comparisons between
implementations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from llm_serving.protocol.model_config import HF_INDEX_FILE, HF_SINGLE_FILE, LlamaConfig

_DTYPES = {"float32": np.float32, "float16": np.float16}
NORM_NOISE = 0.05  # norm weights are 1 + NORM_NOISE * N(0, 1): near the usual init, but not all equal


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the config's family (``lm_head.weight`` omitted when tied, as HF saves it)."""
    h, f, v, kv = config.hidden_size, config.intermediate_size, config.vocab_size, config.kv_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_attention_heads * config.head_dim, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, config.q_dim),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (config.q_dim,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_hf_weights(config: LlamaConfig, seed: int = 0, std: float = 0.2,
                      dtype: str = "float32") -> dict[str, np.ndarray]:
    """Seeded normal weights by HF name; same seed, config and dtype give identical tensors."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(config).items():
        noise = rng.standard_normal(shape, dtype=np.float32)
        values = 1.0 + NORM_NOISE * noise if name.endswith("norm.weight") else std * noise
        out[name] = values.astype(_DTYPES[dtype])
    return out


def _split(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Cut the ordered names into ``shards`` contiguous, non-empty groups of about equal bytes."""
    groups: list[list[str]] = [[]]
    total, acc = sum(sizes), 0
    for j, (name, size) in enumerate(zip(names, sizes)):
        must_open = len(names) - j <= shards - len(groups)  # one tensor left per shard still to open
        if groups[-1] and len(groups) < shards and (acc >= total * len(groups) / shards or must_open):
            groups.append([])
        groups[-1].append(name)
        acc += size
    return groups


def build_random_model(out_dir: str | Path, config: LlamaConfig, seed: int = 0, std: float = 0.2,
                       dtype: str = "float32", tokenizer_model: Path | None = None,
                       shards: int = 1) -> Path:
    """Write a loadable HF Llama directory (config.json, safetensors, optional tokenizer.model).

    Previous ``model*.safetensors`` files and index in ``out_dir`` are replaced so loaders can't mix them.
    """
    weights = random_hf_weights(config, seed, std, dtype)
    if not 1 <= shards <= len(weights):
        raise ValueError(f"shards must be between 1 and {len(weights)} (the tensor count), got {shards}")
    if tokenizer_model is not None and not Path(tokenizer_model).is_file():
        raise FileNotFoundError(f"tokenizer model not found: {tokenizer_model}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / HF_INDEX_FILE]:
        old.unlink(missing_ok=True)

    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if shards == 1:
        save_file(weights, out / HF_SINGLE_FILE, metadata={"format": "pt"})
    else:
        names = list(weights)
        weight_map = {}
        groups = _split(names, [weights[n].nbytes for n in names], shards)
        for k, group in enumerate(groups, start=1):
            file_name = f"model-{k:05d}-of-{shards:05d}.safetensors"
            save_file({n: weights[n] for n in group}, out / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, file_name))
        index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())}, "weight_map": weight_map}
        (out / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_model is not None:
        shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    return out
