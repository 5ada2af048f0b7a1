"""``model_config.backend: mindformers`` in the main environment (no MindFormers here): the configuration's
checks, the agent spec it produces, and the inputs the backend builds from a step batch (agents/mindformers/
inputs.py, numpy only). The graphs themselves are exported by tests_mindformers/ in the MindFormers environment.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from agents.mindformers.inputs import (
    check_whole_prompts,
    decode_arrays,
    prefill_arrays,
    prefill_rows,
    shape_arrays,
    warmup_batch,
)
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import agent_spec, resolve_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.wire import AgentSpec

MF = {"backend": "mindformers", "model_cfg_path": "predict_llama2_7b.yaml", "dtype": "float16",
      "device_target": "Ascend"}


def config(tmp_path: Path, model: dict | None = None, **sections) -> ServingConfig:
    """The embedded model, if resolved, is built under ``tmp_path`` (never in the user's cache)."""
    sections.setdefault("default_model", {"data_dir": str(tmp_path / "models"), "weights": "random"})
    return ServingConfig.from_dict({"model_config": {**MF, **(model or {})}, **sections}, source="mf.yaml",
                                   base_dir=tmp_path)


# ---- configuration -------------------------------------------------------------------------------------------
def test_backend_mindformers_config(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert cfg.uses_mindformers
    assert cfg.model_config.model_cfg_path == str(tmp_path / "predict_llama2_7b.yaml")
    assert not cfg.chunked_prefill and not cfg.prefix_caching  # MindFormers' prefill starts at position 0
    for compat in ("ms", "ge", "kbk"):  # llm-serving's values all run our own graph
        assert not config(tmp_path, {"backend": compat}).uses_mindformers


@pytest.mark.parametrize(("model", "sections", "key", "message"), [
    ({"backend": "torch"}, {}, "model_config.backend", "expected one of ms, ge, kbk, mindformers, got 'torch'"),
    ({"model_cfg_path": None}, {}, "model_config.model_cfg_path", "set model_config.model_cfg_path to it"),
    ({"model_cfg_path": ""}, {}, "model_config.model_cfg_path", "MindFormers predict YAML"),
    ({"dtype": "float32"}, {}, "model_config.dtype", "float32 is not served on Ascend"),
    ({"device_target": "CPU"}, {}, "model_config.device_target", "backend mindformers serves on Ascend only"),
    ({}, {"serving_config": {"num_agents": 2}}, "serving_config.num_agents", "backend mindformers runs one agent"),
    ({}, {"scheduler": {"enable_chunked_prefill": True}}, "scheduler.enable_chunked_prefill",
     "prefills whole prompts from position 0"),
    ({}, {"scheduler": {"enable_prefix_caching": True}}, "scheduler.enable_prefix_caching",
     "prefills whole prompts from position 0"),
])
def test_config_mistakes_name_the_key(tmp_path: Path, model: dict, sections: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config(tmp_path, model, **sections)
    assert err.value.key == key
    assert "mf.yaml" in str(err.value)


def test_missing_yaml_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model_config.model_cfg_path: MindFormers predict YAML .*"
                                          r"predict_llama2_7b.yaml does not exist") as err:
        resolve_model(config(tmp_path), tokenizer=False)
    assert err.value.key == "model_config.model_cfg_path"


@pytest.mark.parametrize("changes, phrase", [
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "without Qwen2ForCausalLM's q/k/v biases"),
    ({"head_dim": 64}, "a head_dim of its own"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
      "num_experts_per_tok": 2}, "without MixtralForCausalLM's q/k/v biases, q/k norms, experts"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "does not read config.json's rope_scaling (linear)"),
])
def test_a_model_mindformers_would_build_otherwise_is_refused(tmp_path: Path, changes: dict, phrase: str) -> None:
    """MindFormers builds its Llama from its YAML: what config.json says beyond it would be lost, so it is refused
    (whether or not MindFormers is installed)."""
    import json

    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig

    model = build_random_model(tmp_path / "m", LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                                           num_hidden_layers=1, num_attention_heads=2,
                                                           num_key_value_heads=1))
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, **changes}))
    with pytest.raises(ConfigError, match=re.escape(phrase)) as err:
        resolve_model(config(tmp_path, {"model_path": str(model)}), tokenizer=False)
    assert err.value.key == "model_config.backend"


@pytest.mark.skipif(importlib.util.find_spec("mindformers") is not None, reason="MindFormers is installed here")
def test_without_mindformers_the_master_says_how_to_get_it(tmp_path: Path) -> None:
    (tmp_path / "predict_llama2_7b.yaml").write_text("model:\n  model_config:\n    type: LlamaConfig\n")
    with pytest.raises(ConfigError, match=r"MindFormers is not installed for .*python.*: create its environment "
                                          r"with `bash scripts/mindformers_env.sh`") as err:
        resolve_model(config(tmp_path), tokenizer=False)
    assert err.value.key == "model_config.backend"


