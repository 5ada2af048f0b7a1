"""Mixture-of-experts hyper-parameters of Qwen3-MoE, Qwen2-MoE and Mixtral config.json files (issue 54): which
layers are sparse, how many experts a token picks and how their weights are normalised. Keys that would change
the maths in a way no layer here computes are refused by name, as ``model_config.refuse_unserved_keys`` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_serving.protocol.config_errors import ModelConfigError

# architecture -> (config.json's keys for the expert count, the first present read (transformers 5 writes Qwen's
# num_experts as num_local_experts; Qwen's own files say num_experts), the key that renormalises the top-k weights
# (None: always, Mixtral's softmax over the top k), whether a sigmoid-gated shared expert runs beside the routed ones)
_QWEN = ("num_experts", "num_local_experts")
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": (_QWEN, "norm_topk_prob", False),
                     "Qwen2MoeForCausalLM": (_QWEN, "norm_topk_prob", True),
                     "MixtralForCausalLM": (("num_local_experts",), None, False)}
# keys that change routing where set (a token dropped past an expert's capacity, or a top-k over groups of
# experts): never computed here, so refused unless absent or at the no-op value
_REFUSED = {"capacity_factor": (None,), "moe_capacity_factor": (None,), "n_group": (None, 1),
            "topk_group": (None, 1), "routed_scaling_factor": (None, 1, 1.0)}


@dataclass(frozen=True)
class MoeSpec:
    """A MoE model's routing. ``sparse_layers``: the decoder layers whose MLP is the expert block (the others
    keep a dense MLP of ``intermediate_size``). Router jitter and the auxiliary loss act only in training."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], architecture: str, source: str = "config") -> MoeSpec:
        if architecture not in MOE_ARCHITECTURES:
            raise ModelConfigError(f"{source}: {architecture} is not a mixture-of-experts architecture")
        count_keys, norm_key, shared = MOE_ARCHITECTURES[architecture]
        count_key = next((key for key in count_keys if key in raw), count_keys[0])
        for key, served in _REFUSED.items():
            if raw.get(key) not in served:
                raise ModelConfigError(f"{source}: {key}: {raw[key]!r} is not served (only {served[-1]!r})")
        try:
            layers, experts, top_k = int(raw["num_hidden_layers"]), int(raw[count_key]), int(
                raw["num_experts_per_tok"])
            step = int(raw.get("decoder_sparse_step", 1))
            dense_only = {int(i) for i in raw.get("mlp_only_layers") or []}
            size = int(raw["moe_intermediate_size"] if norm_key else raw["intermediate_size"])
            shared_size = int(raw["shared_expert_intermediate_size"]) if shared else 0
        except KeyError as exc:
            raise ModelConfigError(f"{source}: missing required key {exc.args[0]!r}") from None
        if not 0 < top_k <= experts:
            raise ModelConfigError(f"{source}: num_experts_per_tok: {top_k} must be in 1..{count_key} ({experts})")
        if norm_key is None and (step != 1 or dense_only):  # transformers' Mixtral reads neither key
            raise ModelConfigError(f"{source}: decoder_sparse_step / mlp_only_layers: {architecture} has every "
                                   "layer sparse; dense layers are served for the Qwen MoE families only")
        if step < 1:
            raise ModelConfigError(f"{source}: decoder_sparse_step: {step} must be at least 1")
        bad = sorted(i for i in dense_only if not 0 <= i < layers)
        if bad:
            raise ModelConfigError(f"{source}: mlp_only_layers: {bad} are not layers of 0..{layers - 1}")
        sparse = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        norm = True if norm_key is None else bool(raw.get(norm_key, False))
        return cls(experts, top_k, size, norm, shared_size, sparse)


def hf_keys(spec: MoeSpec, architecture: str, num_layers: int) -> dict[str, Any]:
    """config.json's MoE keys for ``spec`` (``LlamaConfig.to_hf_dict``), which ``MoeSpec.from_dict`` reads back
    to the same spec: the dense layers as ``mlp_only_layers`` with a sparse step of 1."""
    count_keys, norm_key, shared = MOE_ARCHITECTURES[architecture]
    out: dict[str, Any] = {count_keys[0]: spec.num_experts, "num_experts_per_tok": spec.top_k}
    if norm_key is None:  # Mixtral: the experts' size is intermediate_size, already written
        return out
    out.update({norm_key: spec.norm_topk_prob, "moe_intermediate_size": spec.moe_intermediate_size,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(num_layers) if i not in spec.sparse_layers]})
    if shared:
        out["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    return out
