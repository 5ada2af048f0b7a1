"""An int8 KV cache on Ascend (``kv_cache_dtype: int8``, ``device_target: Ascend``; docs/quantization.md): static
per-channel scales calibrated on this CPU (``llm-serving calibrate-kv``), K and V rounded into int8 caches before
ReshapeAndCache, PagedAttention reading them with its antiquant scale and a zero offset. Checked with the
stand-ins of the fused ops (agents/model/backends/ascend_reference.py) against the float caches, exported (with
``infer_boost`` on, which MindSpore 2.10's PagedAttention type inference requires for int8 caches) and
contract-checked, each new rule shown refusing the mistake it names."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Parameter, ops
from mindspore.common.initializer import initializer
from safetensors.numpy import save_file

from agents.model.backends.ascend import AscendAttention, AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.tools.calibrate_kv import calibrate
from agents.tools.contracts import check_graph
from agents.tools.export import export_graphs, export_runner
from agents.tools.mindir import read_graph
from agents.weights.checkpoints import load_weights
from agents.weights.errors import WeightLoadError
from agents.weights.kv_scales import HEADROOM, KV_SCALES_FILE, load_kv_scales, save_kv_scales, scales_of
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import runner_config_dict
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.ascend_env import INT8_KV_DIRECTIONS
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_block_bytes
from tests.chunk_driver import ChunkDriver
from tests.script_runner import ROOT

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # head_dim 64
RC = RunnerConfig(num_blocks=60, block_size=16, max_model_len=96, prefill_batch_sizes=(2,), prefill_seq_lengths=(48,),
                  decode_batch_sizes=(8,), decode_block_widths=(6,), mixed_steps=True, max_num_batched_tokens=24)
LENGTHS = (1, 2, 15, 17, 33, 47, 49, 80)
STEPS = 12


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, n - 1).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The float runner's greedy continuations, scales calibrated on the prompts and them (so nothing served here
    clips), and the int8 runner."""
    setup_device("CPU", 0)
    model_dir = build_random_model(tmp_path_factory.mktemp("kv8"), CONFIG, seed=5, std=0.15)
    weights = load_weights(model_dir, CONFIG)
    ops_ = AscendBackend(ReferenceOps(CONFIG.head_dim))
    float_runner = ModelRunner(CONFIG, weights, RC, ops_)
    float_runner.warmup()
    ref = ChunkDriver(float_runner, seed=0).generate(prompts(), STEPS, 24)
    absmax = calibrate(CONFIG, weights, [p + t for p, t in zip(prompts(), ref[0])])
    save_kv_scales(absmax, model_dir / KV_SCALES_FILE, 0, headroom=1.0)  # calibrated on the very text served
    scales = load_kv_scales(model_dir / KV_SCALES_FILE, CONFIG, ShardPlan(CONFIG))
    int8_rc = dataclasses.replace(RC, kv_cache_dtype="int8", int8_kv_direction="multiply")
    int8_runner = ModelRunner(CONFIG, {**weights, **scales}, int8_rc, ops_)
    int8_runner.warmup()
    return {"dir": model_dir, "weights": weights, "float": float_runner, "int8": int8_runner, "ref": ref,
            "absmax": absmax, "scales": scales}


