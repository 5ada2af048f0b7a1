"""Where an agent's steps come from: the master's command pipe and shared memory (every rank on the master's host,
and rank 0 always), or rank 0's broadcast (``step_broadcast``: the other ranks when some of them run on other
hosts). ``agents.agent_main.serve`` runs whichever it is given."""

from __future__ import annotations

import os

from agents.runtime.step_broadcast import STOP, StepBroadcast
from llm_serving.protocol.batch import Step, StepOutput
from llm_serving.protocol.shm_channel import StepChannel
from llm_serving.protocol.wire import CMD


class SharedMemorySteps:
    """Step numbers on the command pipe, batches in shared memory (step ``s`` in segment ``s % segments``), rank 0's
    answers written back there. With ``forward`` (rank 0 of a pool with ranks on other hosts) each step read, or
    the failure to read it, is broadcast to the other ranks, and so is the end."""

    def __init__(self, channels: list[StepChannel], cmd_fd: int, forward: StepBroadcast | None = None) -> None:
        self.channels, self.cmd_fd, self.forward = channels, cmd_fd, forward

    def next_step(self) -> int | None:
        """The next step number; None once the master closes the pipe or sends a negative one."""
        data = read_exact(self.cmd_fd, CMD.size)
        step = None if data is None else CMD.unpack(data)[0]
        if step is None or step < 0:
            if self.forward is not None:
                self.forward.stop()
            return None
        return step

    def read_step(self, step: int) -> Step:
        try:
            seen, batch = self.channels[step % len(self.channels)].read_step()
            if seen != step:
                raise RuntimeError(f"shared memory holds step {seen}, the master signalled step {step}")
        except Exception:
            if self.forward is not None:
                self.forward.send(step, None)  # the followers answer it with an error too, and stay in step
            raise
        if self.forward is not None:
            self.forward.send(step, batch)
        return batch

    def write_output(self, step: int, output: StepOutput) -> None:
        self.channels[step % len(self.channels)].write_output(step, output)


class BroadcastSteps:
    """Steps as rank 0 broadcasts them; these ranks answer the master only with their frames."""

    def __init__(self, broadcast: StepBroadcast) -> None:
        self.broadcast = broadcast
        self._batch: Step | None = None

    def next_step(self) -> int | None:
        step, self._batch = self.broadcast.receive()
        return None if step == STOP else step

    def read_step(self, step: int) -> Step:
        batch, self._batch = self._batch, None
        if batch is None:
            raise RuntimeError(f"rank 0 could not read step {step} from the master's shared memory")
        return batch

    def write_output(self, step: int, output: StepOutput) -> None:
        raise RuntimeError("only rank 0 answers the master")


def read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``; None at EOF."""
    data = b""
    while len(data) < n:
        try:
            chunk = os.read(fd, n - len(data))
        except InterruptedError:
            continue
        if not chunk:
            return None
        data += chunk
    return data
