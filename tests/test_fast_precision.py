"""The faster precision modes (``model_config.precision``: ``fast`` = bfloat16 projections with float32 sums,
``half`` = float16 projection weights with float32 arithmetic): the kernels against numpy references that round
the same way, the packed layouts, the model and the whole engine (chunked prefill, prefix caching, tensor
parallelism) against exact mode, and the configuration errors. The measured precision and speed on the bench
model are in docs/benchmarks.md "Fast precision mode"."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from mindspore import Tensor

from agents.model.backends import PortableBackend
from agents.model.native_kernels import native_ops
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights import packed as packed_weights
from agents.weights.checkpoints import load_weights
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.op_cell import OpCell, built_ops

pw = packed_weights


# ---- rounding and packing ------------------------------------------------------------------------------------
def test_bf16_rounding_is_nearest_even_and_keeps_specials():
    one = 1.0
    values = np.array([one, one + 2 ** -8, one + 3 * 2 ** -8, one + 2 ** -8 + 2 ** -20, -2.5, 0.0, -0.0, np.inf,
                       -np.inf, 3.4e38], np.float32)
    # ties go to the even neighbour (1 + 1.5 ulp -> 1 + 2 ulp), above a tie up; past the largest bfloat16: inf
    expected = [one, one, one + 2 ** -6, one + 2 ** -7, -2.5, 0.0, -0.0, np.inf, -np.inf, np.inf]
    got = pw.round_bf16(values)
    assert got.tolist() == expected
    assert np.signbit(got[6]) and np.isnan(pw.round_bf16(np.array([np.nan], np.float32)))[0]


@pytest.mark.parametrize("out,inner,swiglu", [(40, 37, False), (64, 8, False), (1, 3, False), (40, 37, True),
                                              (2, 9, True)])
def test_bf16_pack_holds_pairs_of_inputs_and_unpacks_to_the_rounded_weight(out, inner, swiglu):
    w = np.random.default_rng(0).standard_normal((out, inner)).astype(np.float32)
    packed = pw.pack_bf16(w, swiglu)
    assert packed.dtype == np.int32 and packed.shape == pw.packed_shape_bf16(out, inner, swiglu)
    np.testing.assert_array_equal(pw.unpack_bf16(packed, out, inner, swiglu), pw.round_bf16(w))
    if not swiglu:  # panel 0, pair 0, output 0: inputs 0 (low half) and 1 (high half)
        word = int(packed.view(np.uint32)[0, 0])
        assert word & 0xFFFF == pw.to_bf16(w[0, 0]) and word >> 16 == (pw.to_bf16(w[0, 1]) if inner > 1 else 0)


# ---- kernels ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["default", "generic"])
def ops_(request, generic_kernel_dir):
    """The kernels as built here (AVX-512 with BF16), and built without AVX-512 (plain loops: same maths)."""
    setup_device("CPU")
    ops = built_ops(request.param, 64, generic_kernel_dir)
    if request.param == "default" and not ops.bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    assert request.param == "default" or not ops.bf16
    return ops


FORMATS = ("bfloat16", "float16")


def held(w: np.ndarray, fmt: str, swiglu: bool = False) -> np.ndarray:
    """The packed weight of ``fmt``, and (second) the weight values the kernel multiplies by."""
    if fmt == "bfloat16":
        return pw.pack_bf16(w, swiglu)
    return pw.pack(w, swiglu).astype(np.float16)


def weight_values(w: np.ndarray, fmt: str) -> np.ndarray:
    return (pw.round_bf16(w) if fmt == "bfloat16" else w.astype(np.float16)).astype(np.float64)


def input_values(x: np.ndarray, fmt: str) -> np.ndarray:
    """bfloat16 mode rounds a projection's input rows too; float16 mode keeps them float32."""
    return (pw.round_bf16(x) if fmt == "bfloat16" else x).astype(np.float64)


def check(got: np.ndarray, reference: np.ndarray, unrounded: np.ndarray) -> None:
    """``got`` equals the reference of the same rounding up to float32 summation (relative 1e-5 of the output's
    scale), and that bound is sharp: the unrounded float64 result is much further away."""
    scale = np.abs(reference).max()
    err = np.abs(got - reference).max() / scale
    assert err < 1e-5, err
    assert np.abs(unrounded - reference).max() / scale > 20 * max(err, 1e-7)


