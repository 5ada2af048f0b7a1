"""MoE block vs a dense MLP of the same active size, CPU graph mode: the time of one block call at batch 1 and 32
with few or many experts held (same top-k), so a reader sees whether the cost follows the experts a step touches
or the experts the layer holds. The block alone (the layer's MLP slot, agents.model.moe), not a whole decode step.
Figures: docs/model.md "Mixture of experts".

    python scripts/bench_moe.py [--hidden 1024] [--expert-ffn 256] [--top-k 8] [--experts 8 64] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, run as a script

from agents.model.moe import MoeBlock
from llm_serving.protocol.moe_config import MoeSpec


class DenseMlp(nn.Cell):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.f = ffn
        self.gate_up = Parameter(Tensor(rng.normal(0, 0.02, (2 * ffn, hidden)).astype(np.float32)), name="gate_up")
        self.linear = ops.MatMul(transpose_b=True)
        self.down = Parameter(Tensor(rng.normal(0, 0.02, (hidden, ffn)).astype(np.float32)), name="down")

    def construct(self, x: Tensor) -> Tensor:
        gu = self.linear(x, self.gate_up)
        return self.linear(ops.silu(gu[:, :self.f]) * gu[:, self.f:], self.down)


def _moe(hidden: int, f: int, k: int, experts: int) -> MoeBlock:
    rng = np.random.default_rng(0)
    block = MoeBlock(MoeSpec(experts, k, f, True, 0, (0,)), hidden, ms.float32)
    block.load({"layers.0.router": rng.normal(0, 1, (experts, hidden)).astype(np.float32),
                "layers.0.experts_gate_up": rng.normal(0, 0.02, (experts, 2 * f, hidden)).astype(np.float32),
                "layers.0.experts_down": rng.normal(0, 0.02, (experts, hidden, f)).astype(np.float32)}, 0)
    return block


def time_ms(cell: nn.Cell, x: Tensor, repeat: int) -> float:
    cell(x).asnumpy()  # compile
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        cell(x).asnumpy()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    h, f, k = args.hidden, args.expert_ffn, args.top_k
    cells = {f"dense ffn {k * f}": DenseMlp(h, k * f)}
    cells.update({f"moe {e} experts, top {k}": _moe(h, f, k, e) for e in args.experts})
    print(f"hidden {h}, expert ffn {f}, median of {args.repeat} calls, ms")
    for name, cell in cells.items():
        inputs = [Tensor(np.random.default_rng(b).normal(0, 1, (b, h)).astype(np.float32)) for b in args.batches]
        row = [f"{time_ms(cell, x, args.repeat):.2f}" for x in inputs]
        print(f"{name:28s} " + "  ".join(f"batch {b}: {t}" for b, t in zip(args.batches, row)))


if __name__ == "__main__":
    main()