def prefill(runner, prompt: list[int], blocks: list[int]) -> np.ndarray:
    """One prompt prefilled into ``blocks``; its cached rows ``[2, len, kv_dim]`` (keys, values) as stored."""
    n, bs = len(prompt), runner.rc.block_size
    table = np.zeros((1, 6), np.int32)
    table[0, : len(blocks)] = blocks
    slots = (table[0, np.arange(n) // bs] * bs + np.arange(n) % bs).astype(np.int32)
    runner.step(StepBatch(np.asarray(prompt, np.int32), np.arange(n, dtype=np.int32), slots,
                          np.array([n], np.int32), np.array([n], np.int32), table))
    attention = runner.model.layers[1].attention
    return np.stack([c.asnumpy().reshape(-1, CONFIG.kv_dim)[slots] for c in attention.caches()])


def test_calibration_reads_each_channels_largest_key_and_value(setup):
    """The portable CPU model's caches (what calibrate reads) hold the Ascend graphs' roped keys and values."""
    prompt = prompts(seed=3)[5]
    rows = prefill(setup["float"], prompt, [7, 8, 9])
    np.testing.assert_allclose(calibrate(CONFIG, setup["weights"], [prompt])[1], np.abs(rows).max(1), rtol=1e-6)


def test_the_int8_cache_holds_each_value_rounded_over_its_channels_scale(setup):
    prompt = prompts()[6]  # calibrated on: no value beyond its channel's largest
    held = prefill(setup["int8"], prompt, [10, 11, 12, 13])
    floats = prefill(setup["float"], prompt, [10, 11, 12, 13])
    attention = setup["int8"].model.layers[1].attention
    scale = attention.kv_scale.asnumpy().astype(np.float32)  # float16, as PagedAttention reads it
    assert held.dtype == np.int8 and np.abs(held).max() <= 127
    inverse = attention.kv_inverse.asnumpy()
    np.testing.assert_array_equal(held, np.clip(np.rint(floats * inverse[:, None]), -127, 127))
    assert (np.abs(held * scale[:, None] - floats) <= scale[:, None] * 0.5001).all()
    np.testing.assert_allclose(scale, np.float16(setup["absmax"][1] / 127), rtol=1e-3)


class DequantizedFloatCache(AscendAttention):
    """Float caches holding what the int8 cache stands for: each K and V value rounded to its channel's scale step
    (``round(x / scale) * scale``, the float16 scale), read by PagedAttention without antiquant."""

    def __init__(self, config, num_blocks, block_size, dtype, fused, kv_int8=False) -> None:
        super().__init__(config, num_blocks, block_size, dtype, fused, kv_int8=True)  # its scale Parameters
        shape = (num_blocks, block_size, self.n_kv, self.head_dim)
        self.key_cache = Parameter(initializer("zeros", shape, dtype), name="key_cache", requires_grad=False)
        self.value_cache = Parameter(initializer("zeros", shape, dtype), name="value_cache", requires_grad=False)
        self.kv_int8 = False

    def rope_and_write(self, qkv, cos, sin, slot_mapping, lens):
        q, k = self.rope(qkv[:, : self.hidden], qkv[:, self.hidden: self.hidden + self.kv_dim], cos, sin, lens)
        v = qkv[:, self.hidden + self.kv_dim:]
        k_step = self.quantized(k, 0).astype(self.dtype) * self.kv_scale[0].astype(self.dtype)
        v_step = self.quantized(v, 1).astype(self.dtype) * self.kv_scale[1].astype(self.dtype)
        written = self.cache_write(k_step, v_step, self.key_cache, self.value_cache, slot_mapping)
        return ops.depend(q, written), k, v


def test_attention_over_the_int8_cache_is_attention_over_its_dequantized_values(setup):
    """Chunks over cached context (PagedAttention with q_seq_lens) and decodes mixed, as the scheduler runs them:
    the int8 caches with PagedAttention's antiquant give the tokens and log-probabilities of float caches holding
    the dequantized values (so the scales are applied per channel, keys' and values' rows each to its cache)."""
    backend = backend_with(DequantizedFloatCache, ReferenceOps(CONFIG.head_dim))
    dequantized = ModelRunner(CONFIG, {**setup["weights"], **setup["scales"]}, RC, backend)
    dequantized.warmup()
    ref_tokens, ref_logprobs = ChunkDriver(dequantized, seed=0).generate(prompts(), STEPS, 24)
    tokens, logprobs = ChunkDriver(setup["int8"], seed=0).generate(prompts(), STEPS, 24)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.array(logprobs), np.array(ref_logprobs), atol=1e-5)


def test_greedy_on_the_int8_cache_stays_near_the_float_caches(setup):
    """Against the float caches (random weights, whose large activations make the rounding of K and V to 1/254 of
    each channel's range visible): log-probabilities of the same tokens within 0.5 until the first different token
    (measured: at most 0.33), at least half the sequences equal."""
    tokens, logprobs = ChunkDriver(setup["int8"], seed=0).generate(prompts(), STEPS, 24)
    ref_tokens, ref_logprobs = setup["ref"]
    equal = 0
    for got, lp, ref, ref_lp in zip(tokens, logprobs, ref_tokens, ref_logprobs):
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
        np.testing.assert_allclose(lp[:first], ref_lp[:first], atol=0.5)
        equal += first == len(ref)
    print(f"int8 KV cache against the float caches: {equal} of {len(LENGTHS)} sequences equal")
    assert equal >= len(LENGTHS) // 2


# ---- export and the contract rules ---------------------------------------------------------------------------------
def int8_rc(dtype: str) -> RunnerConfig:
    return dataclasses.replace(RC, dtype=dtype, device_target="Ascend", kv_cache_dtype="int8",
                               int8_kv_direction="multiply")


SHAPES = [("decode", 8, 6), ("mixed", 3, 48)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_cache_graphs_export_and_every_contract_rule_holds(setup, tmp_path, dtype):
    weights = {**setup["weights"], **setup["scales"]}
    for shape, summary in export_graphs(export_runner(CONFIG, int8_rc(dtype), weights), tmp_path, SHAPES):
        graph = read_graph(summary.path)
        assert check_graph(graph) == [], shape
        for node in graph.of("PagedAttention"):
            assert node.inputs[1].info.dtype == node.inputs[2].info.dtype == "int8"
            assert [(s.name.rsplit(".", 1)[-1], s.info.dtype, s.info.shape) for s in node.inputs[5:7]] == [
                ("kv_scale", "float16", (2, CONFIG.kv_dim)), ("kv_offset", "float16", (2, CONFIG.kv_dim))]
        for node in graph.of("ReshapeAndCache"):
            assert node.inputs[0].info.dtype == node.inputs[1].info.dtype == "int8"
        assert len(graph.of("Round")) == 2 * CONFIG.num_hidden_layers


def test_without_infer_boost_mindspore_refuses_int8_caches(setup, tmp_path, monkeypatch):
    """Why export (and the agents on Ascend, agents.runtime.device) turn infer_boost on."""
    import agents.tools.export as export_tool

    monkeypatch.setattr(export_tool, "int8_caches", lambda runner: False)
    weights = {**setup["weights"], **setup["scales"]}
    with pytest.raises(TypeError, match=r"PagedAttention\], the input type must be same"):
        export_graphs(export_runner(CONFIG, int8_rc("float16"), weights), tmp_path, SHAPES[:1])


class CastOnly(AscendAttention):
    """Truncates instead of rounding."""

    def quantized(self, x, row):
        return (x * self.kv_inverse[row]).astype(ops.dtype(self.key_cache))


class ScalesOfOneRow(AscendAttention):
    """Passes one row of scales (the keys') for both caches."""

    def attend_paged(self, q, block_tables, context_lens, mask=None, q_lens=None):
        return self.paged(q, self.key_cache, self.value_cache, block_tables, context_lens, self.kv_scale[0],
                          self.kv_offset[0], mask, q_lens)


class NoAntiquant(AscendAttention):
    """Reads the int8 caches as if they held the values themselves."""

    def attend_paged(self, q, block_tables, context_lens, mask=None, q_lens=None):
        return self.paged(q, self.key_cache, self.value_cache, block_tables, context_lens, None, None, mask, q_lens)


class QuantizesTheUnropedKey(AscendAttention):
    """Caches the key before the rotary embedding."""

    def rope_and_write(self, qkv, cos, sin, slot_mapping, lens):
        q, k = qkv[:, : self.hidden], qkv[:, self.hidden: self.hidden + self.kv_dim]
        v = qkv[:, self.hidden + self.kv_dim:]
        written = self.cache_write(self.quantized(k, 0), self.quantized(v, 1), self.key_cache, self.value_cache,
                                   slot_mapping)
        q, k = self.rope(q, k, cos, sin, lens)
        return ops.depend(q, written), k, v


def backend_with(cell: type, fused=None) -> AscendBackend:
    """The Ascend backend (``fused``: its ops, the NPU's by default) with ``cell`` as its attention."""
    class Changed(AscendBackend):
        def attention(self, config, num_blocks, block_size, dtype):
            return cell(config, num_blocks, block_size, dtype, self.fused, self.kv_cache_dtype == "int8")
    return Changed(fused)


# each a graph export accepts; tests/test_ascend_contract_check.py counts these rules as shown failing
INT8_CACHE_MISTAKES = {"cast without rounding": (CastOnly, "int8-cache-quantized"),
                       "one row of scales": (ScalesOfOneRow, "int8-cache-antiquant"),
                       "no antiquant": (NoAntiquant, "int8-cache-antiquant"),
                       "the unroped key quantized": (QuantizesTheUnropedKey, "caches-the-roped-key")}


@pytest.mark.parametrize("mistake", list(INT8_CACHE_MISTAKES))
def test_each_int8_mistake_exports_and_its_rule_refuses_it(setup, tmp_path, mistake):
    cell, rule = INT8_CACHE_MISTAKES[mistake]
    weights = {**setup["weights"], **setup["scales"]}
    ((_, summary),) = export_graphs(export_runner(CONFIG, int8_rc("float16"), weights, backend_with(cell)), tmp_path,
                                    SHAPES[:1])
    broken = {v.rule for v in check_graph(read_graph(summary.path))}
    assert rule in broken, broken


# ---- the antiquant scale's direction (model_config.ascend_int8_kv_direction) ----------------------------------------
ASCEND_INT8 = {"device_target": "Ascend", "dtype": "float16", "kv_cache_dtype": "int8"}


def test_int8_kv_on_ascend_is_refused_until_the_npu_check_names_the_direction():
    with pytest.raises(ConfigError) as exc:
        ServingConfig.from_dict({"model_config": ASCEND_INT8})
    assert exc.value.key == "model_config.ascend_int8_kv_direction"
    assert "multiplies the int8 cache by its antiquant scale or divides by it is unverified" in str(exc.value)
    assert "llm-serving preflight" in str(exc.value) and "model_config.ascend_preflight" in str(exc.value)
    for direction in INT8_KV_DIRECTIONS:
        cfg = ServingConfig.from_dict({"model_config": {**ASCEND_INT8, "ascend_int8_kv_direction": direction}})
        assert runner_config_dict(cfg)["int8_kv_direction"] == direction
    with pytest.raises(ConfigError, match="ascend_int8_kv_direction: expected one of multiply, reciprocal, got 'x'"):
        ServingConfig.from_dict({"model_config": {**ASCEND_INT8, "ascend_int8_kv_direction": "x"}})
    with pytest.raises(ConfigError, match="ascend_int8_kv_direction: applies to kv_cache_dtype int8 on Ascend only "
                       r"\(got kv_cache_dtype auto, device_target Ascend\)"):
        ServingConfig.from_dict({"model_config": {**ASCEND_INT8, "kv_cache_dtype": "auto",
                                                  "ascend_int8_kv_direction": "multiply"}})
    with pytest.raises(ConfigError, match="applies to kv_cache_dtype int8 on Ascend only"):
        ServingConfig.from_dict({"model_config": {"kv_cache_dtype": "int8", "ascend_int8_kv_direction": "multiply"}})
    with pytest.raises(ValueError, match="ascend_int8_kv_direction: expected one of multiply, reciprocal"):
        AscendBackend().with_kv_cache_dtype("int8")


def dequantized_by(direction: str, cached: np.ndarray, antiquant_scale: np.ndarray) -> np.ndarray:
    """What a PagedAttention applying its antiquant scale ``direction``'s way reads an int8 value as."""
    scale = antiquant_scale.astype(np.float32)
    return cached * scale if direction == "multiply" else cached / scale


@pytest.mark.parametrize("direction", INT8_KV_DIRECTIONS)
def test_each_direction_gives_paged_attention_the_scale_it_applies(setup, direction):
    """The graph's antiquant_scale Parameter holds the calibrated steps (multiply) or their inverses
    (reciprocal) in float16, and a value written to the cache reads back, that direction's way, within half a
    step; read the other way it does not."""
    rc = dataclasses.replace(RC, kv_cache_dtype="int8", int8_kv_direction=direction)
    backend = AscendBackend(ReferenceOps(CONFIG.head_dim, direction))
    runner = ModelRunner(CONFIG, {**setup["weights"], **setup["scales"]}, rc, backend)
    attention = runner.model.layers[1].attention
    steps = setup["scales"]["layers.1.kv_scale"]
    held = attention.kv_scale.asnumpy()
    assert held.dtype == np.float16
    np.testing.assert_array_equal(held, (steps if direction == "multiply" else 1.0 / steps).astype(np.float16))
    values = np.random.default_rng(2).uniform(-127, 127, (500, *steps.shape)).astype(np.float32) * steps
    cached = np.clip(np.rint(values * attention.kv_inverse.asnumpy()), -127, 127)
    step = dequantized_by(direction, np.ones(1, np.float32), held)
    assert (np.abs(dequantized_by(direction, cached, held) - values) <= 0.5001 * step).all()
    other = INT8_KV_DIRECTIONS[1 - INT8_KV_DIRECTIONS.index(direction)]
    assert not np.allclose(dequantized_by(other, cached, held), values, rtol=0.1)


def test_a_runner_dequantizing_the_npus_way_reads_what_the_float_caches_hold(setup):
    """End to end on the stand-in dividing by its antiquant scale: the reciprocal runner's greedy tokens stay
    near the float caches' as the multiplying one's do (test_greedy_on_the_int8_cache_stays_near_the_float_caches)
    and its first prompt's log-probabilities are those of the multiplying runner to within the float16 rounding of
    the inverted scales."""
    rc = dataclasses.replace(RC, kv_cache_dtype="int8", int8_kv_direction="reciprocal")
    backend = AscendBackend(ReferenceOps(CONFIG.head_dim, "reciprocal"))
    runner = ModelRunner(CONFIG, {**setup["weights"], **setup["scales"]}, rc, backend)
    runner.warmup()
    tokens, logprobs = ChunkDriver(runner, seed=0).generate(prompts(), STEPS, 24)
    ref_tokens, ref_logprobs = ChunkDriver(setup["int8"], seed=0).generate(prompts(), STEPS, 24)
    same = sum(t == r for t, r in zip(tokens, ref_tokens))
    print(f"reciprocal against multiply: {same} of {len(LENGTHS)} sequences equal")
    assert same >= len(LENGTHS) // 2
    first = next((i for i, (a, b) in enumerate(zip(tokens[0], ref_tokens[0])) if a != b), len(tokens[0]))
    np.testing.assert_allclose(logprobs[0][:first], ref_logprobs[0][:first], atol=0.05)


# ---- scales, memory and the commands ------------------------------------------------------------------------------
def test_the_scales_leave_headroom_above_the_calibrated_values():
    absmax = np.array([[[0.0, 1.0, 127.0]]], np.float32)
    np.testing.assert_allclose(scales_of(absmax, 1.0), [[[1e-4, 1 / 127, 1.0]]], rtol=1e-6)
    np.testing.assert_allclose(scales_of(absmax), [[[1e-4, HEADROOM / 127, HEADROOM]]], rtol=1e-6)
    assert HEADROOM == 1.25


def test_a_ranks_scales_are_its_kv_heads_channels(setup):
    whole = load_kv_scales(setup["dir"] / KV_SCALES_FILE, CONFIG, ShardPlan(CONFIG))["layers.1.kv_scale"]
    halves = [load_kv_scales(setup["dir"] / KV_SCALES_FILE, CONFIG, ShardPlan(CONFIG, 2, r))["layers.1.kv_scale"]
              for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves, axis=1), whole)


def test_scales_of_another_shape_or_none_are_refused(setup, tmp_path):
    with pytest.raises(WeightLoadError, match="llm-serving calibrate-kv --model"):
        load_kv_scales(tmp_path / KV_SCALES_FILE, CONFIG, ShardPlan(CONFIG))
    save_file({"layers.0.kv_scale": np.ones((2, 64), np.float32)}, tmp_path / KV_SCALES_FILE)
    with pytest.raises(WeightLoadError, match=r"'layers.0.kv_scale' has shape \(2, 64\), expected \(2, 128\)"):
        load_kv_scales(tmp_path / KV_SCALES_FILE, CONFIG, ShardPlan(CONFIG))


def test_an_int8_block_on_ascend_is_a_byte_a_value():
    plan = ShardPlan(CONFIG)
    assert kv_block_bytes(plan, 16, "float16", "int8", "Ascend") * 2 == kv_block_bytes(plan, 16, "float16")
    assert kv_block_bytes(plan, 16, "float32", "int8") == 2 * 2 * 16 * 2 * (64 + 4)  # CPU: a scale per row


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)


