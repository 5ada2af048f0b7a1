"""A whole load-test run: the arrival schedule, requests in flight, the server gauge, and saving results.

``benchmark`` sends requests at arrival offsets (Poisson, gamma or constant gaps; optionally under a
concurrency cap), scrapes the server's running-batch gauge from ``GET /metrics`` meanwhile, and computes the
metrics; ``save_run`` writes ``result_<qps>_x.json`` with the contest's per-request fields, a summary json, a
markdown report and the PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import numpy as np
from tqdm import tqdm

from loadtest import BenchError, report
from loadtest.dataset import BenchRequest
from loadtest.metrics import compute_metrics
from loadtest.protocol import BenchConfig, RequestResult, send_request

ARRIVALS = ("poisson", "gamma", "constant")
RUNNING_BATCH_GAUGE = "llm_serving_running_batch_size"
# the server's speculative-decoding counters, read before and after a run (absent: not reported)
SPEC_COUNTERS = {"drafts": "llm_serving_spec_decode_drafts_total",
                 "proposed": "llm_serving_spec_decode_proposed_tokens_total",
                 "accepted": "llm_serving_spec_decode_accepted_tokens_total"}


def arrival_offsets(n: int, qps: float, process: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Send times in seconds after the first request (which goes at 0).

    poisson: exponential gaps of mean 1/qps; gamma: gaps of mean 1/qps with shape ``burstiness`` (< 1 is
    burstier, 1 is Poisson); constant: exactly 1/qps apart; qps = inf sends everything at once.
    """
    if process not in ARRIVALS:
        raise BenchError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    if not qps > 0:
        raise BenchError(f"-X/--qps must be > 0, got {qps}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if n <= 1 or math.isinf(qps):
        return np.zeros(max(n, 0))
    rng = np.random.default_rng(seed)
    mean = 1.0 / qps
    if process == "poisson":
        gaps = rng.exponential(mean, n - 1)
    elif process == "gamma":
        gaps = rng.gamma(burstiness, mean / burstiness, n - 1)
    else:
        gaps = np.full(n - 1, mean)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_gauge(text: str, name: str) -> float | None:
    """Sum of a Prometheus gauge's samples over its label sets, or None when absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", re.MULTILINE)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None


async def read_counters(cfg: BenchConfig) -> dict[str, float]:
    """The server's speculative-decoding counters now ({} when /metrics or the counters are not there)."""
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                    session.get(f"{cfg.base_url}/metrics") as resp):
            text = await resp.text() if resp.status == 200 else ""
    except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
        return {}
    values = {key: parse_gauge(text, name) for key, name in SPEC_COUNTERS.items()}
    return {} if None in values.values() else values


async def _scrape(cfg: BenchConfig, now: Callable[[], float], samples: list[tuple[float, float]],
                  stop: asyncio.Event) -> None:
    """Poll the server's running-batch gauge until ``stop``; give up quietly if it is not served.

    Its own session, so a full connection pool of streaming requests never delays a scrape.
    """
    url = f"{cfg.base_url}/metrics"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            try:
                async with session.get(url) as resp:
                    text = await resp.text() if resp.status == 200 else ""
                    value = parse_gauge(text, RUNNING_BATCH_GAUGE)
            except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
                value = None
            if value is None and not samples:
                return  # no gauge on this server
            if value is not None:
                samples.append((now(), value))
            try:
                await asyncio.wait_for(stop.wait(), cfg.metrics_interval)
            except TimeoutError:
                pass


class ProgressBar:
    """Requests done, with the failures so far, as a tqdm bar on stderr.

    Off when not ``enabled`` (``--no-progress``) and when the stream is not a terminal (tqdm's
    ``disable=None``), so logs and captured output get no bar.
    """

    def __init__(self, total: int, enabled: bool = True, file: TextIO | None = None):
        self.failed = 0
        self.bar = tqdm(total=total, desc="requests", unit="req",
                        file=file if file is not None else sys.stderr, disable=None if enabled else True,
                        dynamic_ncols=True, postfix={"failed": 0})

    def update(self, ok: bool) -> None:
        if not ok:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


@dataclass
class BenchRun:
    config: BenchConfig
    results: list[RequestResult]
    duration: float  # first request sent -> last response done: the contest's total time
    server_batch: list[tuple[float, float]]
    metrics: dict[str, Any]


async def benchmark(requests: Sequence[BenchRequest], cfg: BenchConfig, progress: bool = True) -> BenchRun:
    """Send ``requests`` on the configured arrival schedule and collect results and metrics."""
    offsets = arrival_offsets(len(requests), cfg.qps, cfg.arrival, cfg.burstiness, cfg.seed)
    bar = ProgressBar(len(requests), progress)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # aiohttp would silently cap concurrency at 100
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    samples: list[tuple[float, float]] = []
    before = await read_counters(cfg) if cfg.metrics_interval else {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        async def one(req: BenchRequest) -> RequestResult:
            if gate is None:
                res = await send_request(session, cfg, req, now)
            else:
                async with gate:
                    res = await send_request(session, cfg, req, now)
            bar.update(res.success)
            return res

        stop = asyncio.Event()
        scraper = asyncio.create_task(_scrape(cfg, now, samples, stop)) if cfg.metrics_interval else None
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = offset - now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = now()
        stop.set()
        if scraper is not None:
            await scraper
    bar.close()
    after = await read_counters(cfg) if before else {}
    spec = {key: after[key] - before[key] for key in after}
    return BenchRun(cfg, results, duration, samples, compute_metrics(results, duration, samples, spec))


async def wait_ready(cfg: BenchConfig, seconds: float) -> None:
    """Poll ``GET /health`` until it answers 200, or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{cfg.base_url}/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.2)
    raise BenchError(f"server at {cfg.base_url} not ready after {seconds:g}s ({last})")


def save_run(run: BenchRun, out_dir: str | Path, settings: dict[str, Any],
             draw: bool = True) -> dict[str, Path]:
    """Write result_<qps>_x.json (per request), summary json, markdown report and PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"{float(run.config.qps)}_x"  # the contest names its file result_{x}_x.json with x a float
    paths = {"results": out / f"result_{suffix}.json", "summary": out / f"summary_{suffix}.json",
             "report": out / f"report_{suffix}.md"}
    paths["results"].write_text(json.dumps([r.to_json() for r in run.results], ensure_ascii=False))
    summary = {"settings": settings, "metrics": run.metrics, "server_running_batch": run.server_batch}
    paths["summary"].write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    pngs = []
    if draw:
        from loadtest import plots  # matplotlib takes a while to import: only when drawing

        pngs = plots.write_plots(run.results, run.duration, out, suffix, run.server_batch)
    paths.update({p.stem: p for p in pngs})
    paths["report"].write_text(report.markdown_report(run.metrics, settings, [p.name for p in pngs]))
    return paths
