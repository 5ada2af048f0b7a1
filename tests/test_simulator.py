"""The simulator: step shapes, the cost models, the real scheduler on a virtual clock, workloads, the tuner, the
commands, and a profile of a real served engine."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import yaml

from llm_serving.bench.results import RequestResult
from llm_serving.cli.main import main as cli_main
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.core.step_shape import StepShape, distinct_positions, step_rows, steps_from_rows
from llm_serving.protocol.batch import StepBatch
from llm_serving.simulator.costs import (
    FEATURES,
    CostModelError,
    DeviceCost,
    DeviceProfile,
    FittedCost,
    fitted_from_profile,
    load_profile,
    merged_profiles,
    request_overhead,
    round_spread,
    save_profile,
)
from llm_serving.simulator.profiling import SweepPoint, run_sweep
from llm_serving.simulator.run import simulate
from llm_serving.simulator.target import MODEL_SHAPES, Target, build_target
from llm_serving.simulator.tuner import Constraint, TuneError, tune, tuned_yaml
from llm_serving.simulator.workload import (
    SimRequest,
    WorkloadError,
    clip_to_context,
    from_results,
    retimed,
    word_encoder,
)
from tests.tiny_engine import tiny_engine_config


class Constant:
    """Every step takes ``step_s`` (+ ``per_token_s`` a query token): results that can be worked out by hand."""

    def __init__(self, step_s: float, per_token_s: float = 0.0) -> None:
        self.step_s, self.per_token_s = step_s, per_token_s

    def seconds(self, shape: StepShape) -> float:
        return shape.num_steps * self.step_s + self.per_token_s * shape.num_tokens

    def describe(self) -> str:
        return "constant"


def sched_config(**kw) -> SchedulerConfig:
    base = {"num_blocks": 256, "block_size": 16, "max_num_seqs": 8, "max_prefill_batch": 4,
            "max_num_batched_tokens": 512, "max_model_len": 512, "chunked_prefill": True}
    return SchedulerConfig(**{**base, **kw})


def req(i: int, prompt_len: int, new: int, at: float = 0.0, first: int = 0) -> SimRequest:
    ids = tuple(range(3 + first, 3 + first + prompt_len))
    return SimRequest(i, at, f"p{i}", ids, new)


# ---- step shapes ----------------------------------------------------------------------------------------
def test_step_shape_sums_what_the_scheduler_batched():
    sched = Scheduler(sched_config(max_num_batched_tokens=40))
    for i, n in enumerate((30, 20)):
        sched.add(Sequence(f"r{i}", list(range(3, 3 + n)), SamplingParams(4, ignore_eos=True)))
    _, batch = sched.schedule()  # 30 tokens of r0 and a 10-token chunk of r1
    shape = StepShape.of(batch, 16)
    assert shape == StepShape(num_seqs=2, num_tokens=40, prefill_tokens=40, prefill_seqs=2, context_tokens=40,
                              attention_pairs=30 * 30 + 10 * 10, shared_context_tokens=0)
    assert steps_from_rows(json.loads(json.dumps(step_rows([(shape, 0.5)])))) == [(shape, 0.5)]
    older = {k: v for k, v in step_rows([(shape, 0.5)])[0].items() if k != "shared_context_tokens"}
    assert steps_from_rows([older]) == [(shape, 0.5)]  # a profile recorded before the field: nothing shared


def test_positions_in_blocks_another_sequence_reads_count_as_shared():
    tables = np.array([[5, 6, 7], [5, 6, 9], [5, 8, 0]], np.int32)  # a prefix of blocks 5, 6 (16 tokens each)
    ctx = np.array([40, 35, 20])  # reads 5 6 7(8 tokens); 5 6 9(3); 5 8(4): 47 distinct of 95
    assert distinct_positions(tables, ctx, 16) == 16 + 16 + 8 + 3 + 4
    assert distinct_positions(tables[2:], ctx[2:], 16) == 20
    assert distinct_positions(np.array([[5, 6], [6, 5]], np.int32), np.array([20, 32]), 16) == 32  # 6 fullest once
    batch = StepBatch(np.zeros(3, np.int32), ctx - 1, np.zeros(3, np.int32), np.ones(3, np.int32),
                      ctx.astype(np.int32), tables)
    assert StepShape.of(batch, 16).shared_context_tokens == 95 - 47


def test_simulated_steps_over_a_cached_prefix_read_shared_blocks():
    shapes: list[StepShape] = []

    class Recording(Constant):
        def seconds(self, shape: StepShape) -> float:
            shapes.append(shape)
            return super().seconds(shape)

    simulate(sched_config(prefix_caching=True), [req(0, 64, 2)] + [req(i, 64, 8, at=1.0) for i in (1, 2, 3)],
             Recording(0.01))
    shared = [s for s in shapes if s.shared_context_tokens]  # their last chunks, then their decode steps
    assert [s.prefill_seqs for s in shared] == [3] + [0] * 7 and all(s.num_seqs == 3 for s in shared)
    assert all(s.shared_context_tokens == 2 * 48 for s in shared)  # the three cached blocks, read thrice


# ---- cost models ----------------------------------------------------------------------------------------
def shapes(rng: np.random.Generator, n: int) -> list[StepShape]:
    out = []
    for _ in range(n):
        seqs = int(rng.integers(1, 33))
        prompts = int(rng.integers(0, 3))
        tokens = seqs + prompts * int(rng.integers(2, 200))
        out.append(StepShape(seqs, tokens, tokens - seqs + prompts if prompts else 0, prompts,
                             int(rng.integers(seqs, 4000)), int(rng.integers(0, 20000))))
    return out


def test_the_fit_recovers_a_linear_cost_and_averages_noise():
    rng = np.random.default_rng(0)
    truth = FittedCost((0.0, 2e-3, 5e-5, 3e-5, 4e-7, 1e-3, 2e-4, 1e-8))
    xs = shapes(rng, 400)
    exact = FittedCost.fit([(s, truth.seconds(s)) for s in xs])
    assert np.allclose(exact.coefficients, truth.coefficients, rtol=1e-4, atol=1e-9)
    noisy = FittedCost.fit([(s, truth.seconds(s) * rng.uniform(0.6, 1.4)) for s in xs])  # mean 1: unbiased
    ratio = sum(noisy.seconds(s) for s in xs) / sum(truth.seconds(s) for s in xs)
    assert ratio == pytest.approx(1.0, abs=0.03)
    assert all(c >= 0 for c in noisy.coefficients)
    with pytest.raises(CostModelError, match=f"at least {len(FEATURES)}"):
        FittedCost.fit([(xs[0], 0.01)])
    # the served decode buckets: each step also pays for the graph its batch pads to, and per position read in it
    bucketed = FittedCost((0.0, 1e-3, 5e-5, 0.0, 4e-7, 1e-3, 0.0, 0.0, 1e-4, 2e-3, 5e-3, 0.0, 1e-7, 3e-7),
                          buckets=(1, 8, 32))
    assert bucketed.seconds(StepShape(9, 9, 0, 0, 90, 90)) == pytest.approx(1e-3 + 9 * 5e-5 + 90 * (4e-7 + 3e-7)
                                                                             + 5e-3)
    refit = FittedCost.fit([(s, bucketed.seconds(s)) for s in xs], buckets=[32, 1, 8])
    assert refit.buckets == (1, 8, 32) and "bucket 32 unshared context" in refit.describe()
    assert sum(refit.seconds(s) for s in xs) == pytest.approx(sum(bucketed.seconds(s) for s in xs), rel=1e-6)
    # positions another sequence reads from the same block pay the global slope only
    shared = dataclasses.replace(StepShape(9, 9, 0, 0, 90, 90), shared_context_tokens=40)
    assert bucketed.seconds(shared) == pytest.approx(1e-3 + 9 * 5e-5 + 90 * 4e-7 + 50 * 3e-7 + 5e-3)


def test_profile_files_round_trip_and_name_the_file_when_broken(tmp_path):
    samples = [(StepShape(1, 1, 0, 0, 10, 10), 0.003), (StepShape(4, 64, 64, 4, 64, 1024), 0.02)]
    path = save_profile(tmp_path / "p.json", samples, {"num_blocks": 99})
    assert load_profile(path) == (samples, {"num_blocks": 99})
    (tmp_path / "bad.json").write_text('{"steps": [{"num_seqs": 1}]}')
    with pytest.raises(CostModelError, match="bad.json"):
        load_profile(tmp_path / "bad.json")
    # sessions of one config, taken apart: fitted together, compared session against session
    rng = np.random.default_rng(1)
    truth = FittedCost((1e-3, 2e-3, 5e-5, 3e-5, 4e-7, 1e-3, 2e-4, 1e-8))
    xs = shapes(rng, 40)
    slow = save_profile(tmp_path / "slow.json", [(x, 1.2 * truth.seconds(x)) for x in xs],
                        {"num_blocks": 99, "first_token_probes": [[16, 0.01]], "round_steps": [40]})
    fast = save_profile(tmp_path / "fast.json", [(x, 0.8 * truth.seconds(x)) for x in xs],
                        {"num_blocks": 99, "first_token_probes": [[16, 0.02]], "round_steps": [40]})
    fit, meta, _ = fitted_from_profile(f"{slow},{fast}")
    assert sum(fit.seconds(x) for x in xs) == pytest.approx(sum(truth.seconds(x) for x in xs), rel=0.01)
    assert meta["round_steps"] == [40, 40] and meta["first_token_probes"] == [[16, 0.01], [16, 0.02]]
    assert "slow.json, fast.json, whose fits differ by 50%" in fit.describe()
    steps, _ = merged_profiles([slow, fast])
    assert round_spread(steps, meta["round_steps"]) == pytest.approx(0.5)  # 1.2 / 0.8
    with pytest.raises(CostModelError, match="missing.json"):
        fitted_from_profile(f"{slow},{tmp_path / 'missing.json'}")


def test_the_request_overhead_is_what_the_engine_does_not_explain():
    cost = Constant(0.004)
    assert request_overhead(cost, [(16, 0.010), (64, 0.012), (16, 0.010)]) == pytest.approx(0.003)
    assert request_overhead(cost, []) == 0.0
    assert request_overhead(cost, [(16, 0.001)]) == 0.0


def test_device_cost_decode_reads_the_weights_prefill_multiplies_them():
    d = DeviceProfile(step_overhead_s=0.0, seq_overhead_s=0.0)
    llama = MODEL_SHAPES["llama-2-7b"]
    cost = DeviceCost(d, llama)
    weights = cost.weight_bytes_per_rank
    assert weights / 2**30 == pytest.approx(12.55, abs=0.05)  # 6.74e9 parameters in float16
    decode = cost.seconds(StepShape(1, 1, 0, 0, 1, 1))
    assert decode == pytest.approx(weights / (d.memory_bandwidth_gbs * 1e9 * d.memory_efficiency), rel=1e-3)
    long_prefill = cost.seconds(StepShape(1, 4096, 4096, 1, 4096, 4096 * 4096))
    flops = llama.flops_per_token() * 4096 - 2 * 4096 * 32000 * 4095 + 4 * 4096 * 32 * (4096 * 4096 - 0)
    assert long_prefill == pytest.approx(flops / (d.peak_tflops * 1e12 * d.compute_efficiency), rel=0.01)
    tp2 = DeviceCost(d, llama, tensor_parallel=2)
    assert tp2.weight_bytes_per_rank == pytest.approx(weights / 2)
    assert tp2.seconds(StepShape(1, 1, 0, 0, 1, 1)) > decode / 2  # plus 64 all-reduces
    int8 = DeviceCost(d, llama, int8_projections=True)
    assert int8.weight_bytes_per_rank / weights == pytest.approx(0.52, abs=0.02)  # embeddings stay float16
    assert cost.kv_blocks(16) == int((64 * 2**30 * 0.9 - weights) // (2 * 32 * 128 * 32 * 2 * 16))
    with pytest.raises(CostModelError, match="no room for a KV cache"):
        DeviceCost(d, MODEL_SHAPES["llama-2-70b"]).kv_blocks(16)
    assert DeviceCost(d, MODEL_SHAPES["llama-2-70b"], tensor_parallel=8).kv_blocks(16) > 1000
    with pytest.raises(CostModelError, match="not one of"):
        d.with_values({"bandwidth": "1"})
    with pytest.raises(CostModelError, match="not a number"):
        d.with_values({"peak_tflops": "fast"})
    assert d.with_values({"peak_tflops": "100"}).peak_tflops == 100.0


def test_a_moe_step_reads_the_experts_its_tokens_touch():
    """Qwen3-30B-A3B: a rank holds every expert (its memory) but a decode step reads the router, the attention and
    the experts its tokens picked: one token 8 of 128 (about 3.3B of 30.5B parameters), 32 tokens most of them,
    4096 all; expert and tensor parallelism read a rank's 1/N of them alike."""
    d = DeviceProfile(step_overhead_s=0.0, seq_overhead_s=0.0)
    moe = MODEL_SHAPES["qwen3-30b-a3b"]
    cost = DeviceCost(d, moe)
    held, one = cost.weight_bytes_per_rank, cost.weight_bytes_read(1)
    assert held / 2 / 1e9 == pytest.approx(30.5, abs=0.1) and one / 2 / 1e9 == pytest.approx(3.35, abs=0.05)
    assert one < cost.weight_bytes_read(32) < cost.weight_bytes_read(4096) == pytest.approx(held, rel=1e-6)
    assert cost.weight_bytes_read(32) / held == pytest.approx(0.88, abs=0.02)  # 1 - (15/16)^32 of the experts
    bandwidth = d.memory_bandwidth_gbs * 1e9 * d.memory_efficiency
    assert cost.seconds(StepShape(1, 1, 0, 0, 1, 1)) == pytest.approx(one / bandwidth, rel=1e-3)
    eight = DeviceCost(d, moe, tensor_parallel=8)
    assert eight.weight_bytes_read(1) == pytest.approx(one / 8) and eight.weight_bytes_per_rank == held / 8
    dense = MODEL_SHAPES["llama-2-7b"]
    assert DeviceCost(d, dense).weight_bytes_read(1) == DeviceCost(d, dense).weight_bytes_per_rank
    assert moe.flops_per_token() / 2 / 1e9 == pytest.approx(3.04, abs=0.01)  # the active matmuls (no embedding)
    int8 = DeviceCost(d, moe, int8_projections=True)  # w8a16: the experts a byte a weight too
    assert int8.weight_bytes_per_rank / held == pytest.approx(0.51, abs=0.01)  # embeddings, router stay float16
    assert int8.weight_bytes_read(1) < 0.6 * one
    # a shared expert (Qwen2-MoE's) is int8 too: its 3 s h weights a byte each, 2 s + h scales; its gate float
    s = 512
    shared = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, shared_expert_intermediate_size=s))
    grown = DeviceCost(d, shared, int8_projections=True).weight_bytes_per_rank - int8.weight_bytes_per_rank
    assert grown == 48 * (3 * s * 2048 + (2 * s + 2048) * 2 + 2048 * 2)


