"""Low load, served and in process, side by side in one run: asynchronous scheduling and multi-step decoding.

    python scripts/bench_low_load.py [--variants sync,async,sync-k4] [--levels 1,8] [--rounds 3] [--num-prompts 32]
                                     [--qps R --in-process-only]

The bench model (scripts/benchmark.py's, random weights, float32) and its alpaca-shaped workload (token-id prompts,
greedy, EOS ignored, outputs capped at ``--max-output-tokens``). A variant is ``sync`` or ``async``
(``scheduler.async_scheduling``), optionally ``-kN`` (``scheduler.decode_steps`` N). For every variant, in
alternating rounds: the engine in process (``Engine.submit``, at most N requests in flight) and the same config
served (``llm-serving serve``, the load client on the streaming OpenAI endpoint, at most N in flight). Prints output
tokens/s and the median time per output token per level; medians over the rounds, and each round's figures. And
where the CPU goes, per output token (from /proc): the agents', the master's (in process: the engine with its
consumer, this process) and the load client's (this process, served).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import TUNED, bench_model_dir, make_requests, write_config

from llm_serving.bench.local_server import running_server
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import NO_TOKEN
from llm_serving.tokenization.tokenizer import Tokenizer
from loadtest.client import benchmark
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig


async def in_process(engine: Engine, prompts: list[tuple[list[int], int]], level: int,
                     qps: float = 0.0) -> tuple[float, float]:
    """(output tokens/s, median ms per output token after the first) with at most ``level`` in flight; ``qps`` > 0:
    the requests arrive as a Poisson stream of that rate instead (seeded: every variant gets the same gaps)."""
    slots = asyncio.Semaphore(level if qps <= 0 else len(prompts))
    per_token: list[float] = []
    gaps = random.Random(0)
    starts = list(itertools.accumulate(gaps.expovariate(qps) if qps > 0 else 0.0 for _ in prompts))

    async def one(ids: list[int], n: int, start: float) -> int:
        await asyncio.sleep(start)
        async with slots:
            stream = engine.submit(ids, SamplingParams(n, ignore_eos=True))
            times = []
            async for event in stream:
                if event.token_id != NO_TOKEN:
                    times.append(time.perf_counter())
            if len(times) > 1:
                per_token.append((times[-1] - times[0]) / (len(times) - 1))
            return len(times)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(ids, n, at) for (ids, n), at in zip(prompts, starts))))
    return tokens / (time.perf_counter() - t0), statistics.median(per_token) * 1e3


def served(port: int, prompts: list[tuple[list[int], int]], level: int) -> tuple[float, float]:
    reqs = [BenchRequest(i, "", n, len(ids), prompt_ids=ids) for i, (ids, n) in enumerate(prompts)]
    cfg = BenchConfig(port=port, endpoint="openai", qps=float("inf"), ignore_eos=True, metrics_interval=0,
                      max_concurrency=level)
    run = asyncio.run(benchmark(reqs, cfg, progress=False))
    failed = [r for r in run.results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return run.metrics["output_throughput"], run.metrics["median_tpot_ms"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def accounted(run, agents: list[int], master: int | None) -> tuple[float, float, float, float, float]:
    """``run()`` -> (tokens/s, ms per output token) with the CPU ms per output token of the agents, the master
    (None: this process) and this process (the load client when the master is another)."""
    before = [cpu_seconds(p) for p in agents], cpu_seconds(master) if master else 0.0, own_cpu_seconds()
    t0 = time.perf_counter()
    rate, tpot = run()
    tokens = rate * (time.perf_counter() - t0)
    agent = sum(cpu_seconds(p) for p in agents) - sum(before[0])
    own = own_cpu_seconds() - before[2]
    master_s = cpu_seconds(master) - before[1] if master else own
    per = 1e3 / tokens
    return rate, tpot, agent * per, master_s * per, (own if master else 0.0) * per


def add_workload_arguments(ap: argparse.ArgumentParser, num_prompts: int, work_dir: str) -> None:
    """The arguments of a low-load run's workload (``workload``): rounds, prompts, lengths, seed, work directory."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=work_dir)


