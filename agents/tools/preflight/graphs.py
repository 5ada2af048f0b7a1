"""The first compile of each graph family the agents warm up, timed on the device: the configured model's shapes
(its ``AgentSpec``, rank 0) or, without a config, the small random Llama's. Nobody knows without an NPU whether a
910B's first start takes minutes or an hour (docs/ascend.md, "Warm-up and graphs"); this measures it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from agents.model.backends import select_backend
from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from agents.weights.kv_scales import with_kv_scales
from agents.weights.sharded import load_rank_weights
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan
from llm_serving.protocol.wire import AgentSpec


def small_spec(device: str, model_dir: Path) -> tuple[LlamaConfig, RunnerConfig]:
    """The small model's graphs, dynamic shapes as on Ascend, at the fewest buckets (only each family's first
    shape is timed: with dynamic shapes it is the family's compile)."""
    return LlamaConfig.from_model_dir(model_dir), RunnerConfig(
        num_blocks=40, block_size=16, max_model_len=128, prefill_batch_sizes=(4,), prefill_seq_lengths=(64,),
        decode_batch_sizes=(8,), dtype="float16", device_target=device, kernels="native", mixed_steps=True,
        max_num_batched_tokens=64, dynamic_shapes=True)


def spec_config(spec_json: str) -> tuple[LlamaConfig, RunnerConfig, str]:
    """The configured model's runner config (``num_blocks: auto``: the fewest blocks that hold one sequence; a
    cache's size changes no graph)."""
    spec = AgentSpec.from_json(spec_json)
    fields = dict(spec.runner_config)
    fields.pop("memory_utilization", None)
    if fields["num_blocks"] is None:
        fields["num_blocks"] = 1 + -(-fields["max_model_len"] // fields["block_size"])
    return LlamaConfig(**spec.llama_config), RunnerConfig(**fields), spec.model_path


def compile_seconds(device: str, spec_json: str | None, small_model: Path) -> tuple[dict[str, float], int]:
    """Graph family -> seconds its first warm-up shape took (its compile; with dynamic shapes the family's only
    one), and how many graphs the warm-up compiled in all: the configured model's (``spec_json``) or the small
    one's at ``small_model``. On CPU the Ascend graphs run on the stand-ins."""
    if spec_json is None:
        config, rc = small_spec(device, small_model)
        weights = load_weights(small_model, config)
    else:  # as export loads them: int8 weights and an int8 cache's scales where the config serves those
        config, rc, model_path = spec_config(spec_json)
        plan = ShardPlan(config)
        weights = load_rank_weights(model_path, config, plan, quantize=rc.quantization != "none")
        weights = with_kv_scales(weights, model_path, config, plan, {"kv_cache_dtype": rc.kv_cache_dtype,
                                                                     "device_target": rc.device_target})
    if device == "Ascend":
        backend = select_backend(rc.kernels, "Ascend", rc.dtype, config.q_dim)
    else:
        backend, rc = AscendBackend(ReferenceOps(config.head_dim)), replace(rc, device_target="CPU")
    runner = ModelRunner(config, weights, rc, backend)
    times = runner.warmup(lambda line: print(line, file=sys.stderr, flush=True))
    first: dict[str, float] = {}
    for (kind, _, _), seconds in times.items():
        first.setdefault(kind, round(seconds, 2))
    graphs = len(times) if not rc.dynamic_shapes else len(first)
    return first, graphs
