"""vLLM's metric names on ``/metrics``, beside ours, for the dashboards and tools that already query them.

Separate series, not aliases: vLLM's latency histograms use vLLM's buckets (ours are finer at the low end), and
its series carry vLLM's labels (``model_name``, ``engine``), so one series cannot be both. Each value comes from
the same observation or the same ``Engine.stats()`` read as ours, so the two never disagree on what happened.
Names, types, labels and buckets follow vLLM v1's Prometheus logger (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "vllm:"
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine core per server (vLLM numbers its data-parallel engines from 0)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

# Engine.stats() key -> (vLLM name without prefix, type, help). A counter's exposed name gains "_total".
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "num_running": ("num_requests_running", "gauge", "Number of requests in model execution batches."),
    "num_waiting": ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    "kv_usage": ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    "num_preemptions": ("num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    "prefix_cache_queried_tokens": ("prefix_cache_queries", "counter",
                                    "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "counter",
                                "Prefix cache hits, in terms of number of cached tokens."),
}


class VllmLatency:
    """vLLM's three request latency histograms, labelled with the served model; observed where ours are."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = (model_name, ENGINE_INDEX)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=registry).labels(*labels)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS, registry=registry).labels(*labels)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LABELS, buckets=E2E_BUCKETS,
                             registry=registry).labels(*labels)


class VllmEngineCollector:
    """The engine stats vLLM dashboards read, under vLLM's names, at each scrape (none while the engine loads)."""

    def __init__(self, model_name: str, engine_stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self._labels = [model_name, ENGINE_INDEX]
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats() or {}
        for key, (name, kind, help_text) in ENGINE_METRICS.items():
            value = stats.get(key)
            if not isinstance(value, (int, float)):
                continue
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(PREFIX + name, help_text, labels=LABELS)
            family.add_metric(self._labels, float(value))
            yield family
        if "lora_max_loras" in stats:  # vLLM's: the labels carry the adapters, the value is the time of the read
            info = GaugeMetricFamily(f"{PREFIX}lora_requests_info", "Running stats on lora requests.",
                                     labels=("running_lora_adapters", "max_lora", "waiting_lora_adapters"))
            info.add_metric([str(stats["lora_running_adapters"]), str(stats["lora_max_loras"]),
                             str(stats["lora_waiting_adapters"])], time.time())
            yield info
