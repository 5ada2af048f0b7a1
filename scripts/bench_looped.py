"""Looped decode graphs against the host loop of single-step calls, in process, side by side in one run (issue 53).

    python scripts/bench_looped.py [--variants k1,host-k4,loop-k4,host-k8,loop-k8] [--levels 1] [--rounds 3]
        [--decode-batches 1,8]

The bench model and workload of scripts/bench_low_load.py (greedy, EOS ignored). ``kN``: ``scheduler.decode_steps``
N; ``loop-kN`` runs each multi-step batch as one looped graph call (``agents.runtime.looped_decode``), ``host-kN``
as N single-step calls (``agents.runtime.multi_step``: the agents get a runner config without looped graphs). The
engine in process only, variants in alternating order each round; medians over the rounds, and each round's
figures.
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

from bench_low_load import add_workload_arguments, in_process, workload
from benchmark import TUNED, write_config

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine import wiring
from llm_serving.engine.loop import Engine

_runner_config_dict = wiring.runner_config_dict


def without_looped_graphs(config: ServingConfig) -> dict:
    """The runner config the agents get, with no looped decode graph: multi-step batches take the host loop."""
    return {**_runner_config_dict(config), "decode_steps": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="k1,host-k4,loop-k4,host-k8,loop-k8")
    ap.add_argument("--levels", default="1", help="requests in flight")
    add_workload_arguments(ap, num_prompts=16, work_dir="/tmp/llm-serving-bench-looped")
    ap.add_argument("--decode-batches", default=",".join(map(str, TUNED["decode"])),
                    help="decode batch buckets (fewer: a quicker start, each looped graph compiles k steps)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    levels = [int(n) for n in args.levels.split(",")]
    work, model_dir, prompts = workload(args)
    decode_batches = tuple(int(n) for n in args.decode_batches.split(","))
    configs = {}
    for v in variants:
        mode, _, steps = v.rpartition("k")
        if mode not in ("", "host-", "loop-") or not steps.isdigit():
            raise SystemExit(f"--variants: {v!r} is not kN, host-kN or loop-kN")
        path = write_config(work / f"config-{v}.yaml", model_dir, TUNED["prefill"], decode_batches, "fcfs",
                            args.max_output_tokens)
        cfg = json.loads(path.read_text())
        cfg["scheduler"].update(decode_steps=int(steps))
        path.write_text(json.dumps(cfg, indent=1) + "\n")
        configs[v] = path
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            wiring.runner_config_dict = without_looped_graphs if v.startswith("host-") else _runner_config_dict
            t0 = time.perf_counter()
            with Engine(ServingConfig.from_yaml(configs[v])) as engine:
                engine.start(progress=None)
                engine.submit(prompts[0][0], SamplingParams(4)).result(timeout=600)  # warm
                start_s = time.perf_counter() - t0
                for level in levels:
                    rows.setdefault((v, level), []).append(asyncio.run(in_process(engine, prompts, level)))
            tpots = ", ".join(f"{level} in flight {rows[(v, level)][-1][1]:.2f} ms" for level in levels)
            print(f"round {rnd + 1} {v}: {tpots} per output token (start {start_s:.1f} s)", file=sys.stderr,
                  flush=True)
    print("| in flight | variant | output tokens/s | ms per output token | ms per output token per round |")
    print("|---|---|---|---|---|")
    for (v, level), runs in sorted(rows.items(), key=lambda x: (x[0][1], variants.index(x[0][0]))):
        rate, tpot = (statistics.median(run[i] for run in runs) for i in range(2))
        each = " / ".join(f"{run[1]:.2f}" for run in runs)
        print(f"| {level} | {v} | {rate:.1f} | {tpot:.2f} | {each} |")


if __name__ == "__main__":
    main()
