"""The master's side of the device agents: one process per rank, a shared-memory step channel, pipe signals.

Each agent is a fresh interpreter (``python -m agents.agent_main``), never a fork of the master: MindSpore is
loaded only there, and graph mode needs its code in files. Per step the master copies the batch into the
fixed-layout segment (``shm_channel``), writes an 8-byte step number to every rank's command pipe and sleeps
in ``poll`` on the ranks' reply pipes; each rank answers with a 16-byte frame after its step, rank 0 having
written the token ids and logprobs into the segment first. Every rank acknowledges so the master never
overwrites a batch another rank is still reading (the tensor-parallel layout: all ranks get the same batch).
With asynchronous scheduling (``AgentSpec.steps_in_flight`` 2) the master sends the next step while one runs:
two segments, step ``s`` in segment ``s % 2``, so neither the batch an agent reads nor the answer the master has
yet to copy is overwritten; the agents take the steps in order from their command pipes.

Failure handling is the point of the design:
- an agent that dies closes its reply pipe, so ``poll`` wakes at once (EOF) and the pool raises
  ``AgentDiedError``, kills the other ranks and unlinks the segment (a 1 s poll timeout also checks exit
  codes, in case something else still holds the pipe open);
- agents hold the read end of a "lifeline" pipe whose write end only the master has: when the master exits,
  even by SIGKILL, the agents see EOF and exit, so no orphan keeps a device;
- a start-up failure in any rank (bad checkpoint path, compile error) becomes one ``AgentStartupError``
  naming the rank and the cause, after every agent is killed and the segment unlinked;
- a step not answered within ``step_timeout_s`` (a stuck or stopped agent) is a death too; the engine sets
  the timeout from ``slowest_warmup_step_s``, which the agents report when ready;
- rank 0's DONE frame names sequences that failed on their own (``StepOutput.errors``): the step succeeds;
- tensor-parallel MindSpore ranks share their model through collectives: the pool starts their cluster's
  scheduler first (``collective_launch``), fails the start-up if it exits, and stops it with the agents;
- ranks on other hosts (``AgentSpec.has_remote_ranks``) are not the pool's children: they join while it starts
  (``rank_join``), their socket stands for their process (frames in, EOF as their death, shutting it down as
  their lifeline), and they, like the local ranks but 0, take each step from rank 0's broadcast: only rank 0 gets
  step numbers on a command pipe. A rank that never joins fails the start-up, naming the command that joins it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from llm_serving.executor.collective_launch import CollectiveCluster, cluster_host, needs_cluster
from llm_serving.executor.rank_join import JoinListener, RemoteRank
from llm_serving.protocol.batch import FAILED_TOKEN, KvCopyStep, Step, StepOutput
from llm_serving.protocol.kv_segment import KvSegment
from llm_serving.protocol.shm_channel import StepChannel
from llm_serving.protocol.wire import (
    CMD,
    DONE,
    ERROR,
    FRAME,
    PROGRESS,
    READY,
    AgentSpec,
    parse_done_payload,
    parse_error_payload,
    parse_ready_payload,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # noqa: UP035  (typing.Self is 3.11+: mypy checks for 3.10)

class AgentError(RuntimeError):
    """Base class of the pool's errors."""