def test_agent_spec_carries_the_backend(tmp_path: Path) -> None:
    plain = ServingConfig()
    model = resolve_model(plain, tokenizer=False)
    spec = agent_spec(plain, model)
    assert (spec.backend, spec.model_cfg_path) == ("ms", None)
    cfg = config(tmp_path)
    spec = agent_spec(cfg, model)  # the same model files served through MindFormers
    assert (spec.backend, spec.model_cfg_path) == ("mindformers", cfg.model_config.model_cfg_path)
    assert AgentSpec.from_json(spec.to_json()) == spec
    assert spec.runner_config["mixed_steps"] is False
    with pytest.raises(ValueError, match="model_cfg_path is required for backend 'mindformers'"):
        AgentSpec(**{**spec.__dict__, "model_cfg_path": None})


# ---- inputs ----------------------------------------------------------------------------------------------------
def prefill(lens: list[int], first_slot: int = 16) -> StepBatch:
    total = sum(lens)
    ids = np.arange(1, total + 1, dtype=np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    q = np.array(lens, np.int32)
    return StepBatch(ids, pos, np.arange(first_slot, first_slot + total, dtype=np.int32), q, q.copy(),
                     np.zeros((len(lens), 4), np.int32))


@pytest.mark.parametrize("lens", [[5], [3, 7, 1], [8, 8, 8, 8], [29, 1, 1, 1]])
def test_prefill_inputs(lens: list[int]) -> None:
    """Prompts back to back, every sequence slot a positive length, the lengths covering every row, and the
    last-token rows (MindFormers gathers at cumsum - 1) those of the prompts."""
    S, T = 4, 32
    ids, bvl, tables, slots = prefill_arrays(prefill(lens), S, T)
    rows = prefill_rows(S, T)
    assert ids.shape == (1, rows) and slots.shape == (rows,) and bvl.shape == (S + 1,) and tables.shape == (S + 1, 1)
    assert all(a.dtype == np.int32 for a in (ids, bvl, tables, slots))
    assert bvl.min() >= 1 and bvl.sum() == rows
    np.testing.assert_array_equal(bvl[: len(lens)], lens)
    last = np.cumsum(bvl) - 1
    np.testing.assert_array_equal(ids[0, last[: len(lens)]], np.cumsum(lens))  # ids are 1..total
    used = sum(lens)
    np.testing.assert_array_equal(slots[:used], np.arange(16, 16 + used))
    assert not ids[0, used:].any() and not slots[used:].any()  # padding: token 0 into the dummy block's slot 0


def test_prefill_bucket_overflow_and_chunks_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit the prefill bucket of 4 x 32"):
        prefill_arrays(prefill([20, 13]), 4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        prefill_arrays(prefill([1] * 5), 4, 32)
    whole = prefill([4])
    chunk = StepBatch(whole.input_ids, whole.positions + 5, whole.slot_mapping, whole.query_lens,
                      np.array([9], np.int32), whole.block_tables)  # 5 cached tokens before this chunk
    with pytest.raises(ValueError, match="prefills whole prompts from position 0"):
        check_whole_prompts(chunk)
    check_whole_prompts(prefill([4, 2]))


def test_decode_inputs() -> None:
    tables = np.array([[3, 5, 0], [7, 0, 0]], np.int32)
    batch = StepBatch(np.array([11, 12], np.int32), np.array([33, 4], np.int32),
                      np.array([82, 116], np.int32), np.ones(2, np.int32), np.array([34, 5], np.int32), tables)
    ids, bvl, table, slots = decode_arrays(batch, 8, 4)
    assert ids.shape == (8, 1) and bvl.shape == (8,) and table.shape == (8, 4) and slots.shape == (8,)
    np.testing.assert_array_equal(ids[:, 0], [11, 12, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(bvl, [34, 5, 1, 1, 1, 1, 1, 1])  # context with the new token; padding 1
    np.testing.assert_array_equal(table[:2, :3], tables)
    assert not table[2:].any() and not table[:, 3].any() and not slots[2:].any()
    np.testing.assert_array_equal(slots[:2], [82, 116])


@pytest.mark.parametrize("shape", [("ragged", 4, 64), ("ragged", 1, 16), ("decode", 8, 16), ("decode", 1, 4)])
def test_warmup_inputs_fill_their_shape(shape: tuple) -> None:
    kind, count, n = shape
    ids, bvl, tables, slots = shape_arrays(shape, warmup_batch(*shape))
    if kind == "ragged":
        assert ids.shape == (1, n + count) and bvl.sum() == n + count and bvl[:count].sum() == n
    else:
        assert ids.shape == (count, 1) and tables.shape == (count, n) and np.all(bvl == 1)
    assert not slots.any()  # every warm-up token writes the dummy block
