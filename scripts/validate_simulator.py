#!/usr/bin/env python3
"""Simulated against measured: served load tests of several configurations and loads, each replayed by the simulator.

    python scripts/validate_simulator.py [--work-dir /tmp/llm-serving-sim] [--cases saturation,1-in-flight,...]
                                         [--rounds 3] [--profile-sessions 2]

For each configuration the step-time model is fitted to a profile measured on the same engine settings
(``llm-serving profile``'s sweep, not the load test itself), then the server runs the load test (the contest's
streaming endpoint) and the simulator replays the same requests with the output lengths the server produced (and
the load tool's arrival process or concurrency cap). Prints per case total time, median TTFT and TPOT, measured
vs simulated, and the error of each, as a markdown table (``--write`` adds it to a file). Model: the shipped
default (the trained pydoc target); every server is started and stopped by the script.

This 2-core machine is shared: for minutes at a time every step runs 1.2-2x slower (docs/simulator.md), which a
profile or a load test of a few seconds catches or misses by chance. So each profile is the union of
``--profile-sessions`` sweeps on separate servers, and each case is measured ``--rounds`` times (the measured
figures are the rounds' medians), spread over the run: profile session 1, measured round 1, session 2, round 2,
... A work directory's profiles and measured runs are reused (delete them to measure again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp
import numpy as np
import yaml

from llm_serving.bench.dataset import contest_prompt, load_dataset
from llm_serving.bench.local_server import running_server
from llm_serving.bench.workload import LengthDist, WorkloadSpec, make_workload, write_workload
from llm_serving.config.serving_config import ServingConfig
from llm_serving.engine.wiring import resolve_model
from llm_serving.simulator.costs import (
    FittedCost,
    load_profile,
    merged_profiles,
    round_spread,
    save_profile,
    shape_summary,
)
from llm_serving.simulator.profiling import default_sweep, engine_steps, run_sweep
from llm_serving.simulator.run import simulate
from llm_serving.simulator.target import build_target
from llm_serving.simulator.tuner import tune, tuned_yaml
from llm_serving.simulator.workload import from_results, retimed
from llm_serving.tokenization.hf_tokenizer import load_tokenizer
from loadtest.client import benchmark, save_run
from loadtest.dataset import BenchRequest, TokenCounter, build_requests
from loadtest.protocol import BenchConfig


@dataclass(frozen=True)
class Case:
    name: str
    num: int
    qps: float = math.inf
    concurrency: int | None = None
    overrides: dict = field(default_factory=dict)
    workload: str = "alpaca"  # alpaca | long | shared


CASES = (
    Case("saturation", 256),
    Case("1-in-flight", 24, concurrency=1),
    Case("8-in-flight", 96, concurrency=8),
    Case("poisson-20", 160, qps=20.0),
    Case("long-prompts", 64, workload="long"),
    Case("prefix-sharing", 128, workload="shared"),  # prefix caching is on by default
    Case("fcfs-decode-8", 128, overrides={"scheduler.policy": "fcfs", "model_config.decode_batch_size": [1, 8]}),
    Case("no-chunking", 128, overrides={"scheduler.enable_chunked_prefill": False}),
)
MAX_PROMPT_TOKENS = 384
WARM_UP_REQUESTS = 64  # sent at once to each measured server before its load test
# what does not change step times: configs differing only so share a profile
ENGINE_KEYS_IGNORED = ("scheduler.policy",)


def workloads(work: Path) -> dict[str, Path]:
    """The alpaca-shaped workloads, without the records whose prompt the served tokenizer makes longer than
    ``MAX_PROMPT_TOKENS`` (they would be refused, not served: the default context is 512 tokens)."""
    tok = load_tokenizer(resolve_model(ServingConfig()).tokenizer_path)
    specs = {
        "alpaca": WorkloadSpec(num=512, seed=0, output_words=LengthDist(40.0, 0.9, 3, 150)),
        "long": WorkloadSpec(num=96, seed=1, input_fraction=1.0, input_words=LengthDist(110.0, 0.3, 60, 150),
                             output_words=LengthDist(30.0, 0.6, 3, 100)),
        "shared": WorkloadSpec(num=16, seed=2, input_fraction=1.0, input_words=LengthDist(90.0, 0.3, 60, 130),
                               output_words=LengthDist(30.0, 0.6, 3, 100)),
    }
    paths = {}
    for name, spec in specs.items():
        records = [r for r in make_workload(spec) if len(tok.encode(contest_prompt(r))) <= MAX_PROMPT_TOKENS]
        paths[name] = write_workload(records, work / f"{name}.json")
    return paths


def config_for(case: Case, work: Path) -> tuple[ServingConfig, Path]:
    cfg = ServingConfig().with_values(case.overrides) if case.overrides else ServingConfig()
    path = work / f"{case.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return ServingConfig.from_yaml(path), path


def profile_for(case: Case, config: ServingConfig, work: Path, log, sessions: int = 1,
                session: int | None = None) -> Path:
    """The case's profile: the union of ``sessions`` one-round sweeps, each on its own server (``session``: measure
    only that one now, if missing). With one session, one server sweeps twice (``llm-serving profile``'s way)."""
    key = "-".join(f"{k}={v}" for k, v in sorted(case.overrides.items()) if k not in ENGINE_KEYS_IGNORED) or "default"
    path = work / f"profile-{key.replace('/', '_')}.json"
    if path.exists():
        return path
    parts = [path.with_suffix(f".session{i}.json") for i in range(sessions)]
    for part in parts if session is None else parts[session:session + 1]:
        if not part.exists():
            points = default_sweep(config.model_config.decode_batch_size[-1], config.max_model_len)
            steps, meta = run_sweep(config, points, work / f"{part.stem}.d", progress=log,
                                    rounds=2 if sessions == 1 else 1)
            save_profile(part, steps, meta)
    if not all(part.exists() for part in parts):
        return path  # the later sessions are still to come
    steps, meta = merged_profiles(parts)
    save_profile(path, steps, meta)
    fit = FittedCost.fit(steps, buckets=meta["decode_buckets"])
    spread = round_spread(steps, meta["round_steps"], meta["decode_buckets"])
    log(f"profile {path.name}: {len(steps)} steps, fit {shape_summary(fit.relative_errors(steps))}, "
        f"{'rounds' if sessions == 1 else 'sessions'} differ by {spread:.0%}")
    return path


def measure(case: Case, config_path: Path, dataset: Path, work: Path, log) -> Path:
    out = work / f"measured-{case.name}"
    results = out / f"result_{float(case.qps)}_x.json"
    if results.exists():
        return results
    counter = TokenCounter(None)
    requests: list[BenchRequest] = build_requests(load_dataset(dataset), case.num, counter)
    record = ["--record-steps", str(out / "served-steps.json")]  # the steps as served, to check the cost model on
    out.mkdir(parents=True, exist_ok=True)
    with running_server(config_path, work / f"server-{case.name}.log", extra_args=record) as (port, ready_s):
        log(f"{case.name}: server ready in {ready_s:.0f} s on port {port}")
        cfg = BenchConfig(port=port, qps=case.qps, max_concurrency=case.concurrency, metrics_interval=0.0)
        # a fresh server's first seconds run up to 1.4x slower (measured: 1.44 s, then 1.37, 1.19, 1.05 s for the
        # same load), so each server is warmed up as the profile's is, and the same steps are left out of the record
        # with prompts no case sends (the alpaca workload's last records), so the warm-up leaves no prefix to hit
        warm = build_requests(load_dataset(work / "alpaca.json")[-WARM_UP_REQUESTS:], WARM_UP_REQUESTS, counter)
        asyncio.run(benchmark(warm, BenchConfig(port=port, qps=math.inf, metrics_interval=0.0), progress=False))
        (out / "warm-up-steps").write_text(str(asyncio.run(steps_so_far(port))))
        run = asyncio.run(benchmark(requests, cfg, progress=False))
    failed = run.metrics["failed_requests"]
    if failed:
        raise SystemExit(f"{case.name}: {failed} requests failed: {run.metrics['errors']}")
    save_run(run, out, {"case": case.name}, draw=False)
    return results


async def steps_so_far(port: int) -> int:
    async with aiohttp.ClientSession() as session:
        return await engine_steps(session, f"http://127.0.0.1:{port}")


def served_steps(results: Path) -> list:
    """The steps a measured server ran for its load test (its warm-up's left out)."""
    served, _ = load_profile(results.parent / "served-steps.json")
    warm_up = int((results.parent / "warm-up-steps").read_text())
    while served and warm_up > 0:
        warm_up -= served.pop(0)[0].num_steps
    return served


def simulated(case: Case, config: ServingConfig, profile: Path, results: list[Path]) -> dict:
    """The simulation of the first round's requests, its step count, and how the cost model does on the steps the
    servers recorded in every round (the model's time for those very steps over their measured time: the error
    that is the cost model's alone, not the scheduling's)."""
    target = build_target(config, str(profile))
    requests = from_results(results[0], target.encode)
    if case.concurrency:
        requests = retimed(requests, case.qps)
    run = simulate(target.scheduler, requests, target.cost, target.request_overhead_s, case.concurrency)
    rounds = [served_steps(r) for r in results]
    return {**run.metrics, "steps": run.steps, "served_steps": sum(s.num_steps for s, _ in rounds[0]),
            "cost_on_served": sum(target.cost.seconds(s) for r in rounds for s, _ in r)
            / sum(t for r in rounds for _, t in r) - 1}


def measured(results: list[Path]) -> dict:
    """The rounds' medians of each metric, and each round's total time."""
    rounds = [json.loads((r.parent / r.name.replace("result_", "summary_")).read_text())["metrics"] for r in results]
    return {**{key: float(np.median([m[key] for m in rounds])) for _, key, _ in METRICS},
            "round_totals": [m["total_time_s"] for m in rounds]}


METRICS = (("total s", "total_time_s", 1.0), ("median TTFT ms", "median_ttft_ms", 1.0),
           ("median TPOT ms", "median_tpot_ms", 1.0))


def table(rows: list[tuple[Case, dict, dict]]) -> str:
    head = ("| case | " + " | ".join(f"{name} meas. / sim. (error)" for name, _, _ in METRICS)
            + " | measured rounds' total s | steps served / sim. | cost model on the served steps |")
    out = [head, "|---|" + "---:|" * (len(METRICS) + 3)]
    for case, meas, sim in rows:
        cells = []
        for _, key, _ in METRICS:
            m, s = meas.get(key), sim.get(key)
            cells.append("n/a" if m is None or s is None else f"{m:.3g} / {s:.3g} ({(s / m - 1) * 100:+.0f}%)")
        cells += [", ".join(f"{t:.2f}" for t in meas["round_totals"]), f"{sim['served_steps']} / {sim['steps']}",
                  f"{sim['cost_on_served'] * 100:+.0f}%"]
        out.append(f"| {case.name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _row(name: str, simulated_s: float, measured_s: list[float]) -> str:
    rounds = ", ".join(f"{t:.2f}" for t in measured_s)
    return f"| {name} | {simulated_s:.2f} | {np.median(measured_s):.2f} ({rounds}) |"


def tune_check(work: Path, dataset: Path, log, rounds: int = 2) -> str:
    """The tuner's choice for the saturation workload (256 requests at once, replayed from the shipped config's
    measured run) set against the shipped default config, both simulated and both measured (alternating rounds)."""
    base, base_path = config_for(CASES[0], work)
    wide = Case("wide-decode", 0, overrides={"model_config.decode_batch_size": [1, 8, 32, 64, 128, 256]})
    profile = profile_for(wide, config_for(wide, work)[0], work, log)
    workload = measure(CASES[0], base_path, dataset, work, log)
    requests = from_results(workload, build_target(base, str(profile)).encode)
    result = tune(base, lambda cfg: build_target(cfg, str(profile)), requests, [], progress=log)
    tuned_path = work / "tuned.yaml"
    tuned_path.write_text(yaml.safe_dump(tuned_yaml(base, None, result.best)))
    log(f"tuned: {result.best.values}")
    measured: dict[str, list[float]] = {"shipped": [], "tuned": []}
    for r in range(rounds):
        for name, path in (("shipped", base_path), ("tuned", tuned_path)):
            res = measure(Case(f"{name}-round{r}", CASES[0].num), path, dataset, work, log)
            summary = json.loads((res.parent / res.name.replace("result_", "summary_")).read_text())
            measured[name].append(summary["metrics"]["total_time_s"])
    med = {k: float(np.median(v)) for k, v in measured.items()}  # the speed-up row
    changes = ", ".join(f"`{k}: {v}`" for k, v in result.best.values.items())
    return "\n".join([
        f"Tuned ({len(result.trials)} configurations simulated): {changes}", "",
        "| config | simulated total s | measured total s (rounds) |", "|---|---:|---:|",
        _row("shipped default", result.base.total_s, measured["shipped"]),
        _row("tuned", result.best.total_s, measured["tuned"]),
        f"| speed-up | {result.base.total_s / result.best.total_s:.2f}x | {med['shipped'] / med['tuned']:.2f}x |",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default="/tmp/llm-serving-sim", help="configs, profiles, results and logs")
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    p.add_argument("--write", metavar="MD", help="append the table to this file")
    p.add_argument("--rounds", type=int, default=3, help="measured runs of each case (their medians are compared)")
    p.add_argument("--profile-sessions", type=int, default=2, help="one-round profile sweeps per configuration, "
                   "each on its own server (1: one server sweeping twice)")
    p.add_argument("--tune", action="store_true", help="also tune the saturation workload and measure the choice "
                   "against the shipped config")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    wanted = args.cases.split(",")
    unknown = set(wanted) - {c.name for c in CASES}
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in CASES]}")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    data = workloads(work)
    cases = [c for c in CASES if c.name in wanted]
    configs = {case.name: config_for(case, work) for case in cases}
    results: dict[str, list[Path]] = {case.name: [] for case in cases}
    for i in range(max(args.profile_sessions, args.rounds)):  # spread over the run (the module docstring)
        for case in cases if i < args.profile_sessions else ():
            profile_for(case, configs[case.name][0], work, log, args.profile_sessions, session=i)
        for case in cases if i < args.rounds else ():
            name = case.name if i == 0 else f"{case.name}-r{i}"
            results[case.name].append(measure(replace(case, name=name), configs[case.name][1],
                                              data[case.workload], work, log))
    rows = []
    for case in cases:
        profile = profile_for(case, configs[case.name][0], work, log, args.profile_sessions)
        rows.append((case, measured(results[case.name]), simulated(case, configs[case.name][0], profile,
                                                                   results[case.name])))
        log(table(rows[-1:]).splitlines()[-1])
    text = table(rows)
    if args.tune:
        text += "\n\n" + tune_check(work, data["alpaca"], log, rounds=max(args.rounds, 2))
    print(text)
    if args.write:
        with open(args.write, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
