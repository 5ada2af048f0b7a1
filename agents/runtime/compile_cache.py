"""MindSpore's graph compile cache for an agent, in a directory of its own per configuration and code.

Why: warm-up compiles one graph per shape bucket (0.5-1 s each on CPU, dozens of buckets), and MindSpore can
save each compiled front-end graph and load it on the next start (``MS_COMPILER_CACHE_ENABLE`` /
``MS_COMPILER_CACHE_PATH``). But MindSpore (2.10) names the saved graphs by their compile order in the process
(``rank_<r>/graph_cache/compile_cache_<n>.mindir``) and checks only a hash of the entry script's dependency files
outside ``sys.path`` (our installed packages are inside it): a changed bucket list, model config, MindSpore
version, kernel library or source file would load last time's graph ``n`` for a different shape. So each agent
gets a directory named by a hash of everything its graphs depend on (``cache_key``): the agent spec (model,
runner config with every bucket, capacities, rank count), the rank, the source of ``agents/`` (kernels
included) and ``llm_serving/protocol/``, MindSpore's and Python's versions, the CPU and compiler that the native
kernels are built for, and the ``MS_*`` environment.

A first start compiles into a private temporary directory and renames it into place only after the whole
warm-up succeeded, with the warm-up's measured step costs (``step_costs.json``): concurrent starts never read
a half-written cache, a failed start leaves nothing behind, and a warm start compiles (loads) every shape
without running it (docs/benchmarks.md, "Start-up").

Under tensor parallelism each rank has its own directory (the rank is in the key) and its graphs hold the
collectives; a warm start loads them, and the logits gathers, in the order the cold start compiled them
(``agents.model.parallel.ShardedStep.compile``), and loads only where every rank hit (``agents.agent_main.warm_up``):
a rank that runs its graphs waits in their collectives for the others. A replacement rank then starts in seconds
(docs/reliability.md, "Tensor-parallel recovery").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version as _version
from pathlib import Path

from llm_serving.protocol.wire import AgentSpec

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("agents", "llm_serving/protocol")
SOURCE_SUFFIXES = (".py", ".cc", ".h")
COSTS_FILE = "step_costs.json"
KEY_FILE = "key.json"
COMPLETE = "COMPLETE"  # written last: its presence marks a whole cache (its mtime: when last used)
KEEP = 8  # whole caches kept under one root, the most recently used
# per-start values of the collective cluster and the cache's own switches: they never change a graph
_ENV_IGNORED = ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_ROLE",
                "MS_NODE_ID", "MS_WORKER_NUM", "MS_TOPO_TIMEOUT", "MS_WORKER_IP")


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the agents' source files (path and bytes): any code change is a new cache."""
    h = hashlib.sha256()
    for sub in SOURCE_DIRS:
        for path in sorted((root / sub).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")}))


def cache_key(spec: AgentSpec, rank: int) -> dict:
    """Everything this rank's compiled graphs depend on, as a JSON-able dict (its hash names the directory)."""
    return {
        "spec": asdict(spec), "rank": rank, "source": source_digest(), "mindspore": _version("mindspore"),
        "python": sys.version, "machine": platform.machine(),
        "cpu": hashlib.sha256(_cpu_identity().encode()).hexdigest(),
        "cxx": shutil.which(os.environ.get("CXX", "g++")) or "",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MS_") and k not in _ENV_IGNORED},
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def usable(spec: AgentSpec) -> str | None:
    """None where the cache is verified for this agent, else why it stays off."""
    if spec.kind != "llama" or spec.backend != "ms":
        return f"not used by {spec.kind} agents with backend {spec.backend}"
    if spec.runner_config.get("device_target", "CPU") != "CPU":
        return "verified on CPU only"
    return None


class CompileCache:
    """One agent's cache directory: ``hit`` when a whole cache is there (load it), else a private one to fill.

    ``enable()`` points MindSpore at it (before the first graph compiles); ``commit(costs)`` after a successful
    warm-up publishes a new cache; ``costs`` are a hit's saved step costs.
    """

    def __init__(self, root: Path, spec: AgentSpec, rank: int) -> None:
        self.root = Path(root).expanduser()
        self.key = cache_key(spec, rank)
        self.final = self.root / key_digest(self.key)
        self.hit = (self.final / COMPLETE).is_file()
        self.costs: dict[tuple, float] = {}
        if self.hit:
            try:
                self.costs = {tuple(k): float(v) for k, v in json.loads((self.final / COSTS_FILE).read_text())}
            except (OSError, ValueError, TypeError):  # unreadable costs: load the graphs, measure again
                self.costs = {}
            self.path = self.final
            os.utime(self.final / COMPLETE)
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f"{self.final.name}.tmp-{os.getpid()}-", dir=self.root))

    def enable(self) -> None:
        """Turn MindSpore's compile cache on at ``self.path`` (read at each graph compile; the log level before
        MindSpore is imported)."""
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(self.path)
        # MindSpore logs one PIPELINE warning per graph saved or loaded; our progress line says hit or miss
        os.environ.setdefault("MS_SUBMODULE_LOG_v", "{PIPELINE:3}")

    def commit(self, costs: dict[tuple, float]) -> bool:
        """Publish a freshly filled cache with the warm-up's step costs; False on a hit or when another start
        published the same key first (ours is then removed)."""
        if self.hit:
            return False
        (self.path / COSTS_FILE).write_text(json.dumps([[list(k), v] for k, v in costs.items()]))
        (self.path / KEY_FILE).write_text(json.dumps(self.key, indent=1, sort_keys=True, default=str) + "\n")
        (self.path / COMPLETE).write_text("")
        try:
            os.rename(self.path, self.final)
        except OSError:  # published by a concurrent start (or not writable): keep that one
            self.discard()
            return False
        self.path = self.final
        prune(self.root)
        return True

    def discard(self) -> None:
        """Remove an unpublished cache (a failed warm-up's)."""
        if not self.hit:
            shutil.rmtree(self.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(root: Path, keep: int = KEEP) -> None:
    """Remove the least recently used whole caches beyond ``keep`` (each configuration or code change makes a
    new one) and the temporary directories of starts that died before publishing theirs."""
    for tmp in root.glob("*.tmp-*"):
        pid = tmp.name.split(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
    used = {}  # whole cache -> when last used; another rank's start may publish or prune one meanwhile, and a
    # temporary directory is never whole (its COMPLETE is written just before it is renamed)
    for d in root.iterdir():
        try:
            if ".tmp-" not in d.name:
                used[d] = (d / COMPLETE).stat().st_mtime
        except FileNotFoundError:
            continue
    for old in sorted(used, key=used.__getitem__, reverse=True)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def open_cache(spec: AgentSpec, rank: int, progress: Callable[[str], None]) -> CompileCache | None:
    """This agent's compile cache, enabled (None when the spec turns it off or it cannot be used here)."""
    if spec.compile_cache_dir is None:
        return None
    why_not = usable(spec)
    if why_not is not None:
        progress(f"compile cache off: {why_not}")
        return None
    try:
        cache = CompileCache(Path(spec.compile_cache_dir), spec, rank)
    except OSError as exc:  # an unwritable directory costs a cold start, never the start itself
        progress(f"compile cache off: {exc}")
        return None
    cache.enable()
    progress(f"compile cache {'hit' if cache.hit else 'miss, filling'}: {cache.path}")
    return cache
