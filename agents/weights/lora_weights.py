"""A PEFT LoRA adapter's weights laid out beside our fused projections, for one tensor-parallel rank.

Each fused projection of a layer (``w_qkv``, ``wo``, ``w_gate_up``, ``w_down``) that the adapter touches gets one
pair ``A`` ``[R, in]``, ``B`` ``[out, R]`` (float32, the scaling folded into ``B``), ``R`` the sum of its adapted
parts' ranks: the parts' ``A`` stacked, each part's ``B`` in its own columns and in its own rows of the fused output
(q, k, v; gate, up), zero elsewhere. One ``(x A^T) B^T`` then adds every part's update to the fused output, so a
projection is one low-rank update whatever its parts. Under tensor parallelism the column-parallel projections
(``w_qkv``, ``w_gate_up``) keep ``A`` whole and the rank's rows of ``B`` (the rows its fused weight has); the
row-parallel ones (``wo``, ``w_down``) keep the rank's columns of ``A`` and ``B`` whole: each rank's update is then
a partial sum that the all-reduce already following the projection completes. On every rank
``W_rank + B_rank A_rank`` is the rank's slice of PEFT's merged weight (tests/test_lora_adapters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agents.weights.checkpoints import SafetensorsFile
from agents.weights.errors import WeightLoadError
from llm_serving.protocol.lora import ADAPTER_WEIGHTS, TARGETS, AdapterError, LoraConfig, module_name
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

PEFT_PREFIX = "base_model.model."  # PEFT saves a causal LM's adapter under its wrapper's names
PARTS = {kind: [t for t, (k, _) in TARGETS.items() if k == kind] for kind in ("w_qkv", "wo", "w_gate_up", "w_down")}
ROW_PARALLEL = ("wo", "w_down")


@dataclass(frozen=True)
class LoraPair:
    """One fused projection's update on one rank: ``x -> (x A^T) B^T``."""

    a: np.ndarray  # [R, in on this rank]
    b: np.ndarray  # [out on this rank, R], scaling folded in


def load_lora_weights(adapter_dir: str | Path, lora: LoraConfig, config: LlamaConfig,
                      plan: ShardPlan) -> dict[str, LoraPair]:
    """``layers.{i}.{projection}`` -> the rank's pair, for every projection ``lora`` adapts."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} (a PEFT LoRA adapter directory has it)")
    try:
        tensors = SafetensorsFile(path)
    except WeightLoadError as exc:
        raise AdapterError(str(exc)) from None
    used: set[str] = set()
    pairs = {}
    for layer in sorted({m.layer for m in lora.modules}):
        for kind, parts in PARTS.items():
            modules = [m for m in lora.modules if m.layer == layer and m.target in parts]
            if modules:
                pairs[f"layers.{layer}.{kind}"] = _pair(tensors, used, kind, modules, config, plan, path)
    unused = sorted(set(tensors) - used)
    if unused:
        raise AdapterError(f"{path}: tensor {unused[0]!r} ({len(unused)} unused in all) is not a LoRA A or B of the "
                           "modules adapter_config.json names: the adapter would not be served as trained")
    return pairs


def _pair(tensors: SafetensorsFile, used: set[str], kind: str, modules: list, config: LlamaConfig,
          plan: ShardPlan, path: Path) -> LoraPair:
    rows = _rank_rows(kind, config, plan)  # per part, in the part's own rows
    cols = _rank_columns(kind, plan)
    sizes = {t: (hi - lo) for t, (lo, hi) in zip(PARTS[kind], rows)}
    in_width = _in_width(kind, config)
    total = sum(m.rank for m in modules)
    a = np.zeros((total, in_width if cols is None else cols[1] - cols[0]), np.float32)
    b = np.zeros((sum(sizes.values()), total), np.float32)
    col = 0
    for m in modules:
        name = PEFT_PREFIX + module_name(m.layer, m.target)
        a_t = _read(tensors, used, f"{name}.lora_A.weight", (m.rank, in_width), path)
        b_t = _read(tensors, used, f"{name}.lora_B.weight", (_out_width(m.target, config), m.rank), path)
        a[col:col + m.rank] = a_t if cols is None else a_t[:, cols[0]:cols[1]]
        lo, hi = rows[PARTS[kind].index(m.target)]
        start = sum(sizes[t] for t in PARTS[kind][:PARTS[kind].index(m.target)])
        b[start:start + hi - lo, col:col + m.rank] = b_t[lo:hi] * np.float32(m.scaling)
        col += m.rank
    return LoraPair(a, b)


def _read(tensors: SafetensorsFile, used: set[str], name: str, shape: tuple[int, int], path: Path) -> np.ndarray:
    if name not in tensors:
        raise AdapterError(f"{path}: missing {name!r}, which adapter_config.json's target_modules ask for")
    arr = np.asarray(tensors[name], np.float32)
    if arr.shape != shape:
        raise AdapterError(f"{path}: {name!r} has shape {list(arr.shape)}, expected {list(shape)} (the rank in "
                           "adapter_config.json and the model's sizes)")
    used.add(name)
    return arr


def _in_width(kind: str, config: LlamaConfig) -> int:
    return {"wo": config.q_dim, "w_down": config.intermediate_size}.get(kind, config.hidden_size)


def _out_width(target: str, config: LlamaConfig) -> int:
    return {"q_proj": config.q_dim, "k_proj": config.kv_dim, "v_proj": config.kv_dim, "o_proj": config.hidden_size,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
            "down_proj": config.hidden_size}[target]


def _rank_rows(kind: str, config: LlamaConfig, plan: ShardPlan) -> list[tuple[int, int]]:
    """Each part's output rows on this rank, in the part's own coordinates (as the fused weight cuts them)."""
    if kind == "w_qkv":
        starts = (0, config.q_dim, config.q_dim + config.kv_dim)
        return [(lo - s, hi - s) for (lo, hi), s in zip(plan.qkv_rows(), starts)]
    if kind == "w_gate_up":
        return [plan.ffn_range()] * 2
    return [(0, config.hidden_size)]


def _rank_columns(kind: str, plan: ShardPlan) -> tuple[int, int] | None:
    """The input columns of a row-parallel projection on this rank; None: all of them."""
    if kind == "wo":
        return plan.attention_columns()
    if kind == "w_down":
        return plan.ffn_range()
    return None
