"""The text renderings of a run's metrics: the console summary and the markdown report page."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_serving.bench.metrics import LATENCIES


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


_STATS = (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))
_SHORT = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _general_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("Successful requests", _fmt(m["successful_requests"])),
        ("Failed requests", _fmt(m["failed_requests"])),
        ("Benchmark duration (s)", _fmt(m["benchmark_duration_s"])),
        ("Total time, contest score (s)", _fmt(m["total_time_s"])),
        ("Total input tokens", _fmt(m["total_input_tokens"])),
        ("Total generated tokens", _fmt(m["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(m["request_throughput"])),
        ("Output token throughput (tok/s)", _fmt(m["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(m["total_token_throughput"])),
        ("Max requests in flight (client)", _fmt(m["max_in_flight"])),
        ("Max running batch (server /metrics)", _fmt(m["max_server_running_batch"], 0)),
        ("Speculative acceptance rate (server /metrics)", _fmt(m.get("spec_acceptance_rate"))),
        ("Mean acceptance length (tokens per draft)", _fmt(m.get("spec_mean_acceptance_length"))),
    ]


def format_console(m: dict[str, Any]) -> str:
    """The summary block printed after a run, in the layout of vLLM's ``bench serve``."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name + ':':<44}{value:>16}" for name, value in _general_rows(m)]
    for key, title in LATENCIES:
        lines.append(f"{title:-^60}")
        lines += [f"{f'{stat} {_SHORT[key]} (ms):':<44}{_fmt(m[f'{pre}_{key}_ms']):>16}"
                  for stat, pre in _STATS]
    if m["errors"]:
        lines.append("{:-^60}".format("Errors"))
        lines += [f"{e['count']:>5} x {e['example']}"[:200] for e in m["errors"].values()]
    lines.append("=" * 60)
    return "\n".join(lines)


def markdown_report(m: dict[str, Any], settings: dict[str, Any], plots: Sequence[str] = ()) -> str:
    """A markdown page: run settings, the metrics tables, failures and links to the plots."""
    out = ["# Serving benchmark", "", "| Setting | Value |", "|---|---|"]
    out += [f"| {k} | `{v}` |" for k, v in settings.items()]
    out += ["", "| Metric | Value |", "|---|---:|"]
    out += [f"| {name} | {value} |" for name, value in _general_rows(m)]
    out += ["", "| Latency (ms) | Mean | Median | P90 | P99 |", "|---|---:|---:|---:|---:|"]
    for key, title in LATENCIES:
        cells = " | ".join(_fmt(m[f"{pre}_{key}_ms"]) for _, pre in _STATS)
        out.append(f"| {title} ({_SHORT[key]}) | {cells} |")
    if m["errors"]:
        out += ["", "## Failures", ""] + [f"- {e['count']} x {group}, e.g. `{e['example']}`"
                                          for group, e in m["errors"].items()]
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"
