"""How many graphs an Ascend agent compiles, and its dynamic-shape graphs (``model_config.dynamic_shapes``): one
graph per step family with open input dimensions, as MindFormers and vllm-mindspore compile theirs. On CPU the
Ascend wiring runs with the stand-ins of the fused primitives (agents/model/backends/ascend_reference.py) and the
graphs export with the real ones (docs/ascend.md, "Graphs")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig, compiled_graphs
from agents.tools.contracts import check_graph
from agents.tools.export import export_graphs, export_runner
from agents.tools.mindir import read_graph
from agents.weights.checkpoints import load_weights
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import runner_config_dict
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.script_runner import ROOT

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # head_dim 64
RC = RunnerConfig(num_blocks=60, block_size=16, max_model_len=96, prefill_batch_sizes=(2,),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(2, 8), decode_block_widths=(2, 6), mixed_steps=True,
                  max_num_batched_tokens=48)


def shipped_910b(**model_config) -> RunnerConfig:
    """The runner config of configs/llama2_7b_ascend.yaml (a block count in place of auto), as the agents build it."""
    cfg = ServingConfig.from_yaml(ROOT / "configs" / "llama2_7b_ascend.yaml")
    if model_config:
        cfg = replace(cfg, model_config=replace(cfg.model_config, **model_config))
    fields = {**runner_config_dict(cfg), "num_blocks": 5000}
    fields.pop("memory_utilization", None)
    return RunnerConfig(**fields).with_decode_widths(full_width=AscendBackend.skips_padding)


def test_the_shipped_910b_config_compiles_one_graph_per_family():
    assert compiled_graphs(shipped_910b(), ragged_prefill=True) == {"ragged": 1, "mixed": 1, "decode": 1}


def test_the_shipped_910b_config_without_dynamic_shapes_compiles_a_graph_per_bucket():
    """13 prefill token buckets, 19 mixed and 5 batch x 7 width decode buckets (the count before dynamic shapes)."""
    counts = compiled_graphs(shipped_910b(dynamic_shapes=False), ragged_prefill=True)
    assert counts == {"ragged": 13, "mixed": 19, "decode": 35} and sum(counts.values()) == 67


def test_dynamic_shapes_are_on_for_ascend_and_refused_elsewhere():
    assert runner_config_dict(ServingConfig())["dynamic_shapes"] is False
    with pytest.raises(ConfigError, match="model_config.dynamic_shapes"):
        ServingConfig.from_dict({"model_config": {"dynamic_shapes": True}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("graphs"), CONFIG, seed=5, std=0.15)


def stand_in_runner(model_dir, dynamic: bool) -> ModelRunner:
    setup_device("CPU", 0)
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), replace(RC, dynamic_shapes=dynamic),
                         AscendBackend(ReferenceOps(CONFIG.head_dim)))
    runner.warmup()
    return runner


def test_one_dynamic_graph_per_family_gives_the_static_graphs_tokens(model_dir):
    """Every warm-up shape of a family runs on its one graph (one compiled phase per cell), and chunks, prefills
    and decodes give the tokens and logprobs of the graphs compiled per bucket."""
    static, dynamic = stand_in_runner(model_dir, False), stand_in_runner(model_dir, True)
    cells = {id(g): g for g in dynamic.graphs.values()}.values()
    assert all(len(set(cell._phases.values())) == 1 for cell in cells)
    assert len({p for g in static.graphs.values() for p in g._phases.values()}) == len(static.graph_shapes())
    rng = np.random.default_rng(0)
    prompts = [[CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, n - 1).tolist() for n in (5, 17, 40)]
    want = ChunkDriver(static, seed=1).generate(prompts, 6, 24, [0, 1, 2])
    got = ChunkDriver(dynamic, seed=1).generate(prompts, 6, 24, [0, 1, 2])
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_dynamic_graphs_export_once_per_family_and_pass_the_contract_check(tmp_path, model_dir, dtype):
    """Export round-trip: one MindIR per family, its inputs' dimensions open (-1), the fused primitives in it and
    every contract rule passed."""
    rc = replace(RC, dtype=dtype, device_target="Ascend", dynamic_shapes=True)
    graphs = export_graphs(export_runner(CONFIG, rc, load_weights(model_dir, CONFIG)), tmp_path)
    assert [shape[0] for shape, _ in graphs] == ["ragged", "mixed", "decode"]
    attention = {"ragged": "FlashAttentionScore", "mixed": "PagedAttention", "decode": "PagedAttention"}
    for shape, summary in graphs:
        assert summary.path.name == f"{shape[0]}_dynamic.mindir"
        assert all(-1 in info.shape for info in summary.inputs), summary.inputs
        assert summary.fused()["ReshapeAndCache"] == summary.fused()[attention[shape[0]]] == CONFIG.num_hidden_layers
        graph = read_graph(summary.path)
        assert check_graph(graph) == []
        if shape[0] == "mixed":  # one mask for every layer's PagedAttention (its input 7), built once
            assert len({node.inputs[7].name for node in graph.of("PagedAttention")}) == 1
            assert summary.ops["Greater"] == 1
