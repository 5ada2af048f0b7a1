"""The mindformers backend against the real MindFormers 1.8.0 (MindSpore 2.7.2), in its own environment:

    PY=$(bash scripts/mindformers_env.sh) && $PY -m pytest -q tests_mindformers

A tiny Llama (seeded random weights in a Hugging Face directory) is built by our backend from a MindFormers
predict YAML and exported on CPU (MindFormers' Llama calls Ascend-only kernels: on CPU it compiles and exports
but does not run). Every graph goes through the real ``LlamaForCausalLM.construct`` with the inputs our runner
builds; the MindIR files are parsed back.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.expanduser("~/.cache/llm-serving/mindformers-output"))

import mindspore as ms
from mindspore.train import mind_ir_pb2

from agents.mindformers.export import export_graphs, export_runner
from agents.mindformers.inputs import shape_arrays
from agents.mindformers.model import build_network
from agents.mindformers.runner import MindFormersRunnerConfig, MindFormersStep
from agents.tools.contracts import check_graph
from agents.tools.mindir import read_graph, read_mindir
from agents.weights.checkpoints import load_weights
from agents.weights.mindformers_names import gate_up_to_mindformers, qkv_to_mindformers, to_mindformers
from llm_serving.cli.commands.patch_mindformers import apply_patches, default_target, installed_version
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
LLAMA = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
RC = {"num_blocks": 16, "block_size": 16, "max_model_len": 64, "prefill_batch_sizes": (1, 4),
      "prefill_seq_lengths": (32,), "decode_batch_sizes": (1, 4)}


def predict_yaml(path: Path, qkv_concat: bool, **changes) -> Path:
    """A MindFormers predict YAML as their configs write it (keys our serving config owns deliberately off)."""
    mc = {"type": "LlamaConfig", "batch_size": 1, "seq_length": 4096, "hidden_size": LLAMA.hidden_size,
          "num_layers": LLAMA.num_hidden_layers, "num_heads": LLAMA.num_attention_heads,
          "n_kv_heads": LLAMA.num_key_value_heads, "vocab_size": LLAMA.vocab_size,
          "intermediate_size": LLAMA.intermediate_size, "rms_norm_eps": 1.0e-5, "bos_token_id": 1,
          "eos_token_id": 2, "pad_token_id": 0, "ignore_token_id": -100, "compute_dtype": "float16",
          "layernorm_compute_type": "float32", "softmax_compute_type": "float16", "rotary_dtype": "float16",
          "param_init_type": "float16", "use_past": True, "use_flash_attention": True, "block_size": 32,
          "num_blocks": 1024, "is_dynamic": True, "qkv_concat": qkv_concat, "theta": 10000.0,
          "checkpoint_name_or_path": "llama2_7b", **changes}
    path.write_text(yaml.safe_dump({"model": {"model_config": mc, "arch": {"type": "LlamaForCausalLM"}}}))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("model"), LLAMA, seed=3)


@pytest.fixture(scope="module")
def weights(model_dir: Path) -> dict:
    return load_weights(model_dir, LLAMA)


def test_installed_mindformers_is_the_pinned_release_with_our_patches_applied() -> None:
    target = default_target()
    assert installed_version(target) == "1.8.0"
    assert {state for _, state in apply_patches(target, check=True)} == {"applied"}


def test_fused_layouts_are_mindformers_own() -> None:
    """Our converters give what MindFormers' own HF -> MindFormers converters give."""
    from mindformers.utils.convert_utils import ffn_concat_hf2mg, qkv_concat_hf2mg

    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((LLAMA.qkv_dim, LLAMA.hidden_size)).astype(np.float32)
    np.testing.assert_array_equal(qkv_to_mindformers(qkv, LLAMA), qkv_concat_hf2mg(
        qkv, LLAMA.num_attention_heads, LLAMA.num_key_value_heads, LLAMA.hidden_size))
    gate_up = rng.standard_normal((2 * LLAMA.intermediate_size, LLAMA.hidden_size)).astype(np.float32)
    np.testing.assert_array_equal(gate_up_to_mindformers(gate_up), ffn_concat_hf2mg(gate_up, LLAMA.intermediate_size))


def parameters(path: Path) -> dict[str, np.ndarray]:
    """The weights a MindIR file holds, as float32, by the network's parameter names."""
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(path.read_bytes())
    out = {}
    for p in model.graph.parameter:
        kind = mind_ir_pb2.TensorProto.DataType.Name(p.data_type)
        raw = np.frombuffer(p.raw_data, {"FLOAT16": np.float16, "FLOAT": np.float32, "BFLOAT16": np.uint16}[kind])
        value = (raw.astype(np.uint32) << 16).view(np.float32) if kind == "BFLOAT16" else raw.astype(np.float32)
        out[p.name.rpartition(":net.")[2]] = value.reshape(tuple(p.dims))  # "<graph>:net.model.layers..."
    return out


def as_dtype(value: np.ndarray, dtype: str) -> np.ndarray:
    """``value`` rounded as MindSpore stores it in ``dtype``, back in float32."""
    return ms.Tensor(value.astype(np.float32), dtype=getattr(ms, dtype)).astype(ms.float32).asnumpy()


