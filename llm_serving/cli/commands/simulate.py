"""The ``simulate`` command: a workload served by the real scheduler on a virtual clock, each step's time from a
cost model (``llm_serving.simulator``); prints and writes the load tool's report and plots for it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_serving.cli.options import Command
from llm_serving.cli.simulation import add_simulation_arguments, build


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_simulation_arguments(p)
    p.add_argument("-O", "--out_dir", "--out-dir", dest="out_dir", default=None,
                   help="also write the load tool's result, summary, report and plots here")
    p.add_argument("--no-plots", action="store_true", help="with -O: skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object instead")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.bench import report
    from llm_serving.simulator.run import simulate, write_run

    config, target, requests = build(args, progress=lambda line: print(line, file=sys.stderr))
    run = simulate(target.scheduler, requests, target.cost, target.request_overhead_s,
                   args.max_concurrency)
    metrics = run.metrics
    settings = {"config": config.source, "cost": target.cost.describe(), "kv_blocks": target.scheduler.num_blocks,
                "tokenizer": target.tokenizer, "requests": len(requests),
                "request_overhead_ms": round(target.request_overhead_s * 1e3, 3),
                "workload": args.results or f"{args.dataset} at {args.qps:g} req/s ({args.arrival})"}
    if args.json:
        print(json.dumps({"settings": settings, "metrics": metrics}))
    else:
        print(f"simulated with {settings['cost']}", file=sys.stderr)
        print(report.format_console(metrics))
        print(f"steps {run.steps} ({run.prefill_steps} with prompt tokens), preemptions {run.preemptions}, "
              f"peak KV use {metrics['max_kv_usage']:.0%}, prefix-cache hit tokens {run.prefix_hit_tokens}")
    if args.out_dir:
        paths = write_run(run, Path(args.out_dir), args.qps, settings, draw=not args.no_plots)
        print(f"report: {paths['report']}", file=sys.stderr)
    return 0


COMMAND = Command("simulate", "simulate a workload on the real scheduler with a measured or device cost model "
                  "(no agents; seconds for thousands of requests)", _add_arguments, _run)
