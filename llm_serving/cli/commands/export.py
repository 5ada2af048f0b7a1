"""The ``export`` subcommand: ``llm-serving export --config X.yaml [--model DIR] --out DIR``.

Writes one MindIR file per warm-up shape of the configured model, device target and dtype (what MindSpore Lite or
a GE-based deployment loads) and prints, per graph, its shapes and the fused primitives in it. The graphs are built
and exported on this machine's CPU, so an Ascend config exports without an NPU. The master never imports MindSpore:
the config and model are resolved here, and ``python -m agents.tools.export`` does the rest in a child process.
``--check`` also checks every graph against the fused Ascend ops' real contracts (``agents.tools.contracts``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from llm_serving.cli.options import Command, add_config_arguments, config_from_args


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the .mindir files (created)")
    p.add_argument("--shape", action="append", default=[], metavar="KIND:BATCH:N",
                   help="export only this warm-up shape, e.g. decode:8:16 or ragged:4:128 (repeatable; "
                   "default: every warm-up shape)")
    p.add_argument("--rank", type=int, default=0, metavar="R", help="with serving_config.num_agents > 1 (tensor "
                   "parallelism): export rank R's graphs, its slice of the model and its collectives (default 0)")
    p.add_argument("--check", action="store_true", help="check every exported graph against the fused Ascend ops' "
                   "real contracts (what feeds each input, attributes, dtypes, layouts; docs/ascend.md); exit 1 "
                   "on a violation")


def export_argv(spec_json: str, out: str, shapes: list[str], module: str = "agents.tools.export",
                check: bool = False, rank: int = 0) -> list[str]:
    """The child's command line (``module``: ``agents.mindformers.export`` for backend mindformers)."""
    argv = [sys.executable, "-m", module, "--spec", spec_json, "--out", out]
    if rank:
        argv += ["--rank", str(rank)]
    for shape in shapes:
        argv += ["--shape", shape]
    return argv + ["--check"] if check else argv


def _run(args: argparse.Namespace) -> int:
    from llm_serving.engine.wiring import agent_spec, resolve_model

    config = config_from_args(args)
    model = resolve_model(config, lambda line: print(line, file=sys.stderr, flush=True), tokenizer=False)
    spec = agent_spec(config, model)
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    module = "agents.mindformers.export" if spec.backend == "mindformers" else "agents.tools.export"
    if args.rank and not 0 <= args.rank < spec.tensor_parallel_size:
        print(f"llm-serving export: error: --rank {args.rank} is not a rank of serving_config.num_agents "
              f"{spec.tensor_parallel_size}", file=sys.stderr)
        return 2
    return subprocess.run(export_argv(spec.to_json(), args.out, args.shape, module, args.check, args.rank), env=env,
                          check=False).returncode


COMMAND = Command("export", "write one MindIR per warm-up shape for the configured device target and dtype "
                  "(built on CPU: no NPU needed) and list each graph's shapes and fused primitives",
                  _add_arguments, _run)
