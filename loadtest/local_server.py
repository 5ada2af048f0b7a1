"""A local server process for benchmarks and tests: a free port to give it, and a graceful stop.

The benchmark scripts start ``llm-serving serve`` themselves; the stop mirrors Ctrl+C (the server then closes its
agents and their shared memory) and kills only a server that does not exit in time.
"""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A port the kernel has just handed out on 127.0.0.1 (free unless someone takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> None:
    """Send ``sig`` and wait up to ``timeout_s`` for the process to exit, then kill it."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
