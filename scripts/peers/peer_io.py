"""What passes between scripts/benchmark.py and a peer's runner, and the arithmetic both sides share.

A runner runs inside its peer's own venv (scripts/peer_env.sh), so this module is standard library only: the
runner imports it from its own directory, the benchmark as ``peers.peer_io``. The benchmark writes the requests
as token ids (every system gets the same ids; no tokenizer of a peer is involved) with the concurrency levels
to run; the runner writes each level's per-request output ids and times (seconds from the level's start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REQUESTS_FORMAT = "llm-serving-peer-requests/1"
RESULTS_FORMAT = "llm-serving-peer-results/1"
SATURATION = 0  # the concurrency level "every request at once"


class PeerFileError(ValueError):
    """A request or result file that is not what the other side wrote."""


@dataclass
class PeerRequest:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int


@dataclass
class RequestFile:
    model_dir: str
    eos_token_id: int
    levels: list[int]  # concurrency levels in the order to run them; SATURATION = all at once
    low_load_requests: int  # levels other than saturation run only the first this many requests
    requests: list[PeerRequest]

    def level_requests(self, level: int) -> list[PeerRequest]:
        """The requests a level runs: all of them at saturation, the first ``low_load_requests`` otherwise (one
        request at a time over the whole workload would take minutes per system)."""
        return self.requests if level == SATURATION else self.requests[: self.low_load_requests]


def write_requests(path: Path, rf: RequestFile) -> None:
    path.write_text(json.dumps({"format": REQUESTS_FORMAT, **asdict(rf)}) + "\n")


def read_requests(path: Path) -> RequestFile:
    """Read and check a request file (a runner fails early, naming the problem, rather than mid-run)."""
    obj = json.loads(Path(path).read_text())
    if not isinstance(obj, dict) or obj.get("format") != REQUESTS_FORMAT:
        raise PeerFileError(f"{path}: not a {REQUESTS_FORMAT} file")
    reqs = []
    for i, r in enumerate(obj["requests"]):
        ids, n = r.get("prompt_ids"), r.get("max_new_tokens")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise PeerFileError(f"{path}: request {i} prompt_ids must be a non-empty list of token ids")
        if not (isinstance(n, int) and n >= 1):
            raise PeerFileError(f"{path}: request {i} max_new_tokens must be an int >= 1, got {n!r}")
        reqs.append(PeerRequest(int(r["index"]), ids, n))
    levels = [int(v) for v in obj["levels"]]
    if any(v < 0 for v in levels):
        raise PeerFileError(f"{path}: concurrency levels must be >= 0 (0 = all at once), got {levels}")
    return RequestFile(str(obj["model_dir"]), int(obj["eos_token_id"]), levels, int(obj["low_load_requests"]),
                       reqs)


@dataclass
class Timing:
    """One request of a level; times in seconds from the level's start. ``first_token_s`` is None where the
    peer's API returns a request's tokens only at its end (a static batch). ``output_ids`` is None for our
    server, whose HTTP answer is text (``tokens`` then is its usage count)."""

    index: int
    output_ids: list[int] | None
    start_s: float
    end_s: float
    first_token_s: float | None = None
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.output_ids is not None:
            self.tokens = len(self.output_ids)

    @property
    def latency(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM reports it."""
        if self.first_token_s is None or self.tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.tokens - 1)


@dataclass
class LevelRun:
    level: int
    wall_s: float  # first request started -> last request done
    timings: list[Timing] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)


@dataclass
class PeerResult:
    peer: str
    version: str
    settings: str
    convert_s: float | None  # exporting the HF directory to the peer's format (None: reused from a cache)
    load_s: float  # model load and warm-up, outside every timed level
    runs: list[LevelRun]
    not_run: str = ""  # why levels of the request file have no run (a peer that serves one sequence at a time)


def write_results(path: Path, res: PeerResult) -> None:
    path.write_text(json.dumps({"format": RESULTS_FORMAT, **asdict(res)}) + "\n")