# ---- the simulation ----------------------------------------------------------------------------------------
def test_one_request_takes_its_prefill_and_a_step_per_further_token():
    run = simulate(sched_config(), [req(0, 40, 5)], Constant(0.010))
    (r,) = run.results
    assert r.success and r.output_tokens == 5
    assert r.ttft == pytest.approx(0.010) and r.end_time == pytest.approx(0.050)
    assert r.itl == pytest.approx([0.010] * 4) and run.steps == 5 and run.prefill_steps == 1
    assert run.kv_usage[-1][1] == 0.0  # every block back
    shifted = simulate(sched_config(), [req(0, 40, 5, at=1.0)], Constant(0.010), request_overhead_s=0.002)
    assert shifted.results[0].ttft == pytest.approx(0.014) and shifted.duration == pytest.approx(0.054)


def test_a_step_sent_ahead_starts_before_an_arrival_joins():
    """Asynchronous scheduling: the decode step after the running one is decided when that one starts, so a
    request arriving meanwhile joins a step later than it would otherwise (steps of 10 ms, B arrives at 25 ms)."""
    reqs = [req(0, 40, 10), req(1, 10, 3, at=0.025, first=50)]
    plain = simulate(sched_config(), reqs, Constant(0.010))
    ahead = simulate(sched_config(async_scheduling=True), reqs, Constant(0.010))
    assert plain.results[1].ttft == pytest.approx(0.015) and ahead.results[1].ttft == pytest.approx(0.025)
    assert plain.results[0].end_time == ahead.results[0].end_time == pytest.approx(0.100)
    assert ahead.steps == plain.steps and ahead.kv_usage[-1][1] == 0.0


