"""Ranks on other hosts: how they join an agent pool, and what the pool holds of one.

A pool whose ``AgentSpec`` has remote ranks listens at ``join_address`` while it starts (``JoinListener``). On
each remote host ``llm-serving agent --join HOST:PORT --rank R`` (``llm_serving.cli.commands.agent``) connects
and sends one JSON line, ``{"protocol": ..., "rank": R}``; the pool answers one line, the spec and the cluster
environment of rank R (``{"spec": ..., "env": ...}``) or ``{"error": ..., "retry": bool}``. The connection then
is that rank's link: the agent writes its frames (progress, ready, done, errors) on it as a local agent does on
its reply pipe, and its EOF is the agent's lifeline (the pool shuts the socket down to stop the rank; a rank
that dies closes it). Its steps come from rank 0 through the collective, never from this host's memory.

Joining is plain TCP with no authentication, like MindSpore's own cluster ports: the hosts of one deployment are
expected on a private network (docs/deployment.md).
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import time
from collections.abc import Callable

from llm_serving.protocol.shm_channel import MAGIC
from llm_serving.protocol.wire import AgentSpec, split_address

# both sides of a join run the same build: the step broadcast pickles StepBatch, the frames are the wire's
PROTOCOL = f"llm-serving-join/1 step-layout-{MAGIC:x}"
HELLO_TIMEOUT_S = 5.0  # a connection that sends no hello line in this time is dropped
_LINE_LIMIT = 1 << 20


class JoinRefused(RuntimeError):
    """The pool refused a join; ``retry``: whether asking again may succeed (another pool start, a rank freed)."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class RemoteRank:
    """What the pool holds of a rank on another host: the socket it joined on, in place of its process. Shutting
    the socket down asks it to exit (as closing the lifeline pipe does for a local rank)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.returncode: int | None = None  # 0 once its connection is over

    @property
    def fd(self) -> int:
        return self.sock.fileno()  # -1 once closed

    @property
    def pid(self) -> None:
        return None  # on another host

    def where(self) -> str:
        return f"at {self.peer}"

    def poll(self) -> int | None:
        return self.returncode

    def hang_up(self) -> None:
        """Tell the rank to exit (EOF on its link); its frames may still arrive until it closes its end."""
        self._shutdown(socket.SHUT_WR)

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the rank closes its end (frames still in flight are dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.where()}", timeout or 0.0)
            readable, _, _ = select.select([self.sock], [], [], left)
            if readable:
                try:
                    if not self.sock.recv(65536):
                        self.returncode = 0
                except OSError:
                    self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        self._shutdown(socket.SHUT_RDWR)
        self.returncode = 0 if self.returncode is None else self.returncode

    def close(self) -> None:
        """Close the socket (the pool's last use of it)."""
        self.sock.close()
        self.returncode = 0 if self.returncode is None else self.returncode

    def _shutdown(self, how: int) -> None:
        if self.fd < 0:
            return
        try:
            self.sock.shutdown(how)
        except OSError:
            pass  # already disconnected


class JoinListener:
    """The pool's side of joining: listens at the spec's join address and admits each remote rank once."""

    def __init__(self, spec: AgentSpec, rank_env: Callable[[int, str], dict[str, str]]) -> None:
        """``rank_env(rank, worker_ip)``: the collective cluster's environment for that rank."""
        self.spec, self.rank_env = spec, rank_env
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the next pool rebinds at once
        try:
            self._sock.bind(spec.join_host_port)
            self._sock.listen(16)
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen for joining ranks at {spec.join_address}: {exc}") from exc
        self.joined: dict[int, RemoteRank] = {}

    @property
    def expected(self) -> list[int]:
        return list(range(self.spec.num_local_ranks, self.spec.tensor_parallel_size))

    @property
    def waiting_for(self) -> list[int]:
        return [r for r in self.expected if r not in self.joined]

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> tuple[int, RemoteRank] | str:
        """Take one pending connection: (its rank, its handle) when admitted, else why it was refused."""
        conn, peer = self._sock.accept()
        where = f"{peer[0]}:{peer[1]}"
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            rank, refusal = self._check_hello(conn.makefile("rb").readline(_LINE_LIMIT))
            if refusal is not None:
                conn.sendall(_line({"error": refusal.args[0], "retry": refusal.retry}))
                conn.close()
                return f"refused a join from {where}: {refusal.args[0]}"
            env = self.rank_env(rank, peer[0])
            conn.sendall(_line({"spec": self.spec.to_json(), "env": env}))
            conn.settimeout(None)
        except OSError as exc:
            conn.close()
            return f"dropped a join from {where}: {exc}"
        handle = RemoteRank(conn, where)
        self.joined[rank] = handle
        return rank, handle

    def _check_hello(self, line: bytes) -> tuple[int, JoinRefused | None]:
        try:
            hello = json.loads(line)
            protocol, rank = hello["protocol"], hello["rank"]
        except (ValueError, KeyError, TypeError):
            return -1, JoinRefused("expected a JSON line with 'protocol' and 'rank'", retry=False)
        if protocol != PROTOCOL:
            return -1, JoinRefused(f"this pool speaks {PROTOCOL!r}, the joining agent {protocol!r}: run the same "
                                   "llm-serving build on every host", retry=False)
        if not isinstance(rank, int) or rank not in self.expected:
            return -1, JoinRefused(f"rank {rank!r} is not one that joins this pool (ranks "
                                   f"{self.expected[0]}..{self.expected[-1]} of {self.spec.tensor_parallel_size} "
                                   "join from other hosts)", retry=False)
        if rank in self.joined:
            return -1, JoinRefused(f"rank {rank} has already joined", retry=True)
        return rank, None

    def close(self) -> None:
        self._sock.close()


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def join_pool(address: str, rank: int, retry_s: float = 0.5,
              log: Callable[[str], None] = lambda _line: None) -> tuple[socket.socket, AgentSpec, dict[str, str]]:
    """(The remote host.) Connect to the pool at ``address`` as ``rank``, asking again every ``retry_s`` while no
    pool listens there or the pool asks to retry; the connected socket, the spec and the rank's environment.
    Raises ``JoinRefused`` when the pool refuses for good (wrong rank, another build)."""
    host, port = split_address(address)
    said = None
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
        except OSError as exc:
            said = _say_once(log, said, f"no pool accepts joins at {address} yet ({exc.strerror or exc}); retrying")
            time.sleep(retry_s)
            continue
        try:
            sock.sendall(_line({"protocol": PROTOCOL, "rank": rank}))
            answer = json.loads(sock.makefile("rb").readline(_LINE_LIMIT) or b"{}")
        except (OSError, ValueError) as exc:
            sock.close()
            said = _say_once(log, said, f"the join at {address} broke off ({exc}); retrying")
            time.sleep(retry_s)
            continue
        if "spec" in answer:
            sock.settimeout(None)
            return sock, AgentSpec.from_json(answer["spec"]), {str(k): str(v) for k, v in answer["env"].items()}
        sock.close()
        message = str(answer.get("error", "the pool closed the connection"))
        if not answer.get("retry", True):
            raise JoinRefused(message, retry=False)
        said = _say_once(log, said, f"{message}; retrying")
        time.sleep(retry_s)


def _say_once(log: Callable[[str], None], said: str | None, line: str) -> str:
    if line != said:
        log(line)
    return line
