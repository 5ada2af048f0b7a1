"""Families built on Llama's layer: a Mistral checkpoint (``MistralForCausalLM``, no sliding window shorter than the
context) served with transformers' own Mistral model's greedy ids; architectures not served are refused by name."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig
from tests.paged_driver import PagedDriver

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def as_family(model_dir, **changes):
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, **changes}))
    return model_dir


def hf_greedy_auto(model_dir, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_a_mistral_checkpoint_gives_transformers_mistral_greedy_ids(tmp_path):
    model_dir = as_family(build_random_model(tmp_path, CONFIG, seed=6, std=0.25),
                          architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    config = LlamaConfig.from_model_dir(model_dir)
    rc = RunnerConfig(num_blocks=40, block_size=16, max_model_len=128, prefill_batch_sizes=(2,),
                      prefill_seq_lengths=(64,), decode_batch_sizes=(2,), decode_block_widths=(8,))
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 256, n - 1).tolist() for n in (9, 30)]
    tokens, _ = PagedDriver(runner, seed=1).generate(prompts, 10)
    assert tokens == [hf_greedy_auto(model_dir, p, 10) for p in prompts]


@pytest.mark.parametrize("changes, phrase", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64,
      "max_position_embeddings": 32768}, "sliding_window: 64 (shorter than max_position_embeddings 32768)"),
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "unsupported architecture ['GemmaForCausalLM']"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True},
     "attention_bias: True is not served"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 1, "max_position_embeddings": 32768}, "sliding_window: 64"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64}, "sliding_window: 64"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "llama"}, "unsupported model_type 'llama' for Mistral"),
])
def test_what_is_not_served_is_refused_by_name(changes, phrase):
    with pytest.raises(ModelConfigError, match=f"config.json: .*{re.escape(phrase)}"):
        LlamaConfig.from_dict({**CONFIG.to_hf_dict(), **changes}, source="config.json")


def test_a_sliding_window_no_layer_uses_is_served():
    """Qwen's configs carry a sliding_window that only use_sliding_window, from layer max_window_layers on, turns on
    (transformers' Qwen2Config); its own q/k/v biases are not refused by Llama's attention_bias rule."""
    raw = {**CONFIG.to_hf_dict(), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "sliding_window": 64, "max_position_embeddings": 32768, "attention_bias": True}
    assert LlamaConfig.from_dict(raw).qkv_bias
    assert LlamaConfig.from_dict({**raw, "use_sliding_window": True, "max_window_layers": 2}).qkv_bias


def test_a_sliding_window_that_covers_the_context_is_served():
    raw = {**CONFIG.to_hf_dict(), "architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "sliding_window": 4096, "max_position_embeddings": 4096}
    assert LlamaConfig.from_dict(raw).max_position_embeddings == 4096


def test_the_converter_carries_a_llama3_directory(tmp_path):
    """rope_scaling and the eos lists in the written config.json, tokenizer.json and generation_config.json
    copied: the converted directory is served as the source is."""
    from agents.weights.convert import convert

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    source = as_family(build_random_model(tmp_path / "src", CONFIG, seed=6), rope_scaling=scaling,
                       eos_token_id=[2, 5])
    (source / "tokenizer.json").write_text("{}")
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5, 7]}))
    out = convert(source, tmp_path / "converted")
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "generation_config.json").is_file()
    assert LlamaConfig.from_model_dir(out) == LlamaConfig.from_model_dir(source)
    assert LlamaConfig.from_model_dir(out).rope_scaling["rope_type"] == "llama3"
    assert LlamaConfig.from_model_dir(out).stop_ids == (2, 5, 7)