def test_chunks_batches_and_the_concurrency_cap():
    chunked = simulate(sched_config(max_num_batched_tokens=32, max_num_seqs=8), [req(0, 100, 2)], Constant(0.01))
    assert chunked.results[0].ttft == pytest.approx(0.04)  # 100 prompt tokens in chunks of 32
    many = [req(i, 10, 4, first=20 * i) for i in range(8)]
    together = simulate(sched_config(max_num_seqs=8), many, Constant(0.01))
    assert together.duration == pytest.approx(0.05)  # max_prefill_batch 4: the second four start a step later
    one_at_a_time = simulate(sched_config(max_num_seqs=8), many, Constant(0.01), max_concurrency=1)
    assert one_at_a_time.duration == pytest.approx(8 * 0.04)
    assert [r.send_time for r in one_at_a_time.results] == pytest.approx([0.04 * i for i in range(8)])


def test_the_policy_is_the_schedulers_own():
    reqs = [req(0, 10, 3, first=0), req(1, 10, 30, first=50), req(2, 10, 10, first=100)]
    cfg = {"max_num_seqs": 1, "max_prefill_batch": 1}
    fcfs = simulate(sched_config(policy="fcfs", **cfg), reqs, Constant(0.01))
    lof = simulate(sched_config(policy="longest_output_first", **cfg), reqs, Constant(0.01))
    def order(run):
        return [r.index for r in sorted(run.results, key=lambda r: r.ttft)]

    assert order(fcfs) == [0, 1, 2] and order(lof) == [1, 2, 0]
    assert fcfs.duration == pytest.approx(lof.duration)


