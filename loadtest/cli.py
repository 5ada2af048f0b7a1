"""Command line of the load test: the contest's ``test_serving_performance.py`` flags and more.

Compatible with the contest script: ``-X/--qps``, ``-P/--port``, ``-O/--out_dir``, ``-T/--test_time`` and an
alpaca json read from ``./alpaca_5010.json`` by default; it sends ``int(test_time * qps)`` requests cycling
through the dataset in order and writes ``result_<qps>_x.json`` with the contest's per-request fields. Beyond
the contest script it offers real arrival processes, a concurrency cap, the ``full`` and OpenAI endpoints, a
time-bounded run (per-request timeout), vLLM-style metrics and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict

from llm_serving.bench import BenchError, report
from llm_serving.bench.arrivals import ARRIVALS, arrival_offsets
from llm_serving.bench.dataset import DEFAULT_DATASET, default_dataset, load_dataset
from llm_serving.bench.local_server import wait_ready
from loadtest.client import RUNNING_BATCH_GAUGE, benchmark, save_run
from loadtest.dataset import TokenCounter, build_requests
from loadtest.protocol import DEFAULT_PORT, ENDPOINTS, BenchConfig

PROG = "test_serving_performance"
DESCRIPTION = ("Load-test an llm-serving (or OpenAI-compatible) server the way the contest's "
               "test_serving_performance.py does, with vLLM-style metrics.")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tool's flags, for its own parser or an ``llm-serving bench`` subparser."""
    p.add_argument("-X", "--qps", type=float, default=1.0,
                   help="mean request rate in req/s; inf = all at once")
    p.add_argument("-P", "--port", type=int, default=DEFAULT_PORT, help="server port (%(default)s)")
    p.add_argument("-O", "--out_dir", "--out-dir", dest="out_dir", default="bench_results",
                   help="directory for results, report and plots (%(default)s)")
    p.add_argument("-T", "--test_time", "--test-time", dest="test_time", type=float, default=3600.0,
                   help="seconds of arrivals: sends int(test_time * qps) requests unless --num-prompts")
    p.add_argument("--dataset_path", "--dataset-path", "--dataset", dest="dataset_path",
                   default=DEFAULT_DATASET,
                   help="alpaca json [{instruction, input, output}] (%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="server host (%(default)s)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="stream",
                   help="stream: /models/<m>/generate_stream; full: /models/<m>/generate; "
                        "openai: /v1/completions with SSE (%(default)s)")
    p.add_argument("--model-name", default="llama2", help="model name in the URL / OpenAI body (%(default)s)")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="arrival process (%(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: <1 burstier, 1 = poisson (%(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="number of requests (overrides -T)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed for arrivals and --shuffle (%(default)s)")
    p.add_argument("--shuffle", action="store_true", help="sample the dataset in a seeded random order")
    p.add_argument("--tokenizer", default=None,
                   help="sentencepiece tokenizer.model (or its dir) for counting")
    p.add_argument("--tokens-per-word", type=float, default=1.3,
                   help="token estimate per whitespace word without --tokenizer (%(default)s)")
    p.add_argument("--return-full-text", action=argparse.BooleanOptionalAction, default=True,
                   help="send return_full_text like the contest (stream's last line = whole text)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="per-request limit in s (%(default)s)")
    p.add_argument("--metrics-interval", type=float, default=0.5,
                   help=f"s between GET /metrics scrapes of {RUNNING_BATCH_GAUGE}; 0 = off (%(default)s)")
    p.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many s for GET /health")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal)")


def _num_prompts(args: argparse.Namespace) -> int:
    if args.num_prompts is not None:
        n = args.num_prompts
    elif math.isinf(args.qps):
        raise BenchError("-X/--qps inf sends everything at once: give --num-prompts")
    else:
        n = int(args.test_time * args.qps)  # the contest's count
    if n < 1:
        raise BenchError(f"nothing to send: {n} requests (check -T/--test_time, -X/--qps, --num-prompts)")
    return n


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the load test; exit 0 if every request succeeded, 1 if some failed, 2 if it could not run."""
    return run_args(build_parser(prog).parse_args(argv), prog)


def run_args(args: argparse.Namespace, prog: str = PROG) -> int:
    """``main`` after parsing: the entry point for a subcommand that registered ``add_arguments``."""
    try:
        cfg = BenchConfig(host=args.host, port=args.port, endpoint=args.endpoint, model_name=args.model_name,
                          qps=args.qps, arrival=args.arrival, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, seed=args.seed,
                          return_full_text=args.return_full_text, request_timeout=args.request_timeout,
                          metrics_interval=max(args.metrics_interval, 0.0))
        arrival_offsets(2, cfg.qps, cfg.arrival, cfg.burstiness)  # validate before loading anything
        n = _num_prompts(args)
        counter = TokenCounter(args.tokenizer, args.tokens_per_word)
        args.dataset_path = default_dataset(args.dataset_path)
        requests = build_requests(load_dataset(args.dataset_path), n, counter, args.shuffle, args.seed)
        if args.wait_ready > 0:
            asyncio.run(wait_ready(cfg.base_url, args.wait_ready))
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"{prog}: {n} requests to {cfg.url()} at {cfg.qps:g} req/s ({cfg.arrival}), "
          f"token counts by {counter.method}", file=sys.stderr)
    run = asyncio.run(benchmark(requests, cfg, progress=not args.no_progress))
    settings = {**asdict(cfg), "url": cfg.url(), "dataset": str(args.dataset_path), "num_prompts": n,
                "token_counting": counter.method}
    paths = save_run(run, args.out_dir, settings, draw=not args.no_plots)
    print(report.format_console(run.metrics))
    unchecked = sum(1 for r in run.results if r.success and r.full_text_checked is False)
    if unchecked:
        print(f"warning: {unchecked} streams' last line did not equal the concatenated chunks "
              "(return_full_text line missing or different)", file=sys.stderr)
    print(f"results: {paths['results']}  report: {paths['report']}")
    return 0 if run.metrics["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
