"""The Ascend graphs as MindSpore builds them, checked on CPU by export (``agents.tools.export``,
``llm-serving export``).

Export runs MindSpore's front end (type and shape inference, pruning) on graphs whose kernels exist only on the
NPU. Every warm-up shape of a small Ascend config is exported in float16 and bfloat16, its MindIR parsed, and the
fused primitives and outputs checked; misconfigurations that export would refuse get our error first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mindspore import ops

from agents.model.backends.ascend import AscendAttention, AscendBackend, FusedOps
from agents.runtime.graph_family import by_graph, warmup_shapes_of
from agents.runtime.runner import RunnerConfig, graph_families, warmup_shapes
from agents.tools.contracts import check_graph
from agents.tools.export import export_graphs, export_runner
from agents.tools.mindir import FUSED_PRIMITIVES, TensorInfo, graph_file_name, read_graph, read_mindir
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.script_runner import ROOT

LAYERS = 2
CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=LAYERS,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # head_dim 64


def runner_config(dtype: str, **overrides) -> RunnerConfig:
    """Prefill in ragged buckets of 32, 48 and 64 tokens (two prompts), decode batches of 1 and 4."""
    base = {"num_blocks": 40, "block_size": 16, "max_model_len": 64, "prefill_batch_sizes": (2,),
            "prefill_seq_lengths": (32,), "decode_batch_sizes": (1, 4), "dtype": dtype, "device_target": "Ascend"}
    return RunnerConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return load_weights(build_random_model(tmp_path_factory.mktemp("llama"), CONFIG, seed=3, std=0.2), CONFIG)


def runner(weights, rc: RunnerConfig, backend=None, config: LlamaConfig = CONFIG):
    return export_runner(config, rc, weights, backend)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def exported(request, weights, tmp_path_factory):
    """Every warm-up shape of the config, exported."""
    rc = runner_config(request.param)
    return request.param, rc, export_graphs(runner(weights, rc), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(("ragged", "expected"), [
    (True, ["ragged_b2_t32", "ragged_b2_t48", "ragged_b2_t64", "mixed_b4_m16", "mixed_b4_m24", "mixed_b4_m32",
            "mixed_b4_m48", "mixed_b4_m64", "verify_b4_v16", "decode_b1_w4", "decode_b4_w4"]),
    (False, ["prefill_b2_s32", "prefill_b1_s64", "chunk_b2_c32", "chunk_b1_c64", "verify_b4_v16", "decode_b1_w4",
             "decode_b4_w4"])])
def test_every_warmup_shape_of_every_family_gets_a_file_of_its_own(ragged, expected):
    """Export names each file by its graph family (``GraphFamily.tag``; no table of the exporter's own): every
    shape of every family, mixed, chunk and verify steps included, in warm-up order, under the names deployments
    know."""
    rc = runner_config("float16", mixed_steps=True, verify_tokens=3).with_decode_widths(full_width=False)
    families = graph_families(rc, ragged)
    tags = {graph: family.tag for graph, family in by_graph(families).items()}
    assert [graph_file_name(shape, tags[shape[0]]) for shape in warmup_shapes_of(families)] == expected


def test_every_warmup_shape_exports_with_the_fused_primitives_and_greedy_outputs(exported):
    dtype, rc, graphs = exported
    assert [shape for shape, _ in graphs] == warmup_shapes(rc.with_decode_widths(full_width=False), ragged_prefill=True)
    assert {kind for (kind, _, _), _ in graphs} == {"ragged", "decode"}
    heads, head_dim = CONFIG.num_attention_heads, CONFIG.head_dim
    for (kind, batch, n), graph in graphs:
        decode = kind == "decode"
        tokens = batch if decode else n
        assert graph.fused() == {
            "ReshapeAndCache": LAYERS,  # kept in prefill and decode: the query depends on the write
            **({"PagedAttention": LAYERS} if decode else {"FlashAttentionScore": LAYERS}),
            "ApplyRotaryPosEmb": LAYERS, "RmsNorm": 2 * LAYERS + 1, "Swiglu": LAYERS, "ArgMaxWithValue": 1,
        }, (kind, batch, n)
        assert graph.outputs == (TensorInfo("int32", (batch,)), TensorInfo("float32", (batch,)),
                                 TensorInfo("float32", (batch, CONFIG.vocab_size)))
        assert graph.inputs[0] == TensorInfo("int32", (tokens,))
        assert graph.inputs[4] == TensorInfo("int32", (batch, n if decode else 1))  # block tables
        assert graph.op_outputs["ReshapeAndCache"][0] == TensorInfo(dtype, (tokens, CONFIG.kv_dim))
        if decode:
            assert graph.op_outputs["PagedAttention"] == (TensorInfo(dtype, (batch, heads, head_dim)),)
        else:  # the bucket plus one appended row per sequence slot
            assert graph.op_outputs["FlashAttentionScore"][3] == TensorInfo(dtype, (n + batch, CONFIG.hidden_size))
        assert graph.op_outputs["ArgMaxWithValue"][1] == TensorInfo("float32", (batch,))
        assert [str(v) for v in check_graph(read_graph(graph.path))] == [], (kind, batch, n)  # export --check


def test_each_layer_writes_and_reads_its_own_cache_parameters(exported):
    """Traced node by node (``read_graph``): every layer's ReshapeAndCache writes that layer's two cache
    Parameters at the graph input ``slot_mapping``, and in decode its PagedAttention reads the same two, in the same
    order, through the graph input ``block_tables``, with the config's head counts."""
    _, _, graphs = exported
    for (kind, _, _), summary in graphs:
        graph = read_graph(summary.path)
        writes = graph.of("ReshapeAndCache")
        caches = [tuple(s.name for s in w.inputs[2:4]) for w in writes]
        assert caches == [(f"model.layers.{i}.attention.key_cache", f"model.layers.{i}.attention.value_cache")
                          for i in range(LAYERS)], kind
        assert all(w.inputs[2].kind == w.inputs[3].kind == "parameter" for w in writes)
        assert all((w.inputs[4].kind, w.inputs[4].name) == ("input", "slot_mapping") for w in writes)
        if kind != "decode":
            continue
        for attend, cache in zip(graph.of("PagedAttention"), caches):
            assert tuple(s.name for s in attend.inputs[1:3]) == cache
            assert (attend.inputs[3].kind, attend.inputs[3].name) == ("input", "block_tables")
            constants = [s.value for s in attend.inputs if s.kind == "constant"]
            assert constants[5:8] == [CONFIG.num_attention_heads, pytest.approx(CONFIG.head_dim ** -0.5),
                                      CONFIG.num_key_value_heads]


class WriteOrderedOnlyInPrefill(AscendAttention):
    """The pitfall in the notes: the cache write's result consumed only on the prefill path. MindSpore then
    drops the write from decode graphs, silently (the decode output does not depend on it)."""

    def construct(self, qkv, cos, sin, slot_mapping, lens, block_tables, is_prefill):
        q, k = self.rope(qkv[:, : self.hidden], qkv[:, self.hidden: self.hidden + self.kv_dim], cos, sin, lens)
        v = qkv[:, self.hidden + self.kv_dim:]
        written = self.cache_write(k, v, self.key_cache, self.value_cache, slot_mapping)
        if is_prefill:
            return self.prefill(ops.depend(q, written), k, v, lens)
        return self.decode(q, block_tables, lens)


class PitfallBackend(AscendBackend):
    def attention(self, config, num_blocks, block_size, dtype):
        return WriteOrderedOnlyInPrefill(config, num_blocks, block_size, dtype, FusedOps())


def test_the_cache_write_count_catches_the_pruning_pitfall(weights, tmp_path):
    """Why the test above counts ReshapeAndCache in decode graphs too."""
    ((_, graph),) = export_graphs(runner(weights, runner_config("float16"), PitfallBackend()), tmp_path,
                                  [("decode", 4, 4)])
    assert "ReshapeAndCache" not in graph.fused() and graph.fused()["PagedAttention"] == LAYERS


def test_float32_on_ascend_is_our_error_before_mindspore_export_refuses_it(weights, tmp_path):
    with pytest.raises(ValueError, match="model_config.dtype float32 is not served on Ascend"):
        runner_config("float32")
    rc = runner_config("float32", device_target="CPU")  # past our checks: export itself refuses the graph
    with pytest.raises((TypeError, RuntimeError, ValueError), match=r"Tensor\[BFloat16\], Tensor\[Float16\]"):
        export_graphs(runner(weights, rc, AscendBackend()), tmp_path, [("decode", 1, 4)])


def test_kernel_limits_that_export_does_not_check_are_ours(tmp_path):
    """head_dim 24 exports (MindSpore checks no head size), but the kernels MindSpore ships refuse it."""
    odd = LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 96})
    odd_weights = load_weights(build_random_model(tmp_path / "odd", odd, seed=3), odd)
    rc = runner_config("float16")
    with pytest.raises(ValueError, match="head_dim 24 must be one of 64, 128, 256"):
        runner(odd_weights, rc, config=odd)

    class Unchecked(AscendBackend):
        def check(self, *args) -> None:
            pass

    ((_, graph),) = export_graphs(runner(odd_weights, rc, Unchecked(), odd), tmp_path, [("decode", 1, 4)])
    assert graph.fused()["PagedAttention"] == LAYERS
    found = [str(v) for v in check_graph(read_graph(graph.path))]  # export --check refuses the graph too
    assert found and all("[kernel-limits] head_dim 24 must be a multiple of 16" in v for v in found), found
    backend = AscendBackend()
    for block_size in (8, 512):
        with pytest.raises(ValueError, match=f"pa_config.block_size {block_size} must be one of 16, 32, 64, 128"):
            backend.check(CONFIG, block_size, 2)
    wide = LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 1024})  # head_dim 256
    backend.check(wide, 64, 2)
    with pytest.raises(ValueError, match="block_size 128 x head_dim 256 exceeds 16384"):
        backend.check(wide, 128, 2)
    with pytest.raises(ValueError, match="prefill_batch_size 2000 exceeds 1024"):
        backend.check(CONFIG, 16, 2000)


