"""What a LoRA update costs beside a projection, as MindSpore graph ops, for choosing how the graphs batch adapters.

    python scripts/bench_lora_ops.py [--rounds 3] [--calls 200]

A chain of ``--depth`` projections shaped as the bench model's (hidden 512 -> 512, the output projection) in one
graph, per call, at batch 1 and 32, four ways measured in turn each round:
- base: ``x W^T`` only;
- masked: every slot's A stacked (``[S*R, in]``), one ``x A^T``, a per-row mask (zero outside the row's slot, so a
  row without an adapter adds zeros), one ``(.) B^T``: three ops, the same for every mix of adapters;
- gathered: each row's own A and B gathered by its slot index (``[t, R, in]``), two batched matmuls: the cost
  grows with the rows, not the slots;
- one adapter (S = 1, masked).
The ratios to base, side by side in one process, are the figures (the machine is shared: absolute ms move).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


class Chain(nn.Cell):
    """``depth`` projections one after another, each with the update ``kind`` asks for."""

    def __init__(self, kind: str, depth: int) -> None:
        super().__init__()
        self.kind, self.depth = kind, depth
        self.matmul = ops.MatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def construct(self, x, w, a, b, mask, a_rows, b_rows):
        for _ in range(self.depth):
            y = self.matmul(x, w)
            if self.kind == "masked":
                y = y + self.matmul(self.matmul(x, a) * mask, b)
            elif self.kind == "gathered":
                xa = self.bmm(ops.expand_dims(x, 1), a_rows)  # [t, 1, R]
                y = y + self.bmm(xa, b_rows).squeeze(1)  # [t, 1, out]
            x = y  # W scaled by 1/sqrt(in) keeps the values near 1: no denormals (a shrinking chain measured those)
        return x


def inputs(batch: int, dim: int, slots: int, rank: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    f = np.float32
    x = rng.standard_normal((batch, dim)).astype(f)
    w = (rng.standard_normal((dim, dim)) / dim ** 0.5).astype(f)
    a = (rng.standard_normal((slots * rank, dim)) / dim ** 0.5).astype(f)
    b = (rng.standard_normal((dim, slots * rank)) / rank ** 0.5).astype(f)
    slot = rng.integers(0, slots + 1, batch)  # 0: no adapter
    mask = np.zeros((batch, slots * rank), f)
    for i, s in enumerate(slot):
        if s:
            mask[i, (s - 1) * rank: s * rank] = 1
    a_slots = np.concatenate([np.zeros((1, rank, dim), f), a.reshape(slots, rank, dim)])
    b_slots = np.concatenate([np.zeros((1, dim, rank), f), b.reshape(dim, slots, rank).transpose(1, 0, 2)])
    a_rows = a_slots[slot].transpose(0, 2, 1)  # [t, in, R]
    b_rows = b_slots[slot].transpose(0, 2, 1)  # [t, R, out]
    return tuple(Tensor(v) for v in (x, w, a, b, mask, a_rows, b_rows))


def time_ms(cell: Chain, args: tuple, calls: int) -> float:
    cell(*args).asnumpy()  # compile
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        cell(*args).asnumpy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    ways = {"base": ("base", 3), "masked, 3 adapters": ("masked", 3), "gathered, 3 adapters": ("gathered", 3),
            "masked, 1 adapter": ("masked", 1)}
    cells = {name: Chain(kind, args.depth) for name, (kind, _) in ways.items()}
    results: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):  # the order alternates between rounds
        for batch in (1, 32):
            for name, (_, slots) in reversed(list(ways.items())) if round_ % 2 else ways.items():
                ms_per_call = time_ms(cells[name], inputs(batch, args.dim, slots, args.rank), args.calls)
                results.setdefault((name, batch), []).append(ms_per_call)
    print(f"{args.depth} projections {args.dim}x{args.dim} per call, rank {args.rank}, median of {args.calls} calls, "
          f"median of {args.rounds} rounds\n")
    print("| way | batch 1: ms per call | x base | batch 32: ms per call | x base |")
    print("|---|---|---|---|---|")
    for name in ways:
        cols = []
        for batch in (1, 32):
            got, base = statistics.median(results[(name, batch)]), statistics.median(results[("base", batch)])
            cols += [f"{got:.3f}", f"{got / base:.2f}x"]
        print(f"| {name} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
