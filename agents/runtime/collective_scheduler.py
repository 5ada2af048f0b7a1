"""The scheduler process of MindSpore's dynamic cluster, one per tensor-parallel agent pool.

``python -m agents.runtime.collective_scheduler --lifeline-fd FD`` with ``MS_ROLE=MS_SCHED``, ``MS_SCHED_HOST``,
``MS_SCHED_PORT`` and ``MS_WORKER_NUM`` set (``llm_serving.executor.collective_launch`` starts it). The ranks register
with it in ``init()``; their collectives then run between them.

Why two processes: the scheduler's ``init()`` never returns while its cluster lives and holds the GIL, so no
thread of its own can watch the master. So this process forks first, before importing MindSpore: the child
runs the scheduler and is killed by the kernel when this parent dies (``PR_SET_PDEATHSIG``; the parent is
single-threaded, so that is exactly when the parent exits); the parent only watches the master's lifeline
pipe and its child. The pool kills the parent (its pid is the one the pool knows), and with it the child.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(1)  # no parent-death signal, or the parent already died before it was set


def run_scheduler() -> None:
    """The child: MindSpore's scheduler node (blocks while the cluster lives). It only builds the ranks'
    topology, so it runs on CPU whatever their device (``init()`` takes the MCCL path for ``MS_SCHED``)."""
    import mindspore as ms
    from mindspore.communication import init

    ms.set_device("CPU")
    init()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="MindSpore cluster scheduler for one agent pool")
    parser.add_argument("--lifeline-fd", type=int, required=True)
    args = parser.parse_args(argv)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(args.lifeline_fd)
        _die_with_parent(parent)
        try:
            run_scheduler()
        except BaseException as exc:  # noqa: BLE001 - reported on stderr; the exit code says it failed
            print(f"collective scheduler failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the child follows through PDEATHSIG
    while True:
        readable, _, _ = select.select([args.lifeline_fd], [], [], 0.5)
        if readable and not os.read(args.lifeline_fd, 1):
            os._exit(0)  # the master is gone: so is the child (PDEATHSIG)
        done, status = os.waitpid(child, os.WNOHANG)
        if done:  # the scheduler ended (its cluster is over, or it failed): so does this process
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 1)


if __name__ == "__main__":
    main()