# ---- llm-serving export ------------------------------------------------------------------------------------
def write_config(tmp_path, model_dir, dtype="float16") -> str:
    path = tmp_path / "ascend.yaml"
    path.write_text(f"model_config:\n  model_path: {model_dir}\n  dtype: {dtype}\n  device_target: Ascend\n"
                    "  seq_length: [32]\n  prefill_batch_size: [2]\n  decode_batch_size: [1, 4]\n"
                    "pa_config:\n  num_blocks: 40\n  block_size: 16\n  decode_seq_length: 64\n"
                    # whole prompts only, so the command exports the shapes asked for quickly (mixed graphs:
                    # tests/test_ascend_chunked.py)
                    "scheduler:\n  enable_chunked_prefill: false\n  enable_prefix_caching: false\n")
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving.cli.main", "export", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)


def test_export_command_writes_and_describes_the_ascend_graphs_without_an_npu(tmp_path):
    model_dir = build_random_model(tmp_path / "llama", CONFIG, seed=3, std=0.2)
    out = tmp_path / "mindir"
    res = cli("--config", write_config(tmp_path, model_dir), "--out", str(out), "--shape", "decode:4:4",
              "--shape", "ragged:2:48")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if " -> " in line]
    assert [line.split(":")[0] for line in lines] == ["decode batch=4 blocks=4", "ragged batch=2 tokens=48"]
    assert "PagedAttention x2" in lines[0] and "FlashAttentionScore x2" in lines[1]
    for line in lines:
        assert "outputs (ids, logprobs, logits) int32[" in line and "ReshapeAndCache x2" in line
    assert sorted(p.name for p in out.iterdir()) == ["decode_b4_w4.mindir", "ragged_b2_t48.mindir"]
    assert read_mindir(out / "decode_b4_w4.mindir").fused()["ArgMaxWithValue"] == 1
    assert set(FUSED_PRIMITIVES) >= set(read_mindir(out / "ragged_b2_t48.mindir").fused())


