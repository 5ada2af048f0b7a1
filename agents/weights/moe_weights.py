"""A sparse layer's expert weights from a Hugging Face checkpoint (issue 54), fused as the dense layer's are:
each expert's gate and up projections concatenated into one ``[2f, h]`` ``[gate; up]`` weight, then the experts
stacked, so a grouped kernel indexes one expert's rows in one tensor. Canonical names (beside the dense layer's in
``agents.weights.checkpoints``): ``layers.{i}.router [E, h]``, ``layers.{i}.experts_gate_up [E, 2f, h]``,
``layers.{i}.experts_down [E, h, f]``, and Qwen2-MoE's ``layers.{i}.shared_gate_up [2s, h]``,
``layers.{i}.shared_down [h, s]``, ``layers.{i}.shared_gate [1, h]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from agents.weights.errors import WeightLoadError
from llm_serving.protocol.moe_config import MoeSpec

# architecture -> (the layer's MoE block prefix, each expert's (gate, up, down) projection names)
_HF_BLOCK = {"Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2"))}


# the canonical kinds of a sparse layer (``layers.{i}.<kind>``), in place of the dense ``w_gate_up`` and ``w_down``
MOE_KINDS = ("router", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down", "shared_gate")
Span = tuple[int, int]
# (checkpoint name, its full shape, rows, columns) -> that slice, the full shape checked first
Take = Callable[[str, tuple[int, ...], Span | None, Span | None], np.ndarray]


def moe_shapes(spec: MoeSpec, layer: int, hidden: int, experts: Span | None = None, ffn: Span | None = None,
               shared: Span | None = None) -> dict[str, tuple[int, ...]]:
    """Sparse layer ``layer``'s canonical tensors with their shapes: the whole layer's, or one rank's slice of it
    (``experts``, each expert's ``ffn`` rows and the shared expert's ``shared`` rows; ``ShardPlan.expert_range``
    and its siblings)."""
    e0, e1 = experts or (0, spec.num_experts)
    f0, f1 = ffn or (0, spec.moe_intermediate_size)
    s0, s1 = shared or (0, spec.shared_expert_intermediate_size)
    p = f"layers.{layer}."
    out = {p + "router": (spec.num_experts, hidden), p + "experts_gate_up": (e1 - e0, 2 * (f1 - f0), hidden),
           p + "experts_down": (e1 - e0, hidden, f1 - f0)}
    if spec.shared_expert_intermediate_size:
        out.update({p + "shared_gate_up": (2 * (s1 - s0), hidden), p + "shared_down": (hidden, s1 - s0),
                    p + "shared_gate": (1, hidden)})
    return out


def read_moe_layer(take: Take, layer: int, architecture: str, spec: MoeSpec, hidden: int,
                   experts: Span | None = None, ffn: Span | None = None,
                   shared: Span | None = None) -> tuple[dict[str, np.ndarray], set[str]]:
    """Sparse layer ``layer``'s canonical weights (or a rank's slice, as ``moe_shapes``) read through ``take``, and
    the checkpoint names they used (for ``checkpoints.refuse_unused``)."""
    block, (gate, up, down) = _HF_BLOCK[architecture]
    prefix, f, h, s = f"model.layers.{layer}.{block}.", spec.moe_intermediate_size, hidden, \
        spec.shared_expert_intermediate_size
    e0, e1 = experts or (0, spec.num_experts)
    rows = ffn or (0, f)
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...], cut_rows: Span | None = None, cut_cols: Span | None = None):
        used.add(prefix + name)
        return take(prefix + name, shape, cut_rows, cut_cols)

    for e in range(spec.num_experts):  # every expert's names are the model's, held here or not
        if not e0 <= e < e1:
            used.update(prefix + f"experts.{e}.{n}.weight" for n in (gate, up, down))
    out = {f"layers.{layer}.router": get("gate.weight", (spec.num_experts, h)),
           f"layers.{layer}.experts_gate_up": np.stack([np.concatenate(
               [get(f"experts.{e}.{gate}.weight", (f, h), rows), get(f"experts.{e}.{up}.weight", (f, h), rows)])
               for e in range(e0, e1)]),
           f"layers.{layer}.experts_down": np.stack([get(f"experts.{e}.{down}.weight", (h, f), None, rows)
                                                     for e in range(e0, e1)])}
    if s:
        cut = shared or (0, s)
        out[f"layers.{layer}.shared_gate_up"] = np.concatenate(
            [get("shared_expert.gate_proj.weight", (s, h), cut), get("shared_expert.up_proj.weight", (s, h), cut)])
        out[f"layers.{layer}.shared_down"] = get("shared_expert.down_proj.weight", (h, s), None, cut)
        out[f"layers.{layer}.shared_gate"] = get("shared_expert_gate.weight", (1, h))
    return out, used


def down_absmax(take: Take, layer: int, architecture: str, spec: MoeSpec, hidden: int,
                experts: Span | None = None) -> np.ndarray:
    """Each held expert's down-projection rows' largest magnitudes ``[e, h]`` over the whole row (all ``f``
    columns), read one expert at a time: the w8a16 scales of a rank that holds a column slice of each row (experts
    cut under tensor parallelism), so that every degree holds the numbers one rank does."""
    block, (_, _, down) = _HF_BLOCK[architecture]
    e0, e1 = experts or (0, spec.num_experts)
    shape = (hidden, spec.moe_intermediate_size)
    return np.stack([np.abs(take(f"model.layers.{layer}.{block}.experts.{e}.{down}.weight", shape, None, None)
                            .astype(np.float32)).max(1) for e in range(e0, e1)])


def projection_names(layer: int, architecture: str, spec: MoeSpec) -> list[str]:
    """Sparse layer ``layer``'s checkpoint names of the projections that ``model_config.quantization`` w8a16 holds
    int8: every expert's gate, up and down, and the shared expert's (the router and the shared expert's gate stay
    float: ``agents.model.moe.SharedExpert``)."""
    block, names = _HF_BLOCK[architecture]
    prefix = f"model.layers.{layer}.{block}."
    out = [f"{prefix}experts.{e}.{n}.weight" for e in range(spec.num_experts) for n in names]
    if spec.shared_expert_intermediate_size:
        out += [f"{prefix}shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return out


def shared_down_absmax(take: Take, layer: int, architecture: str, spec: MoeSpec, hidden: int) -> np.ndarray:
    """The shared expert's down-projection rows' largest magnitudes ``[h]`` over the whole row: the w8a16 scales of
    a rank that holds a column slice of it (as ``down_absmax``, and the dense MLP's down projection)."""
    block = _HF_BLOCK[architecture][0]
    shape = (hidden, spec.shared_expert_intermediate_size)
    name = f"model.layers.{layer}.{block}.shared_expert.down_proj.weight"
    return np.abs(take(name, shape, None, None).astype(np.float32)).max(1)


def _in_memory(tensors: Mapping[str, np.ndarray], source: str) -> Take:
    def take(name: str, shape: tuple[int, ...], rows: Span | None, cols: Span | None) -> np.ndarray:
        if name not in tensors:
            raise WeightLoadError(f"{source}: missing tensor {name!r}")
        value = np.asarray(tensors[name])
        if value.shape != shape:
            raise WeightLoadError(f"{source}: {name}: expected shape {shape}, got {value.shape}")
        value = value if rows is None else value[rows[0]:rows[1]]
        return value if cols is None else value[:, cols[0]:cols[1]]
    return take


def fuse_moe_layer(tensors: Mapping[str, np.ndarray], layer: int, architecture: str, spec: MoeSpec, hidden: int,
                   source: str = "checkpoint") -> tuple[dict[str, np.ndarray], set[str]]:
    """The canonical weights of sparse layer ``layer`` from in-memory (or read-on-lookup) tensors, and the
    checkpoint names they used."""
    return read_moe_layer(_in_memory(tensors, source), layer, architecture, spec, hidden)