@pytest.mark.parametrize(("dtype", "qkv_concat"), [("float16", True), ("bfloat16", False)])
def test_export_through_our_backend(tmp_path: Path, model_dir: Path, weights: dict, dtype: str,
                                    qkv_concat: bool) -> None:
    """Every warm-up shape exports: ArgMaxWithValue in prefill and decode graphs, int32 ids and float32 logprobs
    and logits out, our four int32 inputs in, the KV write kept, and the checkpoint's weights inside."""
    rc = MindFormersRunnerConfig(**RC, dtype=dtype)
    lines: list[str] = []
    runner = export_runner(LLAMA, rc, weights, str(predict_yaml(tmp_path / "predict.yaml", qkv_concat)), lines.append)
    assert any("num_blocks 1024 -> 16" in line for line in lines)  # the serving config's cache, reported
    assert runner.net.config.qkv_concat is qkv_concat
    shapes = runner.graph_shapes()
    assert {s[0] for s in shapes} == {"ragged", "decode"}
    layers = LLAMA.num_hidden_layers
    for shape, summary in export_graphs(runner, tmp_path / "out", shapes):
        kind, count, _ = shape
        rows = count + 1 if kind == "ragged" else count  # one gathered row per sequence slot
        assert summary.ops["ArgMaxWithValue"] == 1, shape
        assert [str(t) for t in summary.outputs] == [f"int32[{rows}]", f"float32[{rows}]",
                                                     f"float32[{rows},{LLAMA.vocab_size}]"], shape
        expected = runner.warmup_inputs(shape)
        assert [(t.dtype, t.shape) for t in summary.inputs] == [("int32", a.shape) for a in expected], shape
        assert summary.ops["ReshapeAndCache"] == layers, shape
        attention = "FlashAttentionScore" if kind == "ragged" else "PagedAttention"
        assert summary.ops[attention] == layers and summary.ops["ApplyRotaryPosEmb"] == layers, shape
        # MindFormers' serving graphs, a stack that runs on 910B, meet the contracts we check ours against
        assert [str(v) for v in check_graph(read_graph(summary.path))] == [], shape
    held = parameters(summary.path)
    want = to_mindformers(weights, LLAMA, fused=qkv_concat)
    for name in ("model.layers.1.attention.w_qkv.weight" if qkv_concat else "model.layers.1.attention.wk.weight",
                 "model.layers.0.feed_forward.w_gate_hidden.weight" if qkv_concat
                 else "model.layers.0.feed_forward.w3.weight", "lm_head.weight", "model.norm_out.weight"):
        np.testing.assert_array_equal(held[name], as_dtype(want[name], dtype if held[name].ndim > 1 else "float32"),
                                      err_msg=name)


def test_without_the_switch_the_graph_returns_logits(tmp_path: Path, weights: dict) -> None:
    """The patch's switch (config.greedy_in_graph) is what puts ArgMaxWithValue in the graph."""
    rc = MindFormersRunnerConfig(**RC)
    runner = export_runner(LLAMA, rc, weights, str(predict_yaml(tmp_path / "p.yaml", True)))
    runner.net.greedy_in_graph = False
    plain = MindFormersStep(runner.net)  # a new cell, so a new compile
    runner.graph("decode")
    ms.export(plain, *[ms.Tensor(a) for a in runner.warmup_inputs(("decode", 4, 4))],
              file_name=str(tmp_path / "plain"), file_format="MINDIR")
    summary = read_mindir(tmp_path / "plain.mindir")
    assert summary.ops["ArgMaxWithValue"] == 0
    assert [str(t) for t in summary.outputs] == [f"float32[4,{LLAMA.vocab_size}]"]


def test_our_inputs_bind_to_the_real_construct(tmp_path: Path) -> None:
    from mindformers import LlamaForCausalLM

    bound = inspect.signature(LlamaForCausalLM.construct).bind(
        None, "input_ids", batch_valid_length="bvl", block_tables="tables", slot_mapping="slots")
    assert list(bound.arguments) == ["self", "input_ids", "batch_valid_length", "block_tables", "slot_mapping"]
    assert list(inspect.signature(MindFormersStep.construct).parameters)[1:] == [
        "input_ids", "batch_valid_length", "block_tables", "slot_mapping"]


def test_yaml_and_model_must_agree(tmp_path: Path) -> None:
    yaml_path = predict_yaml(tmp_path / "big.yaml", True, hidden_size=512)
    with pytest.raises(ValueError, match=r"big.yaml says hidden_size 512, the model at /m has hidden_size 256"):
        build_network(yaml_path, LLAMA, {**RC, "dtype": "float16"}, "/m")
    with pytest.raises(ValueError, match=r"model_config.model_cfg_path: .*nope.yaml does not exist"):
        build_network(tmp_path / "nope.yaml", LLAMA, {**RC, "dtype": "float16"}, "/m")


def test_runner_config_refusals() -> None:
    with pytest.raises(ValueError, match="dtype float32: MindFormers' Llama runs float16 or bfloat16"):
        MindFormersRunnerConfig(**RC, dtype="float32")
    with pytest.raises(ValueError, match="prefills whole prompts"):
        MindFormersRunnerConfig(**RC, mixed_steps=True)