SHAPES = [(1, 37, 40), (5, 64, 72), (13, 37, 8), (130, 1100, 40)]  # rows past one tile / one task's chunk; odd K


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_partial_and_residual(ops_, fmt, m, k, n):
    rng = np.random.default_rng(m + k)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    rows = max(m // 2, 1)
    ref = input_values(x, fmt) @ weight_values(w, fmt).T
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    packed = Tensor(held(w, fmt))
    check(OpCell(ops_.linear(n))(Tensor(x), packed).asnumpy(), ref, exact)
    got = OpCell(ops_.partial_linear(n))(Tensor(x), packed, Tensor(np.array([rows], np.int32))).asnumpy()
    assert not got[rows:].any()
    check(got[:rows], ref[:rows], exact[:rows])
    got = OpCell(ops_.residual_linear())(Tensor(x), packed, Tensor(residual), Tensor(np.array([rows], np.int32)))
    got = got.asnumpy()
    assert not got[rows:].any()
    check(got[:rows] - residual[:rows], ref[:rows], exact[:rows])


def normalized_inputs(m: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x whose RMSNorm is exact in float32 (row r is +-2^e_r, so mean(x^2) is 4^e_r; eps 0), a norm weight of
    arbitrary floats, and the normalized rows (sign x weight): the kernel's bfloat16 rounding of them is then
    known exactly, whatever its summation order."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], (m, k))
    x = (signs * 2.0 ** rng.integers(-3, 4, (m, 1))).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    return x, norm_w, (signs * norm_w).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_norm_linear_and_norm_swiglu(ops_, fmt, m, k, n):
    x, norm_w, normed = normalized_inputs(m, k, m + n)
    rng = np.random.default_rng(k)
    w, w_gu = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((2 * n, k)).astype(np.float32)
    eps, rows = Tensor(np.zeros(1, np.float32)), Tensor(np.array([m], np.int32))
    got = OpCell(ops_.norm_linear(n))(Tensor(x), Tensor(norm_w), eps, Tensor(held(w, fmt)), rows).asnumpy()
    check(got, input_values(normed, fmt) @ weight_values(w, fmt).T, normed.astype(np.float64) @ w.T)

    got = OpCell(ops_.norm_swiglu(n))(Tensor(x), Tensor(norm_w), eps, Tensor(held(w_gu, fmt, swiglu=True)), rows)
    gate_up = input_values(normed, fmt) @ weight_values(w_gu, fmt).T
    ref = gate_up[:, :n] / (1 + np.exp(-gate_up[:, :n])) * gate_up[:, n:]
    np.testing.assert_allclose(got.asnumpy(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_float16_weights_give_the_float32_tile_bitwise_for_any_row_count(ops_):
    """More than one tile of rows widens each float16 panel once and runs the float32 tile; one tile widens as it
    reads. Both are the same products in the same order: a row's result does not depend on the batch."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal((72, 64)).astype(np.float32)
    cell, packed = OpCell(ops_.linear(72)), Tensor(pw.pack(w).astype(np.float16))
    whole = cell(Tensor(x), packed).asnumpy()
    for start in range(0, 40, 10):
        np.testing.assert_array_equal(cell(Tensor(x[start:start + 10]), packed).asnumpy(), whole[start:start + 10])
    exact_on_rounded = cell(Tensor(x), Tensor(pw.pack(w.astype(np.float16).astype(np.float32)))).asnumpy()
    np.testing.assert_array_equal(whole, exact_on_rounded)


# ---- the model -------------------------------------------------------------------------------------------------
CONFIG = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
RC = RunnerConfig(num_blocks=80, block_size=8, max_model_len=128, prefill_batch_sizes=(1, 4), prefill_seq_lengths=(32,),
                  decode_batch_sizes=(4,), decode_block_widths=(16,))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return load_weights(build_random_model(tmp_path_factory.mktemp("fast"), CONFIG, seed=3, std=0.08), CONFIG)


def teacher_forced_logits(runner: ModelRunner, ids: np.ndarray) -> np.ndarray:
    """Logits ``[batch, positions, vocab]`` of every position after a 12-token prefill, the same tokens fed to
    every runner (so positions compare on the same context)."""
    b, n = ids.shape
    tables = (1 + np.arange(b * 16, dtype=np.int32)).reshape(b, 16)
    slots = (tables[:, :2].repeat(8, 1) * 8 + np.tile(np.arange(8), 2)).astype(np.int32)[:, :12]
    rows = [runner.step_logits(StepBatch(ids[:, :12].reshape(-1), np.tile(np.arange(12, dtype=np.int32), b),
                                         slots.reshape(-1), np.full(b, 12, np.int32), np.full(b, 12, np.int32),
                                         tables))]
    for t in range(12, n):
        rows.append(runner.step_logits(StepBatch(ids[:, t].copy(), np.full(b, t, np.int32),
                                                 (tables[:, t // 8] * 8 + t % 8).astype(np.int32),
                                                 np.ones(b, np.int32), np.full(b, t + 1, np.int32), tables)))
    return np.stack(rows, 1)


def rule_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The contest's per-position error (scripts/check_precision.py): max |ours - ref| / max |ref|."""
    return np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)


@pytest.fixture(scope="module")
def runners(weights):
    setup_device("CPU")
    if not native_ops(CONFIG.hidden_size).bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    out = {}
    for precision in ("exact", "half", "fast"):
        out[precision] = ModelRunner(CONFIG, weights, RunnerConfig(**{**RC.__dict__, "precision": precision}))
        out[precision].warmup()
    return out


def test_model_weights_are_held_in_the_modes_format(runners):
    layer = {p: r.model.layers[0] for p, r in runners.items()}
    assert layer["exact"].w_qkv.weight.dtype == runners["exact"].model.dtype
    assert str(layer["half"].w_qkv.weight.dtype) == "Float16"
    assert str(layer["fast"].w_gate_up.weight.dtype) == "Int32"
    assert str(runners["fast"].model.lm_head.weight.dtype) == "Int32"
    w = runners["exact"].model.layers[1].w_down.unstored(runners["exact"].model.layers[1].w_down.weight.asnumpy())
    fast = runners["fast"].model.layers[1].w_down
    np.testing.assert_array_equal(fast.unstored(fast.weight.asnumpy()), pw.round_bf16(w))


def test_modes_stay_near_exact_on_the_same_tokens(runners):
    """Same tokens, every position: float16 weights within the contest's 5 per mille (and nearer exact than
    bfloat16); bfloat16 differs (really on) but within a few per cent on this random model."""
    ids = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 40)).astype(np.int32)
    logits = {p: teacher_forced_logits(r, ids) for p, r in runners.items()}
    half, fast = rule_errors(logits["half"], logits["exact"]), rule_errors(logits["fast"], logits["exact"])
    assert half.max() < 0.005
    assert 0 < fast.max() < 0.05 and fast.mean() > 2 * half.mean()
    exact_ids = logits["exact"].argmax(-1)
    assert (logits["half"].argmax(-1) == exact_ids).mean() > 0.95
    assert (logits["fast"].argmax(-1) == exact_ids).mean() > 0.8


@pytest.mark.parametrize("precision", ["half", "fast"])
def test_a_rows_result_does_not_depend_on_its_batch(runners, precision):
    """Each row is rounded and summed on its own, so a sequence computes bitwise the same alone or batched (what
    makes a prefix-cache hit give the cold run's numbers in exact mode holds here too)."""
    ids = np.random.default_rng(1).integers(3, CONFIG.vocab_size, (4, 20)).astype(np.int32)
    batched = teacher_forced_logits(runners[precision], ids)
    np.testing.assert_array_equal(teacher_forced_logits(runners[precision], ids[2:3])[0], batched[2])


def test_portable_backend_refuses_the_modes():
    with pytest.raises(ValueError, match="model_config.precision fast needs the native CPU kernels"):
        PortableBackend().with_precision("fast")
    with pytest.raises(ValueError, match="precision 'float8'"):
        RunnerConfig(num_blocks=8, block_size=8, max_model_len=32, prefill_seq_lengths=(32,), precision="float8")


# ---- the whole engine ------------------------------------------------------------------------------------------
TINY = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "vocab_size": 998, "seed": 5}


