"""End-of-sequence id lists: config.json's ``eos_token_id`` list and generation_config.json's ids (Llama 3
instruct stops at ``<|eot_id|>``, listed there) all end a request, finish reason "eos"; ``model_config.end_token``
replaces them."""

from __future__ import annotations

import json
import shutil

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import resolve_model
from llm_serving.protocol.model_config import LlamaConfig

TINY = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "vocab_size": 1000, "seed": 3}
PROMPT = [1, 17, 230, 45, 9, 301]


def config(tmp_path, model_path=None, **model) -> ServingConfig:
    return ServingConfig.from_dict({
        "default_model": {"data_dir": str(tmp_path / "default"), **TINY},
        "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [2],
                         **({"model_path": str(model_path)} if model_path else {}), **model},
        "pa_config": {"num_blocks": 32, "block_size": 8, "decode_seq_length": 64},
        "serving_config": {"compile_cache": False}})


def generate(cfg: ServingConfig):
    with Engine(cfg) as engine:
        engine.start(progress=None)
        return engine.submit(PROMPT, SamplingParams(max_new_tokens=12)).result(timeout=120)


def test_the_configs_lists_are_read_in_order(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    (d / "config.json").write_text(json.dumps({**base, "eos_token_id": [128001, 128008]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    cfg = LlamaConfig.from_model_dir(d)
    assert cfg.eos_token_id == 128001 and cfg.stop_ids == (128001, 128008, 128009)
    assert cfg.to_hf_dict()["eos_token_id"] == [128001, 128008, 128009]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert LlamaConfig.from_model_dir(d).stop_ids == (128001, 128008, 7)
    assert LlamaConfig.from_dict({**base, "eos_token_id": 2}).stop_ids == (2,)


def test_any_listed_id_ends_the_request(tmp_path):
    from tests.hf_reference import hf_greedy, load_hf

    model_dir = resolve_model(config(tmp_path)).model_path
    free = hf_greedy(load_hf(model_dir), PROMPT, 12, eos_token_id=2)[0]  # the default model's own ids: eos 2 only
    assert len(free) == 12
    cut = next(i for i in range(3, 12) if free[i] not in free[:i] and free[i] != 2)
    stop = free[cut]
    model = tmp_path / "listed"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    listed = generate(config(tmp_path, model))
    assert listed.token_ids == free[: cut + 1] and listed.finish_reason == "eos"
    replaced = generate(config(tmp_path, model, end_token=2))  # end_token: that id alone
    assert replaced.token_ids == free and replaced.finish_reason == "length"
