"""Where a batch-1 decode step goes inside the agent: the graph call, the Python around it, and each thread's CPU.

    python scripts/profile_decode_step.py [--rounds 2] [--steps 300] [--kernel-threads 2 1]

Why: issue 53's one-stream gap. Our kernels alone, called back to back without MindSpore
(``scripts/bench_decode_kernels.cc``), run the bench model's decode token at the machine's two-core memory
bandwidth; the same kernels in the step graph take longer. This splits the difference. For the bench model and the
"hollow" model (``scripts/bench_fixed_cost.py``: the same graphs, ops and graph inputs, ~no weights to read), with
each ``LLM_SERVING_KERNEL_THREADS`` (read once per process, so one child process per configuration, the
configurations alternating over ``--rounds``), a batch-1 decode step at context 64:

- ``ModelRunner.step``: what the agent pays a step (inputs padded and made Tensors, the graph called, outputs read);
- the graph call alone: the same graph called with its input Tensors made once, its outputs read;
- CPU per step of the calling thread (Python, MindSpore's runtime, its share of the kernels' tasks) and of the
  other threads (the kernels' helper: its share of the tasks, and polling between ops), from /proc.

The hollow model's graph call is MindSpore's fixed cost of the step; the bench model's, less the kernels' time from
``bench_decode_kernels``, is what the runtime's work between our ops costs the kernels on top (docs/benchmarks.md,
"Where the one-stream token goes").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) each of this process's threads has used, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        used[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return used


def child(model: str, steps: int) -> dict[str, float]:
    """One configuration's figures (this process's kernel threads), ms."""
    from bench_fixed_cost import MODELS
    from bench_model import batch1_decode_runner, decode_batch
    from mindspore import Tensor

    from llm_serving.protocol.step import StepKind

    runner = batch1_decode_runner(MODELS[model])
    runner.warmup()
    batch = decode_batch(1, 64)
    shape, arrays = runner.families[StepKind.DECODE].inputs(batch)
    graph, inputs = runner.graph(shape[0]), [Tensor(a) for a in arrays]

    def graph_call() -> None:
        runner.backend.before_step(1)
        ids, logprobs, _ = graph(*inputs)
        ids.asnumpy(), logprobs.asnumpy()
        runner.backend.after_step()

    calls = {"step": lambda: runner.step(batch), "graph": graph_call}
    for call in calls.values():
        for _ in range(20):
            call()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(steps):  # in turn: the machine is shared
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            wall[name].append(time.perf_counter() - t0)
    before = thread_cpu_seconds()
    for _ in range(steps):
        runner.step(batch)
    after = thread_cpu_seconds()
    caller = os.getpid()  # the Python thread calls the graph, and MindSpore's CPU runtime launches its kernels there
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    return {"step": statistics.median(wall["step"]) * 1e3, "graph": statistics.median(wall["graph"]) * 1e3,
            "caller_cpu": used.get(caller, 0.0) / steps * 1e3,
            "other_cpu": sum(v for tid, v in used.items() if tid != caller) / steps * 1e3}


def run_child(model: str, threads: int, steps: int) -> dict[str, float]:
    env = dict(os.environ, LLM_SERVING_KERNEL_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--child", model, "--steps", str(steps)], check=True,
                         capture_output=True, text=True, cwd=ROOT, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per configuration and round")
    parser.add_argument("--kernel-threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--models", nargs="+", default=["bench", "hollow"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    configs = [(model, threads) for model in args.models for threads in args.kernel_threads]
    results: dict[tuple[str, int], list[dict[str, float]]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for model, threads in configs:
            results[(model, threads)].append(run_child(model, threads, args.steps))
    print(f"load average after: {os.getloadavg()[0]:.1f}; medians over {args.rounds} rounds of {args.steps} steps, "
          "batch 1, context 64\n")
    print("| model | kernel threads | ModelRunner.step, ms | graph call, ms | Python around it, ms | "
          "calling thread CPU, ms | other threads CPU, ms | per round: step |")
    print("|---|---|---|---|---|---|---|---|")
    for (model, threads), rounds in results.items():
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        per_round = " / ".join(f"{r['step']:.2f}" for r in rounds)
        print(f"| {model} | {threads} | {med['step']:.2f} | {med['graph']:.2f} | {med['step'] - med['graph']:.2f} | "
              f"{med['caller_cpu']:.2f} | {med['other_cpu']:.2f} | {per_round} |")


if __name__ == "__main__":
    main()
