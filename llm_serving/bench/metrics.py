"""Load-test metrics in vLLM ``bench serve`` terms, from the per-request results of a run.

Definitions (per successful request; failed ones only count as failures):
TTFT = first output chunk - send; E2E = last byte - send; ITL = gaps between output chunks;
TPOT = (E2E - TTFT) / (output_tokens - 1) for requests with more than one token. Non-streamed requests
(``full`` endpoint) have TTFT = E2E and no ITL/TPOT. Throughputs divide by the benchmark duration, which is
the contest's "total time": from the first request sent to the last response finished.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llm_serving.bench.results import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
             ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))


def latency_samples(results: Sequence[RequestResult]) -> dict[str, np.ndarray]:
    """Per-metric samples in milliseconds over the successful requests."""
    ok = [r for r in results if r.success]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [gap for r in ok for gap in r.itl]
    e2el = [r.latency for r in ok if r.latency is not None]
    return {k: np.asarray(v, dtype=np.float64) * 1000.0 for k, v in
            (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el))}


def in_flight(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """Client-side running batch as a step function: (times, requests in flight from that time on)."""
    events = [(r.send_time, 1) for r in results] + [(r.end_time, -1) for r in results]
    if not events:
        return np.zeros(0), np.zeros(0)
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times count finishes first
    times = np.array([e[0] for e in events], dtype=np.float64)
    counts = np.cumsum([e[1] for e in events]).astype(np.float64)
    return times, counts


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    server_batch: Sequence[tuple[float, float]] = (),
                    spec: dict[str, float] | None = None) -> dict[str, Any]:
    """Summary numbers; latency statistics are in ms and None when there is no sample. ``spec``: the server's
    speculative-decoding counters over the run (drafts, proposed, accepted), when it has them."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    m: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "benchmark_duration_s": duration,
        "total_time_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    for key, samples in latency_samples(results).items():
        m[f"mean_{key}_ms"] = float(samples.mean()) if samples.size else None
        for p in PERCENTILES:
            name = "median" if p == 50 else f"p{p}"
            m[f"{name}_{key}_ms"] = float(np.percentile(samples, p)) if samples.size else None
    _, counts = in_flight(results)
    m["max_in_flight"] = int(counts.max()) if counts.size else 0
    m["max_server_running_batch"] = max((v for _, v in server_batch), default=None)
    spec = spec or {}
    drafts = spec.get("drafts", 0)
    m["spec_acceptance_rate"] = spec["accepted"] / spec["proposed"] if drafts and spec["proposed"] else None
    # tokens a sequence gets from one verification: its accepted proposals and the model's own pick
    m["spec_mean_acceptance_length"] = 1 + spec["accepted"] / drafts if drafts else None
    errors: dict[str, dict[str, Any]] = {}
    for r in failed:  # grouped by what precedes the first ":" (e.g. "HTTP 400 prompt_too_long")
        group = errors.setdefault(r.error.split(":", 1)[0], {"count": 0, "example": r.error})
        group["count"] += 1
    m["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1]["count"])[:10])
    return m


def parse_gauge(text: str, name: str) -> float | None:
    """Sum of a Prometheus gauge's samples over its label sets, or None when absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", re.MULTILINE)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None
