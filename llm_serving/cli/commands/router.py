"""The ``router`` command: one HTTP front end over several ``llm-serving serve`` engines (data parallelism, and with
``--prefill`` prefill/decode disaggregation; ``llm_serving.router``; launches in docs/deployment.md)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time

from llm_serving.cli.options import CliError, Command
from llm_serving.router.timeouts import Timeouts


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", required=True, metavar="URL", help="an engine's base URL, e.g. "
                   "http://10.0.0.2:8001 (repeat for each engine)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill engine's base URL "
                   "(repeatable; engines started with serving_config.kv_transfer): completion and chat requests run "
                   "their prompt there first and the --engine engines decode from its KV blocks")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind, 0 for any free one (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("LLM_SERVING_API_KEY") or None, metavar="KEY",
                   help="require Authorization: Bearer KEY on every route but /health, and send it to the engines on "
                        "the router's own calls (/metrics); give the engines the same serving_config.api_key "
                        "(default $LLM_SERVING_API_KEY, which keeps it out of ps)")
    p.add_argument("--no-prefix-affinity", action="store_true", help="route by load alone")
    p.add_argument("--min-match", type=float, default=0.5, metavar="F", help="share of a prompt an engine must "
                   "hold as a remembered prefix to be preferred (default 0.5)")
    p.add_argument("--max-imbalance", type=int, default=4, metavar="N", help="most requests in flight the "
                   "preferred engine may have beyond the least busy one (default 4)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S", help="seconds between health "
                   "checks of each engine (default 1)")
    p.add_argument("--connect-timeout", type=float, default=Timeouts.connect_s, metavar="S", help="seconds to "
                   f"connect to an engine before trying another (default {Timeouts.connect_s:g})")
    p.add_argument("--first-byte-timeout", type=float, default=Timeouts.first_byte_s, metavar="S", help="seconds "
                   "an engine may take to begin its answer (a request that is not streamed: the whole generation) "
                   f"before the request goes to another engine or gets a 504 (default {Timeouts.first_byte_s:g})")
    p.add_argument("--idle-timeout", type=float, default=Timeouts.idle_s, metavar="S", help="seconds an engine "
                   "may send nothing in the middle of an answer before it is cut (a stream ends with an error "
                   f"event; default {Timeouts.idle_s:g})")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.front.api_key import exposure_warning
    from llm_serving.router.affinity import AffinityPolicy
    from llm_serving.router.proxy import RouterServer

    for flag, urls in (("--engine", args.engine), ("--prefill", args.prefill)):
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise CliError(f"{flag} {url!r}: expected a URL such as http://HOST:PORT")
    if not 0 <= args.min_match <= 1 or args.max_imbalance < 0 or args.health_interval <= 0:
        raise CliError("--min-match must be in [0, 1], --max-imbalance >= 0 and --health-interval > 0")
    for flag in ("connect_timeout", "first_byte_timeout", "idle_timeout"):
        if not getattr(args, flag) > 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0 seconds")
    timeouts = Timeouts(args.connect_timeout, args.first_byte_timeout, args.idle_timeout)
    policy = AffinityPolicy(len(args.engine), args.min_match, args.max_imbalance, not args.no_prefix_affinity)
    prefill_policy = AffinityPolicy(len(args.engine) + len(args.prefill), args.min_match, args.max_imbalance,
                                    not args.no_prefix_affinity)
    server = RouterServer(args.engine, policy, args.health_interval, tuple(args.prefill), prefill_policy, timeouts,
                          args.api_key)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    if warning := exposure_warning(args.host, args.api_key, "--api-key (or $LLM_SERVING_API_KEY)"):
        print(warning, file=sys.stderr, flush=True)
    asyncio.run(_serve(server, sock))
    return 0


async def _serve(server, sock: socket.socket) -> None:
    from aiohttp import web

    runner = server.make_runner()
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    up = sum(server.engines[i].healthy for i in server.serving)
    prefill = f", {len(server.prefilling)} prefill engines" if server.prefilling else ""
    print(f"[llm-serving router {time.strftime('%H:%M:%S')}] ready at http://{host}:{port} "
          f"({up} of {len(server.serving)} engines serving{prefill})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


COMMAND = Command("router", "one HTTP front end over several serving engines (data parallelism, prefill/decode "
                  "disaggregation)",
                  _add_arguments, _run)
