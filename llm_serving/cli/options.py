"""What the ``llm-serving`` commands share: the ``Command`` entry each command module defines, the one-line
user error, and the launch options (--config, --model and their overrides) of generate, serve, bench and export.
Light on purpose: every command module imports it, and ``--help`` imports every command module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm_serving.protocol.model_config import DEVICE_TARGETS


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CliError(Exception):
    """A user mistake worth one line on stderr and exit status 2 (not a traceback)."""


# ---- shared options ---------------------------------------------------------------------------------------
def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config/--model and the launch overrides shared by generate, serve and bench."""
    p.add_argument("--config", metavar="YAML", help="launch configuration (default: built-in defaults, "
                   "which serve the embedded default model)")
    p.add_argument("--model", metavar="PATH", help="model directory or checkpoint (overrides "
                   "model_config.model_path)")
    p.add_argument("--decode-batch-size", type=int, metavar="B", help="largest decode batch (one bucket)")
    p.add_argument("--prefill-batch-size", type=int, metavar="P", help="largest prefill batch (one bucket)")
    p.add_argument("--policy", choices=("fcfs", "longest_output_first", "priority"), help="admission order")
    p.add_argument("--agents", type=int, metavar="K", help="tensor-parallel size: agent processes (ranks), each "
                   "holding 1/K of the model")
    p.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), help="answer a thinking model's "
                   "<think> block as the chat message's reasoning_content (tokenizer.reasoning_parser, as vLLM's)")
    p.add_argument("--device-target", choices=DEVICE_TARGETS, help="device of the agents "
                   "(model_config.device_target; rank r on device serving_config.start_device_id + r)")


def config_from_args(args: argparse.Namespace) -> Any:
    from llm_serving.config.serving_config import ServingConfig

    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    if getattr(args, "device_target", None):
        cfg = cfg.with_values({"model_config.device_target": args.device_target})
    if getattr(args, "reasoning_parser", None):
        cfg = cfg.with_values({"tokenizer.reasoning_parser": args.reasoning_parser})
    return cfg.with_overrides(model_path=args.model, policy=args.policy,
                              decode_batch_size=args.decode_batch_size,
                              prefill_batch_size=args.prefill_batch_size, num_agents=args.agents)
