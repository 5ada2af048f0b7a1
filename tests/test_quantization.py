"""int8 weight-only quantization (``model_config.quantization: w8a16``): the quantizer and the int8 panel layout,
the int8 projections against the float32 ones on the dequantized weights (bit for bit, both kernel builds), the
model and the whole engine (chunked prefill, prefix caching, tensor parallelism) against the float32 model on the
dequantized checkpoint and Hugging Face, the loader's tensor-parallel slices, and the configuration errors. The
measured quality and speed on the trained pair are in docs/quantization.md."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from agents.model.backends import PortableBackend
from agents.runtime import kv_budget
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights import packed as pw
from agents.weights.checkpoints import load_weights
from agents.weights.sharded import load_rank_weights
from llm_serving.config.serving_config import ServingConfig
from llm_serving.models.default_model import ensure_default_model
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_block_bytes
from tests.op_cell import OpCell, built_ops
from tests.test_fast_precision import CONFIG, RC, engine_run, teacher_forced_logits

PROJECTIONS = ("w_qkv", "wo", "w_gate_up", "w_down")
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the quantizer and the layout ------------------------------------------------------------------------------
def test_rows_are_quantized_symmetrically_to_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 50)).astype(np.float32) * np.array([[1], [10], [0.01], [1], [0], [3]], np.float32)
    q, scale = pw.quantize_rows(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and np.abs(q).max() == 127
    np.testing.assert_allclose(scale, np.abs(w).max(1) / 127, rtol=1e-6)
    assert scale[4] == 0 and not q[4].any()  # an all-zero row
    err = np.abs(pw.dequantize_rows(q, scale) - w)
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-5)).all()
    # a row-parallel slice scaled by its whole row's magnitude: the same numbers as the whole row's quantization
    part_q, part_scale = pw.quantize_rows(w[:, 10:30], np.abs(w).max(1))
    np.testing.assert_array_equal(part_q, q[:, 10:30])
    np.testing.assert_array_equal(part_scale, scale)


@pytest.mark.parametrize("out,inner,swiglu", [(40, 37, False), (64, 8, False), (1, 3, False), (40, 37, True),
                                              (2, 9, True)])
def test_int8_pack_appends_each_panels_scales_and_unpacks(out, inner, swiglu):
    w = np.random.default_rng(1).standard_normal((out, inner)).astype(np.float32)
    q, scale = pw.quantize_rows(w)
    packed = pw.pack_int8(q, scale, swiglu)
    assert packed.dtype == np.int8 and packed.shape == pw.packed_shape_int8(out, inner, swiglu)
    back_q, back_scale = pw.unpack_int8(packed, out, inner, swiglu)
    np.testing.assert_array_equal(back_q, q)
    np.testing.assert_array_equal(back_scale, scale)
    panel = packed.reshape(-1, inner + pw.SCALE_ROWS, 32)[0]
    np.testing.assert_array_equal(panel[:inner], pw.pack(q, swiglu)[:inner])  # q in the float32 panels' layout
    # then the scales of panel 0's 32 columns (outputs 0..31; SwiGLU: gate rows 0..15, then up rows 0..15)
    np.testing.assert_array_equal(np.ascontiguousarray(panel[inner:]).view(np.float32).reshape(32),
                                  pw.pack(scale.reshape(out, 1), swiglu)[0])
    assert np.ascontiguousarray(panel[inner:]).view(np.float32)[0, 0] == scale[0]


# ---- kernels ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["default", "generic"])
def ops_(request, generic_kernel_dir):
    """The kernels as built here (AVX-512), and built without AVX-512 (the plain loops: int8's portable fallback)."""
    setup_device("CPU")
    ops = built_ops(request.param, 64, generic_kernel_dir)
    if request.param == "default" and not ops.projections:
        pytest.skip("this CPU has no AVX-512")
    return ops


def quantized(w: np.ndarray, swiglu: bool = False) -> tuple[Tensor, Tensor]:
    """The int8 packed weight, and the float32 panels of the weight it stands for."""
    q, scale = pw.quantize_rows(w)
    return Tensor(pw.pack_int8(q, scale, swiglu)), Tensor(pw.pack(pw.dequantize_rows(q, scale), swiglu))


# rows: one, a partial tile, two tiles (the panel formed once into scratch), past one task's chunk; odd K
SHAPES = [(1, 37, 40), (5, 64, 72), (13, 37, 8), (130, 1100, 40)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_ops_equal_the_float32_ops_on_the_dequantized_weight(ops_, m, k, n):
    rng = np.random.default_rng(m + k)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    w_gu = rng.standard_normal((2 * n, k)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    norm_w, eps = Tensor(rng.uniform(0.5, 1.5, k).astype(np.float32)), Tensor(np.array([1e-5], np.float32))
    rows = Tensor(np.array([max(m // 2, 1)], np.int32))
    int8, deq = quantized(w)
    int8_gu, deq_gu = quantized(w_gu, swiglu=True)
    calls = [(ops_.linear(n), lambda v: (Tensor(x), v)),
             (ops_.partial_linear(n), lambda v: (Tensor(x), v, rows)),
             (ops_.residual_linear(), lambda v: (Tensor(x), v, Tensor(residual), rows)),
             (ops_.norm_linear(n), lambda v: (Tensor(x), norm_w, eps, v, rows))]
    for op, inputs in calls:
        np.testing.assert_array_equal(OpCell(op)(*inputs(int8)).asnumpy(), OpCell(op)(*inputs(deq)).asnumpy())
    swiglu = OpCell(ops_.norm_swiglu(n))
    np.testing.assert_array_equal(swiglu(Tensor(x), norm_w, eps, int8_gu, rows).asnumpy(),
                                  swiglu(Tensor(x), norm_w, eps, deq_gu, rows).asnumpy())
    got = OpCell(ops_.linear(n))(Tensor(x), int8).asnumpy()  # and near the unquantized product
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_a_wrongly_shaped_int8_weight_is_refused(ops_):
    w = np.random.default_rng(2).standard_normal((40, 37)).astype(np.float32)
    packed = pw.pack_int8(*pw.quantize_rows(w))
    with pytest.raises(RuntimeError):
        OpCell(ops_.linear(40))(Tensor(np.ones((2, 37), np.float32)), Tensor(packed[:-32]))  # scales cut off


# ---- the model -------------------------------------------------------------------------------------------------
def dequantized(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The canonical weights with the layers' projections replaced by what w8a16 holds (dequantized)."""
    return {k: pw.dequantize_rows(*pw.quantize_rows(v)) if k.rsplit(".", 1)[-1] in PROJECTIONS else v
            for k, v in weights.items()}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return load_weights(build_random_model(tmp_path_factory.mktemp("w8"), CONFIG, seed=3, std=0.08), CONFIG)


@pytest.fixture(scope="module")
def runners(weights):
    setup_device("CPU")
    out = {"w8a16": ModelRunner(CONFIG, weights, RunnerConfig(**{**RC.__dict__, "quantization": "w8a16"})),
           "dequantized": ModelRunner(CONFIG, dequantized(weights), RC),
           "exact": ModelRunner(CONFIG, weights, RC)}
    for runner in out.values():
        runner.warmup()
    return out


def test_the_layers_hold_int8_and_the_lm_head_float(runners):
    model = runners["w8a16"].model
    assert all(str(getattr(layer, name).weight.dtype) == "Int8" for layer in model.layers for name in PROJECTIONS)
    assert model.lm_head.weight.dtype == runners["exact"].model.lm_head.weight.dtype
    held = sum(getattr(layer, name).weight.nbytes for layer in model.layers for name in PROJECTIONS)
    float_held = sum(getattr(layer, name).weight.nbytes for layer in runners["exact"].model.layers
                     for name in PROJECTIONS)
    assert held < 0.27 * float_held  # a byte a weight, plus 4 bytes of scale per output row


def test_the_quantized_model_computes_the_dequantized_float_model_bit_for_bit(runners):
    ids = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 40)).astype(np.int32)
    w8 = teacher_forced_logits(runners["w8a16"], ids)
    np.testing.assert_array_equal(w8, teacher_forced_logits(runners["dequantized"], ids))
    exact = teacher_forced_logits(runners["exact"], ids)
    assert 0 < np.abs(w8 - exact).max()  # really quantized
    # a row's result does not depend on its batch
    np.testing.assert_array_equal(teacher_forced_logits(runners["w8a16"], ids[1:2])[0], w8[1])


def test_weight_bytes_count_a_byte_a_quantized_weight(weights):
    float_bytes = kv_budget.weight_bytes(weights, "float32")
    int8_bytes = kv_budget.weight_bytes(weights, "float32", quantized=True)
    projections = sum(v.size for k, v in weights.items() if k.rsplit(".", 1)[-1] in PROJECTIONS)
    rows = sum(v.shape[0] for k, v in weights.items() if k.rsplit(".", 1)[-1] in PROJECTIONS)
    assert float_bytes - int8_bytes == 3 * projections - 4 * rows


# ---- tensor-parallel slices --------------------------------------------------------------------------------------
@pytest.mark.parametrize("host_dtype", ["float32", "bfloat16"])
def test_a_ranks_slices_are_the_whole_models_quantization_cut(tmp_path, weights, host_dtype):
    """Column-parallel slices hold whole rows; a row-parallel slice (wo, w_down) is scaled by its whole rows,
    so tp 2 holds exactly the numbers tp 1 does (quantized from float32 where the rank holds bfloat16)."""
    model = build_random_model(tmp_path / "m", CONFIG, seed=3, std=0.08)
    for rank in (0, 1):
        plan = ShardPlan(CONFIG, 2, rank)
        shard = load_rank_weights(model, CONFIG, plan, host_dtype, quantize=True)
        for key in ("layers.1.wo", "layers.0.w_down"):
            q, scale = pw.quantize_rows(weights[key])
            cols = plan.attention_columns() if key.endswith("wo") else plan.ffn_range()
            np.testing.assert_array_equal(shard[key], q[:, cols[0]:cols[1]])
            np.testing.assert_array_equal(shard[f"{key}.scale"], scale)
        q, scale = pw.quantize_rows(weights["layers.0.w_gate_up"])
        lo, hi = plan.ffn_range()
        f = CONFIG.intermediate_size
        np.testing.assert_array_equal(shard["layers.0.w_gate_up"], np.concatenate([q[lo:hi], q[f + lo:f + hi]]))
        assert shard["layers.0.w_gate_up.scale"].shape == (2 * (hi - lo),)
        assert "lm_head.scale" not in shard and shard["lm_head"].dtype == (np.uint16 if host_dtype == "bfloat16"
                                                                           else np.float32)


# ---- the whole engine ------------------------------------------------------------------------------------------
ENGINE = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
          "num_kv_heads": 2, "vocab_size": 998, "seed": 5}


def engine_config(data_dir, quantization: str, tp: int = 1, model_path=None,
                  kv_cache_dtype: str = "auto") -> ServingConfig:
    """Chunked prefill (a 24-token step budget) and prefix caching on, as tests/test_fast_precision.py serves."""
    return ServingConfig.from_dict({
        "default_model": {"data_dir": str(data_dir), **ENGINE},
        "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [8],
                         "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                         **({"model_path": str(model_path)} if model_path else {})},
        "pa_config": {"num_blocks": 64, "block_size": 8, "decode_seq_length": 96},
        "serving_config": {"num_agents": tp, "agent_restart_backoff_s": 0.01},
        "scheduler": {"policy": "fcfs", "enable_chunked_prefill": True, "enable_prefix_caching": True,
                      "max_num_batched_tokens": 24}})


def dequantized_checkpoint(model_dir, out_dir):
    """A copy of an HF model directory whose layer projections are their w8a16 values (per output row, so the
    fused and the separate projections quantize alike)."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    for name, value in tensors.items():
        if name.split(".")[-2] in HF_PROJECTIONS:
            tensors[name] = pw.dequantize_rows(*pw.quantize_rows(value))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    setup_device("CPU")
    data_dir = tmp_path_factory.mktemp("w8_engine")
    cfg = engine_config(data_dir, "w8a16")
    model_dir = ensure_default_model(cfg.default_model, cfg.max_model_len)
    deq_dir = dequantized_checkpoint(model_dir, data_dir / "dequantized")
    runs = {"w8a16": engine_run(cfg), "w8a16_tp2": engine_run(engine_config(data_dir, "w8a16", tp=2)),
            "dequantized": engine_run(engine_config(data_dir, "none", model_path=deq_dir)),
            "w8a16_kv8_tp2": engine_run(engine_config(data_dir, "w8a16", tp=2, kv_cache_dtype="int8"))}
    return runs, deq_dir


def test_engine_serves_the_dequantized_models_tokens_and_logits(engine_runs):
    runs, _ = engine_runs
    for ours, ref in zip(runs["w8a16"], runs["dequantized"]):
        assert ours.token_ids == ref.token_ids
        np.testing.assert_array_equal(ours.logits, ref.logits)


def test_engine_at_tp2_gives_tp1s_tokens(engine_runs):
    """The ranks hold tp 1's int8 numbers (whole-row scales); only the order of float32 sums differs."""
    runs, _ = engine_runs
    for ours, ref in zip(runs["w8a16_tp2"], runs["w8a16"]):
        assert ours.token_ids == ref.token_ids
        np.testing.assert_allclose(ours.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())


def test_engine_with_an_int8_cache_too_stays_near_at_tp2(engine_runs):
    """int8 weights and an int8 KV cache, ranks in two processes, chunks and a prefix-cache hit (engine_run
    asserts the hit): logits on the same context within a few per cent of the float cache's."""
    runs, _ = engine_runs
    for ours, ref in zip(runs["w8a16_kv8_tp2"], runs["w8a16"]):
        assert len(ours.token_ids) == 12
        differ = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)) if a != b), 12)
        upto = min(differ + 1, 12)
        errors = np.abs(ours.logits[:upto] - ref.logits[:upto]).max(-1) / np.abs(ref.logits[:upto]).max(-1)
        assert errors.max() < 0.05
    assert sum(a.token_ids == b.token_ids for a, b in zip(runs["w8a16_kv8_tp2"], runs["w8a16"])) >= 4


def test_engine_greedy_equals_hugging_face_on_the_dequantized_checkpoint(engine_runs):
    from tests.hf_reference import hf_greedy, load_hf

    runs, deq_dir = engine_runs
    hf = load_hf(deq_dir)
    rng = np.random.default_rng(8)  # engine_run's prompts
    shared = [1] + rng.integers(3, 998, 39).tolist()
    prompts = [shared + [5, 6], shared + [7]] + [[1] + rng.integers(3, 998, n).tolist() for n in (3, 17, 33, 50)]
    for prompt, ours in zip(prompts, runs["w8a16"]):
        assert hf_greedy(hf, prompt, 12)[0] == ours.token_ids


def test_the_ascend_wiring_gives_hugging_faces_greedy_on_the_dequantized_checkpoint(tmp_path):
    """The Ascend backend's w8a16 graphs with the CPU stand-ins (WeightQuantBatchMatmul's contract: int8 [out, in]
    times a scale per output row, transposed) in float32: Hugging Face's greedy ids on the dequantized weights."""
    from agents.model.backends.ascend import AscendBackend
    from agents.model.backends.ascend_reference import ReferenceOps
    from tests.hf_reference import load_hf
    from tests.test_ascend_reference import PROMPT_LENS, STEPS, check_against_hf, prompts

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model_dir = build_random_model(tmp_path / "llama", config, seed=7, std=0.2)
    rc = RunnerConfig(num_blocks=40, block_size=16, max_model_len=64, prefill_batch_sizes=(3,),
                      prefill_seq_lengths=(32,), decode_batch_sizes=(8,), decode_block_widths=(4,),
                      quantization="w8a16")
    runner = ModelRunner(config, load_weights(model_dir, config), rc, AscendBackend(ReferenceOps(config.head_dim)))
    runner.warmup()
    layer = runner.model.layers[0]
    assert str(layer.w_gate_up.weight.dtype) == "Int8" and tuple(layer.w_gate_up.weight.shape) == (640, 256)
    assert tuple(layer.w_gate_up.scale.shape) == (640,)
    hf = load_hf(dequantized_checkpoint(model_dir, tmp_path / "dequantized"))
    assert check_against_hf(runner, hf, prompts(config, PROMPT_LENS), STEPS) == len(PROMPT_LENS)


# ---- configuration -----------------------------------------------------------------------------------------------
def test_backends_without_int8_projections_refuse(weights):  # the config errors: tests/test_config.py
    with pytest.raises(ValueError, match="quantization w8a16 needs the native CPU projections"):
        PortableBackend().with_quantization("w8a16")
    with pytest.raises(ValueError, match="quantization 'int4'"):
        RunnerConfig(num_blocks=8, block_size=8, max_model_len=32, prefill_seq_lengths=(32,), quantization="int4")
    with pytest.raises(ValueError, match="need model_config.quantization w8a16"):
        ModelRunner(CONFIG, {**weights, "layers.0.wo.scale": np.ones(CONFIG.hidden_size, np.float32)}, RC)


def test_the_choice_reaches_the_agents():
    from llm_serving.engine.wiring import runner_config_dict

    cfg = ServingConfig.from_dict({"model_config": {"quantization": "w8a16"}})
    assert runner_config_dict(cfg)["quantization"] == "w8a16"
    assert ServingConfig.from_dict({}).model_config.quantization == "none"


# ---- int8 KV cache (model_config.kv_cache_dtype: int8) -------------------------------------------------------------
N_KV, REP, BLOCK = 2, 2, 4


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def quantize_kv(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference of an int8 cache row: q = rint(x / scale), scale = max |x| / 127 (float32)."""
    scale = (np.abs(rows).max(-1) / np.float32(127)).astype(np.float32)
    q = np.where(scale[..., None] > 0, np.rint(rows / np.where(scale > 0, scale, 1)[..., None]), 0)
    return np.clip(q, -127, 127).astype(np.int8), scale


def int8_cache_rows(cache: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values [.., dim], float32 scales) of an int8 cache [2 * kv, slots, dim + 4]."""
    return cache[..., :dim], np.ascontiguousarray(cache[..., dim:]).view(np.float32)[..., 0]


class KvStep:
    """Random qkv rows for tokens at positions, run through one native attention op with a float32 and an int8
    cache side by side (the same inputs), and the numpy attention over the int8 cache's dequantized rows."""

    def __init__(self, ops, dim: int, slots: int) -> None:
        self.ops, self.dim = ops, dim
        self.caches = {"f32": Tensor(np.zeros((2 * N_KV, slots, dim), np.float32)),
                       "i8": Tensor(np.zeros((2 * N_KV, slots, dim + 4), np.int8))}
        self.rng = np.random.default_rng(dim)

    def inputs(self, positions: np.ndarray):
        heads, dim = N_KV * REP, self.dim
        qkv = self.rng.standard_normal((len(positions), (heads + 2 * N_KV) * dim)).astype(np.float32)
        inv = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
        angles = np.concatenate([positions[:, None] * inv] * 2, -1)
        return qkv, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def run(self, op, qkv, cos, sin, slots, *rest) -> dict[str, np.ndarray]:
        return {kind: OpCell(op)(Tensor(qkv), Tensor(cos), Tensor(sin), Tensor(slots.astype(np.int32)),
                                 *[Tensor(r) for r in rest], cache).asnumpy()
                for kind, cache in self.caches.items()}

    def reference(self, qkv, cos, sin, token: int, slots_read: np.ndarray) -> np.ndarray:
        """Token ``token``'s attention output over the int8 cache's rows at ``slots_read``, dequantized."""
        heads, dim = N_KV * REP, self.dim
        q8, scale = int8_cache_rows(self.caches["i8"].asnumpy(), dim)
        rows = q8[:, slots_read].astype(np.float64) * scale[:, slots_read, None]
        out = np.zeros((heads, dim))
        for h in range(heads):
            q = rope_rows(qkv[token, h * dim:(h + 1) * dim].astype(np.float64), cos[token], sin[token])
            keys, values = rows[h // REP], rows[N_KV + h // REP]
            s = keys @ q / np.sqrt(dim)
            p = np.exp(s - s.max())
            out[h] = (p / p.sum()) @ values
        return out.reshape(-1)


@pytest.mark.parametrize("build", ["default", "generic"])
@pytest.mark.parametrize("dim", [64, 48])  # the unrolled head size and the generic loops
def test_int8_cache_holds_each_rows_quantization_and_attention_reads_it_back(generic_kernel_dir, build, dim):
    setup_device("CPU")
    ops_ = built_ops(build, N_KV * REP * dim, generic_kernel_dir)  # the ops' output width
    kv = KvStep(ops_, dim, slots=16 * BLOCK)
    # prefill: prompts of 5 and 7 tokens in blocks 1-2 and 3-4
    lens = np.array([5, 7], np.int32)
    positions = np.concatenate([np.arange(5), np.arange(7)]).astype(np.float32)
    slots = np.concatenate([BLOCK + np.arange(5), 3 * BLOCK + np.arange(7)])
    qkv, cos, sin = kv.inputs(positions)
    out = kv.run(ops_.prefill, qkv, cos, sin, slots, lens)
    f32, i8 = kv.caches["f32"].asnumpy(), kv.caches["i8"].asnumpy()
    q8, scale = int8_cache_rows(i8, dim)
    want_q, want_scale = quantize_kv(f32[:, slots])  # the float cache holds the roped keys and the values
    np.testing.assert_array_equal(q8[:, slots], want_q)
    np.testing.assert_array_equal(scale[:, slots], want_scale)
    assert not q8[:, :BLOCK].any()  # nothing else written
    for t in (0, 4, 5, 11):  # causal within each prompt
        first = 0 if t < 5 else 5
        ref = kv.reference(qkv, cos, sin, t, slots[first:t + 1])
        np.testing.assert_allclose(out["i8"][t], ref, rtol=1e-4, atol=1e-5)
    assert 0 < np.abs(out["i8"] - out["f32"]).max() < 0.05  # quantized, and near the float cache's answer

    # a decode step of each sequence, then a chunk of three tokens of the second over its cached context
    tables = np.array([[1, 2, 0], [3, 4, 0]], np.int32)
    qkv, cos, sin = kv.inputs(np.array([5, 7], np.float32))
    offsets = np.arange(BLOCK, dtype=np.int32)
    decode_slots = np.array([BLOCK + 5, 3 * BLOCK + 7])
    out = kv.run(ops_.decode, qkv, cos, sin, decode_slots, tables, np.array([6, 8], np.int32), offsets)
    for b, slots_read in enumerate((BLOCK + np.arange(6), 3 * BLOCK + np.arange(8))):
        np.testing.assert_allclose(out["i8"][b], kv.reference(qkv, cos, sin, b, slots_read), rtol=1e-4, atol=1e-5)
    qkv, cos, sin = kv.inputs(np.array([8, 9, 10], np.float32))
    chunk_slots = np.array([3 * BLOCK + 8, 3 * BLOCK + 9, 3 * BLOCK + 10])
    out = kv.run(ops_.chunked, qkv, cos, sin, chunk_slots, np.array([0, 3], np.int32), np.array([0, 11], np.int32),
                 np.array([[0, 0, 0], [3, 4, 5]], np.int32), offsets)
    for i in range(3):
        ref = kv.reference(qkv, cos, sin, i, 3 * BLOCK + np.arange(9 + i))
        np.testing.assert_allclose(out["i8"][i], ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def kv_runners(weights):
    setup_device("CPU")
    out = {"int8": ModelRunner(CONFIG, weights, RunnerConfig(**{**RC.__dict__, "kv_cache_dtype": "int8"})),
           "exact": ModelRunner(CONFIG, weights, RC)}
    for runner in out.values():
        runner.warmup()
    return out


def test_the_int8_cache_is_a_quarter_of_the_bytes_and_stays_near_float(kv_runners):
    cache = kv_runners["int8"].model.layers[0].attention.kv_cache
    float_cache = kv_runners["exact"].model.layers[0].attention.kv_cache
    assert str(cache.dtype) == "Int8" and cache.nbytes == float_cache.nbytes * (CONFIG.head_dim + 4) // (
        4 * CONFIG.head_dim)
    ids = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 40)).astype(np.int32)
    int8, exact = (teacher_forced_logits(kv_runners[k], ids) for k in ("int8", "exact"))
    errors = np.abs(int8 - exact).max(-1) / np.abs(exact).max(-1)
    assert 0 < errors.max() < 0.05
    assert (int8.argmax(-1) == exact.argmax(-1)).mean() > 0.9
    # each row is quantized on its own: a sequence's numbers do not depend on its batch
    np.testing.assert_array_equal(teacher_forced_logits(kv_runners["int8"], ids[3:4])[0], int8[3])


def test_block_bytes_of_an_int8_cache():
    plan = ShardPlan(CONFIG)
    f32, i8 = kv_block_bytes(plan, 16, "float32"), kv_block_bytes(plan, 16, "float32", "int8")
    assert i8 == f32 * (CONFIG.head_dim + 4) // (4 * CONFIG.head_dim)


def test_backends_without_an_int8_cache_refuse():  # the config errors: tests/test_config.py
    with pytest.raises(ValueError, match="kv_cache_dtype int8 is held by the native CPU attention only"):
        PortableBackend().with_kv_cache_dtype("int8")
