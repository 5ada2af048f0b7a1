"""Prefill/decode disaggregation: decode inter-token latency while long prompts arrive, against chunked prefill.

    python scripts/bench_disaggregation.py [--streams 4] [--stream-tokens 64] [--long-prompts 8]
                                           [--long-len 480] [--interval 0.75] [--chunk 64] [--rounds 1]

``--streams`` slots of streamed requests (short prompts, ``--stream-tokens`` tokens each, ignore_eos, one after
another) decode while ``--long-prompts`` prompts of ``--long-len`` tokens (4 tokens answered each) arrive every
``--interval`` seconds. On the bench model (scripts/benchmark.py), each engine a ``llm-serving serve`` pinned with
taskset, in one run:
- ``1 engine, 2 cores``: one engine on both cores, at the default step budget (a long prompt's whole prefill in one
  step) and with chunked prefill at ``--chunk`` tokens a step (decode steps carry prompt chunks);
- ``2 colocated engines``: one per core behind ``llm-serving router`` (data parallelism: the same hardware as below);
- ``prefill + decode``: a prefill engine on core 0 and a decode engine on core 1 (serving_config.kv_transfer)
  behind ``llm-serving router --prefill``: the decode engine imports each long prompt's KV blocks and computes only
  its last partial block.
Printed: the streams' inter-token latency (median, p90, p99, max) and the long prompts' latency (median, max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import aiohttp
from bench_data_parallel import router
from benchmark import bench_model_dir, write_config

from llm_serving.bench.local_server import free_port, stop, wait_until_ready


@contextlib.contextmanager
def engine(config: Path, cores: str, log: Path) -> Iterator[str]:
    """``llm-serving serve`` pinned to ``cores`` (its agents inherit it); yields its URL."""
    port = free_port()
    env = {**os.environ, "LLM_SERVING_KERNEL_THREADS": str(len(cores.split(",")))}
    argv = ["taskset", "-c", cores, sys.executable, "-m", "llm_serving", "serve", "--config", str(config),
            "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, port, 900)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> list[float]:
    """When each token of a streamed completion arrived."""
    body = {"model": "llama2", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times


async def stream_slot(session: aiohttp.ClientSession, url: str, rng: random.Random, tokens: int,
                      done: asyncio.Event) -> list[float]:
    """Streams one after another until ``done``: the gaps between consecutive tokens of each."""
    gaps: list[float] = []
    while not done.is_set():
        times = await stream(session, url, [rng.randrange(10, 7900) for _ in range(24)], tokens)
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return gaps


async def long_prompt(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    body = {"model": "llama2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return time.perf_counter() - t0


async def workload(url: str, args: argparse.Namespace, rng: random.Random) -> tuple[list[float], list[float]]:
    """(the streams' inter-token gaps, the long prompts' latencies): the streams run from before the first long
    prompt arrives until the last one is answered."""
    longs = [[rng.randrange(10, 7900) for _ in range(args.long_len)] for _ in range(args.long_prompts)]
    done = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        slots = [asyncio.create_task(stream_slot(session, url, random.Random(rng.random()), args.stream_tokens, done))
                 for _ in range(args.streams)]
        await asyncio.sleep(args.interval)
        pending = []
        for p in longs:
            pending.append(asyncio.create_task(long_prompt(session, url, p)))
            await asyncio.sleep(args.interval)
        latencies = await asyncio.gather(*pending)
        done.set()
        gaps = [g for slot in await asyncio.gather(*slots) for g in slot]
    return gaps, list(latencies)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(name: str, url: str, args: argparse.Namespace) -> None:
    asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "long_prompts": 1, "stream_tokens": 8,
                                                    "interval": 0.2}), random.Random(99)))  # warm the path
    for rnd in range(args.rounds):
        gaps, latencies = asyncio.run(workload(url, args, random.Random(args.seed + rnd)))
        ms = [g * 1e3 for g in gaps]
        print(f"| {name} | {statistics.median(ms):.1f} | {pct(ms, 0.9):.1f} | {pct(ms, 0.99):.1f} | {max(ms):.1f} | "
              f"{statistics.median(latencies):.2f} | {max(latencies):.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=480)
    ap.add_argument("--interval", type=float, default=0.75)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=64, help="the small step budget of the chunked-prefill engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", default="colocated,dp,disaggregated")
    ap.add_argument("--work-dir", default="/tmp/llm-serving-bench-pd")
    args = ap.parse_args()
    work = Path(args.work_dir)
    model_dir = bench_model_dir(work)
    plain = write_config(work / "colocated.yaml", model_dir, (1, 4), (1, 8, 16), "fcfs", args.stream_tokens)
    cfg = json.loads(plain.read_text())
    small = work / "colocated_small_chunks.yaml"  # chunks of at most --chunk tokens (a step's whole budget)
    small.write_text(json.dumps({**cfg, "scheduler": {**cfg["scheduler"], "max_num_batched_tokens": args.chunk}}))
    split = work / "disaggregated.yaml"
    split.write_text(json.dumps({**cfg, "serving_config": {"kv_transfer": True}}, indent=1) + "\n")
    print(f"{args.streams} streams of {args.stream_tokens} tokens; {args.long_prompts} prompts of {args.long_len} "
          f"tokens, one every {args.interval} s (bench model, this host's 2 cores)\n")
    print("| setup | ITL median ms | p90 | p99 | max | long prompt s median | max |")
    print("|---|---|---|---|---|---|---|")
    setups = args.setups.split(",")
    with contextlib.ExitStack() as stack:
        if "colocated" in setups:
            with engine(plain, "0,1", work / "colocated.log") as url:
                run("1 engine, 2 cores, default step budget (whole prompts)", url, args)
            with engine(small, "0,1", work / "colocated_small.log") as url:
                run(f"1 engine, 2 cores, chunked prefill ({args.chunk}-token steps)", url, args)
        if "dp" in setups:
            with contextlib.ExitStack() as inner:
                urls = [inner.enter_context(engine(plain, str(core), work / f"dp{core}.log")) for core in (0, 1)]
                port = inner.enter_context(router(urls, work / "router_dp.log"))
                run("2 colocated engines (1 core each) via router", f"http://127.0.0.1:{port}", args)
        if "disaggregated" in setups:
            prefill = stack.enter_context(engine(split, "0", work / "prefill.log"))
            trusting = work / "disaggregated_decode.yaml"  # the decode engine fetches from this prefill engine only
            trusting.write_text(json.dumps({**cfg, "serving_config": {"kv_transfer": True,
                                                                      "kv_transfer_peers": [prefill]}}) + "\n")
            decode = stack.enter_context(engine(trusting, "1", work / "decode.log"))
            port = stack.enter_context(router([decode], work / "router_pd.log", prefill=(prefill,)))
            run("prefill engine (core 0) + decode engine (core 1)", f"http://127.0.0.1:{port}", args)


if __name__ == "__main__":
    main()
