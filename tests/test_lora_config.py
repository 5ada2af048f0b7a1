"""The ``lora`` section and the serve command's adapter flags: every key checked, errors naming key and file."""

from __future__ import annotations

import argparse

import pytest

from llm_serving.cli.commands.serve import add_arguments, load_config
from llm_serving.config.serving_config import ConfigError, ServingConfig


def test_defaults_serve_no_adapters():
    lora = ServingConfig().lora
    assert (lora.enable, lora.max_loras, lora.max_lora_rank, lora.adapters, lora.allow_runtime_updates) == (
        False, 1, 16, {}, False)


def test_yaml_mapping_and_list_are_the_same_and_paths_resolve_against_the_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    as_map = ServingConfig.from_dict({"lora": {"enable": True, "modules": {"x": "a", "y": "b"}}},
                                     base_dir=tmp_path)
    as_list = ServingConfig.from_dict({"lora": {"enable": True, "modules": ["x=a", "y=b"]}}, base_dir=tmp_path)
    assert as_map.lora == as_list.lora
    assert as_map.lora.adapters == {"x": str(tmp_path / "a"), "y": str(tmp_path / "b")}
    assert ServingConfig.from_dict(as_map.to_dict()).lora == as_map.lora  # round trip


@pytest.mark.parametrize(("body", "key"), [
    ({"max_loras": 0, "enable": True}, "lora.max_loras"),
    ({"max_lora_rank": 513, "enable": True}, "lora.max_lora_rank"),
    ({"modules": ["x=."]}, "lora.modules"),  # not enabled
    ({"allow_runtime_updates": True}, "lora.allow_runtime_updates"),
    ({"enable": True, "modules": ["x"]}, "lora.modules"),
    ({"enable": True, "modules": ["x=/no/such/dir"]}, "lora.modules.x"),
    ({"enable": True, "modules": ["bad name=."]}, "lora.modules.bad name"),
    ({"enable": True, "modules": ["llama2=."]}, "lora.modules.llama2"),  # the base model's alias
    ({"enable": True, "modules": {"x": 3}}, "lora.modules"),
    ({"enable": True, "max_loras": "two"}, "lora.max_loras"),
    ({"enable": True, "bogus": 1}, "lora.bogus"),
])
def test_bad_keys_are_refused_by_name(tmp_path, body, key):
    with pytest.raises(ConfigError) as err:
        ServingConfig.from_dict({"lora": body}, source="serve.yaml", base_dir=tmp_path)
    assert err.value.key == key and "serve.yaml" in str(err.value)


def test_adapters_are_refused_with_speculative_decoding():
    with pytest.raises(ConfigError, match="verify steps") as err:
        ServingConfig.from_dict({"lora": {"enable": True}, "speculative": {"method": "ngram"},
                                 "scheduler": {"async_scheduling": False}})
    assert err.value.key == "lora.enable"


def test_serve_flags_set_the_lora_keys(tmp_path, monkeypatch):
    (tmp_path / "ad").mkdir()
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lora-modules", "sql=ad", "chat=./ad", "--max-loras", "3", "--max-lora-rank", "64",
                              "--allow-runtime-lora-updating"])
    lora = load_config(args).lora
    assert lora.enable and lora.allow_runtime_updates and (lora.max_loras, lora.max_lora_rank) == (3, 64)
    assert lora.adapters == {"sql": str(tmp_path / "ad"), "chat": str(tmp_path / "ad")}
    assert not load_config(parser.parse_args([])).lora.enable
    with pytest.raises(ConfigError) as err:
        load_config(parser.parse_args(["--lora-modules", "x=missing"]))
    assert err.value.key == "lora.modules.x"