def workload(args: argparse.Namespace) -> tuple[Path, Path, list[tuple[list[int], int]]]:
    """The work directory, the bench model's directory in it, and the prompts (token ids, max new tokens)."""
    work = Path(args.work_dir)
    model_dir = bench_model_dir(work)
    tok = Tokenizer(model_dir / "tokenizer.model")
    return work, model_dir, [(tok.encode(r.prompt), r.max_new_tokens) for r in make_requests(args, model_dir)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="sync,async,sync-k4", help="sync|async[-kN], comma-separated")
    ap.add_argument("--levels", default="1,8", help="requests in flight")
    add_workload_arguments(ap, num_prompts=32, work_dir="/tmp/llm-serving-bench-low-load")
    ap.add_argument("--qps", type=float, default=0.0, help="in process: Poisson arrivals of this rate (level ignored)")
    ap.add_argument("--in-process-only", action="store_true", help="skip the served runs")
    args = ap.parse_args()
    variants = args.variants.split(",")
    levels = [int(n) for n in args.levels.split(",")]
    work, model_dir, prompts = workload(args)
    configs = {}
    for k in variants:
        mode, _, steps = k.partition("-k")
        if mode not in ("sync", "async") or not (steps or "1").isdigit():
            raise SystemExit(f"--variants: {k!r} is not sync|async[-kN]")
        path = write_config(work / f"config-{k}.yaml", model_dir, TUNED["prefill"], TUNED["decode"], "fcfs",
                            args.max_output_tokens)
        cfg = json.loads(path.read_text())
        cfg["scheduler"].update(decode_steps=int(steps or 1), async_scheduling=mode == "async")
        path.write_text(json.dumps(cfg, indent=1) + "\n")
        configs[k] = path
    rows: dict[tuple[str, str, int], list[tuple[float, ...]]] = {}
    for rnd in range(args.rounds):
        for k in variants if rnd % 2 == 0 else variants[::-1]:
            with Engine(ServingConfig.from_yaml(configs[k])) as engine:
                engine.start(progress=None)
                engine.submit(prompts[0][0], SamplingParams(4)).result(timeout=600)  # warm
                for level in levels:
                    rows.setdefault(("in process", k, level), []).append(accounted(
                        lambda n=level: asyncio.run(in_process(engine, prompts, n, args.qps)), engine.agent_pids,
                        None))
            if args.in_process_only:
                print(f"round {rnd + 1} {k} done", file=sys.stderr, flush=True)
                continue
            with running_server(configs[k], work / f"server-{k}.log", cwd=ROOT) as (port, _):
                served(port, prompts[:8], 1)  # warm
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as health:
                    agents = json.load(health)["agent_pids"]
                for level in levels:
                    rows.setdefault(("served", k, level), []).append(accounted(
                        lambda n=level: served(port, prompts, n), agents, parent_pid(agents[0])))
            print(f"round {rnd + 1} {k} done", file=sys.stderr, flush=True)
    print("| in flight | path | variant | output tokens/s | ms per output token | tokens/s per round "
          "| CPU ms per output token: agents / master / load client |")
    print("|---|---|---|---|---|---|---|")
    for (path, k, level), runs in sorted(rows.items(), key=lambda x: (x[0][2], x[0][0], variants.index(x[0][1]))):
        rate, tpot, agent, master, client = (statistics.median(run[i] for run in runs) for i in range(5))
        each = " / ".join(f"{run[0]:.0f}" for run in runs)
        cpu = f"{agent:.2f} / {master:.2f} / " + (f"{client:.2f}" if path == "served" else "-")
        print(f"| {level} | {path} | {k} | {rate:.1f} | {tpot:.2f} | {each} | {cpu} |")


if __name__ == "__main__":
    main()