def test_shared_prompts_hit_the_prefix_cache_and_speculation_is_refused():
    reqs = [req(i, 64, 4, at=0.1 * i) for i in range(4)]  # the same prompt, one after another
    cached = simulate(sched_config(prefix_caching=True), reqs, Constant(0.01, 1e-3))
    plain = simulate(sched_config(), reqs, Constant(0.01, 1e-3))
    assert cached.prefix_hit_tokens == 3 * 48 and plain.prefix_hit_tokens == 0  # whole blocks before the last token
    assert cached.metrics["median_ttft_ms"] < plain.metrics["median_ttft_ms"]
    with pytest.raises(ValueError, match="speculative"):
        simulate(sched_config(speculative="ngram"), reqs, Constant(0.01))


def test_preemption_when_the_cache_runs_out_still_finishes_everything():
    reqs = [req(i, 30, 60, first=40 * i) for i in range(6)]
    run = simulate(sched_config(num_blocks=12, max_num_seqs=6), reqs, Constant(0.01))
    assert run.preemptions > 0 and all(r.success and r.output_tokens == 60 for r in run.results)
    assert run.kv_usage[-1][1] == 0.0


def test_multi_step_decoding_delivers_tokens_k_at_a_time():
    run = simulate(sched_config(decode_steps=4), [req(0, 10, 9)], Constant(0.01))
    (r,) = run.results
    assert r.output_tokens == 9 and run.steps == 9
    assert r.itl == pytest.approx([0.04, 0.0, 0.0, 0.0, 0.04, 0.0, 0.0, 0.0])  # the prefill's token, then 4 + 4


