"""Checkpoints with int8 weights (compressed-tensors W8A16, docs/quantization.md "Pre-quantized checkpoints"):
written by ``llm-serving quantize`` and by compressed-tensors' own compressor (both of its layouts), read by slices
at tensor-parallel degrees 1 and 2, served with ``quantization: w8a16`` (the numbers quantizing at load holds) and
without it (dequantized), against Hugging Face transformers loading the same directories; config.json's and the
tensors' refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from agents.runtime.device import setup_device
from agents.weights import packed as pw
from agents.weights.checkpoints import load_weights
from agents.weights.errors import WeightLoadError
from agents.weights.quantize_checkpoint import quantize_checkpoint
from agents.weights.sharded import load_rank_weights
from llm_serving.cli.main import main as cli
from llm_serving.models.default_model import ensure_default_model
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig, checkpoint_int8
from llm_serving.protocol.parallel import ShardPlan
from tests.test_fast_precision import engine_run
from tests.test_quantization import HF_PROJECTIONS, PROJECTIONS, engine_config

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def quantized_at_load(model_dir, config: LlamaConfig, plan: ShardPlan) -> dict[str, np.ndarray]:
    """What ``quantization: w8a16`` holds from a float checkpoint (tp 1 quantizes as the model packs)."""
    weights = load_rank_weights(model_dir, config, plan, quantize=True)
    for key in [k for k in weights if k.rsplit(".", 1)[-1] in PROJECTIONS]:
        if f"{key}.scale" not in weights:
            weights[key], weights[f"{key}.scale"] = pw.quantize_rows(weights[key])
    return weights


def assert_holds_quantize_at_loads_numbers(out, config: LlamaConfig, src, src_config: LlamaConfig) -> None:
    """Every rank of TP 1 and 2 reads from the int8 checkpoint ``out`` the tensors (dtypes too) that quantizing the
    float checkpoint ``src`` at load holds."""
    for tp in (1, 2):
        for rank in range(tp):
            ours = load_rank_weights(out, config, ShardPlan(config, tp, rank), quantize=True)
            ref = quantized_at_load(src, src_config, ShardPlan(src_config, tp, rank))
            assert ours.keys() == ref.keys()
            for key, value in ref.items():
                assert ours[key].dtype == value.dtype, key
                np.testing.assert_array_equal(ours[key], value, err_msg=key)


def as_bfloat16(model_dir) -> None:
    """Every tensor of ``model_dir``'s safetensors in bfloat16 (numpy has none: through torch)."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    for path in model_dir.glob("*.safetensors"):
        save_torch({k: v.to(torch.bfloat16) for k, v in load_torch(path).items()}, path, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_int8_checkpoint_holds_quantize_at_loads_numbers_at_tp_1_and_2(tmp_path, dtype):
    src = build_random_model(tmp_path / "float", CONFIG, seed=3, std=0.08, shards=3)
    if dtype == "bfloat16":
        as_bfloat16(src)
    out = quantize_checkpoint(src, tmp_path / "int8", max_shard_bytes=40_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    config = LlamaConfig.from_model_dir(out)
    assert config.int8_weights and not LlamaConfig.from_model_dir(src).int8_weights
    assert_holds_quantize_at_loads_numbers(out, config, src, CONFIG)
    # the tensors it does not quantize are copied byte for byte (bfloat16 too), the projections are int8 + scales
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    source = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in index.items():
        with safe_open(out / file, "pt") as f:
            stored = f.get_slice(name)
            if name.split(".")[-2] in HF_PROJECTIONS and name.endswith(".weight"):
                assert stored.get_dtype() == "I8"
            elif name.endswith(".weight_scale"):
                assert stored.get_dtype() == "F32" and len(stored.get_shape()) == 2
            else:
                with safe_open(src / source[name], "pt") as g:
                    assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name
    # served without quantization: the dequantized weights; the float-only loader says where int8 is read
    floats = load_rank_weights(out, config, ShardPlan(config, 1, 0))
    with pytest.raises(WeightLoadError, match=r"an int8 checkpoint \(config.json quantization_config\): it is read by"):
        load_weights(out, config)
    ref = quantized_at_load(src, CONFIG, ShardPlan(CONFIG, 1, 0))
    np.testing.assert_array_equal(floats["layers.1.w_down"], pw.dequantize_rows(ref["layers.1.w_down"],
                                                                                ref["layers.1.w_down.scale"]))


@pytest.mark.parametrize("family", [{"architecture": "Qwen2ForCausalLM"},  # q/k/v biases stay float
                                    {"architecture": "Qwen3ForCausalLM", "explicit_head_dim": 32,
                                         "tie_word_embeddings": True},  # head norms; no lm_head tensor
                                    {"architecture": "MistralForCausalLM"}])
def test_other_families_int8_checkpoints_hold_quantize_at_loads_numbers(tmp_path, family):
    config = dataclasses.replace(CONFIG, **family)
    src = build_random_model(tmp_path / "float", config, seed=4, std=0.08)
    out = quantize_checkpoint(src, tmp_path / "int8")
    loaded = LlamaConfig.from_model_dir(out)
    assert loaded == dataclasses.replace(LlamaConfig.from_model_dir(src), int8_weights=True)
    assert_holds_quantize_at_loads_numbers(out, loaded, src, config)


# ---- compressed-tensors' own writer --------------------------------------------------------------------------
def compressed_tensors_checkpoint(src, out, layout: str):
    """``src`` quantized by compressed-tensors (W8A16: int8, symmetric, per channel; its own scale rule, max / 127.5,
    so values reach -128) and saved by transformers in ``layout``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int",
                                                                             strategy="channel", symmetric=True))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            module.weight_scale.data = module.weight.data.abs().amax(1, keepdim=True) / 127.5
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=layout)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in ("tokenizer.model", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def hf_dequantized(model_dir):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    setup_device("CPU")
    data_dir = tmp_path_factory.mktemp("int8_ckpt")
    cfg = engine_config(data_dir, "w8a16")
    src = ensure_default_model(cfg.default_model, cfg.max_model_len)
    dirs = {"ours": quantize_checkpoint(src, data_dir / "ours"),
            **{layout: compressed_tensors_checkpoint(src, data_dir / layout, layout)
               for layout in ("int-quantized", "pack-quantized")}}
    runs = {"float_w8a16": engine_run(cfg),
            "ours_w8a16": engine_run(engine_config(data_dir, "w8a16", model_path=dirs["ours"])),
            "ours_none": engine_run(engine_config(data_dir, "none", model_path=dirs["ours"])),
            "pack_w8a16_tp2": engine_run(engine_config(data_dir, "w8a16", tp=2, model_path=dirs["pack-quantized"])),
            "pack_none": engine_run(engine_config(data_dir, "none", model_path=dirs["pack-quantized"]))}
    return runs, dirs


def test_serving_our_int8_checkpoint_is_quantizing_at_load(served):
    """Tokens and logits bit for bit: the same int8 numbers; without quantization, the dequantized float model,
    which the int8 projections compute bit for bit (tests/test_quantization.py)."""
    runs, _ = served
    for name in ("ours_w8a16", "ours_none"):
        for ours, ref in zip(runs[name], runs["float_w8a16"]):
            assert ours.token_ids == ref.token_ids
            np.testing.assert_array_equal(ours.logits, ref.logits)


def engine_prompts() -> list[list[int]]:
    rng = np.random.default_rng(8)  # tests.test_fast_precision.engine_run's prompts
    shared = [1] + rng.integers(3, 998, 39).tolist()
    return [shared + [5, 6], shared + [7]] + [[1] + rng.integers(3, 998, n).tolist() for n in (3, 17, 33, 50)]


@pytest.mark.parametrize("checkpoint,runs_", [("ours", ["ours_w8a16"]),
                                              ("int-quantized", ["pack_w8a16_tp2", "pack_none"]),
                                              ("pack-quantized", ["pack_w8a16_tp2", "pack_none"])])
def test_served_int8_checkpoints_give_hugging_faces_greedy_on_them(served, checkpoint, runs_):
    """Hugging Face transformers (with compressed-tensors) loading the same directory, dequantized. Our runs of
    compressed-tensors' int-quantized layout are its pack-quantized layout's: both hold the same values
    (test_compressed_tensors_layouts_read_as_its_values), so one of them is served (TP 2 at its own numbers, TP 1
    dequantized); our checkpoint's TP 2 slices are checked against quantizing at load above."""
    from tests.hf_reference import hf_greedy

    runs, dirs = served
    hf = hf_dequantized(dirs[checkpoint])
    expected = [hf_greedy(hf, prompt, 12)[0] for prompt in engine_prompts()]
    for name in runs_:
        assert [r.token_ids for r in runs[name]] == expected, name


def test_compressed_tensors_layouts_read_as_its_values(served):
    """Both layouts give compressed-tensors' int8 values (the packed words unpacked) and scales as stored."""
    _, dirs = served
    config = LlamaConfig.from_model_dir(dirs["pack-quantized"])
    packed = load_rank_weights(dirs["pack-quantized"], config, ShardPlan(config, 1, 0), quantize=True)
    plain = load_rank_weights(dirs["int-quantized"], config, ShardPlan(config, 1, 0), quantize=True)
    stored = load_file(dirs["int-quantized"] / "model.safetensors")
    q = stored["model.layers.1.mlp.down_proj.weight"]
    assert q.dtype == np.int8 and q.min() == -128
    np.testing.assert_array_equal(packed["layers.1.w_down"], q)
    np.testing.assert_array_equal(packed["layers.1.w_down.scale"],
                                  stored["model.layers.1.mlp.down_proj.weight_scale"].reshape(-1))
    for key, value in plain.items():
        np.testing.assert_array_equal(packed[key], value, err_msg=key)
    # slices that start and end inside a packed word (cuts of other TP degrees and head sizes)
    from agents.weights.int8_checkpoint import Int8Slices
    from agents.weights.sharded import open_source

    words = Int8Slices(open_source(dirs["pack-quantized"])[0])
    name = "model.layers.1.mlp.down_proj.weight"
    for rows, cols in (((3, 17), (1, 2)), (None, (3, 70)), ((0, 5), (157, 160)), (None, None)):
        lo, hi = cols or (0, q.shape[1])
        r0, r1 = rows or (0, q.shape[0])
        np.testing.assert_array_equal(words.read_int8(name, rows, cols), q[r0:r1, lo:hi])


# ---- refusals ------------------------------------------------------------------------------------------------
W8A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                          "symmetric": True, "strategy": "channel",
                                                                          "dynamic": False, "group_size": None}}}}


