"""What clients of ``llm-serving router`` get when an engine behind it stops (SIGSTOP): engines with stand-in agents
(10 ms steps) behind a router, 8 completions of 150 tokens at once (half streamed), the first engine stopped 0.4 s
after they start; each request's status, seconds and the end of its answer. Figures in docs/reliability.md.

    python scripts/router_sigstop.py [--engines N] [--router-tree DIR] [-- ROUTER FLAGS...]

``--router-tree``: run the router from another checkout (e.g. an older commit's ``git archive``) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def start(argv: list[str], cwd: Path, ready: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A process and the URL its "ready" line names."""
    out = log.open("w+")
    proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        out.seek(0)
        found = re.search(ready, out.read())
        if found:
            return proc, found.group(1)
        time.sleep(0.5)
    raise SystemExit(f"{argv[3]} did not start: see {log}")


async def one(session: aiohttp.ClientSession, url: str, i: int, t0: float) -> str:
    stream = (i // 2) % 2 == 1  # engines take idle turns: streamed and not on each
    body = {"prompt": f"story {i}", "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": stream}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            tail = (await r.read()).decode("utf-8", "replace")[-140:].replace("\n", " ")
            status = str(r.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        status, tail = type(exc).__name__, ""
    return f"{i} | stream={stream} | {status} | {time.monotonic() - t0:.1f} s | {tail}"


async def load(url: str, stopped: subprocess.Popen, client_timeout: float) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=client_timeout)) as session:
        tasks = [asyncio.ensure_future(one(session, url, i, t0)) for i in range(8)]
        await asyncio.sleep(0.4)
        os.kill(stopped.pid, signal.SIGSTOP)
        for line in await asyncio.gather(*tasks):
            print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--router-tree", type=Path, default=ROOT)
    p.add_argument("--client-timeout", type=float, default=40.0)
    p.add_argument("router_flags", nargs="*")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="router-sigstop-"))
    engines = [start([sys.executable, "-m", "llm_serving", "serve", "--port", "0", "--standin-agents",
                      "--standin-step-delay", "0.01", "--set", f"default_model.data_dir={work / 'model'}",
                      "--set", "default_model.weights=random"], ROOT, r"ready in .* at (http://\S+)",
                     work / f"engine{i}.log") for i in range(args.engines)]
    flags = [f for _, url in engines for f in ("--engine", url)]
    router, url = start([sys.executable, "-m", "llm_serving", "router", "--port", "0", "--no-prefix-affinity", *flags,
                         *args.router_flags], args.router_tree, r"ready at (http://\S+)", work / "router.log")
    try:
        asyncio.run(load(url, engines[0][0], args.client_timeout))
    finally:
        os.kill(engines[0][0].pid, signal.SIGCONT)
        for proc in [router, *(e for e, _ in engines)]:
            proc.terminate()
            proc.wait(30)
    print(f"logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