def read_results(path: Path) -> PeerResult:
    obj = json.loads(Path(path).read_text())
    if not isinstance(obj, dict) or obj.get("format") != RESULTS_FORMAT:
        raise PeerFileError(f"{path}: not a {RESULTS_FORMAT} file")
    runs = [LevelRun(int(r["level"]), float(r["wall_s"]), [Timing(**t) for t in r["timings"]]) for r in obj["runs"]]
    return PeerResult(obj["peer"], obj["version"], obj["settings"], obj["convert_s"], float(obj["load_s"]), runs,
                      str(obj.get("not_run", "")))


class ClosedLoop:
    """Which requests to start when, for a client that keeps at most ``limit`` requests in flight (0: all at
    once), starting them in order as earlier ones finish: the same closed loop as the load client's
    ``--max-concurrency`` against our server, for peers driven in process."""

    def __init__(self, count: int, limit: int):
        if count < 0 or limit < 0:
            raise ValueError(f"count and limit must be >= 0, got {count}, {limit}")
        self.count = count
        self.limit = limit or count
        self.next = 0
        self.in_flight: set[int] = set()
        self.finished: set[int] = set()

    def to_start(self) -> list[int]:
        """Positions to start now (marked in flight)."""
        out = []
        while self.next < self.count and len(self.in_flight) < self.limit:
            out.append(self.next)
            self.in_flight.add(self.next)
            self.next += 1
        return out

    def finish(self, pos: int) -> None:
        if pos not in self.in_flight:
            raise ValueError(f"request {pos} is not in flight")
        self.in_flight.remove(pos)
        self.finished.add(pos)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.count


def runner_parser(doc: str, cache_flag: str, cache_help: str) -> argparse.ArgumentParser:
    """A runner's command line as scripts/benchmark.py calls it: ``--requests``, ``--out`` and the directory
    ``cache_flag`` where its converted model is kept; the runner adds its own options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--requests", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(cache_flag, required=True, type=Path, help=cache_help)
    return p


def one_at_a_time(rf: RequestFile, generate: Callable[[PeerRequest], tuple[list[int], float]]) -> LevelRun:
    """The 1-in-flight level of a runner whose library takes one request at a time: ``generate(request)`` returns
    its output ids and the ``time.perf_counter()`` at which the first one came."""
    timings = []
    t0 = time.perf_counter()
    for r in rf.level_requests(1):
        start = time.perf_counter() - t0
        ids, first = generate(r)
        timings.append(Timing(r.index, ids, start, time.perf_counter() - t0, first - t0))
    return LevelRun(1, time.perf_counter() - t0, timings)


def batches(count: int, size: int) -> list[range]:
    """Consecutive groups of at most ``size`` positions (0: one group): how a static-batch peer runs a level."""
    size = size or count
    return [range(i, min(i + size, count)) for i in range(0, count, size)] if count else []


def compare_ids(reference: Sequence[Sequence[int]], timings: Iterable[Timing]) -> tuple[int, int, list[int]]:
    """(equal, compared, indices that differ): each timing's output ids against the reference of its index."""
    equal, compared, differ = 0, 0, []
    for t in timings:
        compared += 1
        if t.output_ids is not None and list(t.output_ids) == list(reference[t.index]):
            equal += 1
        else:
            differ.append(t.index)
    return equal, compared, differ


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two id lists differ (the shorter's length if one is a prefix), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(run: LevelRun) -> dict[str, Any]:
    """Totals and per-request means of a level (TTFT/TPOT None where the peer could not time them)."""
    lat = [t.latency for t in run.timings]
    ttft = [t.first_token_s - t.start_s for t in run.timings if t.first_token_s is not None]
    tpot = [p for p in (t.tpot for t in run.timings) if p is not None]
    return {"requests": len(run.timings), "wall_s": run.wall_s, "output_tokens": run.output_tokens,
            "tokens_per_s": run.output_tokens / run.wall_s if run.wall_s > 0 else float("nan"),
            "mean_latency_s": statistics.fmean(lat) if lat else None,
            "p50_latency_s": statistics.median(lat) if lat else None,
            "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
            "mean_tpot_s": statistics.fmean(tpot) if tpot else None}
