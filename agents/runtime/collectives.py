"""An agent rank's part in MindSpore's collectives: its share of the host's cores, then joining the cluster.

The pool (``llm_serving.executor.collective_launch``) starts the cluster's scheduler and gives every rank its
``MS_ROLE`` / ``MS_SCHED_HOST`` / ``MS_SCHED_PORT`` / ``MS_WORKER_NUM`` / ``MS_NODE_ID``; ``init()`` then picks
HCCL on Ascend and MCCL on CPU.

CPU threads: ``tp`` ranks on one host would each start thread pools sized for every core (MindSpore's CPU
kernels, our native kernels' helpers), ``tp`` times too many threads spinning on the same cores. So each rank
gets ``cores / ranks on this host`` threads (all ``tp`` unless some ranks run on other hosts). The OS places
them: pinning each rank to its own share of the cores (``LLM_SERVING_PIN_RANKS=1``) was slower here (2 ranks on
2 cores, bench model: decode batch 128 137 ms pinned against 93 ms not, on the idle machine), since a rank
waiting in a collective leaves its core idle while the other rank's communication threads could use it.

Joining: MindSpore 2.10's cluster client races with its own event thread when it connects to the scheduler
(the connection's completion is handled before the connection is filled in; the attempt then fails and is
retried every 0.5 s): measured here, a rank's ``init()`` took 3.5 s in some starts and 45-50 s in others,
more often when a core was idle. So a rank joins on one core with its main thread in ``SCHED_BATCH``, which the
event threads it creates in ``init()`` inherit: a woken batch thread does not preempt the running one, so the
client finishes its bookkeeping before the handler runs. Afterwards every thread of the process is put back
(``SCHED_OTHER``, the rank's cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llm_serving.protocol.parallel import ShardPlan


def cpu_share(cores: list[int], ranks_here: int, index: int) -> tuple[list[int] | None, int]:
    """(cores to pin the ``index``-th of ``ranks_here`` ranks on this host to, or None to leave it unpinned; its
    thread count)."""
    threads = max(1, len(cores) // ranks_here)
    if len(cores) < ranks_here:
        return None, 1
    return sorted(cores)[index * threads: (index + 1) * threads], threads


def share_cpus(plan: ShardPlan, ranks_here: int) -> int:
    """Size our kernels' thread pool to this rank's share of the cores (``ranks_here``: the pool's ranks on this
    host), and pin the process to that share where asked (before MindSpore or the kernels start any thread,
    which inherit both); returns the thread count for MindSpore's CPU kernels."""
    pinned, threads = cpu_share(list(os.sched_getaffinity(0)), ranks_here, plan.rank % ranks_here)
    if pinned is not None and os.environ.get("LLM_SERVING_PIN_RANKS") == "1":
        os.sched_setaffinity(0, pinned)
    os.environ.setdefault("LLM_SERVING_KERNEL_THREADS", str(threads))
    return threads


def join_cluster(plan: ShardPlan, fields: Mapping[str, Any], cpu_threads: int,
                 lifeline_fd: int | None) -> tuple[float, float]:
    """Set the device up (``fields``: the runner config's, for ``agents.runtime.device.setup_device``) and join
    the ranks' cluster (blocks until every rank has joined); the seconds spent importing MindSpore and setting the
    device up, and in ``init()`` (a start-up's phases, for its progress).

    ``init()`` holds the GIL while it waits, so the agent's watchdog thread cannot see the master die meanwhile:
    a ``lifeline_reaper`` process watches the lifeline pipe for that time instead.
    """
    t0 = time.perf_counter()
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    from agents.runtime.device import setup_device

    device_target = fields["device_target"]
    setup_device(device_target, fields["device_id"], fields.get("device_environment"), fields.get("max_device_memory"))
    t1 = time.perf_counter()
    if device_target == "CPU":
        ms.device_context.cpu.op_tuning.threads_num(cpu_threads)
    reaper = None
    if lifeline_fd is not None:
        reaper = subprocess.Popen([sys.executable, "-m", "agents.runtime.lifeline_reaper", "--pid", str(os.getpid()),
                                   "--lifeline-fd", str(lifeline_fd)], pass_fds=(lifeline_fd,),
                                  stdin=subprocess.DEVNULL)
    try:
        with _batch_on_one_core(plan.rank):
            init()
    finally:
        if reaper is not None:
            reaper.kill()
            reaper.wait()
    if (get_rank(), get_group_size()) != (plan.rank, plan.tp):
        raise RuntimeError(f"the collective cluster made this agent rank {get_rank()} of {get_group_size()}, "
                           f"expected rank {plan.rank} of {plan.tp} (MS_NODE_ID / MS_WORKER_NUM)")
    return t1 - t0, time.perf_counter() - t1


@contextmanager
def _batch_on_one_core(rank: int) -> Iterator[None]:
    """Main thread (and the threads it creates meanwhile) on one core in ``SCHED_BATCH``; afterwards every
    thread of the process goes back to ``SCHED_OTHER`` and the main thread's cores before (see the module doc)."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(cores)[rank % len(cores)]})
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    try:
        yield
    finally:
        for entry in Path("/proc/self/task").iterdir():
            try:
                os.sched_setscheduler(int(entry.name), os.SCHED_OTHER, os.sched_param(0))
                os.sched_setaffinity(int(entry.name), cores)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile
