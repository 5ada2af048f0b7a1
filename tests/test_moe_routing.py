"""MoE routing (agents.model.moe_routing) against transformers' own sparse MoE blocks, and MoeSpec's reading of
config.json (llm_serving.protocol.moe_config): issue 54 parts 1 and 2's reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from agents.model import moe_routing
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.moe_config import MoeSpec

H, F, E, K = 16, 8, 8, 2
COMMON = {"hidden_size": H, "num_experts_per_tok": K, "num_hidden_layers": 4, "num_attention_heads": 2,
          "num_key_value_heads": 2, "vocab_size": 32}
FAMILIES = {
    "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock,
                            {"num_experts": E, "moe_intermediate_size": F, "norm_topk_prob": True}),
    "Qwen2MoeForCausalLM": (Qwen2MoeConfig, Qwen2MoeSparseMoeBlock,
                            {"num_experts": E, "moe_intermediate_size": F, "norm_topk_prob": False,
                             "shared_expert_intermediate_size": 12}),
    "MixtralForCausalLM": (MixtralConfig, MixtralSparseMoeBlock, {"num_local_experts": E, "intermediate_size": F}),
}


def _block(arch: str, seed: int) -> tuple[torch.nn.Module, dict]:
    config_cls, block_cls, extra = FAMILIES[arch]
    raw = {**COMMON, **extra}
    torch.manual_seed(seed)
    block = block_cls(config_cls(**raw)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block, raw


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 5, 32])
def test_grouped_routing_matches_transformers(arch: str, tokens: int) -> None:
    block, raw = _block(arch, seed=tokens)
    spec = MoeSpec.from_dict(raw, arch)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = block(x)[0].numpy()
    w = {n: p.detach().numpy() for n, p in block.named_parameters()}
    xs = x[0].numpy()
    got = moe_routing.moe_forward(xs, w["gate.weight"], w["experts.gate_up_proj"], w["experts.down_proj"],
                                  spec.top_k, spec.norm_topk_prob)
    if spec.shared_expert_intermediate_size:
        gate_up = np.concatenate([w["shared_expert.gate_proj.weight"], w["shared_expert.up_proj.weight"]])
        got += moe_routing.shared_expert(xs, gate_up, w["shared_expert.down_proj.weight"],
                                         w["shared_expert_gate.weight"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_plan_groups_rows_by_expert_and_visits_only_chosen_experts() -> None:
    logits = np.full((3, E), -10.0, np.float32)
    logits[0, [5, 1]] = [3.0, 2.0]
    logits[1, [1, 5]] = [3.0, 1.0]
    logits[2, [5, 6]] = [2.0, 1.0]
    weights, ids = moe_routing.top_k(logits, K, normalise=True)
    route = moe_routing.plan(weights, ids)
    assert ids.tolist() == [[5, 1], [1, 5], [5, 6]]
    assert route.experts.tolist() == [1, 5, 6]  # expert 0, 2, 3, 4, 7: never read
    assert route.counts.tolist() == [2, 3, 1]
    assert route.tokens.tolist() == [0, 1, 0, 1, 2, 2]
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    unnormalised, _ = moe_routing.top_k(logits, K, normalise=False)
    assert (unnormalised.sum(-1) < 1).all()


def test_spec_layers_from_sparse_step_and_mlp_only_layers() -> None:
    raw = {**COMMON, **FAMILIES["Qwen3MoeForCausalLM"][2], "num_hidden_layers": 6, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    assert MoeSpec.from_dict(raw, "Qwen3MoeForCausalLM").sparse_layers == (1, 5)
    mixtral = MoeSpec.from_dict({**COMMON, **FAMILIES["MixtralForCausalLM"][2], "router_jitter_noise": 0.1},
                                "MixtralForCausalLM")  # jitter: training only
    assert mixtral.norm_topk_prob and mixtral.sparse_layers == (0, 1, 2, 3)
    assert mixtral.moe_intermediate_size == F and mixtral.shared_expert_intermediate_size == 0


@pytest.mark.parametrize(("change", "named"), [
    ({"capacity_factor": 1.25}, "capacity_factor"), ({"n_group": 4}, "n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"), ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"), ({"moe_intermediate_size": None}, None)])
def test_spec_refuses_by_name(change: dict, named: str | None) -> None:
    raw = {**COMMON, **FAMILIES["Qwen3MoeForCausalLM"][2], **change}
    if named is None:
        del raw["moe_intermediate_size"]
        named = "moe_intermediate_size"
    with pytest.raises(ModelConfigError, match=f"cfg.json: .*{named}"):
        MoeSpec.from_dict(raw, "Qwen3MoeForCausalLM", "cfg.json")


def _save_tiny(arch: str, out) -> torch.nn.Module:
    import transformers

    config_cls, _, extra = FAMILIES[arch]
    config = config_cls(**{**COMMON, **extra, "num_hidden_layers": 2, "intermediate_size": extra.get(
        "intermediate_size", 12)})
    torch.manual_seed(3)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_hf_checkpoint_experts_fused_per_expert(arch: str, tmp_path) -> None:
    """Per-expert tensors as save_pretrained writes them, fused [gate; up] per expert and stacked: the block
    computed from them equals the checkpoint's own model's block."""
    from agents.weights.checkpoints import SafetensorsFile
    from agents.weights.moe_weights import fuse_moe_layer

    model = _save_tiny(arch, tmp_path)
    spec = MoeSpec.from_dict(json.loads((tmp_path / "config.json").read_text()), arch)
    tensors = SafetensorsFile(tmp_path / "model.safetensors")
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    for layer in spec.sparse_layers:
        fused, used = fuse_moe_layer(tensors, layer, arch, spec, H)
        assert fused[f"layers.{layer}.experts_gate_up"].shape == (E, 2 * F, H)
        assert len(used) == 1 + 3 * E + (4 if spec.shared_expert_intermediate_size else 0)
        block = model.model.layers[layer].mlp
        with torch.no_grad():
            want = block(x[None])[0].numpy()
        got = moe_routing.sparse_block(x.numpy(), fused, layer, spec.top_k, spec.norm_topk_prob)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fuse_names_missing_and_misshapen_tensors(tmp_path) -> None:
    from agents.weights.checkpoints import SafetensorsFile
    from agents.weights.errors import WeightLoadError
    from agents.weights.moe_weights import fuse_moe_layer

    arch = "Qwen3MoeForCausalLM"
    _save_tiny(arch, tmp_path)
    spec = MoeSpec.from_dict(json.loads((tmp_path / "config.json").read_text()), arch)
    tensors = dict(SafetensorsFile(tmp_path / "model.safetensors").items())
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(WeightLoadError, match="ck: missing tensor 'model.layers.0.mlp.experts.3.up_proj.weight'"):
        fuse_moe_layer(tensors, 0, arch, spec, H, "ck")
    tensors["model.layers.0.mlp.experts.3.up_proj.weight"] = np.zeros((F, H + 1), np.float32)
    with pytest.raises(WeightLoadError, match=r"experts.3.up_proj.weight: expected shape \(8, 16\)"):
        fuse_moe_layer(tensors, 0, arch, spec, H, "ck")
