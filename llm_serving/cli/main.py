"""The ``llm-serving`` command line (also ``python -m llm_serving``).

Every module of ``llm_serving.cli.commands`` that defines ``COMMAND`` (an ``options.Command``: name, help line,
a function adding its arguments and one running it) is a subcommand: a new command is a new module there, and
this file imports none of them by name. Command modules keep heavy imports inside their run functions, so
``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from llm_serving.cli import commands
from llm_serving.cli.options import CliError, Command


def discover_commands() -> list[Command]:
    """The ``COMMAND`` of each module in ``llm_serving.cli.commands``, by module name."""
    found = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if isinstance(getattr(module, "COMMAND", None), Command):
            found.append(module.COMMAND)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    from llm_serving.config.serving_config import ConfigError
    from llm_serving.engine.request_stream import EngineError
    from llm_serving.executor.agent_pool import AgentError
    from llm_serving.request_errors import RequestRejected

    parser = argparse.ArgumentParser(prog="llm-serving", description="Continuous-batching LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    handlers = {}
    for cmd in discover_commands():
        cmd.add_arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
        handlers[cmd.name] = cmd.run
    args = parser.parse_args(argv)
    try:
        return handlers[args.command](args)
    except (CliError, ConfigError, RequestRejected) as exc:
        print(f"llm-serving {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (EngineError, AgentError) as exc:  # agents failed to start or died
        print(f"llm-serving {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