# ---- workloads -------------------------------------------------------------------------------------------
def test_a_request_ends_where_its_model_ended_it_and_asks_for_what_it_asked():
    reqs = [SimRequest(0, 0.0, "a", tuple(range(3, 13)), 100, output_tokens=5), req(1, 10, 20, first=40)]
    run = simulate(sched_config(max_num_seqs=1, max_prefill_batch=1, policy="longest_output_first"), reqs,
                   Constant(0.01))
    first, second = run.results
    assert first.output_tokens == 5 and first.finish_reason == "eos" and second.finish_reason == "length"
    assert first.ttft < second.ttft  # ordered by the 100 tokens it asked for, not the 5 it got
    assert run.kv_usage[-1][1] == 0.0


def test_results_files_replay_their_lengths_and_times(tmp_path):
    rows = [RequestResult(0, "hello there", 3, 50, success=True, output_tokens=7, send_time=0.5).to_json(),
            RequestResult(1, "failed one", 3, 50, success=False, error="HTTP 500").to_json(),
            RequestResult(2, "hello you", 3, 50, success=True, output_tokens=3, send_time=0.1).to_json()]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    enc = word_encoder(1000)
    got = from_results(tmp_path / "r.json", enc)
    assert [(r.index, r.arrival_s, r.max_new_tokens, r.length) for r in got] == [(2, 0.1, 50, 3), (0, 0.5, 50, 7)]
    assert got[0].prompt_ids[:2] == got[1].prompt_ids[:2]  # "<s> hello" shared
    assert len(enc("one two three four")) == 1 + math.ceil(4 * 1.3)
    assert [r.arrival_s for r in retimed(got, math.inf)] == [0.0, 0.0]
    (tmp_path / "bad.json").write_text("[{}]")
    with pytest.raises(WorkloadError, match="bad.json"):
        from_results(tmp_path / "bad.json", enc)
    assert clip_to_context([req(0, 10, 100)], 50)[0].max_new_tokens == 40
    with pytest.raises(WorkloadError, match="request 0"):
        clip_to_context([req(0, 60, 1)], 50)