def engine_config(data_dir, precision: str, tp: int = 1) -> ServingConfig:
    """Chunked prefill (a 24-token step budget, prompts up to 50 tokens) and prefix caching on."""
    return ServingConfig.from_dict({
        "default_model": {"data_dir": str(data_dir), **TINY},
        "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [8],
                         "precision": precision},
        "pa_config": {"num_blocks": 64, "block_size": 8, "decode_seq_length": 96},
        "serving_config": {"num_agents": tp, "agent_restart_backoff_s": 0.01},
        "scheduler": {"policy": "fcfs", "enable_chunked_prefill": True, "enable_prefix_caching": True,
                      "max_num_batched_tokens": 24}})


def engine_run(cfg: ServingConfig) -> list:
    """Six prompts (two share a 40-token prefix, so the second is a prefix-cache hit), 12 greedy tokens each with
    their logits, EOS ignored."""
    rng = np.random.default_rng(8)
    shared = [1] + rng.integers(3, 998, 39).tolist()
    prompts = [shared + [5, 6], shared + [7]] + [[1] + rng.integers(3, 998, n).tolist() for n in (3, 17, 33, 50)]
    engine = Engine(cfg)
    engine.start(progress=None)
    try:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        first = engine.submit(prompts[0], params, logits_tokens=12).result(timeout=120)
        rest = [engine.submit(p, params, logits_tokens=12) for p in prompts[1:]]
        results = [first] + [s.result(timeout=120) for s in rest]
        assert engine.stats()["prefix_cache_hit_tokens"] >= 32  # the shared prefix came from the cache
    finally:
        engine.shutdown()
    return results


