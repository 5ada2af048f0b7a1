"""What MindSpore's collectives need from the master for a tensor-parallel agent pool: one scheduler process
(``agents.runtime.collective_scheduler``, the dynamic cluster's ``MS_SCHED`` role) on a free port, and the cluster
environment of every rank. ``AgentPool`` starts it before the ranks and stops it with them.

Ports: the scheduler's port is one the kernel hands out as free (bound to port 0 on the loopback, or on the
join address's host when ranks on other hosts join, then released), so two servers on one machine get different
ones; the ranks themselves listen on no fixed port. If another process takes the port in between, the scheduler
exits and the pool's start-up fails like any other (the engine then retries with a new port).

Lifetime: the scheduler holds the read end of its own lifeline pipe, like the agents: when the master exits,
even by SIGKILL, it sees EOF and exits, and its MindSpore child dies with it. ``stop`` kills it at once.
MindSpore's heartbeats between the ranks and the scheduler stay on: with ``MS_DISABLE_HEARTBEAT=1`` a rank
crashed (SIGSEGV) in ``init()`` here, once in a few starts. The pool supervises the ranks itself anyway.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llm_serving.protocol.wire import AgentSpec

HOST = "127.0.0.1"  # the scheduler's address when every rank runs on the master's host


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cluster_host(spec: AgentSpec) -> str:
    """Where the scheduler listens: the loopback, or the join address's host when ranks on other hosts join."""
    return spec.join_host_port[0] if spec.has_remote_ranks else HOST


def needs_cluster(spec: AgentSpec) -> bool:
    """MindSpore agents of more than one rank share a model through collectives; stand-ins need none."""
    return spec.kind == "llama" and spec.tensor_parallel_size > 1


@dataclass
class CollectiveCluster:
    """The scheduler process of one pool's cluster and the environment its ranks join it with."""

    proc: subprocess.Popen
    host: str
    port: int
    world_size: int
    topology_timeout_s: int
    lifeline_w: int

    @classmethod
    def start(cls, spec: AgentSpec, env: dict[str, str], topology_timeout_s: float) -> CollectiveCluster:
        """Spawn the scheduler (``env``: the agents' environment) on a free port; it waits for the ranks."""
        host = cluster_host(spec)
        port, world = free_port(host), spec.tensor_parallel_size
        timeout = max(1, int(topology_timeout_s))
        life_r, life_w = os.pipe()
        child_env = {**env, **cls.common_env(host, port, world, timeout), "MS_ROLE": "MS_SCHED"}
        child_env.setdefault("GLOG_v", "3")  # MindSpore logs the scheduler's retries every 0.5 s as warnings
        root = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "agents.runtime.collective_scheduler", "--lifeline-fd", str(life_r)]
        try:
            proc = subprocess.Popen(argv, pass_fds=(life_r,), env=child_env, stdin=subprocess.DEVNULL, stdout=2)
        except BaseException:
            os.close(life_w)
            raise
        finally:
            os.close(life_r)
        return cls(proc, host, port, world, timeout, life_w)

    @staticmethod
    def common_env(host: str, port: int, world: int, topology_timeout_s: int) -> dict[str, str]:
        return {"MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world),
                "MS_TOPO_TIMEOUT": str(topology_timeout_s)}

    def rank_env(self, rank: int, worker_ip: str | None = None) -> dict[str, str]:
        """The environment of rank ``rank``'s agent process (its rank is its node id); ``worker_ip``: the address
        the other ranks reach it at, when they are not all on the loopback."""
        env = {**self.common_env(self.host, self.port, self.world_size, self.topology_timeout_s),
               "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)}
        if worker_ip is not None:
            env["MS_WORKER_IP"] = worker_ip
        return env

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The scheduler's exit code once it has exited, else None."""
        return self.proc.poll()

    def stop(self) -> None:
        """Kill the scheduler (its MindSpore child follows) and close its lifeline; idempotent."""
        if self.lifeline_w >= 0:
            os.close(self.lifeline_w)
            self.lifeline_w = -1
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
