"""A local server process for benchmarks and tests: a free port to give it, a wait until it is ready, and a
graceful stop.

The benchmark scripts start ``llm-serving serve`` themselves; ``wait_until_ready`` waits for it while noticing a
server that died; the stop mirrors Ctrl+C (the server then closes its agents and their shared memory) and kills
only a server that does not exit in time.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time

from loadtest import BenchError
from loadtest.client import wait_ready
from loadtest.protocol import BenchConfig


def free_port() -> int:
    """A port the kernel has just handed out on 127.0.0.1 (free unless someone takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health`` in time; the message says which."""


def wait_until_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> float:
    """Seconds until the server on ``port`` answers ``GET /health`` with 200. Polled in 5 s rounds, so that a
    server that exited is noticed at once (``ServerStartError``: "exited N", or the last answer at the timeout)."""
    t0 = time.perf_counter()
    cfg = BenchConfig(port=port)
    while True:
        try:
            asyncio.run(wait_ready(cfg, 5.0))
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
