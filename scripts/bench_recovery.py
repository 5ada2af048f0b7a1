"""Agent recovery time: SIGKILL one rank of a serving engine, time until the engine answers again.

    python scripts/bench_recovery.py [--config configs/default.yaml] [--tp 2] [--kills 3] [--rank 1]
                                     [--compile-cache DIR | --no-compile-cache] [--phases]
                                     [--standby [--kill-while-standby-starts]]

Starts an ``Engine`` on the config (``serving_config.num_agents`` set to ``--tp``; the compile cache in a
temporary directory unless ``--compile-cache`` names one: the engine's first start fills it), then ``--kills``
times: sends 8 requests, waits until they decode, kills rank ``--rank`` with SIGKILL, sends one more request
and prints seconds from the kill until the new pool is up (``agent_restarts`` counts it) and until that
request is answered, and whether the 8 interrupted requests gave the same greedy ids as before the kill.
``--phases``: afterwards starts the engine's agent pool alone once more (what a restart does, the compile cache
as a restart finds it), printing when each start-up line of each rank arrived: where a restart's time goes.
``--standby``: with ``serving_config.standby_agents``; each kill waits until the standby is ready (the kill then
promotes it), or with ``--kill-while-standby-starts`` kills as soon as the standby has started starting (the
recovery then waits for it).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import agent_spec, resolve_model
from llm_serving.executor.agent_pool import AgentPool

PROMPTS = [[1] + [(37 * i + 11 * j) % 900 + 3 for j in range(8 + 3 * i)] for i in range(8)]
GREEDY = SamplingParams(max_new_tokens=24)


def config(args: argparse.Namespace, cache: str | bool, data_dir: str) -> ServingConfig:
    d = yaml.safe_load(Path(args.config).read_text())
    d.setdefault("serving_config", {}).update({"num_agents": args.tp, "compile_cache": cache,
                                               "standby_agents": args.standby})
    d.setdefault("default_model", {})["data_dir"] = data_dir
    return ServingConfig.from_dict(d)


def wait_until(engine: Engine, check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if engine.error is not None:
            raise RuntimeError(f"the engine failed: {engine.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def kill_and_time(engine: Engine, args: argparse.Namespace, reference: list[list[int]]) -> dict[str, float | bool]:
    """One kill of rank ``args.rank`` while 8 requests decode: seconds to the new pool and to a new request's
    answer."""
    if args.standby:
        want = ("starting",) if args.kill_while_standby_starts else ("ready",)
        wait_until(engine, lambda: engine.stats()["standby"] in want, 300, f"the standby {want[0]}")
    restarts, decoded = engine.stats()["agent_restarts"], engine.stats()["decode_steps"]
    promoted = engine.stats().get("standby_promotions", 0)
    streams = [engine.submit(p, GREEDY) for p in PROMPTS]
    wait_until(engine, lambda: engine.stats()["decode_steps"] > decoded + 2, 120, "decoding")
    killed = time.monotonic()
    os.kill(engine.agent_pids[args.rank], signal.SIGKILL)
    probe = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=1))
    wait_until(engine, lambda: engine.stats()["agent_restarts"] > restarts, 300, "a new pool")
    pool_up = time.monotonic() - killed
    probe.result(timeout=300)
    answered = time.monotonic() - killed
    same = [s.result(timeout=300).token_ids for s in streams] == reference
    return {"pool_up_s": pool_up, "answered_s": answered, "same_ids": same,
            "promoted": engine.stats().get("standby_promotions", 0) > promoted}


def resident_mib(pids: list[int]) -> float:
    """The processes' resident memory (VmRSS), summed, in MiB."""
    kib = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        kib += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    return kib / 1024


def phases(spec, label: str) -> None:
    """Start ``spec``'s pool alone; print each start-up line's arrival, seconds after the spawn."""
    lines: list[tuple[float, str]] = []
    pool = AgentPool(spec)
    t0 = time.monotonic()
    try:
        pool.start(lambda line: lines.append((time.monotonic() - t0, line)))
        ready = time.monotonic() - t0
    finally:
        pool.close()
    print(f"\n#### {label}: ready after {ready:.1f} s\n")
    warmed: dict[str, list[float]] = {}
    for at, line in lines:
        agent, _, text = line.partition(": ")
        if text.startswith("warmed"):
            warmed.setdefault(agent, []).append(at)
            continue
        print(f"- {at:6.2f} s  {agent}: {text}")
    for agent, times in warmed.items():
        took = sorted(float(text.rsplit(" in ", 1)[1].rstrip("s")) for a, text in
                      (line.partition(": ")[::2] for _, line in lines) if a == agent and text.startswith("warmed"))
        print(f"- {times[0]:6.2f} .. {times[-1]:6.2f} s  {agent}: warmed {len(times)} shapes, {sum(took):.1f} s in "
              f"them (median {statistics.median(took):.2f} s, slowest {took[-1]:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--compile-cache", help="the compile cache root (default: a temporary directory)")
    parser.add_argument("--no-compile-cache", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--standby", action="store_true", help="serving_config.standby_agents on")
    parser.add_argument("--kill-while-standby-starts", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        cache: str | bool = False if args.no_compile_cache else (args.compile_cache or os.path.join(tmp, "cc"))
        cfg = config(args, cache, os.path.join(tmp, "models"))
        engine = Engine(cfg)
        t0 = time.monotonic()
        engine.start(progress=None)
        print(f"tp={args.tp}, compile cache {cache or 'off'}, standby {args.standby}: engine ready in "
              f"{time.monotonic() - t0:.1f} s, load average {os.getloadavg()[0]:.1f}; the serving agents' resident "
              f"memory {resident_mib(engine.agent_pids):.0f} MiB (a standby holds as much again)")
        try:
            reference = [s.result(timeout=300).token_ids for s in [engine.submit(p, GREEDY) for p in PROMPTS]]
            results = []
            print("\n| kill | new pool up, s | new request answered, s | interrupted requests' ids unchanged | "
                  "standby promoted | load |")
            print("|---|---|---|---|---|---|")
            for i in range(args.kills):
                r = kill_and_time(engine, args, reference)
                results.append(r)
                print(f"| {i + 1} | {r['pool_up_s']:.2f} | {r['answered_s']:.2f} | {r['same_ids']} | "
                      f"{r['promoted']} | {os.getloadavg()[0]:.1f} |", flush=True)
            answered = [float(r["answered_s"]) for r in results]
            print(f"\nanswered again after the kill: median {statistics.median(answered):.1f} s, "
                  f"min {min(answered):.1f}, max {max(answered):.1f}")
        finally:
            engine.shutdown()
        if args.phases:
            spec = agent_spec(cfg, resolve_model(cfg))
            phases(spec, "a restart's start-up (the pool alone)")


if __name__ == "__main__":
    main()
