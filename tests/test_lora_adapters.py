"""Issue 56, PEFT adapter directories: ``adapter_config.json`` read as PEFT matches modules (targets, exclusions,
layers, per-module ranks and alphas, rsLoRA) with every key that changes the maths implemented or refused by name,
and the adapter's A and B laid out beside our fused projections per tensor-parallel rank. The reference is PEFT
itself: on every rank, each fused projection's weight plus ``B A`` equals that rank's slice of PEFT's merged model
(``merge_and_unload``), read by our own loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agents.weights.lora_weights import load_lora_weights
from agents.weights.sharded import load_rank_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.lora import AdapterError, LoraConfig
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

peft = pytest.importorskip("peft")  # in the test extra: a skip only outside scripts/test.sh

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
# (PEFT LoraConfig keywords): a few targets, all of them with rsLoRA and per-module ranks, a regular expression
ADAPTERS = {
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "everything": {"r": 8, "lora_alpha": 16, "use_rslora": True,
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                   "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"layers.2.mlp.gate_proj": 3},
                   "layers_to_transform": [0, 2]},
    "regex": {"r": 2, "lora_alpha": 5, "target_modules": r".*\.1\.mlp\.(gate|up)_proj|.*\.0\.self_attn\.k_proj"},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("lora-base"), CONFIG, seed=3)


def make_adapter(base, out, keywords: dict, seed: int) -> tuple:
    """PEFT's adapter directory (A and B random, as after training) and its merged model directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **keywords))
    adapter = out / "adapter"
    lora.save_pretrained(adapter)
    merged = lora.merge_and_unload()
    merged.save_pretrained(out / "merged", safe_serialization=True)
    return adapter, out / "merged"


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_rank_holds_peft_s_merged_update_beside_its_fused_projections(base, tmp_path, name):
    adapter, merged = make_adapter(base, tmp_path, ADAPTERS[name], seed=len(name))
    lora = LoraConfig.from_dir(adapter, CONFIG.num_hidden_layers)
    adapted = {(m.layer, m.target) for m in lora.modules}
    for tp in (1, 2):
        for rank in range(tp):
            plan = ShardPlan(CONFIG, tp, rank)
            pairs = load_lora_weights(adapter, lora, CONFIG, plan)
            want = load_rank_weights(merged, CONFIG, plan)
            before = load_rank_weights(base, CONFIG, plan)
            got = {key: w + pairs[key].b @ pairs[key].a if key in pairs else w for key, w in before.items()}
            changed = {key for key in want if not np.array_equal(want[key], before[key])}
            assert changed == set(pairs), (name, tp, rank)  # exactly the projections PEFT changed
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=0, atol=2e-6, err_msg=f"{name} {key} tp{tp}")
    assert adapted  # and which modules: PEFT's own list
    model_modules = {(int(n.split(".")[4]), n.split(".")[-1]) for n in _peft_targets(base, ADAPTERS[name])}
    assert adapted == model_modules


def _peft_targets(base, keywords: dict) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(**keywords))
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A") and n.endswith("_proj")]


def test_ranks_and_scales_follow_rslora_and_the_patterns():
    raw = {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "down_proj"],
           "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"layers.1.self_attn.q_proj": 4}}
    modules = {(m.layer, m.target): (m.rank, m.scaling) for m in LoraConfig.from_dict(raw, 2).modules}
    assert modules == {(0, "q_proj"): (8, 16 / 8 ** 0.5), (1, "q_proj"): (8, 4 / 8 ** 0.5),
                       (0, "down_proj"): (2, 16 / 2 ** 0.5), (1, "down_proj"): (2, 16 / 2 ** 0.5)}
    every = LoraConfig.from_dict({"target_modules": "all-linear"}, 2).modules
    assert len(every) == 14 and {m.scaling for m in every} == {1.0}  # PEFT's defaults: r 8, lora_alpha 8
    plain = LoraConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"], "lora_dropout": 0.1,
                                  "exclude_modules": ["layers.0.self_attn.v_proj"]}, 2)
    assert [(m.layer, m.rank, m.scaling) for m in plain.modules] == [(1, 4, 2.0)] and plain.max_rank == 4


@pytest.mark.parametrize("raw, named", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["mystery_proj"]}, "adapts none"),
    ({"target_modules": "(unclosed"}, "not a regular expression"),
    ({"r": 0}, "r must be"),
    ({"something_new": 3}, "unknown key 'something_new'"),
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"target_modules": "all-linear", "layers_to_transform": [0]}, "PEFT refuses the pair"),
])
def test_what_changes_the_maths_unserved_is_refused_by_name(tmp_path, raw, named):
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **raw}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=named) as err:
        LoraConfig.from_dir(tmp_path, 2)
    assert "adapter_config.json" in str(err.value)
    assert LoraConfig.from_dict({**config, **{k: None for k in raw}, "target_modules": ["q_proj"], "r": 4,
                                 "peft_type": "LORA", "bias": "none"}, 2).modules  # defaults are harmless


def test_a_weights_file_that_is_not_the_config_s_adapter_is_refused(base, tmp_path):
    adapter, _ = make_adapter(base, tmp_path, ADAPTERS["attention"], seed=1)
    narrower = LoraConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, 3)
    with pytest.raises(AdapterError, match="not a LoRA A or B of the modules"):
        load_lora_weights(adapter, narrower, CONFIG, ShardPlan(CONFIG))
    wider = LoraConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"]}, 3)
    with pytest.raises(AdapterError, match="missing .*up_proj.lora_A"):
        load_lora_weights(adapter, wider, CONFIG, ShardPlan(CONFIG))
    other_rank = LoraConfig.from_dict({"r": 3, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}, 3)
    with pytest.raises(AdapterError, match=r"has shape \[4, 64\], expected \[3, 64\]"):
        load_lora_weights(adapter, other_rank, CONFIG, ShardPlan(CONFIG))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        LoraConfig.from_dir(tmp_path, 3)