def test_calibrate_then_export_an_ascend_int8_config_with_the_check(tmp_path):
    from llm_serving.tokenization.training import train_tokenizer  # sentencepiece, from local text

    config_1000 = dataclasses.replace(CONFIG, vocab_size=1000)
    model_dir = build_random_model(tmp_path / "llama", config_1000, seed=3, std=0.15,
                                   tokenizer_model=train_tokenizer(tmp_path / "tok", vocab_size=1000))
    config = tmp_path / "kv8.yaml"
    config.write_text(f"model_config:\n  model_path: {model_dir}\n  dtype: bfloat16\n  device_target: Ascend\n"
                      "  kv_cache_dtype: int8\n  ascend_int8_kv_direction: reciprocal\n  seq_length: [32]\n"
                      "  prefill_batch_size: [2]\n"
                      "  decode_batch_size: [1, 4]\npa_config:\n  num_blocks: 40\n  block_size: 16\n"
                      "  decode_seq_length: 64\n")
    export = ("export", "--config", str(config), "--out", str(tmp_path / "mindir"), "--shape", "decode:4:4", "--check")
    res = run_cli(*export)
    assert res.returncode == 2 and "llm-serving calibrate-kv --model" in res.stderr, res.stderr[-2000:]
    res = run_cli("calibrate-kv", "--model", str(model_dir), "--windows", "4", "--window-tokens", "64")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "int8 KV cache scales from 256 tokens in 4 windows" in res.stdout
    res = run_cli(*export)
    assert res.returncode == 0 and "every contract rule holds" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    tp2 = tmp_path / "kv8_tp2.yaml"  # rank 1 of two: its kv head's channels of the scales
    tp2.write_text(config.read_text() + "serving_config:\n  num_agents: 2\n")
    res = run_cli("export", "--config", str(tp2), "--out", str(tmp_path / "tp2"), "--shape", "decode:4:4", "--rank",
                  "1", "--check")
    assert res.returncode == 0 and "every contract rule holds" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    scales = {n.inputs[5].info.shape for n in read_graph(tmp_path / "tp2" / "decode_b4_w4.mindir").of("PagedAttention")}
    assert scales == {(2, CONFIG.kv_dim // 2)}
    assert run_cli("calibrate-kv", "--model", str(model_dir), "--text", str(tmp_path / "nope.txt")).returncode == 2
    res = run_cli("calibrate-kv", "--model", str(model_dir), "--headroom", "0.5")
    assert res.returncode == 2 and "--headroom 0.5: at least 1" in res.stderr


def test_the_default_calibration_text_is_packaged():
    from llm_serving.bench.workload import DEFAULT_CORPUS

    assert Path(DEFAULT_CORPUS).is_file()
