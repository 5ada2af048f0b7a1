"""A sparse layer's expert weights from a Hugging Face checkpoint (issue 54), fused as the dense layer's are:
each expert's gate and up projections concatenated into one ``[2f, h]`` ``[gate; up]`` weight, then the experts
stacked, so a grouped kernel indexes one expert's rows in one tensor. Canonical names (beside the dense layer's in
``agents.weights.checkpoints``): ``layers.{i}.router [E, h]``, ``layers.{i}.experts_gate_up [E, 2f, h]``,
``layers.{i}.experts_down [E, h, f]``, and Qwen2-MoE's ``layers.{i}.shared_gate_up [2s, h]``,
``layers.{i}.shared_down [h, s]``, ``layers.{i}.shared_gate [1, h]``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from agents.weights.checkpoints import WeightLoadError
from llm_serving.protocol.moe_config import MoeSpec

# architecture -> (the layer's MoE block prefix, each expert's (gate, up, down) projection names)
_HF_BLOCK = {"Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _get(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    if name not in tensors:
        raise WeightLoadError(f"{source}: missing tensor {name!r}")
    value = np.asarray(tensors[name])
    if value.shape != shape:
        raise WeightLoadError(f"{source}: {name}: expected shape {shape}, got {value.shape}")
    return value


def fuse_moe_layer(tensors: Mapping[str, np.ndarray], layer: int, architecture: str, spec: MoeSpec, hidden: int,
                   source: str = "checkpoint") -> tuple[dict[str, np.ndarray], set[str]]:
    """The canonical weights of sparse layer ``layer``, and the checkpoint names they used (for
    ``checkpoints.refuse_unused``)."""
    block, (gate, up, down) = _HF_BLOCK[architecture]
    prefix, f, h = f"model.layers.{layer}.{block}.", spec.moe_intermediate_size, hidden
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        used.add(prefix + name)
        return _get(tensors, prefix + name, shape, source)

    experts = range(spec.num_experts)
    out = {f"layers.{layer}.router": take("gate.weight", (spec.num_experts, h)),
           f"layers.{layer}.experts_gate_up": np.stack([np.concatenate(
               [take(f"experts.{e}.{gate}.weight", (f, h)), take(f"experts.{e}.{up}.weight", (f, h))])
               for e in experts]),
           f"layers.{layer}.experts_down": np.stack([take(f"experts.{e}.{down}.weight", (h, f)) for e in experts])}
    s = spec.shared_expert_intermediate_size
    if s:
        out[f"layers.{layer}.shared_gate_up"] = np.concatenate(
            [take("shared_expert.gate_proj.weight", (s, h)), take("shared_expert.up_proj.weight", (s, h))])
        out[f"layers.{layer}.shared_down"] = take("shared_expert.down_proj.weight", (h, s))
        out[f"layers.{layer}.shared_gate"] = take("shared_expert_gate.weight", (1, h))
    return out, used
