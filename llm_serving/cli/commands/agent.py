"""The ``agent`` command: run one tensor-parallel rank on this host for a server on another
(``llm-serving agent --join HOST:PORT --rank R``, docs/deployment.md).

It joins the server's agent pool (``llm_serving.executor.rank_join``), starts the rank's agent process on the
spec the pool sends, and when that agent ends (the server stopped, replaced its agents after a failure, or the
agent died) joins again, so a server that heals its agents finds this rank back; ``--once`` leaves after one.
The agent exits with this command (it watches its parent), so stopping the command stops the rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from llm_serving.cli.options import CliError, Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the server's serving_config.join_address")
    p.add_argument("--rank", required=True, type=int, metavar="R", help="this rank's number (one of the ranks "
                   "the server does not start itself: serving_config.local_agents .. num_agents - 1)")
    p.add_argument("--device-id", type=int, metavar="D", help="device of this host the rank runs on (default: "
                   "the server's start_device_id + rank)")
    p.add_argument("--ranks-here", type=int, default=1, metavar="N", help="ranks of this server that run on this "
                   "host: on CPU they share its cores and memory (default 1)")
    p.add_argument("--once", action="store_true", help="exit when the agent ends instead of joining again")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.executor.rank_join import JoinRefused, join_pool
    from llm_serving.protocol.wire import split_address

    try:
        split_address(args.join)
    except ValueError as exc:
        raise CliError(f"--join: {exc}") from None
    if args.rank < 1 or args.ranks_here < 1:
        raise CliError("--rank must be >= 1 (rank 0 runs beside the server) and --ranks-here >= 1")

    def say(line: str) -> None:
        print(f"llm-serving agent rank {args.rank}: {line}", file=sys.stderr, flush=True)

    root = str(Path(__file__).resolve().parents[3])
    while True:
        try:
            sock, spec, env = join_pool(args.join, args.rank, log=say)
        except JoinRefused as exc:
            raise CliError(f"the server at {args.join} refused rank {args.rank}: {exc}") from exc
        child_env = {**os.environ, **{k: str(v) for k, v in spec.extra_env.items()}, **env}
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "agents.agent_main", "--rank", str(args.rank), "--link-fd", str(sock.fileno()),
                "--spec", spec.to_json()]
        if args.device_id is not None:
            argv += ["--device-id", str(args.device_id)]
        argv += ["--ranks-here", str(args.ranks_here)]
        with sock:  # the agent holds its own copy of the link
            proc = subprocess.Popen(argv, pass_fds=(sock.fileno(),), env=child_env, stdin=subprocess.DEVNULL)
        say(f"joined {args.join} (agent pid {proc.pid})")
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
            raise
        say(f"agent pid {proc.pid} exited with {code}")
        if args.once:
            return 0 if code == 0 else 1


COMMAND = Command("agent", "run one tensor-parallel rank of a server on another host", _add_arguments, _run)
