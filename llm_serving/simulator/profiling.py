"""Measure step times on this machine: the served engine (HTTP server, real agents, this config) on a sweep.

The server runs as ``llm-serving serve --record-steps``: its engine records every step's shape and its loop's
whole turn (sent to the next step's scheduling, so the HTTP streaming competing for the master's thread is in
it, as it is under a load test). A warm-up runs first and its steps are dropped (a fresh server's first steps
run up to 1.5x slower). Each point of the sweep sends ``batch`` streamed completions of ``prompt_len``
random token ids (distinct, so no prefix is shared) for ``new_tokens`` tokens with EOS ignored, all at once: its
prefill (chunked or whole) and decode steps at that batch size and context. Then one phase sends requests one
by one while others decode, for the steps that mix decode tokens and prompt chunks, and one sends prompts just
computed again (prefix-cache hits: a few query tokens over a long cached context), also as the largest decode batch
over a few shared prompts (steps whose sequences read the same KV blocks, a shape distinct prompts of that length
could not fill the cache with). The server writes the profile (``costs.load_profile`` reads it) when it stops;
``FittedCost`` is fitted to it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from llm_serving.bench.local_server import running_server
from llm_serving.bench.metrics import parse_gauge
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.step_shape import StepShape
from llm_serving.simulator.costs import load_profile

PROBES = 4  # requests sent one after another at each batch-1 point (time to first token outside the engine)
WARM_UP_ROUNDS = 3  # rounds of the largest batch before the sweep: a fresh server's first steps run slower
STEPS_METRIC = "llm_serving_engine_steps_total"
SHARED_PREFIX_BATCH = 4  # requests sent at once on a prompt just computed (with prefix caching: cache hits)
SHARED_PREFIXES = 4  # prompts the largest batch of cache hits shares
MAX_SWEEP_TOKENS = 8192  # KV positions a sweep point fills at most (a default config's cache holds 8192)


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    prompt_len: int
    new_tokens: int


def default_sweep(max_batch: int, max_model_len: int, new_tokens: int = 32) -> list[SweepPoint]:
    """Batch sizes 1, 2, 4, ... up to the largest decode batch, by prompt lengths 16, 64, 256, ... that leave room
    for the new tokens in the context (at most 8192 prompt tokens a point, so a sweep stays a minute or two on a
    small model)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
    lengths = [n for n in (16, 64, 256, 1024, 4096) if n + new_tokens <= max_model_len] or [8]
    return [SweepPoint(b, n, new_tokens) for b in batches for n in lengths if b * n <= MAX_SWEEP_TOKENS]


def run_sweep(config: ServingConfig, points: list[SweepPoint], work_dir: str | Path, staggered: int = 16,
              seed: int = 0, progress: Callable[[str], None] | None = None, rounds: int = 2
              ) -> tuple[list[tuple[StepShape, float]], dict]:
    """Measured steps of ``rounds`` sweeps of every point (and the staggered phase) and what they were measured
    on (``round_steps``: how many of the steps each round ran, in order); the server's config, log and record
    are kept in ``work_dir``."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    config_path, record = work / "profiled-config.yaml", work / "served-steps.json"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    record.unlink(missing_ok=True)
    with running_server(config_path, work / "profiled-server.log", extra_args=["--record-steps", str(record)],
                        announce=progress) as (port, ready_s):
        if progress:
            progress(f"server ready in {ready_s:.0f} s on port {port}")
        probes, marks = asyncio.run(_drive(f"http://127.0.0.1:{port}", config.model_config.model_name, points,
                                           staggered, rounds, np.random.default_rng(seed), progress))
    steps, meta = load_profile(record)
    cuts, done, index = [], 0, 0  # the step counter's marks -> indices into the recorded round trips
    for mark in marks:
        while index < len(steps) and done < mark:
            done += steps[index][0].num_steps
            index += 1
        cuts.append(index)
    round_steps = [b - a for a, b in itertools.pairwise(cuts)]
    # the warm-up's steps are dropped: the first calls of a fresh server run slower
    return steps[cuts[0]:cuts[-1]], {**meta, "first_token_probes": probes, "warm_up_steps": cuts[0],
                                     "round_steps": round_steps}


async def _drive(url: str, model: str, points: list[SweepPoint], staggered: int, rounds: int,
                 rng: np.random.Generator, progress: Callable[[str], None] | None
                 ) -> tuple[list[tuple[int, float]], list[int]]:
    """Send a warm-up, then the sweep ``rounds`` times; returns (prompt length, client-side time to first token)
    of each request sent alone, from which ``costs.request_overhead`` finds the time a request spends outside the
    engine, and the engine's step counter (/metrics) after the warm-up and after each round."""
    probes, marks = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(prompt_len: int, new_tokens: int, prompt: list[int] | None = None) -> float:
            prompt = prompt if prompt is not None else rng.integers(3, 200, prompt_len).tolist()
            body = {"model": model, "prompt": prompt, "max_tokens": new_tokens,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            t0, first = time.perf_counter(), None
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"profile request failed: HTTP {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
            return first if first is not None else time.perf_counter() - t0

        for _ in range(WARM_UP_ROUNDS):
            await asyncio.gather(*(one(32, 32) for _ in range(points[-1].batch)))
        marks.append(await engine_steps(session, url))
        for r in range(rounds):
            for i, p in enumerate(points):
                if progress:
                    progress(f"profile round {r + 1}/{rounds}, {i + 1}/{len(points)}: {p.batch} x {p.prompt_len} "
                             f"prompt tokens, {p.new_tokens} new")
                if p.batch == 1:
                    for _ in range(PROBES):
                        probes.append((p.prompt_len, await one(p.prompt_len, p.new_tokens)))
                else:
                    await asyncio.gather(*(one(p.prompt_len, p.new_tokens) for _ in range(p.batch)))
            if staggered:
                length, tasks = points[len(points) // 2].prompt_len, []
                for _ in range(staggered):  # each arrives while the earlier ones decode
                    tasks.append(asyncio.create_task(one(length, 2 * points[0].new_tokens)))
                    await asyncio.sleep(0.005)
                await asyncio.gather(*tasks)
            new = points[0].new_tokens
            for n in sorted({p.prompt_len for p in points}):  # prefix-cache hits: short queries over long contexts
                shared = rng.integers(3, 200, n).tolist()
                await one(n, 2, shared)
                await asyncio.gather(*(one(n, new, shared) for _ in range(SHARED_PREFIX_BATCH)))
                # decode batches larger than distinct prompts fit in the KV cache, over a few shared prefixes
                prefixes = [rng.integers(3, 200, n).tolist() for _ in range(SHARED_PREFIXES)]
                await asyncio.gather(*(one(n, 2, prefix) for prefix in prefixes))
                batch = min(points[-1].batch, MAX_SWEEP_TOKENS // (2 * new))  # own blocks: ~new tokens + one
                await asyncio.gather(*(one(n, new, prefixes[i % SHARED_PREFIXES]) for i in range(batch)))
            marks.append(await engine_steps(session, url))
    return probes, marks


async def engine_steps(session: aiohttp.ClientSession, url: str) -> int:
    """The served engine's step counter (/metrics): where a phase of load starts in its step record."""
    async with session.get(f"{url}/metrics") as resp:
        return int(parse_gauge(await resp.text(), STEPS_METRIC) or 0)
