"""A whole load-test run: requests in flight on the arrival schedule, the server gauge, and saving results.

``benchmark`` sends requests at arrival offsets (``llm_serving.bench.arrivals``: Poisson, gamma or constant gaps;
optionally under a concurrency cap), scrapes the server's running-batch gauge from ``GET /metrics`` meanwhile,
and computes the metrics; ``save_run`` writes ``result_<qps>_x.json`` with the contest's per-request fields, a
summary json, a markdown report and the PNG plots (``llm_serving.bench.run_files``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from tqdm import tqdm

from llm_serving.bench.arrivals import arrival_offsets
from llm_serving.bench.metrics import compute_metrics, parse_gauge
from llm_serving.bench.results import RequestResult
from llm_serving.bench.run_files import save_results
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig, send_request

RUNNING_BATCH_GAUGE = "llm_serving_running_batch_size"
# the server's speculative-decoding counters, read before and after a run (absent: not reported)
SPEC_COUNTERS = {"drafts": "llm_serving_spec_decode_drafts_total",
                 "proposed": "llm_serving_spec_decode_proposed_tokens_total",
                 "accepted": "llm_serving_spec_decode_accepted_tokens_total"}


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


def save_run(run: BenchRun, out_dir: str | Path, settings: dict[str, Any],
             draw: bool = True) -> dict[str, Path]:
    """Write result_<qps>_x.json (per request), summary json, markdown report and PNG plots."""
    return save_results(out_dir, run.config.qps, run.results, run.duration, run.server_batch, run.metrics,
                        settings, draw)