class AgentStartupError(AgentError):
    """An agent failed before it was ready; ``rank`` and the agent's ``agent_traceback`` (if any) attached."""

    def __init__(self, message: str, rank: int | None = None, agent_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.agent_traceback = agent_traceback


class AgentDiedError(AgentError):
    """An agent exited, crashed or did not answer a step in time; the pool is closed (agents killed, memory
    unlinked). The engine replaces the pool."""


class AgentStepError(AgentError):
    """An agent raised while running a step (e.g. a shape beyond its buckets); the agents keep serving."""

    def __init__(self, message: str, rank: int, agent_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.agent_traceback = agent_traceback


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Agent:
    rank: int
    proc: subprocess.Popen | RemoteRank  # a rank on another host: the socket it joined on
    cmd_w: int  # master writes step numbers (-1: the rank takes its steps from rank 0's broadcast)
    reply_r: int  # master reads frames (a remote rank's socket)
    lifeline_w: int  # never written; closing it (or the master dying) tells the agent to exit
    buf: bytearray = field(default_factory=bytearray)

    @property
    def remote(self) -> bool:
        return isinstance(self.proc, RemoteRank)

    def where(self) -> str:
        return self.proc.where() if isinstance(self.proc, RemoteRank) else f"pid {self.proc.pid}"

    def exit_text(self, code: int | None) -> str:
        return f"its connection from {self.proc.peer} closed" if isinstance(self.proc, RemoteRank) \
            else describe_exit(code)

    def output_hint(self) -> str:
        return "see the output of its `llm-serving agent --join` on that host" if isinstance(self.proc, RemoteRank) \
            else "see its stderr"


class AgentPool:
    """Starts ``spec.tensor_parallel_size`` agent processes and runs steps on them (one caller thread at a time):
    ``run_step``, or ``submit`` then ``collect`` to work while the agents compute.

    ``close()`` may be called from any thread, also while a step is in flight (``collect`` then raises
    ``AgentDiedError``). Use as a context manager or call ``close()``; both are idempotent.
    """

    def __init__(self, spec: AgentSpec, startup_timeout_s: float = 600.0,
                 step_timeout_s: float | None = None, shutdown_grace_s: float = 5.0) -> None:
        self.spec = spec
        self.num_agents = spec.tensor_parallel_size
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self._agents: list[_Agent] = []
        self._by_fd: dict[int, _Agent] = {}
        self._poller = select.poll()
        self._channels: list[StepChannel] = []  # spec.steps_in_flight segments: step s in segment s % len
        self._kv: KvSegment | None = None  # spec.kv_transfer: whole KV blocks out of and into the agents' caches
        self._cluster: CollectiveCluster | None = None  # the collectives' scheduler of tensor-parallel ranks
        self._listener: JoinListener | None = None  # while starting, for ranks on other hosts to join
        self._join_notes: list[str] = []  # joins refused meanwhile, for the start-up progress
        self._step = 0
        self._in_flight: deque[tuple[int, int]] = deque()  # (step, its decode steps) submitted, oldest first
        self._early: list[tuple[_Agent, int, int, str]] = []  # frames of a later step, read while waiting for one
        self._failed_rows: dict[int, str] = {}  # rank 0's DONE frame of the step being collected
        self.slowest_warmup_step_s: float | None = None  # the agents' slowest warmed-up step, once ready
        self.kv_blocks: int | None = None  # the fewest KV blocks a rank's cache holds, as the ranks reported
        self._state = "new"  # new -> starting -> ready -> closed
        self._death: str | None = None
        self._closing = False
        self._step_lock = threading.Lock()
        self._close_lock = threading.RLock()

    # ---- properties ----------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while every agent (and the collectives' scheduler) is up and serving."""
        return self._state == "ready" and all(a.proc.poll() is None for a in self._agents) and (
            self._cluster is None or self._cluster.exited() is None)

    @property
    def pids(self) -> list[int]:
        """Process ids of the agents on this host, by rank (still listed after close, so callers can check they
        are gone)."""
        return [a.proc.pid for a in self._agents if not isinstance(a.proc, RemoteRank)]

    @property
    def helper_pids(self) -> list[int]:
        """Process ids of the pool's helpers (the collectives' scheduler), listed after close too."""
        return [self._cluster.pid] if self._cluster is not None else []

    @property
    def shm_name(self) -> str | None:
        """Name of the (first) step segment (under /dev/shm on Linux) while it exists."""
        return self._channels[0].name if self._channels else None

    @property
    def steps(self) -> int:
        return self._step

    def stopped_pids(self) -> list[int]:
        """Agents stopped by a signal (state T in /proc: SIGSTOP, SIGTSTP), which answer nothing until
        continued; [] where /proc is absent. Lets an idle master notice a stuck agent before any step."""
        stopped = []
        for agent in self._agents:
            if isinstance(agent.proc, RemoteRank):
                continue
            try:
                stat = Path(f"/proc/{agent.proc.pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if fields and fields[0] in ("T", "t"):
                stopped.append(agent.proc.pid)
        return stopped

    # ---- start-up ------------------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Allocate the segment, spawn the ranks and wait until all loaded and warmed up.

        Agent progress lines reach ``progress`` as ``"agent <rank>: <line>"``. Raises ``AgentStartupError``
        with nothing left behind when any rank fails, the timeout passes or ``close()`` is called meanwhile
        (from another thread: the engine's shutdown while it replaces its agents).
        """
        with self._step_lock:  # close() releases the pipes only once start-up has given up
            if self._state != "new":
                raise RuntimeError(f"AgentPool.start() called on a pool that is {self._state}")
            self._state = "starting"
            try:
                for _ in range(self.spec.steps_in_flight):
                    self._channels.append(StepChannel.create(self.spec.layout))
                if self.spec.kv_transfer:
                    self._kv = KvSegment.create(self.spec.tensor_parallel_size, self.spec.kv_block_bytes,
                                                self.spec.kv_segment_blocks)
                if needs_cluster(self.spec):
                    self._cluster = CollectiveCluster.start(self.spec, self._agent_env(), self.startup_timeout_s)
                if self.spec.has_remote_ranks:
                    assert self._cluster is not None
                    self._listener = JoinListener(self.spec, self._cluster.rank_env)
                    self._poller.register(self._listener.fileno(), select.POLLIN)
                    waiting, address = self._listener.waiting_for, self.spec.join_address
                    self._join_notes.append(f"waiting for ranks {waiting[0]}..{waiting[-1]} to join at {address} "
                                            f"(on their hosts: llm-serving agent --join {address} --rank R)")
                for rank in range(self.spec.num_local_ranks):
                    self._spawn(rank)
                self._wait_ready(progress)
                self._stop_listening()
                with self._close_lock:
                    self._check_not_closing()
                    self._state = "ready"
            except BaseException:
                self._teardown(graceful=False)
                raise

    def _check_not_closing(self) -> None:
        if self._closing:
            raise AgentStartupError("the agent pool was closed during start-up")

    def _spawn(self, rank: int) -> None:
        """Start local rank ``rank``: steps from the command pipe and shared memory, or (a rank but 0 of a pool
        with ranks on other hosts) from rank 0's broadcast."""
        assert self._channels
        follows = self.spec.has_remote_ranks and rank > 0
        cmd_r, cmd_w = os.pipe() if not follows else (-1, -1)
        reply_r, reply_w = os.pipe()
        life_r, life_w = os.pipe()
        child_fds = tuple(fd for fd in (cmd_r, reply_w, life_r) if fd >= 0)
        root = str(Path(__file__).resolve().parents[2])
        env = self._agent_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if self._cluster is not None:
            env.update(self._cluster.rank_env(rank, cluster_host(self.spec) if self.spec.has_remote_ranks else None))
        argv = [sys.executable, "-m", "agents.agent_main", "--rank", str(rank), "--reply-fd", str(reply_w),
                "--lifeline-fd", str(life_r), "--spec", self.spec.to_json()]
        if not follows:
            argv += ["--shm", ",".join(c.name for c in self._channels), "--cmd-fd", str(cmd_r)]
        if self._kv is not None:
            argv += ["--kv-shm", self._kv.name]
        try:
            # stdout goes to our stderr: MindSpore chatter must not mix into the master's stdout output.
            proc = subprocess.Popen(argv, pass_fds=child_fds, env=env, stdin=subprocess.DEVNULL, stdout=2)
        except BaseException:
            for fd in (*child_fds, cmd_w, reply_r, life_w):
                _close_fd(fd)
            raise
        for fd in child_fds:
            os.close(fd)
        self._add_agent(_Agent(rank, proc, cmd_w, reply_r, life_w))

    def _add_agent(self, agent: _Agent) -> None:
        self._agents.append(agent)
        self._by_fd[agent.reply_r] = agent
        self._poller.register(agent.reply_r, select.POLLIN)

    def _admit_joiner(self) -> None:
        """(Start-up.) A rank on another host is connecting: admit it as an agent, or note why not."""
        if self._listener is None:  # closed meanwhile
            return
        joined = self._listener.accept()
        if isinstance(joined, str):
            self._join_notes.append(joined)
            return
        rank, handle = joined
        self._join_notes.append(f"rank {rank} joined from {handle.peer}")
        self._add_agent(_Agent(rank, handle, -1, handle.fd, -1))

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._poller.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def _agent_env(self) -> dict[str, str]:
        return {**os.environ, **{k: str(v) for k, v in self.spec.extra_env.items()}}

    def _wait_ready(self, progress: Callable[[str], None] | None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(range(self.num_agents))
        slowest: list[float] = []
        while pending:
            self._check_not_closing()
            for note in self._join_notes:
                if progress is not None:
                    progress(f"agents: {note}")
            self._join_notes.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                unjoined = self._listener.waiting_for if self._listener is not None else []
                raise AgentStartupError(
                    f"agent rank(s) {sorted(pending)} not ready after {self.startup_timeout_s:g}s "
                    f"(loading weights and compiling every shape bucket)" + (
                        f"; rank(s) {unjoined} never joined at {self.spec.join_address} (on each of their hosts: "
                        f"llm-serving agent --join {self.spec.join_address} --rank R)" if unjoined else ""),
                    rank=min(pending))
            if self._cluster is not None and self._cluster.exited() is not None:
                raise AgentStartupError(f"the collectives' scheduler (pid {self._cluster.pid}) exited with "
                                        f"{describe_exit(self._cluster.exited())} before the ranks were ready "
                                        "(see its stderr)")
            for agent, frames in self._poll(min(left, 1.0)):
                if frames is None:
                    code = self._reap(agent)
                    self._check_not_closing()
                    raise AgentStartupError(f"agent rank {agent.rank} ({agent.where()}) exited with "
                                            f"{agent.exit_text(code)} before it was ready ({agent.output_hint()})",
                                            rank=agent.rank)
                for _step, kind, payload in frames:
                    if kind == PROGRESS and progress is not None:
                        progress(f"agent {agent.rank}: {payload}")
                    elif kind == READY:
                        pending.discard(agent.rank)
                        cost, blocks = parse_ready_payload(payload)
                        if cost is not None:
                            slowest.append(cost)
                        if blocks is not None:
                            self.kv_blocks = blocks if self.kv_blocks is None else min(self.kv_blocks, blocks)
                    elif kind == ERROR:
                        summary, tb = parse_error_payload(payload)
                        raise AgentStartupError(f"agent rank {agent.rank} failed to start: {summary}",
                                                rank=agent.rank, agent_traceback=tb)
        self.slowest_warmup_step_s = max(slowest) if slowest else None

    # ---- steps ---------------------------------------------------------------------------------------------
    def run_step(self, batch: Step) -> StepOutput:
        """Run one step on every rank; rank 0's next tokens and logprobs (copies) in batch order."""
        return self.collect(self.submit(batch), batch.batch_size)

    def submit(self, batch: Step) -> int:
        """Start one step on every rank and return its number at once; ``collect`` waits for its answer. Up to
        ``spec.steps_in_flight`` steps may be in flight, collected in the order they were sent."""
        with self._step_lock:
            self._check_serving()
            if len(self._in_flight) >= len(self._channels):
                raise RuntimeError(f"steps {[s for s, _ in self._in_flight]} are still in flight; collect first")
            step = self._step + 1
            channel = self._channels[step % len(self._channels)]
            channel.check_fits(batch)
            self._step = step
            channel.write_step(step, batch)
            cmd = CMD.pack(step)
            for agent in self._agents:
                if agent.cmd_w < 0:
                    continue  # takes the step from rank 0's broadcast
                try:
                    os.write(agent.cmd_w, cmd)
                except OSError:  # broken pipe: the agent is gone
                    self._died(agent, step)
            self._in_flight.append((step, batch.num_steps))  # several decode steps get as many timeouts
            return step

    def collect(self, step: int, batch_size: int) -> StepOutput:
        """Wait for ``step`` (from ``submit``) on every rank; rank 0's next tokens and logprobs (copies) in batch
        order."""
        with self._step_lock:
            if not self._in_flight or self._in_flight[0][0] != step:
                raise RuntimeError(f"step {step} is not the oldest in flight (in flight: "
                                   f"{[s for s, _ in self._in_flight]})")
            try:
                self._check_serving()
                self._wait_step(step, self._in_flight[0][1])
                output = self._channels[step % len(self._channels)].read_output(step, batch_size)
                output.errors = {r: self._failed_rows.get(r, "failed on the agent")
                                 for r in np.flatnonzero(output.token_ids == FAILED_TOKEN).tolist()}
                return output
            finally:
                self._in_flight.popleft()

    def export_kv(self, block_ids: list[int]) -> list[bytes]:
        """Every rank's bytes of the KV blocks ``block_ids`` (in that order, block after block), by rank; one
        KV-copy step per segment's worth of blocks; no step may be in flight."""
        kv = self._check_kv_copy()
        parts: list[list[bytes]] = [[] for _ in range(self.num_agents)]
        for chunk in self._kv_chunks(block_ids):
            self.run_step(KvCopyStep("export", np.asarray(chunk, np.int32)))
            for rank, data in enumerate(kv.read(len(chunk))):
                parts[rank].append(data)
        return [b"".join(p) for p in parts]

    def import_kv(self, block_ids: list[int], shards: list[bytes]) -> None:
        """Write each rank's shard (``export_kv``'s bytes, from an engine of the same layout) into the KV blocks
        ``block_ids``; no step may be in flight."""
        kv = self._check_kv_copy()
        size, done = self.spec.kv_block_bytes, 0
        for chunk in self._kv_chunks(block_ids):
            with self._step_lock:
                kv.write([s[done * size: (done + len(chunk)) * size] for s in shards], len(chunk))
            self.run_step(KvCopyStep("import", np.asarray(chunk, np.int32)))
            done += len(chunk)

    def _kv_chunks(self, block_ids: list[int]) -> list[list[int]]:
        n = self.spec.kv_segment_blocks
        return [list(block_ids[i: i + n]) for i in range(0, len(block_ids), n)]

    def _check_kv_copy(self) -> KvSegment:
        """The KV segment, where a KV copy may run now."""
        if self._kv is None:
            raise RuntimeError("this agent pool was started without KV transfer (AgentSpec.kv_transfer)")
        if self._in_flight:
            raise RuntimeError("a KV copy waits until no step is in flight")
        return self._kv

    def _check_serving(self) -> None:
        if self._state != "ready":
            raise AgentDiedError(self._death or f"agent pool is {self._state}, not serving")

    def _wait_step(self, step: int, num_steps: int) -> None:
        """Wait for every rank's answer to ``step``; frames of a later step in flight are kept for its turn."""
        waiting = len(self._agents)
        error: AgentStepError | None = None
        timeout_s = None if self.step_timeout_s is None else self.step_timeout_s * num_steps
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._failed_rows = {}
        later = {s for s, _ in self._in_flight if s > step}
        early = [(agent, [(got, kind, payload)]) for agent, got, kind, payload in self._early if got == step]
        self._early = [frame for frame in self._early if frame[1] != step]
        while waiting:
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                self._fail(f"agents did not answer step {step} within {timeout_s:g}s")
            events, early = early or self._poll(timeout), []
            if not events:  # a quiet second: make sure nobody died without closing its pipe
                for agent in self._agents:
                    if agent.proc.poll() is not None:
                        self._died(agent, step)
            for agent, frames in events:
                if frames is None:
                    self._died(agent, step)
                for got, kind, payload in frames:
                    if kind == DONE and got == step:
                        waiting -= 1
                        if agent.rank == 0:
                            self._failed_rows = parse_done_payload(payload)
                    elif kind == ERROR and got == step:
                        waiting -= 1
                        summary, tb = parse_error_payload(payload)
                        error = error or AgentStepError(f"agent rank {agent.rank} failed step {step}: {summary}",
                                                        agent.rank, tb)
                    elif kind in (DONE, ERROR) and got in later:
                        self._early.append((agent, got, kind, payload))
                    else:
                        self._fail(f"agent rank {agent.rank} sent unexpected frame (step {got}, kind {kind}) "
                                   f"while step {step} ran")
        if error is not None:
            raise error

    def _poll(self, timeout_s: float) -> list[tuple[_Agent, list[tuple[int, int, str]] | None]]:
        """Wait for reply-pipe activity: per ready agent, its complete frames, or None at EOF."""
        out: list[tuple[_Agent, list[tuple[int, int, str]] | None]] = []
        for fd, _event in self._poller.poll(max(0, int(timeout_s * 1000))):
            if self._listener is not None and fd == self._listener.fileno():
                self._admit_joiner()
                continue
            agent = self._by_fd[fd]
            data = os.read(fd, 65536)
            if not data:
                out.append((agent, None))
                continue
            agent.buf += data
            frames = []
            while len(agent.buf) >= FRAME.size:
                got, kind, length = FRAME.unpack_from(agent.buf)
                if len(agent.buf) < FRAME.size + length:
                    break
                payload = bytes(agent.buf[FRAME.size: FRAME.size + length]).decode("utf-8", "replace")
                del agent.buf[: FRAME.size + length]
                frames.append((got, kind, payload))
            out.append((agent, frames))
        return out

    def _died(self, agent: _Agent, step: int) -> NoReturn:
        code = self._reap(agent)
        if self._closing:
            self._fail(f"agent pool was closed while step {step} ran")
        self._fail(f"agent rank {agent.rank} ({agent.where()}) died during step {step}: {agent.exit_text(code)}")

    def _fail(self, message: str) -> NoReturn:
        """(Step thread.) Record the death, kill every agent, unlink the segment, raise ``AgentDiedError``."""
        if self._death is None:
            self._death = message
        with self._close_lock:
            self._stop_processes(graceful=False)
            self._release()
        raise AgentDiedError(message)

    @staticmethod
    def _reap(agent: _Agent, timeout_s: float = 2.0) -> int | None:
        try:
            return agent.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    # ---- shutdown ------------------------------------------------------------------------------------------
    def close(self, graceful: bool = True) -> None:
        """Stop every agent and unlink the segment; idempotent, and safe while another thread is in run_step or
        collect. ``graceful``: give serving agents ``shutdown_grace_s`` to exit before they are killed (not
        worth waiting for when they failed: a stopped agent never exits by itself)."""
        with self._close_lock:
            if self._state == "closed":
                return
            self._closing = True
            self._stop_processes(graceful=graceful and self._state == "ready")
        # A collect blocked in poll() now sees EOF and returns; only then do its fds go away.
        with self._step_lock, self._close_lock:
            self._release()

    def _teardown(self, graceful: bool) -> None:
        with self._close_lock:
            self._stop_processes(graceful)
            self._release()

    def _stop_processes(self, graceful: bool) -> None:
        """Ask every agent to exit (EOF on its lifeline and command pipes), then kill what is left."""
        self._state = "closed"
        if self._death is None:
            self._death = "agent pool is closed"
        for agent in self._agents:
            agent.lifeline_w = _close_fd(agent.lifeline_w)
            agent.cmd_w = _close_fd(agent.cmd_w)
            if isinstance(agent.proc, RemoteRank):
                agent.proc.hang_up()
        deadline = time.monotonic() + (self.shutdown_grace_s if graceful else 0.0)
        for agent in self._agents:
            if agent.proc.poll() is None and graceful:
                try:
                    agent.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait()
        self._stop_listening()
        if self._cluster is not None:
            self._cluster.stop()

    def _release(self) -> None:
        """Close the reply pipes and unmap + unlink the segment (agents must be gone; no step in flight)."""
        for agent in self._agents:
            if agent.reply_r >= 0:
                self._poller.unregister(agent.reply_r)
                if isinstance(agent.proc, RemoteRank):
                    agent.proc.close()
                    agent.reply_r = -1
                else:
                    agent.reply_r = _close_fd(agent.reply_r)
        self._by_fd.clear()
        for channel in self._channels:
            channel.close()
        self._channels = []
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") != "closed":
            try:
                self._teardown(graceful=False)
            except Exception:  # noqa: BLE001, S110 - best effort at interpreter exit; close() is the API
                pass


def _close_fd(fd: int) -> int:
    """Close ``fd`` unless already closed (-1); returns -1 to store back, so no fd is ever closed twice."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    return -1
