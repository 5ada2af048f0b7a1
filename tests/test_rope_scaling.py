"""``rope_scaling`` in config.json: the types served (linear, dynamic, llama3, yarn) computed as transformers does,
checked through the model against transformers' logits and greedy ids (dynamic: within max_position_embeddings, where
it is plain RoPE); types and keys that would change the maths without an implementation are refused naming the key
and file (never a silently different model)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from agents.model.rope import inverse_frequencies
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf
from tests.paged_driver import PagedDriver, contiguous_prefill

BASE = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}
# original contexts of 32 positions, so prompts of a few dozen tokens are where the scaled frequencies matter
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16},
}


PLAIN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_the_frequencies_are_transformers_own():
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, scaling in {**SCALINGS, "yarn": PLAIN_YARN, "dynamic": {"rope_type": "dynamic", "factor": 4.0}}.items():
        ours = LlamaConfig.from_dict({**BASE, "rope_scaling": scaling, "rope_theta": 10000.0})
        hf = HFConfig(**BASE, rope_scaling={**scaling, "rope_theta": 10000.0})
        want, want_attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, torch.device("cpu"))
        got, attention = inverse_frequencies(ours)
        np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-6, err_msg=name)
        assert attention == pytest.approx(want_attention, rel=1e-6), name


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    name = request.param
    config = LlamaConfig.from_dict({**BASE, "rope_scaling": SCALINGS[name]})
    model_dir = build_random_model(tmp_path_factory.mktemp(name), config, seed=9, std=0.25)
    assert json.loads((model_dir / "config.json").read_text())["rope_scaling"]["rope_type"] == SCALINGS[name][
        "rope_type"]
    rc = RunnerConfig(num_blocks=40, block_size=16, max_model_len=128, prefill_batch_sizes=(2,),
                      prefill_seq_lengths=(64,), decode_batch_sizes=(2,), decode_block_widths=(8,), kernels="portable")
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    return config, model_dir, runner


def test_logits_and_greedy_ids_equal_transformers_with_the_scaling(scaled):
    config, model_dir, runner = scaled
    hf = load_hf(model_dir)
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in (40, 61)]
    logits = runner.step_logits(contiguous_prefill(prompts, runner.rc.block_size))
    for row, prompt in zip(logits, prompts):
        np.testing.assert_allclose(row, hf_last_logits(hf, prompt).numpy(), atol=5e-4)  # float32 tables, summed apart
    tokens, _ = PagedDriver(runner, seed=2).generate(prompts, 12)
    assert tokens == [hf_greedy(hf, p, 12)[0] for p in prompts]


@pytest.mark.parametrize("scaled", ["llama3"], indirect=True)
def test_without_the_scaling_the_same_weights_answer_otherwise(scaled):
    """What serving the config with rope_scaling ignored would do: the check above would catch it (shown for
    llama3, the type a Llama 3.1 config names)."""
    config, model_dir, runner = scaled
    hf = load_hf(model_dir)
    plain = LlamaConfig.from_dict({**BASE})
    prompt = [1] + np.random.default_rng(1).integers(3, config.vocab_size, 39).tolist()
    ours_plain = ModelRunner(plain, load_weights(model_dir, plain), runner.rc)
    ours_plain.warmup()
    row = ours_plain.step_logits(contiguous_prefill([prompt], 16))[0]
    assert np.abs(row - hf_last_logits(hf, prompt).numpy()).max() > 2e-2  # 40 times the tolerance above


@pytest.mark.parametrize("changes, key, phrase", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling", "rope_type 'longrope' is not served"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling", "needs low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5}}, "rope_parameters", "needs factor"),
    ({"hidden_act": "gelu"}, "hidden_act", "'gelu' is not served"),
    ({"attention_bias": True}, "attention_bias", "True is not served"),
    ({"mlp_bias": True}, "mlp_bias", "True is not served"),
    ({"head_dim": 33}, "head_dim", "33 must be even"),
    ({"sliding_window": 64}, "sliding_window", "64 (shorter than max_position_embeddings 256) is not served"),
])
def test_keys_that_change_the_maths_without_an_implementation_are_refused(changes, key, phrase):
    with pytest.raises(ModelConfigError, match=f"cfg.json: {key}: .*{re.escape(phrase)}"):
        LlamaConfig.from_dict({**BASE, **changes}, source="cfg.json")


def test_what_is_served_as_is():
    assert LlamaConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
                                 ).rope_theta == 5e5  # transformers 5's layout
    assert LlamaConfig.from_dict({**BASE, "sliding_window": 64, "use_sliding_window": False}).rope_scaling is None
    assert LlamaConfig.from_dict({**BASE, "sliding_window": None, "head_dim": 64, "hidden_act": "silu"})
    scaled = LlamaConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2}})  # the older key
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 2}


def test_a_dynamic_model_is_served_within_max_position_embeddings_only(tmp_path):
    """transformers' dynamic NTK keeps the plain frequencies up to max_position_embeddings (checked above) and
    rescales the whole sequence beyond it, which cached keys cannot follow: the rotary tables and the served length
    stop there, the latter with the config key named."""
    from agents.model.rope import rotary_tables
    from llm_serving.config.serving_config import ConfigError, ServingConfig
    from llm_serving.engine.wiring import resolve_model

    config = LlamaConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert config.rope_position_limit == 256 and LlamaConfig.from_dict(BASE).rope_position_limit is None
    assert rotary_tables(config, 256)[0].shape == (256, 64)
    with pytest.raises(ValueError, match="257 positions exceed max_position_embeddings 256"):
        rotary_tables(config, 257)
    model_dir = build_random_model(tmp_path / "dynamic", config, seed=1)

    def served(length: int) -> ServingConfig:
        return ServingConfig.from_dict({"model_config": {"model_path": str(model_dir), "seq_length": [32]},
                                        "pa_config": {"num_blocks": 64, "block_size": 16,
                                                      "decode_seq_length": length}})
    assert resolve_model(served(256), tokenizer=False).llama_config.rope_scaling["rope_type"] == "dynamic"
    with pytest.raises(ConfigError, match="pa_config.decode_seq_length: 512 tokens exceed the 256 positions"):
        resolve_model(served(512), tokenizer=False)