def same_context_errors(ours: list, ref: list) -> np.ndarray:
    """The rule's errors over the positions generated on the same context as the reference: each request's rows
    up to and including its first different token (after it the contexts differ)."""
    errors = []
    for a, b in zip(ours, ref):
        differ = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y]
        upto = differ[0] + 1 if differ else len(b.token_ids)
        errors.append(rule_errors(a.logits[:upto], b.logits[:upto]))
    return np.concatenate(errors)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    setup_device("CPU")
    if not native_ops(64).bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    data_dir = tmp_path_factory.mktemp("fast_engine")
    return {name: engine_run(engine_config(data_dir, precision, tp))
            for name, precision, tp in (("exact", "exact", 1), ("half", "half", 1), ("fast", "fast", 1),
                                        ("fast_tp2", "fast", 2))}


@pytest.mark.parametrize("name,bound", [("half", 0.005), ("fast", 0.05), ("fast_tp2", 0.05)])
def test_engine_in_a_fast_mode_with_chunks_prefix_cache_and_tensor_parallelism(engine_runs, name, bound):
    runs = engine_runs[name]
    assert all(len(r.token_ids) == 12 and r.logits.shape == (12, 998) for r in runs)
    errors = same_context_errors(runs, engine_runs["exact"])
    assert 0 < errors.max() < bound, errors.max()


def test_fast_tp2_computes_what_fast_tp1_does(engine_runs):
    """Ranks split heads and FFN rows, so only the order of float32 sums differs from tp 1; a sum that differs in
    its last bit may round to the neighbouring bfloat16 (2^-8 relative) at the next projection's input: close
    logits, well within what bfloat16 rounding itself costs (the bound of the test above)."""
    errors = same_context_errors(engine_runs["fast_tp2"], engine_runs["fast"])
    assert errors.max() < 0.01


# ---- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_config,message", [
    ({"precision": "quick"}, "model_config.precision.*expected one of exact, fast, half, got 'quick'"),
    ({"precision": "fast", "kernels": "portable"}, "model_config.precision.*fast runs on the native CPU kernels only"),
    ({"precision": "half", "dtype": "float16"}, "model_config.precision.*dtype float32"),
])
def test_config_errors_name_the_key_and_the_file(tmp_path, model_config, message):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model_config": model_config}))
    with pytest.raises(ConfigError, match=message) as info:
        ServingConfig.from_yaml(path)
    assert str(path) in str(info.value)


def test_the_mode_reaches_the_agents(tmp_path):
    from llm_serving.engine.wiring import runner_config_dict

    cfg = ServingConfig.from_dict({"model_config": {"precision": "fast"}})
    assert cfg.model_config.precision == "fast" and runner_config_dict(cfg)["precision"] == "fast"
    assert ServingConfig.from_dict({}).model_config.precision == "exact"
