"""The ``serve`` subcommand's arguments, registered with ``llm_serving.cli.main`` (kept light for ``--help``)."""

from __future__ import annotations

import argparse
import os

from llm_serving.cli.main import Command, add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``serve``; each overrides the matching key of the YAML file (after any ``--set``)."""
    add_config_arguments(p)  # --config, --model, --decode-batch-size, --prefill-batch-size, --policy, --agents
    p.add_argument("--model-path", dest="model", help=argparse.SUPPRESS)  # spelling used in configs/example.yaml
    p.add_argument("--num-agents", dest="agents", type=int, help=argparse.SUPPRESS)
    p.add_argument("--host", help="address to bind (serving_config.server_ip; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind, 0 for any free one (serving_config.server_port)")
    p.add_argument("--api-key", default=os.environ.get("LLM_SERVING_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(serving_config.api_key; default $LLM_SERVING_API_KEY, which keeps it out of ps)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, VALUE in YAML (e.g. --set pa_config.num_blocks=1024)")
    p.add_argument("--standin-agents", action="store_true",
                   help="testing only: agents answer instantly with deterministic tokens, no model")
    p.add_argument("--standin-step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="testing only: simulated compute time of each stand-in step")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.api.launch import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-serving serve", description=COMMAND.help)
    add_arguments(p)
    return p


COMMAND = Command("serve", "serve a model over HTTP (llm-serving and OpenAI APIs) until SIGINT/SIGTERM",
                  add_arguments, _run)