def test_llm_serving_export_command(tmp_path: Path, model_dir: Path) -> None:
    """``llm-serving export`` with backend mindformers: config -> wiring -> agents.mindformers.export."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({
        "model_config": {"model_path": str(model_dir), "backend": "mindformers", "dtype": "float16",
                         "device_target": "Ascend",
                         "model_cfg_path": str(predict_yaml(tmp_path / "predict.yaml", True)),
                         "seq_length": [32], "prefill_batch_size": [1, 4], "decode_batch_size": [1, 4]},
        "pa_config": {"num_blocks": 16, "block_size": 16, "decode_seq_length": 64}}))
    out = subprocess.run([sys.executable, "-m", "llm_serving", "export", "--config", str(cfg), "--out",
                          str(tmp_path / "mindir"), "--shape", "decode:4:4", "--shape", "ragged:4:32"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("mindformers ")]
    assert len(lines) == 2
    assert "ArgMaxWithValue x1" in lines[0] and "PagedAttention x2" in lines[0]
    assert "outputs (ids, logprobs, logits) int32[4], float32[4], float32[4,512]" in lines[0]
    # input names as the MindIR records them (MindFormersStep.construct's), n named by the family's unit
    assert lines[0].startswith("mindformers decode batch=4 blocks=4: inputs input_ids=int32[4,1] "
                               "batch_valid_length=int32[4] block_tables=int32[4,4] slot_mapping=int32[4];")
    assert lines[1].startswith("mindformers ragged batch=4 tokens=32: inputs input_ids=int32[1,36] ")
    assert "FlashAttentionScore x2" in lines[1] and "int32[5], float32[5]" in lines[1]
    assert sorted(p.name for p in (tmp_path / "mindir").iterdir()) == [
        "mindformers_decode_b4_w4.mindir", "mindformers_ragged_b4_t32.mindir"]


def test_runner_plans_steps_into_warmed_shapes(tmp_path: Path, weights: dict) -> None:
    """The real runner's planner splits a step into warm-up shapes whose inputs hold every sequence (the graphs
    themselves cannot run on CPU), and refuses what no shape or the cache holds."""
    runner = export_runner(LLAMA, MindFormersRunnerConfig(**RC), weights, str(predict_yaml(tmp_path / "p.yaml", True)))
    with pytest.raises(ValueError, match="no compile cache"):
        runner.warmup(known_costs={("decode", 1, 4): 0.01})
    one = StepBatch(np.ones(1, np.int32), np.zeros(1, np.int32), np.array([16], np.int32), np.ones(1, np.int32),
                    np.ones(1, np.int32), np.ones((1, 4), np.int32))
    with pytest.raises(RuntimeError, match="was not warmed up"):  # the shared runner never compiles while serving
        runner.step(one)
    runner.warmed.update(runner.graph_shapes())
    runner.step_costs.update({s: 0.01 * (1 + s[1] * s[2] / 32) for s in runner.graph_shapes()})
    lens = np.array([30, 3, 60, 7, 9], np.int32)
    total = int(lens.sum())
    q = lens.copy()
    batch = StepBatch(np.arange(total, dtype=np.int32), np.concatenate([np.arange(n) for n in lens]).astype(
        np.int32), np.arange(16, 16 + total, dtype=np.int32), q, q.copy(), np.zeros((5, 4), np.int32))
    planned = [(g, runner.bucket_inputs(batch.take(g))[0]) for g in runner.plan(batch)]
    assert sorted(i for g, _ in planned for i in g.tolist()) == list(range(5))
    for group, shape in planned:
        assert shape in runner.graph_shapes() and shape[0] == "ragged"
        part = batch.take(group)
        ids, bvl, _, slots = shape_arrays(shape, part)
        np.testing.assert_array_equal(bvl[: len(group)], lens[group])
        np.testing.assert_array_equal(ids[0, : part.num_tokens], part.input_ids)
        np.testing.assert_array_equal(slots[: part.num_tokens], part.slot_mapping)
    ctx = np.array([3, 40, 17, 64], np.int32)
    tables = np.arange(1, 17, dtype=np.int32).reshape(4, 4) % 15 + 1
    decode = StepBatch(np.ones(4, np.int32), ctx - 1, np.array([18, 20, 30, 63], np.int32),
                       np.ones(4, np.int32), ctx, tables)
    for group in runner.plan(decode):
        shape = runner.bucket_inputs(decode.take(group))[0]
        assert shape[0] == "decode" and shape[1] >= len(group) and shape[2] * 16 >= ctx[group].max()
    runner._check_cache_indices(decode)
    decode.block_tables[1, 2] = 16  # one past the cache
    with pytest.raises(ValueError, match=r"block tables reference blocks outside the KV cache \[0, 16\)"):
        runner._check_cache_indices(decode)
    decode.context_lens[0] = 65
    with pytest.raises(ValueError, match="context length 65 exceeds the widest block table 64"):
        runner.plan(decode)
