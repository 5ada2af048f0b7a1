"""Low load, served and in process, side by side in one run: asynchronous scheduling and multi-step decoding.

    python scripts/bench_low_load.py [--variants sync,async,sync-k4] [--levels 1,8] [--rounds 3] [--num-prompts 32]

The bench model (scripts/benchmark.py's, random weights, float32) and its alpaca-shaped workload (token-id prompts,
greedy, EOS ignored, outputs capped at ``--max-output-tokens``). A variant is ``sync`` or ``async``
(``scheduler.async_scheduling``), optionally ``-kN`` (``scheduler.decode_steps`` N). For every variant, in
alternating rounds: the engine in process (``Engine.submit``, at most N requests in flight) and the same config
served (``llm-serving serve``, the load client on the streaming OpenAI endpoint, at most N in flight). Prints output
tokens/s and the median time per output token per level; medians over the rounds, and each round's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import TUNED, build_model, make_requests, write_config

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import NO_TOKEN
from llm_serving.tokenization.tokenizer import Tokenizer
from loadtest.client import benchmark
from loadtest.dataset import BenchRequest
from loadtest.local_server import running_server
from loadtest.protocol import BenchConfig


async def in_process(engine: Engine, prompts: list[tuple[list[int], int]], level: int) -> tuple[float, float]:
    """(output tokens/s, median ms per output token after the first) with at most ``level`` in flight."""
    slots = asyncio.Semaphore(level)
    per_token: list[float] = []

    async def one(ids: list[int], n: int) -> int:
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
    tokens = sum(await asyncio.gather(*(one(ids, n) for ids, n in prompts)))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="sync,async,sync-k4", help="sync|async[-kN], comma-separated")
    ap.add_argument("--levels", default="1,8", help="requests in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/llm-serving-bench-low-load")
    args = ap.parse_args()
    variants = args.variants.split(",")
    levels = [int(n) for n in args.levels.split(",")]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(work)
    tok = Tokenizer(model_dir / "tokenizer.model")
    prompts = [(tok.encode(r.prompt), r.max_new_tokens) for r in make_requests(args, model_dir)]
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
    rows: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        for k in variants if rnd % 2 == 0 else variants[::-1]:
            with Engine(ServingConfig.from_yaml(configs[k])) as engine:
                engine.start(progress=None)
                engine.submit(prompts[0][0], SamplingParams(4)).result(timeout=600)  # warm
                for level in levels:
                    rows.setdefault(("in process", k, level), []).append(
                        asyncio.run(in_process(engine, prompts, level)))
            with running_server(configs[k], work / f"server-{k}.log", cwd=ROOT) as (port, _):
                served(port, prompts[:8], 1)  # warm
                for level in levels:
                    rows.setdefault(("served", k, level), []).append(served(port, prompts, level))
            print(f"round {rnd + 1} {k} done", file=sys.stderr, flush=True)
    print("| in flight | path | variant | output tokens/s | ms per output token | tokens/s per round |")
    print("|---|---|---|---|---|---|")
    for (path, k, level), runs in sorted(rows.items(), key=lambda x: (x[0][2], x[0][0], variants.index(x[0][1]))):
        rate = statistics.median(r for r, _ in runs)
        tpot = statistics.median(t for _, t in runs)
        each = " / ".join(f"{r:.0f}" for r, _ in runs)
        print(f"| {level} | {path} | {k} | {rate:.1f} | {tpot:.2f} | {each} |")


if __name__ == "__main__":
    main()
