"""Data parallelism: saturated throughput of one engine against two engines behind ``llm-serving router``.

    python scripts/bench_data_parallel.py [--num-prompts 128] [--max-output-tokens 64] [--step-delay 0.02]
                                          [--kinds device,cpu] [--rounds 2]

Two kinds of engine, each served as ``llm-serving serve`` subprocesses on the bench model's config
(scripts/benchmark.py) and driven by the load tool with every request at once (OpenAI endpoint, ignore_eos):
- ``device``: stand-in agents that take ``--step-delay`` seconds a step without using the CPU, as an engine whose
  accelerator is the bottleneck would (each engine its own device): what the router adds when engines do not
  compete for this host;
- ``cpu``: the real bench model on this host's CPU: both engines' agents share its cores.
Per kind, in one run: one engine direct, one engine through the router (the proxy's own cost) and two engines
through the router; output tokens/s and the ratio to one engine direct. ``--rounds`` repeats them in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import TUNED, bench_model_dir, make_requests, write_config

from llm_serving.bench.local_server import free_port, running_server, stop, wait_until_ready
from loadtest.client import benchmark
from loadtest.protocol import BenchConfig


@contextlib.contextmanager
def router(engines: list[str], log: Path, prefill: tuple[str, ...] = ()) -> Iterator[int]:
    """``llm-serving router`` over the engines at ``engines`` (and prefill engines at ``prefill``); yields its port."""
    port = free_port()
    argv = [sys.executable, "-m", "llm_serving", "router", "--port", str(port)]
    argv += [a for url in engines for a in ("--engine", url)] + [a for url in prefill for a in ("--prefill", url)]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, port, 60)
        yield port
    finally:
        stop(proc)


def throughput(port: int, reqs) -> float:
    cfg = BenchConfig(port=port, endpoint="openai", qps=float("inf"), ignore_eos=True, metrics_interval=0)
    run = asyncio.run(benchmark(reqs, cfg, progress=False))
    failed = [r for r in run.results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return run.metrics["output_throughput"]


def measure(kind: str, engines: int, via_router: bool, config: Path, reqs, args, work: Path) -> float:
    extra = ["--standin-agents", "--standin-step-delay", str(args.step_delay)] if kind == "device" else []
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(running_server(config, work / f"{kind}-{i}.log", 600, cwd=ROOT,
                                                    extra_args=extra))[0] for i in range(engines)]
        port = stack.enter_context(router([f"http://127.0.0.1:{p}" for p in ports], work / "router.log")) \
            if via_router else ports[0]
        throughput(port, reqs[: max(8, len(reqs) // 8)])  # warm the path (connections, first buckets)
        return throughput(port, reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--step-delay", type=float, default=0.02, help="device kind: seconds a step (default 0.02)")
    ap.add_argument("--kinds", default="device,cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/llm-serving-bench-dp")
    args = ap.parse_args()
    work = Path(args.work_dir)
    model_dir = bench_model_dir(work)
    reqs = make_requests(args, model_dir)
    config = write_config(work / "config.yaml", model_dir, TUNED["prefill"], TUNED["decode"], "fcfs",
                          args.max_output_tokens)
    variants = [("1 engine", 1, False), ("1 engine via router", 1, True), ("2 engines via router", 2, True)]
    print(f"{len(reqs)} requests, up to {args.max_output_tokens} output tokens each, all at once; "
          f"output tokens/s, one column per round\n")
    print("| kind | " + " | ".join(name for name, _, _ in variants) + " | 2 engines / 1 |")
    print("|---|" + "---|" * (len(variants) + 1))
    for kind in args.kinds.split(","):
        rates: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for rnd in range(args.rounds):
            for name, n, via in variants if rnd % 2 == 0 else variants[::-1]:
                rates[name].append(measure(kind, n, via, config, reqs, args, work))
        cells = [" / ".join(f"{r:.0f}" for r in rates[name]) for name, _, _ in variants]
        ratio = statistics.median(rates["2 engines via router"]) / statistics.median(rates["1 engine"])
        label = f"device ({args.step_delay * 1e3:.0f} ms a step, stand-in)" if kind == "device" else "cpu (bench model)"
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
