"""Device selection: ``model_config.device_target`` from the YAML and the command line to each rank's device,
the Ascend graph settings and backend choice, and the float32-on-Ascend refusal at load."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from mindspore import nn

from agents import agent_main
from agents.model.backends import PortableBackend, select_backend
from agents.model.backends.ascend import AscendBackend
from agents.runtime.device import apply_jit_config
from agents.tools.contracts import selected_paged_attention
from llm_serving.cli.commands import serve as serve_cli
from llm_serving.cli.options import add_config_arguments, config_from_args
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import ModelFiles, agent_spec, runner_config_dict
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.ascend_env import ASCEND_ENVIRONMENT
from llm_serving.protocol.model_config import LlamaConfig
from tests.script_runner import ROOT

ASCEND = {"model_config": {"device_target": "Ascend", "dtype": "float16"}}


def test_device_target_defaults_to_cpu_and_reaches_the_runner_config():
    assert ServingConfig().model_config.device_target == "CPU"
    assert runner_config_dict(ServingConfig())["device_target"] == "CPU"
    assert runner_config_dict(ServingConfig.from_dict(ASCEND))["device_target"] == "Ascend"


def test_float32_on_ascend_is_refused_at_load_naming_the_key(tmp_path):
    path = tmp_path / "npu.yaml"
    path.write_text("model_config:\n  device_target: Ascend\n  dtype: float32\n")
    with pytest.raises(ConfigError) as exc:
        ServingConfig.from_yaml(path)
    assert exc.value.key == "model_config.dtype"
    assert str(exc.value) == (f"{path}: model_config.dtype: float32 is not served on Ascend "
                              "(model_config.device_target): the fused NPU kernels take float16 or bfloat16")
    with pytest.raises(ConfigError, match="model_config.dtype: float32 is not served on Ascend"):
        ServingConfig.from_dict({"model_config": {"device_target": "Ascend"}})  # float32 is the default dtype
    assert ServingConfig.from_dict({"model_config": {"device_target": "Ascend", "dtype": "bfloat16"}})


def test_unknown_device_target_is_refused():
    with pytest.raises(ConfigError, match="model_config.device_target: expected one of CPU, Ascend, got 'NPU'"):
        ServingConfig.from_dict({"model_config": {"device_target": "NPU", "dtype": "float16"}})


def test_device_target_option_overrides_the_yaml_for_generate_export_and_serve(tmp_path):
    path = tmp_path / "half.yaml"
    path.write_text("model_config:\n  dtype: float16\n")
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args(["--config", str(path)])).model_config.device_target == "CPU"
    args = parser.parse_args(["--config", str(path), "--device-target", "Ascend"])
    assert config_from_args(args).model_config.device_target == "Ascend"
    serve_parser = argparse.ArgumentParser()
    serve_cli.add_arguments(serve_parser)
    args = serve_parser.parse_args(["--config", str(path), "--device-target", "Ascend"])
    assert serve_cli.load_config(args).model_config.device_target == "Ascend"
    with pytest.raises(ConfigError, match="float32 is not served on Ascend"):
        config_from_args(parser.parse_args(["--device-target", "Ascend"]))


def test_each_rank_runs_on_start_device_id_plus_its_rank(tmp_path, monkeypatch):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model_dir = build_random_model(tmp_path, config, seed=1)
    cfg = ServingConfig.from_dict({**ASCEND, "serving_config": {"start_device_id": 4, "num_agents": 2}})
    spec = agent_spec(cfg, ModelFiles(model_dir, config, None))
    built = []

    class Recorder:
        def __init__(self, llama, weights, runner_config, **kwargs) -> None:
            built.append(runner_config)

    monkeypatch.setattr("agents.runtime.runner.ModelRunner", Recorder)
    monkeypatch.setattr("agents.runtime.collectives.join_cluster", lambda *args: (0.0, 0.0))  # no cluster of two here
    monkeypatch.setattr("agents.runtime.collectives.share_cpus", lambda shard, ranks_here: 0)
    for rank in range(spec.tensor_parallel_size):
        agent_main.build_runner(spec, rank, lambda line: None)
    assert [(rc.device_target, rc.device_id) for rc in built] == [("Ascend", 4), ("Ascend", 5)]


def test_ascend_step_graphs_run_kernel_by_kernel_with_infer_boost_and_cpu_graphs_keep_the_defaults():
    ascend, cpu = nn.Cell(), nn.Cell()
    apply_jit_config(ascend, "Ascend")
    apply_jit_config(cpu, "CPU")
    assert ascend.jit_config_dict["jit_level"] == "O0" and ascend.jit_config_dict["infer_boost"] == "on"
    assert not cpu.jit_config_dict


def probe_ascend_setup(config: dict | None, preset: dict | None = None) -> dict:
    """tests/ascend_setup_probe.py in a process of its own (the context and environment are global): what an
    Ascend agent of ``config`` sets up (None: ``setup_device``'s defaults), ``preset`` already in its environment."""
    argv = [json.dumps(config) if config is not None else "", json.dumps(preset or {})]
    out = subprocess.run([sys.executable, "-m", "tests.ascend_setup_probe", *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


STACKS_ENV = {"MS_ENABLE_INTERNAL_BOOST": "on", "MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST": "PagedAttention",
              "MS_ALLOC_CONF": "enable_vmm:False"}


def test_an_ascend_process_turns_infer_boost_and_the_stacks_environment_on_before_choosing_its_device():
    """MindSpore selects the internal kernels only with ``infer_boost`` on (agents/runtime/device.py), and the
    stacks' PagedAttention (ATB) only with the custom one disabled (llm_serving/protocol/ascend_env.py);
    ``set_device`` and the pool cap are recorded, since this machine has no NPU."""
    seen = probe_ascend_setup(None)
    assert seen == {"set_device": [["Ascend", 3]], "jit_config": {"jit_level": "O0", "infer_boost": "on"},
                    "mode": 0, "env": STACKS_ENV, "max_device_memory": []}


def test_an_agent_of_the_default_ascend_config_sets_the_stacks_environment_and_caps_its_pool():
    assert probe_ascend_setup(ASCEND)["env"] == STACKS_ENV
    assert probe_ascend_setup(ASCEND)["max_device_memory"] == ["57GB"]  # 0.9 x 64 GiB, MindFormers' 8B: 58GB


def test_tensor_parallel_agents_add_hccl_settings_and_what_the_user_set_wins():
    seen = probe_ascend_setup({**ASCEND, "serving_config": {"num_agents": 2},
                               "pa_config": {"num_blocks": "auto", "memory_utilization": 0.5}},
                              preset={"MS_ALLOC_CONF": "enable_vmm:True"})
    assert seen["env"] == {**STACKS_ENV, "MS_ALLOC_CONF": "enable_vmm:True", "MS_ENABLE_LCCL": "off",
                           "HCCL_OP_EXPANSION_MODE": "AIV"}
    assert seen["max_device_memory"] == ["32GB"]


def test_each_environment_entry_is_overridden_by_its_config_key():
    overrides = {entry.key.split(".")[1]: f"value-{i}" for i, entry in enumerate(ASCEND_ENVIRONMENT)}
    cfg = ServingConfig.from_dict({"model_config": {**ASCEND["model_config"], **overrides,
                                                    "max_device_memory": "30.5GB"}})
    fields = runner_config_dict(cfg)
    assert fields["device_environment"] == {entry.name: f"value-{i}" for i, entry in enumerate(ASCEND_ENVIRONMENT)}
    assert fields["max_device_memory"] == "30.5GB"
    assert runner_config_dict(ServingConfig())["device_environment"] == {}  # CPU: MindSpore's defaults


def test_the_export_check_follows_the_kernel_the_agents_environment_selects():
    """``export --check`` without ``--paged-attention-kernel`` checks against the kernel the agents will run."""
    assert selected_paged_attention(None, runner_config_dict(ServingConfig.from_dict(ASCEND))) == "atb"
    custom = {"model_config": {**ASCEND["model_config"], "ascend_disable_custom_kernels": "FlashAttentionScore"}}
    assert selected_paged_attention(None, runner_config_dict(ServingConfig.from_dict(custom))) == "custom"
    both = {"model_config": {**ASCEND["model_config"],
                             "ascend_disable_custom_kernels": "FlashAttentionScore, PagedAttention"}}
    assert selected_paged_attention(None, runner_config_dict(ServingConfig.from_dict(both))) == "atb"
    assert selected_paged_attention("custom", runner_config_dict(ServingConfig.from_dict(ASCEND))) == "custom"


@pytest.mark.parametrize("key, value", [("ascend_alloc_conf", "enable_vmm:True"), ("max_device_memory", "58GB")])
def test_an_ascend_environment_key_on_cpu_is_refused_not_ignored(key, value):
    with pytest.raises(ConfigError, match=f"model_config.{key}: sets the Ascend agents' environment, but "
                       "model_config.device_target is CPU"):
        ServingConfig.from_dict({"model_config": {key: value}})


def test_a_pool_cap_mindspore_cannot_read_is_refused():
    with pytest.raises(ConfigError, match="model_config.max_device_memory: expected a size in GB as MindSpore reads "
                       "it \\(e.g. 58GB\\), got '58G'"):
        ServingConfig.from_dict({"model_config": {**ASCEND["model_config"], "max_device_memory": "58G"}})


def test_the_ascend_backend_is_the_devices_own_for_half_precision():
    assert isinstance(select_backend("auto", "Ascend", "float16", 64), AscendBackend)
    assert isinstance(select_backend("native", "Ascend", "bfloat16", 64), AscendBackend)
    assert isinstance(select_backend("portable", "Ascend", "float16", 64), PortableBackend)
    with pytest.raises(ValueError, match="the Ascend kernels take float16 or bfloat16"):
        select_backend("native", "Ascend", "float32", 64)


def test_ascend_serves_chunked_prefill_and_prefix_caching_by_default():
    """Queries over cached context run on Ascend through PagedAttention's ``q_seq_lens``
    (tests/test_ascend_chunked.py)."""
    cfg = ServingConfig.from_dict(ASCEND)
    assert cfg.chunked_prefill and cfg.prefix_caching
    assert runner_config_dict(cfg)["mixed_steps"]
