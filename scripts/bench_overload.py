"""Goodput under overload, with and without admission by expected wait, side by side in one run.

    python scripts/bench_overload.py [--seconds 60] [--loads 1.0,1.2] [--bound 3] [--client-timeout 10] [--set K=V]

The default embedded model (``llm-serving serve`` with no model path), token-id prompts of 8..64 tokens, greedy,
EOS ignored, 16..64 new tokens each, on the streaming OpenAI endpoint. Two servers run at once
(``serving_config.max_queue_wait_s`` empty: the count limit alone; and ``--bound``) and take turns, so the noise of a
shared machine falls on both alike. First each one's saturation throughput: a closed loop keeping
``--saturation-concurrency`` requests in flight (the batch full, a queue behind it). Then open-loop Poisson arrivals
at each load times the saturation throughput (both servers' mean) for ``--seconds``, every client giving up after
``--client-timeout`` s (as the chaos soak's clients do) and not retrying. Prints, per run: completed (ok) requests/s
over the run and against saturation, refusals (503 with Retry-After), client timeouts, ok-latency and TTFT
percentiles, and from the server's /metrics the tokens it generated for requests that did not complete (work wasted
on clients that left), the preemptions, the prefill and decode steps, the tokens generated per second the engine
was busy, and the share of the run it was busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from llm_serving.bench.local_server import running_server
from llm_serving.bench.metrics import parse_gauge
from llm_serving.bench.results import RequestResult
from loadtest.client import BenchRun, benchmark
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig

COUNTERS = {"generated": "llm_serving_tokens_generated_total", "preemptions": "llm_serving_preemptions_total",
            "prefill_steps": "llm_serving_engine_prefill_steps_total",
            "decode_steps": "llm_serving_engine_decode_steps_total", "busy_s": "llm_serving_engine_busy_seconds_total"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals per open-loop run (default 60)")
    p.add_argument("--loads", default="1.0,1.2", help="offered loads as multiples of saturation (default 1.0,1.2)")
    p.add_argument("--bound", type=float, default=3.0, help="serving_config.max_queue_wait_s of the bounded server")
    p.add_argument("--client-timeout", type=float, default=10.0, help="seconds a client waits for its whole answer")
    p.add_argument("--saturation-requests", type=int, default=768, help="requests of the closed-loop saturation run")
    p.add_argument("--saturation-concurrency", type=int, default=64, help="requests in flight in that run")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config value for both servers (e.g. scheduler.min_decode_steps_between_prefills=4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/llm-serving-bench-overload", help="server configs and logs")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def make_requests(n: int, seed: int, start: int = 0) -> list[BenchRequest]:
    """``n`` token-id prompts (ids 3..999 of the embedded model's vocabulary), 8..64 tokens, 16..64 new tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(8, 64))]
        out.append(BenchRequest(start + i, "", rng.randint(16, 64), len(ids), ids))
    return out


def counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {key: parse_gauge(text, name) or 0.0 for key, name in COUNTERS.items()}


def pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.2f}" if values else "-"


def summarize(name: str, offered: float | None, run: BenchRun, before: dict[str, float],
              after: dict[str, float], saturation: float | None) -> dict[str, object]:
    results: list[RequestResult] = run.results
    ok = [r for r in results if r.success]
    refused = sum("HTTP 503" in r.error for r in results)
    timeouts = sum(r.error.startswith("timeout") for r in results)
    delta = {key: after[key] - before[key] for key in after}
    generated = delta["generated"]
    wasted = generated - sum(r.output_tokens for r in ok)
    rate = len(ok) / run.duration
    return {"run": name, "offered_req_s": round(offered, 2) if offered is not None else "closed loop",
            "sent": len(results), "ok": len(ok), "ok_req_s": round(rate, 2),
            "vs_saturation": f"{rate / saturation:.0%}" if saturation else "-", "refused_503": refused,
            "client_timeouts": timeouts, "other_errors": len(results) - len(ok) - refused - timeouts,
            "ok_latency_p50_p99": f"{pct([r.latency for r in ok], 50)} / {pct([r.latency for r in ok], 99)}",
            "ttft_p50_p99": f"{pct([r.ttft for r in ok], 50)} / {pct([r.ttft for r in ok], 99)}",
            "wasted_tokens": f"{wasted:.0f} of {generated:.0f}",
            "preemptions": int(after["preemptions"] - before["preemptions"]),
            "prefill_decode_steps": f"{delta['prefill_steps']:.0f} / {delta['decode_steps']:.0f}",
            "tokens_per_busy_s": round(generated / delta["busy_s"]) if delta["busy_s"] else "-",
            "busy_share": f"{delta['busy_s'] / run.duration:.0%}"}


def measure(port: int, name: str, reqs: list[BenchRequest], cfg: BenchConfig, offered: float | None,
            saturation: float | None) -> dict[str, object]:
    before = counters(port)
    run = asyncio.run(benchmark(reqs, cfg, progress=False))
    after = counters(port)
    row = summarize(name, offered, run, before, after, saturation)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    loads = [float(x) for x in args.loads.split(",")]
    config = work / "serve.yaml"
    config.write_text("{}\n")  # the defaults: the embedded model
    variants = {"no time bound": None, f"max_queue_wait_s {args.bound:g}": args.bound}
    rows: list[dict[str, object]] = []
    with ExitStack() as stack:  # both servers up at once: their runs alternate, so machine noise hits both alike
        ports = {}
        for label, bound in variants.items():
            log = work / f"server_{'unbounded' if bound is None else 'bounded'}.log"
            setting = f"serving_config.max_queue_wait_s={'null' if bound is None else bound}"
            sets = [a for item in [*args.set, setting] for a in ("--set", item)]
            ports[label], _ = stack.enter_context(running_server(
                config, log, args.startup_timeout, cwd=ROOT, extra_args=sets,
                announce=lambda cmd, log=log: print(f"[bench_overload] {cmd} (log {log})", flush=True)))
        saturated = []
        for label, port in ports.items():
            cfg = BenchConfig(port=port, endpoint="openai", ignore_eos=True, metrics_interval=0.0, seed=args.seed,
                              qps=float("inf"), max_concurrency=args.saturation_concurrency, request_timeout=600.0)
            measure(port, f"warm-up, {label}", make_requests(args.saturation_concurrency, args.seed + 1), cfg, None,
                    None)
            row = measure(port, f"saturation, {label}", make_requests(args.saturation_requests, args.seed), cfg,
                          None, None)
            rows.append(row)
            saturated.append(float(row["ok_req_s"]))  # type: ignore[arg-type]
        saturation = sum(saturated) / len(saturated)  # the servers differ only past saturation
        print(f"[bench_overload] saturation: {saturation:.2f} req/s (the mean of both)", flush=True)
        for load in loads:
            qps = load * saturation
            reqs = make_requests(max(1, int(qps * args.seconds)), args.seed + 2)
            for label, port in ports.items():
                cfg = BenchConfig(port=port, endpoint="openai", ignore_eos=True, metrics_interval=0.0,
                                  seed=args.seed, qps=qps, request_timeout=args.client_timeout)
                rows.append(measure(port, f"{load:g}x, {label}", reqs, cfg, qps, saturation))
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