def with_weights(**fields) -> dict:
    scheme = W8A16["config_groups"]["group_0"]
    return {**W8A16, "config_groups": {"group_0": {**scheme, "weights": {**scheme["weights"], **fields}}}}


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, r"quantization_config.quant_method: 'gptq' is not served"),
    ({**W8A16, "format": "float-quantized"}, r"quantization_config.format: 'float-quantized'"),
    ({**W8A16, "kv_cache_scheme": {"num_bits": 8}}, r"quantization_config.kv_cache_scheme"),
    (with_weights(num_bits=4), r"group_0.weights.num_bits: 4 is not served \(only 8\)"),
    (with_weights(strategy="group", group_size=128), r"group_0.weights.strategy: 'group' is not served"),
    (with_weights(symmetric=False), r"group_0.weights.symmetric: False"),
    (with_weights(type="float"), r"group_0.weights.type: 'float'"),
    ({**W8A16, "config_groups": {"group_0": {**W8A16["config_groups"]["group_0"],
                                             "input_activations": {"num_bits": 8}}}},
     r"group_0.input_activations: quantized activations are not served"),
    ({**W8A16, "config_groups": {}}, r"quantization_config.config_groups"),
    ("int8", r"quantization_config: expected a mapping"),
])
def test_config_json_quantizations_other_than_w8a16_are_refused_by_key(qc, match):
    with pytest.raises(ModelConfigError, match=match) as refused:
        checkpoint_int8({"quantization_config": qc}, "cfg.json")
    assert str(refused.value).startswith("cfg.json: quantization_config")
    assert checkpoint_int8({"quantization_config": W8A16}, "cfg.json") and not checkpoint_int8({}, "cfg.json")


