"""What one more kernel launch costs in a compiled MindSpore CPU graph, and how many a decode step launches.

    python scripts/bench_op_launch.py [--ops 16 32 64] [--repeats 400] [--count]

Why: a looped k-step decode graph saved nothing over k calls (docs/benchmarks.md, "Looped decode graphs"), so a
step's fixed cost is per kernel, not per call. This measures it directly: graphs of N chained trivial AOT Custom
ops (our ``PartialLinear`` on a ``[1, 32]`` row with ``rows`` 0: it zeroes 128 bytes and returns), timed in turn
(alternating, the machine is shared), the slope between N and 2N being the cost of one launch.
``--count`` compiles the bench model's batch-1 decode graph (native kernels) with MindSpore's IR dump on and counts
the kernels in its execution order (the dump goes to a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def alternating(calls, repeats: int) -> tuple[list[float], list[float]]:
    """Median wall and CPU (the whole process's) ms of each call, the calls timed in turn. CPU time: on a shared,
    overloaded machine wall time is mostly waiting for a core; the process's CPU time counts only what it ran
    (with ``LLM_SERVING_KERNEL_THREADS=1`` no helper polls, so it is the work and the runtime's own threads)."""
    for call in calls:
        call()
    wall: list[list[float]] = [[] for _ in calls]
    cpu: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, w, c in zip(calls, wall, cpu):
            t0, c0 = time.perf_counter(), time.process_time()
            call()
            c.append((time.process_time() - c0) * 1e3)
            w.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(w) for w in wall], [statistics.median(c) for c in cpu]


def report(label: str, sizes: list[int], wall: list[float], cpu: list[float]) -> None:
    print(f"| {label} | wall ms (median) | process CPU ms (median) |\n|---|---|---|")
    for n, w, c in zip(sizes, wall, cpu):
        print(f"| {n} | {w:.3f} | {c:.3f} |")
    for name, t in (("wall", wall), ("CPU", cpu)):
        slope = (t[len(sizes) - 1] - t[0]) / (sizes[-1] - sizes[0]) * 1e3
        print(f"one more custom op ({name}): {slope:.1f} us (slope {sizes[0]} -> {sizes[-1]} ops); "
              f"with none: {t[0] * 1e3 - slope * sizes[0]:.0f} us")


def launch_cost(sizes: list[int], repeats: int) -> None:
    import numpy as np
    from mindspore import Parameter, ParameterTuple, Tensor, nn

    from agents.model.native_kernels import native_ops
    from agents.runtime.device import setup_device
    from agents.weights import packed as packed_weights

    setup_device("CPU")
    native = native_ops(32)

    class Chain(nn.Cell):
        """``n`` trivial custom ops, each feeding the next (so none can be dropped or reordered); with
        ``weights`` each reads its own weight Parameter, as a layer's projections do."""

        def __init__(self, n: int, weights: bool) -> None:
            super().__init__()
            self.ops = [native.partial_linear(32) for _ in range(n)]
            packed = packed_weights.pack(np.eye(32, dtype=np.float32))
            self.weights = ParameterTuple(Parameter(Tensor(packed), name=f"w{i}") for i in range(n)) \
                if weights else None

        def construct(self, x: Tensor, w: Tensor, rows: Tensor) -> Tensor:
            for i, op in enumerate(self.ops):
                x = op(x, self.weights[i] if self.weights is not None else w, rows)
            return x

    x = Tensor(np.ones((1, 32), np.float32))
    w = Tensor(packed_weights.pack(np.eye(32, dtype=np.float32)))
    for weights, real_rows in ((False, 0), (True, 0), (True, 1)):
        rows = Tensor(np.array([real_rows], np.int32))
        chains = [Chain(n, weights) for n in sizes]
        calls = [lambda c=c, r=rows: c(x, w, r).asnumpy() for c in chains]
        what = (f"{'own weight Parameter each' if weights else 'one weight input'}, "
                f"{'1 row' if real_rows else 'no rows'} computed")
        print(f"\n{what}:\n")
        report("custom ops in the graph", sizes, *alternating(calls, repeats))


def in_graph(extra: list[int], repeats: int) -> None:
    """The bench model's batch-1 decode graph (native kernels, context 64) as the runner builds it, next to the same
    graph with ``extra`` more trivial custom ops chained beside it: what that many launches cost inside a real step
    (the helpers polling as in a served small step), called in turn."""
    import numpy as np
    from bench_model import batch1_decode_runner, decode_batch
    from mindspore import Tensor, nn, ops

    from agents.model.llama import LlamaStep
    from agents.weights import packed as packed_weights

    runner = batch1_decode_runner()
    native = runner.backend.native  # type: ignore[attr-defined]

    class Padded(nn.Cell):
        """The decode step, then ``n`` trivial custom ops (a chain after the step's logits, which its token ids wait
        for: serial, as a layer's ops are, not beside the step on another runtime thread)."""

        def __init__(self, n: int) -> None:
            super().__init__()
            self.step = LlamaStep(runner.model, is_prefill=False)
            self.ops = [native.partial_linear(32) for _ in range(n)]
            self.x = Tensor(np.ones((1, 32), np.float32))
            self.w = Tensor(packed_weights.pack(np.eye(32, dtype=np.float32)))
            self.rows = Tensor(np.zeros(1, np.int32))

        def construct(self, *inputs: Tensor):
            ids, logprobs, logits = self.step(*inputs)
            x = ops.depend(self.x, logits)
            for op in self.ops:
                x = op(x, self.w, self.rows)
            return ops.depend(ids, x), logprobs, logits

    b = decode_batch(1, 64)
    inputs = [Tensor(a) for a in (b.input_ids, b.positions, b.slot_mapping, b.context_lens, b.block_tables,
                                  np.zeros(1, np.int32))]
    cells = [Padded(n) for n in extra]

    def call(cell: nn.Cell) -> None:
        runner.backend.before_step(1)
        cell(*inputs)[0].asnumpy()
        runner.backend.after_step()

    runner.warmup()
    wall, cpu = alternating([lambda c=c: call(c) for c in cells] + [lambda: runner.step(b)], repeats)
    report("extra custom ops in the bench decode graph", extra, wall, cpu)
    print(f"ModelRunner.step of the same batch (inputs made, graph called, outputs read): {wall[-1]:.3f} ms wall, "
          f"{cpu[-1]:.3f} ms CPU")


def count_kernels() -> None:
    """The kernels of the bench model's batch-1 decode graph, from the IR MindSpore dumps at compile time."""
    dump = tempfile.mkdtemp(prefix="ir-dump-")
    os.environ["MS_DEV_SAVE_GRAPHS"] = "1"
    os.environ["MS_DEV_SAVE_GRAPHS_PATH"] = dump
    from bench_model import batch1_decode_runner, decode_batch

    runner = batch1_decode_runner()
    runner.warmup()
    runner.step(decode_batch(1, 64))
    graphs = [p for p in Path(dump).glob("hwopt_end_mindrt_unify_mindir_graph_*LlamaStep*.ir")
              if "PagedDecodeAttention" in p.read_text()]
    if not graphs:
        print(f"no decode graph in the IR dump at {dump}")
        return
    text = graphs[-1].read_text()
    custom = Counter(re.findall(r'func_name: "[^"]*:(\w+)"', text))
    builtin = Counter(re.findall(r"= PrimFunc_(\w+)\(", text))
    print(f"{graphs[-1].name}: {sum(custom.values())} custom ops {dict(custom)}, "
          f"{sum(builtin.values())} MindSpore kernels {dict(builtin)}, {text.count('= Load(')} Parameters read")
    shutil.rmtree(dump, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--count", action="store_true", help="count the bench decode graph's kernels instead")
    parser.add_argument("--in-graph", action="store_true",
                        help="add --ops trivial ops to the bench decode graph instead (0 for none)")
    args = parser.parse_args()
    if args.count:
        count_kernels()
    elif args.in_graph:
        in_graph(sorted(args.ops), args.repeats)
    else:
        launch_cost(sorted(args.ops), args.repeats)


if __name__ == "__main__":
    main()