def test_export_check_passes_our_decode_and_prefill_graphs(tmp_path):
    """``--check`` runs the contract checker on every exported graph (tests/test_ascend_contract_check.py shows each
    rule refusing a mistake; tests_mindformers shows MindFormers' serving graphs passing all of them). Both of ours
    pass: PagedAttention and FlashAttentionScore read the step's graph input ``batch_valid_length`` itself, and
    prefill passes sparse_mode 0 with the 128 x 128 causal mask in the compute dtype."""
    model_dir = build_random_model(tmp_path / "llama", CONFIG, seed=3, std=0.2)
    res = cli("--config", write_config(tmp_path, model_dir), "--out", str(tmp_path / "mindir"), "--check",
              "--shape", "decode:4:4", "--shape", "ragged:2:48")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "check decode_b4_w4.mindir: every contract rule holds" in res.stdout
    assert "check ragged_b2_t48.mindir: every contract rule holds" in res.stdout
    assert "batch_valid_length=int32[4]" in res.stdout and "batch_valid_length=int32[2]" in res.stdout


def test_export_command_refuses_misconfigurations_with_our_message(tmp_path):
    model_dir = build_random_model(tmp_path / "llama", CONFIG, seed=3, std=0.2)
    res = cli("--config", write_config(tmp_path, model_dir, "float32"), "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "model_config.dtype: float32 is not served on Ascend" in res.stderr
    odd = build_random_model(tmp_path / "odd", LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 96}), seed=3)
    res = cli("--config", write_config(tmp_path, odd), "--out", str(tmp_path / "y"), "--shape", "decode:4:4")
    assert res.returncode == 2 and "head_dim 24" in res.stderr and not (tmp_path / "y").exists()
    res = cli("--config", write_config(tmp_path, model_dir), "--out", str(tmp_path / "z"), "--shape", "decode:3:4")
    assert res.returncode == 2 and "not warm-up shapes" in res.stderr


TP_CONFIG = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=LAYERS,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)  # head_dim 64