# ---- the tuner -------------------------------------------------------------------------------------------
def test_the_tuner_finds_bigger_batches_where_steps_cost_the_same(tmp_path):
    base = ServingConfig.from_dict({"model_config": {"decode_batch_size": [1, 8], "prefill_batch_size": [1, 4]},
                                    "pa_config": {"num_blocks": 2048}})

    def target_for(config: ServingConfig) -> Target:
        from llm_serving.engine.wiring import scheduler_config

        return Target(scheduler_config(config, 2, num_blocks=config.pa_config.num_blocks), Constant(0.01, 1e-5),
                      word_encoder(1000), "words")

    reqs = [req(i, 20, 50, first=30 * i) for i in range(64)]
    result = tune(base, target_for, reqs, [])
    assert result.best.total_s < result.base.total_s / 3
    assert result.best.values["model_config.decode_batch_size"] >= 64
    capped = tune(base, target_for, reqs,
                  [Constraint.parse("max_server_running_batch<=16", {"max_server_running_batch"})])
    assert capped.best.feasible and capped.best.metrics["max_server_running_batch"] <= 16
    raw = {"model_config": {"model_name": "mine", "decode_batch_size": [1, 8]}}
    out = tuned_yaml(base, raw, result.best)
    assert out["model_config"]["model_name"] == "mine"
    assert out["model_config"]["decode_batch_size"][-1] == result.best.values["model_config.decode_batch_size"]
    ServingConfig.from_dict(out)  # a valid config
    with pytest.raises(TuneError, match="unknown metric"):
        Constraint.parse("speed>=1", {"total_time_s"})
    with pytest.raises(TuneError, match="expected METRIC"):
        Constraint.parse("ttft small", {"total_time_s"})


