"""The test suite keeps llm-serving's caches (compiled graphs, embedded models, native kernels) in a temporary
directory of its own, never in the user's ``~/.cache/llm-serving``: set before any test module imports llm_serving
(whose defaults read it), inherited by every server and agent process a test starts."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

_ROOT = tempfile.mkdtemp(prefix="llm-serving-test-cache-")
os.environ["LLM_SERVING_CACHE_DIR"] = _ROOT
os.environ.pop("LLM_SERVING_KERNEL_DIR", None)  # under the root too
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)

OUR_PROCESSES = ("agents.agent_main", "agents.runtime.collective_scheduler")


def _our_children() -> dict[int, str]:
    """This test process's live children that are agents or collective schedulers (a server subprocess's agents
    are its own children: they end with the server)."""
    me, out = os.getpid(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and any(name in argv for name in OUR_PROCESSES):
            out[int(entry.name)] = argv
    return out


@pytest.fixture(scope="module", autouse=True)
def no_agents_left_behind(request):
    """A module whose engines or pools leave an agent or scheduler running fails here, by name, rather than a
    later module's process checks (tests share a worker process); what it left is killed."""
    before = set(_our_children())
    yield
    deadline = time.monotonic() + 15
    while (left := {p: a for p, a in _our_children().items() if p not in before}) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not left, f"{request.module.__name__} left agent processes running: {left}"


@pytest.fixture(scope="session")
def generic_kernel_dir(tmp_path_factory):
    """Where the kernels built without AVX-512 go (tests.op_cell.built_ops), once per session."""
    return tmp_path_factory.mktemp("generic-kernels")


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory):
    """``llm-serving serve --standin-agents`` (tests/test_server.py's ServerProcess) for one test module: the real
    HTTP front end, tokenizer and chat template, agents that answer by a fixed rule."""
    from test_server import ServerProcess

    server = ServerProcess(tmp_path_factory.mktemp("standin-serve"), "--standin-agents")
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """``llm-serving serve`` of the small real model (``tests.tiny_engine.TINY_SERVED``), one for the whole session:
    several modules' checks of real answers over HTTP share its start-up."""
    from test_server import ServerProcess

    from tests.tiny_engine import TINY_SERVED, set_args

    server = ServerProcess(tmp_path_factory.mktemp("tiny-serve"), *set_args(TINY_SERVED))
    yield server
    assert server.stop() == 0, server.output