@pytest.mark.parametrize("tp,rank", [(2, 1), (8, 7)])
def test_tensor_parallel_ranks_export_their_slice_with_the_collectives_and_pass_the_check(tmp_path, tp, rank):
    """``export --rank R`` with ``num_agents`` ranks: rank R's graphs hold its heads (at TP 8 each rank keeps one of
    the 4 kv heads), an all-reduce after the embedding and after each row-parallel projection and the greedy
    pick's all-gather over all ``tp`` ranks, in HCCL's world group; ``--check`` passes them."""
    model_dir = build_random_model(tmp_path / "llama", TP_CONFIG, seed=3, std=0.2)
    path = tmp_path / "tp.yaml"
    path.write_text(Path(write_config(tmp_path, model_dir)).read_text() + f"serving_config:\n  num_agents: {tp}\n")
    out = tmp_path / "mindir"
    res = cli("--config", str(path), "--out", str(out), "--rank", str(rank), "--check", "--shape", "decode:4:4",
              "--shape", "ragged:2:48")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert f"(rank {rank} of {tp}: its slice, with the collectives)" in res.stdout
    assert res.stdout.count("every contract rule holds") == 2
    heads, kv_heads = 8 // tp, 4 // min(tp, 4)
    for name in ("decode_b4_w4", "ragged_b2_t48"):
        graph = read_graph(out / f"{name}.mindir")
        reduces, gathers = graph.of("AllReduce"), graph.of("AllGather")
        assert len(reduces) == 2 * LAYERS + 1 and len(gathers) == 1, name
        assert {n.attrs["group"] for n in reduces + gathers} == {"hccl_world_group"}
        assert gathers[0].attrs["rank_size"] == tp
        for write in graph.of("ReshapeAndCache"):
            assert write.inputs[2].info.shape == (40 * min(tp, 4), 16, kv_heads, 64)  # the same memory, more blocks
        attention = graph.of("PagedAttention") or graph.of("FlashAttentionScore")
        assert {n.inputs[10].value for n in attention} == {heads}
    res = cli("--config", str(path), "--out", str(tmp_path / "x"), "--rank", str(tp))
    assert res.returncode == 2 and f"--rank {tp} is not a rank" in res.stderr


# ---- w8a16: int8 weights through WeightQuantBatchMatmul ------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_w8a16_graphs_multiply_every_layer_projection_by_the_weight_quant_matmul(weights, tmp_path, dtype):
    """Each layer's four projections become WeightQuantBatchMatmul over int8 [out, in] Parameters with a scale per
    output channel in the compute dtype; the lm_head stays a float MatMul; every graph passes the contract check
    (tests/test_ascend_contract_check.py shows each of its quant rules refusing a mistake)."""
    rc = runner_config(dtype, quantization="w8a16")
    for _, summary in export_graphs(runner(weights, rc), tmp_path, [("decode", 4, 4), ("ragged", 2, 48)]):
        graph = read_graph(summary.path)
        assert check_graph(graph) == [], summary.path.name
        quant = graph.of("WeightQuantBatchMatmul")
        assert len(quant) == 4 * LAYERS and len(graph.of("MatMul")) == 1  # the lm_head
        names = {n.inputs[1].name.split(".", 3)[-1] for n in quant}
        assert names == {"w_qkv.weight", "wo.weight", "w_gate_up.weight", "w_down.weight"}
        for node in quant:
            out = node.inputs[1].info.shape[0]
            assert node.inputs[1].info.dtype == "int8" and node.inputs[2].info == TensorInfo(dtype, (out,))


@pytest.mark.parametrize("int8_checkpoint", [False, True])
def test_w8a16_ranks_export_their_int8_slices_and_pass_the_check(tmp_path, int8_checkpoint):
    """From a float checkpoint (quantized at load) and from its int8 checkpoint (``llm-serving quantize``:
    bfloat16 host slices, int8 values and scales as stored)."""
    from agents.weights.quantize_checkpoint import quantize_checkpoint

    model_dir = build_random_model(tmp_path / "llama", TP_CONFIG, seed=3, std=0.2)
    if int8_checkpoint:
        model_dir = quantize_checkpoint(model_dir, tmp_path / "int8")
    path = tmp_path / "tp.yaml"
    path.write_text(Path(write_config(tmp_path, model_dir)).read_text().replace(
        "  device_target: Ascend\n", "  device_target: Ascend\n  quantization: w8a16\n")
        + "serving_config:\n  num_agents: 2\n")
    out = tmp_path / "mindir"
    res = cli("--config", str(path), "--out", str(out), "--rank", "1", "--check", "--shape", "decode:4:4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "every contract rule holds" in res.stdout
    graph = read_graph(out / "decode_b4_w4.mindir")
    shapes = {n.inputs[1].name.split(".", 3)[-1]: n.inputs[1].info.shape for n in graph.of("WeightQuantBatchMatmul")}
    assert shapes["wo.weight"] == (512, 256) and shapes["w_down.weight"] == (512, 256)  # half of each row
    assert shapes["w_gate_up.weight"] == (512, 512)
