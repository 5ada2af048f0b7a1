"""``python -m agents.tools.export``: one MindIR file per warm-up shape of a model, for its configured device target and
dtype, built and exported on this machine's CPU, and a line per graph with its shapes and fused primitives (file
names and lines: ``agents.tools.mindir.export_shapes``, from the runner's graph families).

Why on CPU: exporting runs MindSpore's front end (type and shape inference, pruning) on graphs whose kernels exist
only on the NPU, so an Ascend graph is checked, and its MindIR written for MindSpore Lite or a GE-based
deployment, on a machine without one. ``llm-serving export`` starts this module in a child process (the master
never imports MindSpore) with the agents' ``AgentSpec``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from agents.model.backends import OpsBackend, select_backend
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.tools.contracts import add_check_argument, check_exported, selected_paged_attention
from agents.tools.mindir import GraphSummary, export_shapes, parse_shape
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan
from llm_serving.protocol.wire import AgentSpec


def export_runner(config: LlamaConfig, rc: RunnerConfig, weights: dict[str, np.ndarray],
                  backend: OpsBackend | None = None, shard: ShardPlan | None = None,
                  lora: Mapping[str, Any] | None = None) -> ModelRunner:
    """A runner with ``rc.device_target``'s backend (or ``backend``) and its checks, built on this process's CPU:
    the same model, graphs and warm-up inputs as on the device, compiled only by export. ``shard``: one
    tensor-parallel rank's (its slice of ``weights``; its graphs hold the collectives, in no joined group).
    ``lora``: ``AgentSpec.lora``, the adapter slots the graphs hold (``agents.model.lora``)."""
    if backend is None:
        backend = select_backend(rc.kernels, rc.device_target, rc.dtype,
                                 (shard or ShardPlan(config)).attention_config.hidden_size)
    return ModelRunner(config, weights, replace(rc, device_target="CPU", device_id=0), backend, shard=shard,
                       lora=lora)


def export_graphs(runner: ModelRunner, out_dir: str | Path, shapes: list[tuple] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[tuple[tuple, GraphSummary]]:
    """Export ``shapes`` (default: every warm-up shape) of the runner's graphs to ``out_dir``, each with the
    inputs ``warmup()`` runs it with and named by its graph family (``agents.tools.mindir.export_shapes``). With
    ``dynamic_shapes`` the default is each family's one graph, its input dimensions open, as the device compiles it
    (``infer_boost`` on, as there); shapes named in ``shapes`` are exported as given."""
    dynamic = runner.rc.dynamic_shapes and shapes is None
    if shapes is None:
        shapes = runner.graph_shapes()
        if dynamic:
            shapes = [next(s for s in shapes if s[0] == kind) for kind in dict.fromkeys(s[0] for s in shapes)]
    # with adapter slots, the graphs that compute the updates (the plain ones are those exported without them)
    graphs = runner.adapter_graphs or runner.graphs
    with infer_boost(dynamic or int8_caches(runner)):
        return export_shapes(runner, lambda kind: step_cell(graphs[kind]), out_dir, shapes, progress, dynamic)


def int8_caches(runner: ModelRunner) -> bool:
    """Whether the runner's PagedAttention reads int8 caches (``AscendAttention``'s static-scale cache)."""
    return any(getattr(layer.attention, "kv_scale", None) is not None for layer in runner.model.layers)


@contextmanager
def infer_boost(on: bool) -> Iterator[None]:
    """The context's ``infer_boost`` on while the block compiles, as the agents set it on Ascend
    (``agents.runtime.device``): MindSpore 2.10's PagedAttention type inference takes int8 caches only with it, and
    this process's CPU graphs keep their defaults after."""
    if not on:
        yield
        return
    before = ms.get_context("jit_config")
    ms.set_context(jit_config={**before, "infer_boost": "on"})
    try:
        yield
    finally:
        ms.set_context(jit_config={**before, "infer_boost": before.get("infer_boost", "off")})


def step_cell(graph) -> nn.Cell:
    """The compiled step's cell (a tensor-parallel rank's graph is wrapped once more, to gather its logits)."""
    return getattr(graph, "step", graph).cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="export the step graphs of an agent spec to MindIR (on CPU)")
    parser.add_argument("--spec", required=True, help="AgentSpec as JSON (llm-serving export passes it)")
    parser.add_argument("--out", required=True, help="directory for the .mindir files")
    parser.add_argument("--shape", action="append", type=parse_shape, default=None, metavar="KIND:BATCH:N",
                        help="export only these warm-up shapes (repeatable)")
    parser.add_argument("--rank", type=int, default=0, help="under tensor parallelism: the rank whose graphs to "
                        "export (default 0)")
    add_check_argument(parser)
    args = parser.parse_args(argv)
    spec = AgentSpec.from_json(args.spec)
    config = LlamaConfig(**spec.llama_config)
    try:
        fields = dict(spec.runner_config)
        if fields.pop("memory_utilization", None) is not None and fields["num_blocks"] is None:
            # the cache's block count sizes only dim 0 of its Parameters: the fewest that hold one sequence
            fields["num_blocks"] = 1 + -(-fields["max_model_len"] // fields["block_size"])
            print(f"pa_config.num_blocks auto: exporting with {fields['num_blocks']} blocks (the agents size the "
                  "cache from the device's memory when they start)", flush=True)
        rc = RunnerConfig(**fields)
        backend = select_backend(rc.kernels, rc.device_target, rc.dtype, config.q_dim)
        backend.check(config, rc.block_size, rc.prefill_batch_sizes[-1])
    except ValueError as exc:  # before loading weights: a config mistake answers at once
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from agents.weights.kv_scales import with_kv_scales
    from agents.weights.sharded import load_rank_weights

    try:
        shard = ShardPlan(config, spec.tensor_parallel_size, args.rank, spec.expert_parallel)
        weights = load_rank_weights(spec.model_path, config, shard, quantize=rc.quantization != "none")
        weights = with_kv_scales(weights, spec.model_path, config, shard, spec.runner_config)
        runner = export_runner(config, rc, weights, backend, shard, spec.lora)
        shapes = runner.graph_shapes()
        unknown = [s for s in args.shape or [] if s not in shapes]
        if unknown:
            raise ValueError(f"--shape {unknown} are not warm-up shapes of this config: {shapes}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    note = f" (rank {args.rank} of {shard.tp}: its slice, with the collectives)" if shard.tp > 1 else ""
    print(f"exporting {len(args.shape or shapes)} graphs of {rc.device_target} {rc.dtype} ({backend.name} ops) "
          f"to {args.out}{note}", flush=True)
    done = export_graphs(runner, args.out, args.shape or shapes, lambda line: print(line, flush=True))
    kernel = selected_paged_attention(args.paged_attention_kernel, spec.runner_config)
    return check_exported((summary.path for _, summary in done), shard.tp, kernel) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
