"""``llm-serving preflight`` and the verdict the master follows (``model_config.ascend_preflight``).

1. The command end to end on the CPU stand-ins (``--device CPU``, as CI runs it): one child process per kernel
   selection, every check passes, the verdict file says so (the stand-ins read no selection: on an NPU the
   selections differ, here they must all pass).
2. Verdicts written by hand steer the resolved agent settings: the kernel selection (and so the export's
   ``--check`` kernel default), the int8 KV direction; a failed feature is refused naming it; a key set in the
   config wins over the verdict, logged; files that cannot be followed are refused naming the key and the file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from agents.tools.contracts import selected_paged_attention
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import runner_config_dict
from llm_serving.protocol.preflight_verdict import SELECTIONS, VERDICT_VERSION, Verdict, read_verdict
from tests.script_runner import ROOT

ASCEND = {"device_target": "Ascend", "dtype": "float16"}
KERNEL_LIST = "MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST"


def preflight(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving", "preflight", "--device", "CPU", *args],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf")})


def test_preflight_on_the_stand_ins_passes_every_check_and_writes_the_verdict(tmp_path):
    """Two of the selections (the stand-ins read none, so a third would repeat the same computation; the suite's
    time is short): each its own child, every check, the verdict."""
    out = tmp_path / "verdict.json"
    res = preflight(tmp_path, "--out", str(out), "--graphs", "--selections", "custom,atb")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    checks = [line for line in lines if line[:4] in ("PASS", "FAIL")]
    assert checks and all(line.startswith("PASS") for line in checks), "\n".join(checks)
    # per selection: 13 op outputs (3 of them the MoE kernels', one over int8 experts), then per model (one layer,
    # two) prefill, chunks, decode and the graph call
    assert len(checks) == 2 * (13 + 2 * 4)
    assert sum("MoE routed experts" in line for line in checks) == 3 * 2
    assert sum(line.startswith("SAME") for line in lines) == 2  # one int8 direction each
    assert [line.split()[1] for line in lines if line.startswith("== ")][:2] == ["atb:", "custom:"]  # in order
    verdict = read_verdict(out)
    assert verdict.version == VERDICT_VERSION and verdict.device == "CPU" and verdict.mindspore.startswith("2.")
    assert verdict.paged_attention == ["atb", "custom"] and set(verdict.selections) == {"atb", "custom"}
    assert verdict.int8_kv_direction == "multiply"  # the stand-in's (ReferenceOps' default)
    assert verdict.model_reference == "transformers"  # the test extra is installed here
    assert set(verdict.compile_seconds) == {"ragged", "mixed", "decode"}
    assert all(seconds > 0 for seconds in verdict.compile_seconds.values())
    assert f"model_config.ascend_preflight: {out}" in res.stdout
    assert json.loads(out.read_text())["int8_kv_direction"] == "multiply"


def test_an_unknown_selection_is_refused_naming_the_known_ones(tmp_path):
    res = preflight(tmp_path, "--out", str(tmp_path / "v.json"), "--selections", "atb,nope")
    assert res.returncode != 0 and "--selections 'atb,nope'" in res.stderr and "atb-fa-other" in res.stderr
    assert not (tmp_path / "v.json").exists()


# ---- 2. the verdict steers -----------------------------------------------------------------------------------
def write_verdict(path, passed: dict[str, bool], directions: dict[str, str | None] | None = None) -> str:
    directions = directions or {}
    selections = {s.name: {"disable_custom_kernels": s.disable_custom_kernels, "passed": passed.get(s.name, False),
                           "int8_kv_direction": directions.get(s.name, "multiply"),
                           "checks": [{"name": "PagedAttention decode", "passed": passed.get(s.name, False),
                                       "max_error": 0.5, "tolerance": "0.02"}]}
                  for s in SELECTIONS}
    Verdict("2.10.0", "Ascend", "2026-11-28T10:00:00+00:00", "transformers", selections).write(path)
    return str(path)


def config(verdict: str, **keys) -> ServingConfig:
    return ServingConfig.from_dict({"model_config": {**ASCEND, "ascend_preflight": verdict, **keys}})


def test_without_a_verdict_the_stacks_selection_and_no_int8(tmp_path):
    fields = runner_config_dict(ServingConfig.from_dict({"model_config": ASCEND}))
    assert fields["device_environment"][KERNEL_LIST] == "PagedAttention"
    assert selected_paged_attention(None, fields) == "atb"
    with pytest.raises(ConfigError) as exc:
        ServingConfig.from_dict({"model_config": {**ASCEND, "kv_cache_dtype": "int8"}})
    assert exc.value.key == "model_config.ascend_int8_kv_direction"


def test_a_verdict_where_atb_failed_and_custom_passed_serves_the_custom_kernel(tmp_path):
    verdict = write_verdict(tmp_path / "v.json", {"atb": True, "custom": True})
    assert runner_config_dict(config(verdict))["device_environment"][KERNEL_LIST] == "PagedAttention"
    flipped = write_verdict(tmp_path / "flipped.json", {"atb": False, "custom": True})
    fields = runner_config_dict(config(flipped))
    assert fields["device_environment"][KERNEL_LIST] == ""
    assert selected_paged_attention(None, fields) == "custom"  # export --check's kernel default follows
    vllm = write_verdict(tmp_path / "vllm.json", {"atb-fa-other": True})
    assert runner_config_dict(config(vllm))["device_environment"][KERNEL_LIST] == "FlashAttentionScore,PagedAttention"


def test_the_int8_direction_comes_from_the_selection_served(tmp_path):
    verdict = write_verdict(tmp_path / "v.json", {"atb": False, "custom": True},
                            {"atb": "multiply", "custom": "reciprocal"})
    fields = runner_config_dict(config(verdict, kv_cache_dtype="int8"))
    assert fields["int8_kv_direction"] == "reciprocal"
    assert runner_config_dict(config(verdict))["int8_kv_direction"] is None  # no int8 cache, no direction


def test_a_failed_feature_is_refused_naming_it(tmp_path):
    neither = write_verdict(tmp_path / "neither.json", {"atb": True}, {"atb": None})
    with pytest.raises(ConfigError) as exc:
        runner_config_dict(config(neither, kv_cache_dtype="int8"))
    assert exc.value.key == "model_config.kv_cache_dtype"
    assert "int8 on Ascend is refused" in str(exc.value) and neither in str(exc.value)
    assert "matched neither antiquant direction" in str(exc.value)
    runner_config_dict(config(neither))  # the cache in float16 serves
    failed = write_verdict(tmp_path / "failed.json", {})
    with pytest.raises(ConfigError) as exc:
        runner_config_dict(config(failed))
    assert exc.value.key == "model_config.ascend_preflight"
    assert "no kernel selection passed its preflight" in str(exc.value) and failed in str(exc.value)
    assert "atb: PagedAttention decode" in str(exc.value)  # the failed check, named


def test_a_failed_optional_kernel_refuses_its_feature_not_the_selection(tmp_path):
    path = tmp_path / "v.json"
    write_verdict(path, {"atb": True})
    data = json.loads(path.read_text())
    data["selections"]["atb"]["checks"].append({"name": "WeightQuantBatchMatmul", "passed": False, "max_error": 3.0,
                                                "tolerance": "0.02"})
    path.write_text(json.dumps(data))
    assert runner_config_dict(config(str(path)))["device_environment"][KERNEL_LIST] == "PagedAttention"
    with pytest.raises(ConfigError) as exc:
        runner_config_dict(config(str(path), quantization="w8a16"))
    assert exc.value.key == "model_config.quantization" and "WeightQuantBatchMatmul" in str(exc.value)


def test_config_keys_win_over_the_verdict_and_say_so(tmp_path, caplog):
    verdict = write_verdict(tmp_path / "v.json", {"atb": True, "custom": False}, {"atb": "multiply"})
    with caplog.at_level(logging.WARNING, logger="llm_serving.engine.ascend_settings"):
        fields = runner_config_dict(config(verdict, ascend_disable_custom_kernels="", kv_cache_dtype="int8",
                                           ascend_int8_kv_direction="reciprocal"))
    assert fields["device_environment"][KERNEL_LIST] == "" and fields["int8_kv_direction"] == "reciprocal"
    logged = caplog.text
    assert "model_config.ascend_disable_custom_kernels '' wins over the preflight verdict" in logged
    assert "model_config.ascend_int8_kv_direction reciprocal wins over the preflight verdict" in logged


@pytest.mark.parametrize("content,reason", [
    (None, "no such file"),
    ("{not json", "unreadable JSON"),
    (json.dumps({"version": VERDICT_VERSION + 1}), f"verdict version {VERDICT_VERSION + 1}"),
    (json.dumps({"version": VERDICT_VERSION, "device": "Ascend"}), "malformed verdict"),
    (json.dumps({"version": VERDICT_VERSION, "mindspore": "2.10.0", "device": "Ascend", "date": "d",
                 "model_reference": "numpy", "selections": {"atb": {"passed": True, "int8_kv_direction": "up"}}}),
     "int8_kv_direction 'up'"),
])
def test_a_verdict_that_cannot_be_followed_is_refused_naming_key_and_file(tmp_path, content, reason):
    path = tmp_path / "verdict.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        runner_config_dict(config(str(path)))
    assert exc.value.key == "model_config.ascend_preflight"
    assert str(path) in str(exc.value) and reason in str(exc.value)


def test_the_verdict_key_is_refused_on_cpu(tmp_path):
    with pytest.raises(ConfigError) as exc:
        ServingConfig.from_dict({"model_config": {"ascend_preflight": str(tmp_path / "v.json")}})
    assert exc.value.key == "model_config.ascend_preflight"


def test_the_configured_models_graphs_are_timed_without_following_a_verdict(tmp_path):
    """``--graphs --config``: the spec the child compiles is the config's (its buckets, device, model), even where
    the config already names a verdict that does not exist yet and asks for int8 KV on its strength."""
    import argparse

    from llm_serving.cli.commands.preflight import configured_spec
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.wire import AgentSpec

    model = build_random_model(tmp_path / "llama", LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512))
    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"model_config:\n  device_target: Ascend\n  dtype: float16\n  kv_cache_dtype: int8\n"
                    f"  ascend_preflight: {tmp_path / 'not-yet.json'}\n  decode_batch_size: [1, 16]\n"
                    f"  model_path: {model}\n")
    spec = AgentSpec.from_json(configured_spec(argparse.Namespace(config=str(yaml), model=None)))
    assert spec.runner_config["device_target"] == "Ascend" and spec.runner_config["decode_batch_sizes"] == [1, 16]
    assert spec.model_path == str(model)
    assert configured_spec(argparse.Namespace(config=None, model=None)) is None  # the small model's


def test_graphs_of_a_cpu_config_are_refused(tmp_path):
    import argparse

    from llm_serving.cli.commands.preflight import configured_spec
    from llm_serving.cli.options import CliError

    yaml = tmp_path / "cpu.yaml"
    yaml.write_text("model_config:\n  device_target: CPU\n")
    with pytest.raises(CliError, match="preflight times the graphs of an Ascend config"):
        configured_spec(argparse.Namespace(config=str(yaml), model=None))