# ---- the commands ----------------------------------------------------------------------------------------
def test_simulate_and_tune_commands_project_a_device(tmp_path, capsys):
    args = ["--cost", "ascend-910b", "--model-shape", "llama-2-7b", "--num-prompts", "200", "--max-output-tokens",
            "64", "--config", "configs/llama2_7b_ascend.yaml", "--dataset", "/nonexistent.json"]
    assert cli_main(["simulate", *args, "--json"]) == 2
    assert "nonexistent.json" in capsys.readouterr().err
    args = args[:-2] + ["--device-param", "step_overhead_s=0.01"]
    assert cli_main(["simulate", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metrics"]["successful_requests"] == 200 and out["metrics"]["total_time_s"] > 0
    assert "10 ms a step" in out["settings"]["cost"]
    assert cli_main(["simulate", *args, "-O", str(tmp_path / "sim"), "--no-plots"]) == 0
    summary = json.loads(next((tmp_path / "sim").glob("summary_*.json")).read_text())
    assert summary["metrics"]["successful_requests"] == 200
    tuned = tmp_path / "tuned.yaml"
    code = cli_main(["tune", *args, "--constraint", "p90_ttft_ms<=1e9", "--out", str(tuned)])
    assert code == 0, capsys.readouterr().err
    chosen = yaml.safe_load(tuned.read_text())
    assert chosen["model_config"]["model_name"] == "llama_7b"  # the given file's keys kept
    assert "chosen:" in capsys.readouterr().out
    assert cli_main(["simulate", "--cost", "nothing.json", "--num-prompts", "1"]) == 2
    assert "nothing.json" in capsys.readouterr().err


def test_profile_records_the_served_steps_of_a_real_engine(tmp_path):
    config = tiny_engine_config(tmp_path / "model")
    points = [SweepPoint(1, 8, 4), SweepPoint(4, 16, 6)]
    steps, meta = run_sweep(config, points, tmp_path / "work", staggered=3, rounds=2)
    assert meta["served"] and meta["num_blocks"] == 32 and len(meta["first_token_probes"]) == 2 * 4
    assert meta["warm_up_steps"] > 0 and sum(meta["round_steps"]) == len(steps)  # the warm-up left out
    assert meta["decode_buckets"] == [4] and round_spread(steps, meta["round_steps"], meta["decode_buckets"]) >= 0
    decodes = [s for s, _ in steps if s.prefill_tokens == 0]
    assert {s.num_seqs for s in decodes} >= {1, 4} and all(t > 0 for _, t in steps)
    assert sum(s.prefill_tokens for s, _ in steps) >= 2 * (4 * 8 + 4 * 16 + 3 * 16)  # every prompt was prefilled
    assert any(s.shared_context_tokens for s in decodes)  # requests sent on a prompt just computed share its blocks
    path = save_profile(tmp_path / "profile.json", steps, meta)
    target = build_target(config, str(path))
    assert target.scheduler.num_blocks == 32 and target.request_overhead_s >= 0
    assert target.encode("hello world")  # the served tokenizer


def test_priority_orders_the_queue_and_preempts_the_lowest_first():
    """One request at a time: lower priority values start first. Under cache pressure the early, low priority
    request is the one preempted (it finishes last), where fcfs preempts the newcomers (it finishes first)."""
    reqs = [dataclasses.replace(req(i, 10, 3, first=50 * i), priority=p) for i, p in enumerate((2, 0, 1))]
    cfg = {"max_num_seqs": 1, "max_prefill_batch": 1}
    run = simulate(sched_config(policy="priority", **cfg), reqs, Constant(0.01))
    assert [r.index for r in sorted(run.results, key=lambda r: r.ttft)] == [1, 2, 0]
    later = [req(i, 30, 60, at=0.015, first=40 * i) for i in (1, 2, 3)]
    pressed = [dataclasses.replace(req(0, 30, 60), priority=1), *later]
    ends = {}
    for policy in ("priority", "fcfs"):
        run = simulate(sched_config(policy=policy, num_blocks=12, max_num_seqs=6), pressed, Constant(0.01))
        assert run.preemptions > 0 and all(r.success and r.output_tokens == 60 for r in run.results)
        ends[policy] = [r.index for r in sorted(run.results, key=lambda r: r.end_time)]
    assert ends["priority"][-1] == 0 and ends["fcfs"][0] == 0
