"""Kills an agent whose master went away while the agent could not notice it itself.

``mindspore.communication.init()`` blocks (waiting for the other ranks) while holding the GIL, so the agent's
own watchdog thread (``agent_main.watch_master``) cannot run meanwhile; if the master dies then (even by
SIGKILL), the agent would wait for its cluster for MindSpore's topology timeout (30 minutes by default). This
tiny process, started by the agent just before ``init()`` and killed by it right after, watches the same
lifeline pipe: at EOF it kills the agent. It exits by itself when the agent is gone.

    python -m agents.runtime.lifeline_reaper --pid AGENT_PID --lifeline-fd FD
"""

from __future__ import annotations

import argparse
import os
import select
import signal


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kill an agent when its master's lifeline closes")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    args = parser.parse_args(argv)
    while os.getppid() == args.pid:
        readable, _, _ = select.select([args.lifeline_fd], [], [], 0.2)
        if readable and not os.read(args.lifeline_fd, 1):
            os.kill(args.pid, signal.SIGKILL)
            break
    os._exit(0)


if __name__ == "__main__":
    main()
