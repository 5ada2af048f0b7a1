"""MoE block vs a dense MLP of the same active size, CPU graph mode: the time of one block call at batch 1 and 32
with few or many experts held (same top-k), so a reader sees whether the cost follows the experts a step touches
or the experts the layer holds. The block alone (the layer's MLP slot, agents.model.moe); with ``--steps``, whole
decode steps of a model whose every layer is that block against the same model with the dense MLP (ModelRunner,
the bench model's attention and vocabulary, context 128), each shape timed in turn so the machine's drift moves
all of them. The MoE models are Mixtral's (Llama attention, as the dense model's: Qwen3-MoE's head norms would be
graph ops the dense model does not run). On the native backend ``--moe-op`` picks the MLP slot's op: ``layer``
(``MoeLayer``, the whole slot, routing included) or ``experts`` (``MoeExperts`` with the norm and routing in
MindSpore's ops, the path before it); both: side by side. Figures: docs/model.md "Mixture of experts".

    python scripts/bench_moe.py [--hidden 1024] [--expert-ffn 256] [--top-k 8] [--experts 8 64] [--repeat 20]
    python scripts/bench_moe.py --steps [--kernels native] [--quantization none w8a16] [--moe-op layer experts]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, run as a script

from agents.model.backends.native_cpu import NativeCpuBackend
from agents.model.moe import MoeBlock
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import canonical_shapes
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.moe_config import MoeSpec
from scripts.bench_model import BLOCK, alternating_ms, decode_batch

CONTEXT = 128


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


def _runner(config: LlamaConfig, batches: list[int], kernels: str, quantization: str = "none",
            moe_op: str = "layer") -> ModelRunner:
    rng = np.random.default_rng(0)
    weights = {name: (1 + 0.05 * rng.standard_normal(shape) if name.endswith("norm") else
                      0.02 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in canonical_shapes(config).items()}
    width = -(-CONTEXT // BLOCK)
    rc = RunnerConfig(num_blocks=max(batches) * width + 1, block_size=BLOCK, max_model_len=2 * CONTEXT,
                      prefill_batch_sizes=(1,), prefill_seq_lengths=(16,), decode_batch_sizes=tuple(batches),
                      decode_block_widths=(width,), kernels=kernels, quantization=quantization)
    NativeCpuBackend.fused_moe = moe_op == "layer"  # read as the model is built
    try:
        runner = ModelRunner(config, weights, rc)
    finally:
        NativeCpuBackend.fused_moe = True
    runner.warmup()
    return runner


def steps(args: argparse.Namespace) -> None:
    """Decode steps (ms, median of ``repeat`` in turn) of the dense model and of each MoE model, in each of
    ``--quantization`` (w8a16: int8 projections and experts) and, for the MoE models, each of ``--moe-op``."""
    h, f, k = args.hidden, args.expert_ffn, args.top_k
    dense = LlamaConfig(vocab_size=8000, hidden_size=h, intermediate_size=k * f, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=4)
    models = {f"dense ffn {k * f}": (dense, ("layer",))}
    for e in args.experts:
        moe = MoeSpec(e, k, f, True, 0, tuple(range(args.layers)))
        models[f"moe {e} experts, top {k}"] = (dataclasses.replace(dense, architecture="MixtralForCausalLM", moe=moe),
                                               args.moe_op)
    runners = {f"{name}{'' if q == 'none' else ', ' + q}{'' if config.moe is None else ', ' + op}":
               _runner(config, args.batches, args.kernels, q, op)
               for name, (config, ops_) in models.items() for q in args.quantization for op in ops_}
    calls = [(name, b, lambda r=runner, b=b: r.step(decode_batch(b, CONTEXT)))
             for name, runner in runners.items() for b in args.batches]
    times = alternating_ms([call for _, _, call in calls], args.repeat)
    print(f"decode steps, hidden {h}, {args.layers} layers, expert ffn {f}, context {CONTEXT}, kernels "
          f"{args.kernels}, median of {args.repeat}, ms")
    for (name, b, _), ms_ in zip(calls, times):
        print(f"{name:44s} batch {b}: {ms_:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--steps", action="store_true", help="whole decode steps instead of the block alone")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kernels", default="native", choices=["auto", "native", "portable"])
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "w8a16"],
                        help="with --steps: each model in each of these")
    parser.add_argument("--moe-op", nargs="+", default=["layer"], choices=["layer", "experts"],
                        help="with --steps, native kernels: the MoE slot as MoeLayer, or MoeExperts amid graph ops")
    args = parser.parse_args()
    if args.steps:
        steps(args)
        return
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