@pytest.fixture()
def int8_dir(tmp_path):
    return quantize_checkpoint(build_random_model(tmp_path / "float", CONFIG, seed=3), tmp_path / "int8")


def rewrite(model_dir, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change,match", [
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": np.ones((160, 2), np.float32)}),
     r"'model.layers.0.mlp.up_proj.weight_scale' has shape \(160, 2\): only one scale per output channel"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_zero_point": np.ones((160, 1), np.int8)}),
     r"weight_zero_point' is not zero: asymmetric int8 weights are not served"),
    (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"),
     r"'model.layers.1.self_attn.o_proj.weight_scale' has no int8 weight"),
    (lambda t: t.update({"model.layers.1.self_attn.o_proj.weight_g_idx": np.zeros(64, np.int32)}),
     r"weight_g_idx"),
])
def test_tensors_the_layout_does_not_serve_are_refused_by_name(int8_dir, change, match):
    rewrite(int8_dir, change)
    config = LlamaConfig.from_model_dir(int8_dir)
    with pytest.raises(WeightLoadError, match=match):
        load_rank_weights(int8_dir, config, ShardPlan(config, 1, 0), quantize=True)


def test_an_unpacked_shape_the_words_cannot_hold_is_refused(tmp_path):
    src = build_random_model(tmp_path / "float", CONFIG, seed=3)
    out = tmp_path / "packed"
    out.mkdir()
    shutil.copyfile(src / "config.json", out / "config.json")
    tensors = load_file(src / "model.safetensors")
    _, scale = pw.quantize_rows(tensors.pop("model.layers.0.mlp.down_proj.weight"))
    tensors["model.layers.0.mlp.down_proj.weight_packed"] = np.zeros((64, 39), np.int32)  # 160 values need 40
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = np.array([64, 160], np.int64)
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = scale.reshape(-1, 1)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": W8A16}))
    config = LlamaConfig.from_model_dir(out)
    with pytest.raises(WeightLoadError, match=r"weight_packed' has shape \(64, 39\), which does not hold 8-bit "
                                              r"values of shape \(64, 160\)"):
        load_rank_weights(out, config, ShardPlan(config, 1, 0), quantize=True)


def test_quantize_command_errors_are_one_line(tmp_path, capsys):
    src = build_random_model(tmp_path / "float", CONFIG, seed=3)
    assert cli(["quantize", "--model", str(src), "--out", str(src)]) == 2
    assert "goes to another directory than its source" in capsys.readouterr().err
    assert cli(["quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli(["quantize", "--model", str(src), "--out", str(tmp_path / "int8")]) == 0
    assert cli(["quantize", "--model", str(tmp_path / "int8"), "--out", str(tmp_path / "again")]) == 2
    assert "int8 already" in capsys.readouterr().err
