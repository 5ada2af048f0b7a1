"""The ``bench`` subcommand: the contest-style load test (``loadtest`` package) as ``llm-serving bench``."""

from __future__ import annotations

import argparse

from llm_serving.cli.options import Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from loadtest import cli

    cli.add_arguments(p)


def _run(args: argparse.Namespace) -> int:
    from loadtest import cli

    return cli.run_args(args, "llm-serving bench")


COMMAND = Command("bench", "load-test a running server (test_serving_performance.py flags: -X -P -O -T ...)",
                  _add_arguments, _run)
