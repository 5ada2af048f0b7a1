"""A local server process for benchmarks and tests: a free port to give it, a wait until it is ready, and a
graceful stop.

``running_server`` starts ``llm-serving serve`` on a free port and stops it on leaving; ``wait_until_ready`` waits
for a started server while noticing one that died; the stop mirrors Ctrl+C (the server then closes its agents and
their shared memory) and kills only a server that does not exit in time.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from llm_serving.bench import BenchError


def free_port() -> int:
    """A port the kernel has just handed out on 127.0.0.1 (free unless someone takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(base_url: str, seconds: float) -> None:
    """Poll ``GET /health`` of the server at ``base_url`` until it answers 200, or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{base_url}/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.2)
    raise BenchError(f"server at {base_url} not ready after {seconds:g}s ({last})")


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health`` in time; the message says which."""


def wait_until_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> float:
    """Seconds until the server on ``port`` answers ``GET /health`` with 200. Polled in 5 s rounds, so that a
    server that exited is noticed at once (``ServerStartError``: "exited N", or the last answer at the timeout)."""
    t0 = time.perf_counter()
    while True:
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{port}", 5.0))
            return time.perf_counter() - t0
        except BenchError as exc:
            if proc.poll() is not None:
                raise ServerStartError(f"exited {proc.returncode}") from None
            if time.perf_counter() - t0 > timeout_s:
                raise ServerStartError(str(exc)) from None


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> None:
    """Send ``sig`` and wait up to ``timeout_s`` for the process to exit, then kill it."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_server(config: str | Path, log_path: str | Path, timeout_s: float = 600.0, *,
                   cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
                   extra_args: Sequence[str] = (), announce: Callable[[str], None] | None = None,
                   ) -> Iterator[tuple[int, float]]:
    """``python -m llm_serving serve --config CONFIG`` on a free port, its output in ``log_path``: yields (port,
    seconds from start to ready) and stops the server on leaving. ``announce`` gets the command line first;
    ``ServerStartError`` when it exits or is not ready within ``timeout_s`` (the log says why)."""
    port = free_port()
    cmd = [sys.executable, "-m", "llm_serving", "serve", "--config", str(config), "--port", str(port), *extra_args]
    if announce is not None:
        announce(" ".join(cmd))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=None if env is None else dict(env), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield port, wait_until_ready(proc, port, timeout_s)
    finally:
        stop(proc)
