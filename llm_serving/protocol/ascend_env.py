"""The environment an Ascend agent serves with: what the working 910B stacks (MindFormers 1.8 predict mode,
vllm-mindspore) set before MindSpore selects kernels, as one table, each entry overridable by its
``model_config`` key. Kept here (free of MindSpore) because the master checks the keys and resolves the values
(``llm_serving.engine.wiring``), the agents apply them (``agents.runtime.device``) and the contract checker's
export assumes the PagedAttention kernel they select (``agents.tools.export``).

A variable already in the agent's environment wins over both (as both stacks ``setdefault`` theirs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ASCEND_ENVIRONMENT", "ASCEND_HBM_GIB", "INT8_KV_DIRECTIONS", "EnvEntry", "ascend_environment",
           "max_device_memory", "paged_attention_kernel"]


@dataclass(frozen=True)
class EnvEntry:
    """One variable: its default, the ``model_config`` key that overrides it, and whether the default applies
    only under tensor parallelism (an override always applies)."""

    name: str
    default: str
    key: str
    tensor_parallel_only: bool = False


ASCEND_ENVIRONMENT: tuple[EnvEntry, ...] = (
    # vllm-mindspore sets it "on"; MindSpore 2.10's default when unset: keeps the internal fused kernels enabled
    EnvEntry("MS_ENABLE_INTERNAL_BOOST", "on", "model_config.ascend_internal_boost"),
    # PagedAttentionOp is multi-path in 2.10: the custom kernel unless named here, else ATB. MindFormers r1.8
    # mindformers/core/context/build_context.py (set_predict_context_config, predict mode with use_past) sets
    # "PagedAttention"; vllm-mindspore sets "FlashAttentionScore,PagedAttention" (vllm_mindspore init_env and
    # check_ready's MindFormers backend). We follow MindFormers: our FlashAttention contract is the custom one.
    EnvEntry("MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST", "PagedAttention", "model_config.ascend_disable_custom_kernels"),
    # MindFormers r1.8 build_context.py (predict mode) and vllm-mindspore's MindFormers backend: "enable_vmm:False"
    # (vllm-mindspore's native models use "enable_vmm:True")
    EnvEntry("MS_ALLOC_CONF", "enable_vmm:False", "model_config.ascend_alloc_conf"),
    # vllm-mindspore init_env: HCCL, not LCCL, for the collectives, expanded on the AI vector cores
    EnvEntry("MS_ENABLE_LCCL", "off", "model_config.ascend_enable_lccl", tensor_parallel_only=True),
    EnvEntry("HCCL_OP_EXPANSION_MODE", "AIV", "model_config.ascend_hccl_op_expansion_mode",
             tensor_parallel_only=True),
)
# every 910B variant the stacks' predict YAMLs target holds 64 GiB of HBM (MindFormers' Llama 3 8B predict YAML
# caps its pool at max_device_memory "58GB" of it); model_config.max_device_memory overrides on other devices
ASCEND_HBM_GIB = 64
# model_config.ascend_int8_kv_direction: how PagedAttention applies its antiquant_scale to an int8 cache, as a
# device check found it (`llm-serving preflight`): "multiply" (value = int8 x scale; the scale passed is the
# dequantization step) or "reciprocal" (value = int8 / scale; passed its inverse, as QuantV2 takes a scale).
# vllm-mindspore passes one k_scale to both QuantV2 and PagedAttention, so one of the two takes the reciprocal;
# no source says which, so int8 KV on Ascend is refused until the key is set.
INT8_KV_DIRECTIONS = ("multiply", "reciprocal")


def ascend_environment(tensor_parallel_size: int, overrides: Mapping[str, str | None]) -> dict[str, str]:
    """The variables an agent of ``tensor_parallel_size`` ranks sets; ``overrides``: config key -> value (None:
    the table's default)."""
    env = {}
    for entry in ASCEND_ENVIRONMENT:
        value = overrides.get(entry.key)
        if value is not None:
            env[entry.name] = value
        elif tensor_parallel_size > 1 or not entry.tensor_parallel_only:
            env[entry.name] = entry.default
    return env


def max_device_memory(utilization: float, override: str | None) -> str:
    """MindSpore's ``max_device_memory``: ``override``, else ``utilization`` of the HBM (``ASCEND_HBM_GIB``), the
    share ``pa_config.memory_utilization`` sizes the KV cache within (``agents.runtime.kv_budget``), in whole
    GB as MindSpore reads it (0.9 -> "57GB", MindFormers' 8B YAML: "58GB")."""
    if override is not None:
        return override
    return f"{int(utilization * ASCEND_HBM_GIB)}GB"


def paged_attention_kernel(environment: Mapping[str, str]) -> str:
    """The PagedAttention kernel ``environment`` selects: "atb" when the custom one is disabled, else "custom"
    (``agents.tools.contracts`` checks graphs against the one selected)."""
    disabled = environment.get("MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST", "")
    return "atb" if "PagedAttention" in (name.strip() for name in disabled.split(",")) else "custom"
