"""``python -m agents.mindformers.export``: ``llm-serving export`` for backend mindformers.

One MindIR per warm-up shape of the ``MindFormersRunner``, built on this machine's CPU (MindFormers' Llama calls
Ascend-only kernels, so on CPU it can be compiled and exported but not run), each exported with the inputs
``warmup()`` runs it with, through the same step cells the runner serves with. Runs in the MindFormers
environment (``scripts/mindformers_env.sh``); the master starts it with its own python.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agents.mindformers.runner import MindFormersRunner, MindFormersRunnerConfig
from agents.tools.contracts import add_check_argument, check_exported, selected_paged_attention
from agents.tools.mindir import GraphSummary, export_shapes, parse_shape
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.wire import AgentSpec


def export_runner(llama: LlamaConfig, rc: MindFormersRunnerConfig, weights: dict, model_cfg_path: str,
                  progress: Callable[[str], None] | None = None) -> MindFormersRunner:
    """The runner for ``rc`` built on this process's CPU (the device's graphs, compiled only by export)."""
    return MindFormersRunner(llama, weights, replace(rc, device_target="CPU", device_id=0), model_cfg_path,
                             progress=progress)


def export_graphs(runner: MindFormersRunner, out_dir: str | Path, shapes: list[tuple] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[tuple[tuple, GraphSummary]]:
    """Export ``shapes`` (default: every warm-up shape) to ``out_dir`` with their warm-up inputs."""
    shapes = shapes if shapes is not None else runner.graph_shapes()
    return export_shapes(runner, runner.graph, out_dir, shapes, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="export the mindformers backend's step graphs to MindIR (on CPU)")
    parser.add_argument("--spec", required=True, help="AgentSpec as JSON (llm-serving export passes it)")
    parser.add_argument("--out", required=True, help="directory for the .mindir files")
    parser.add_argument("--shape", action="append", type=parse_shape, default=None, metavar="KIND:BATCH:N")
    add_check_argument(parser)
    args = parser.parse_args(argv)
    spec = AgentSpec.from_json(args.spec)
    llama = LlamaConfig(**spec.llama_config)
    from agents.weights.checkpoints import load_weights

    try:
        rc = MindFormersRunnerConfig.from_dict(spec.runner_config)
        runner = export_runner(llama, rc, load_weights(spec.model_path, llama), spec.model_cfg_path,
                               lambda line: print(line, flush=True))
        shapes = runner.graph_shapes()
        unknown = [s for s in args.shape or [] if s not in shapes]
        if unknown:
            raise ValueError(f"--shape {unknown} are not warm-up shapes of this config: {shapes}")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exporting {len(args.shape or shapes)} MindFormers graphs of {rc.device_target} {rc.dtype} to {args.out}",
          flush=True)
    done = export_graphs(runner, args.out, args.shape or shapes, lambda line: print(line, flush=True))
    kernel = selected_paged_attention(args.paged_attention_kernel, spec.runner_config)
    return check_exported((summary.path for _, summary in done), 1, kernel) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
