"""Model-runner speed on the Llama-2-shaped bench model, next to plain matmuls of the same size.

    python scripts/bench_model.py [--repeats 10] [--decode-context 256] [--kernels native portable]

For each kernel choice (``RunnerConfig.kernels``: native C++ ops for projections, attention and the greedy pick,
or portable graph ops; both by default, side by side in one run) prints a markdown table: ms per prefill call
(batch 1/4/8 x 128 tokens) and per decode step (batch 1/32/128 at the given context), the model GFLOP/s each
achieves, and the GFLOP/s of one matmul ``[tokens, hidden] x [hidden, N]`` with the same FLOPs, done by
MindSpore's MatMul and by our native GEMM (``agents/model/kernels/linear.cc``), timed in turn with the step (so that
the machine's drift moves all of them). Also the compile (warm-up) time of every graph shape, and decode step
times with sampling (first choice only).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mindspore as ms
from mindspore import Tensor, nn, ops

from agents.model.backends.graph_ops import greedy_pick
from agents.model.llama import LlamaStep
from agents.model.native_kernels import KernelBuildError, NativeOps, native_ops
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights import packed as packed_weights
from agents.weights.checkpoints import fuse_hf_tensors
from llm_serving.models.random_model import random_hf_weights
from llm_serving.protocol.batch import SamplingBatch, StepBatch
from llm_serving.protocol.model_config import LlamaConfig

BENCH_MODEL = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
BLOCK = 16


class Apply(nn.Cell):
    """A graph of one op."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def construct(self, *inputs: Tensor) -> Tensor:
        return self.op(*inputs)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def reference_matmul(tokens: int, flops: float, native: NativeOps | None = None):
    """One plain ``[tokens, hidden] x [hidden, n]`` matmul doing ``flops`` work: (call, its FLOPs). MindSpore's
    MatMul, or with ``native`` our own packed-weight kernel (``agents/model/kernels/linear.cc``) on the same shape."""
    h = BENCH_MODEL.hidden_size
    n = max(1, round(flops / (2 * tokens * h)))
    rng = np.random.default_rng(0)
    a = Tensor(rng.standard_normal((tokens, h), dtype=np.float32))
    if native is None:
        cell, b = Apply(ops.MatMul()), Tensor(rng.standard_normal((h, n), dtype=np.float32))
    else:
        cell, b = Apply(native.linear(n)), Tensor(packed_weights.pack(rng.standard_normal((n, h), dtype=np.float32)))
    return (lambda: cell(a, b).asnumpy()), 2 * tokens * h * n


def alternating_ms(calls, repeats: int) -> list[float]:
    """Median ms of each call, the calls timed in turn, so that the machine's drift (large on shared VMs) moves
    all of them and their ratios stay meaningful."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, record in zip(calls, times):
            t0 = time.perf_counter()
            call()
            record.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(record) for record in times]


def prefill_batch(batch: int, seq: int) -> StepBatch:
    lens = np.full(batch, seq, np.int32)
    slots = (np.arange(batch * seq) + BLOCK).astype(np.int32)
    return StepBatch(np.ones(batch * seq, np.int32), np.tile(np.arange(seq, dtype=np.int32), batch), slots,
                     lens, lens.copy(), np.zeros((batch, 1), np.int32))


def decode_batch(batch: int, context: int) -> StepBatch:
    width = -(-context // BLOCK)
    tables = (1 + np.arange(batch * width, dtype=np.int32)).reshape(batch, width)
    pos = np.full(batch, context - 1, np.int32)
    slots = tables[:, -1] * BLOCK + (context - 1) % BLOCK
    return StepBatch(np.ones(batch, np.int32), pos, slots.astype(np.int32), np.ones(batch, np.int32),
                     np.full(batch, context, np.int32), tables)


def batch1_decode_runner(config: LlamaConfig = BENCH_MODEL) -> ModelRunner:
    """A runner of ``config`` (random weights, seed 0) on the native kernels with one decode bucket: batch 1, 4
    blocks (``decode_batch(1, 64)``); not warmed up. The step the per-op cost probes take apart
    (scripts/bench_op_launch.py, scripts/profile_decode_step.py)."""
    rc = RunnerConfig(num_blocks=17, block_size=BLOCK, max_model_len=512, prefill_batch_sizes=(1,),
                      prefill_seq_lengths=(32,), decode_batch_sizes=(1,), decode_block_widths=(4,), kernels="native")
    return ModelRunner(config, fuse_hf_tensors(random_hf_weights(config, seed=0, std=0.05), config), rc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--kernels", nargs="+", default=["native", "portable"],
                        choices=["auto", "native", "portable"], help="kernel choices to measure")
    args = parser.parse_args()
    weights = fuse_hf_tensors(random_hf_weights(BENCH_MODEL, seed=0, std=0.05), BENCH_MODEL)
    for i, kernels in enumerate(args.kernels):
        runner = measure(args, weights, kernels)
        if i == 0:
            print_sampling(runner, decode_batch(max(args.decode_batches), args.decode_context), args.repeats)
        print()


def measure(args: argparse.Namespace, weights: dict[str, np.ndarray], kernels: str) -> ModelRunner:
    """Warm a runner with this kernel choice up and print its table."""
    cfg, seq, ctx = BENCH_MODEL, 128, args.decode_context
    width = -(-ctx // BLOCK)
    rc = RunnerConfig(num_blocks=max(args.decode_batches) * width + 1, block_size=BLOCK, max_model_len=max(512, ctx),
                      prefill_batch_sizes=tuple(args.prefill_batches), prefill_seq_lengths=(seq,),
                      decode_batch_sizes=tuple(args.decode_batches), decode_block_widths=(width,),
                      kernels=kernels)
    runner = ModelRunner(cfg, weights, rc)
    t0 = time.perf_counter()
    compile_times = runner.warmup()
    print(f"### kernels: {runner.kernels}\n\nwarm-up: {len(compile_times)} graphs in "
          f"{time.perf_counter() - t0:.1f} s ({min(compile_times.values()):.2f}-{max(compile_times.values()):.2f} s "
          "each)\n")

    calls = []
    for b in args.prefill_batches:
        flops = b * sum(cfg.flops_per_token(p + 1) for p in range(seq))
        calls.append((f"prefill {b}x{seq}", b * seq, flops, prefill_batch(b, seq)))
    for b in args.decode_batches:
        calls.append((f"decode B={b} ctx={ctx}", b, b * cfg.flops_per_token(ctx), decode_batch(b, ctx)))
    try:
        native = native_ops(cfg.hidden_size)
    except KernelBuildError:
        native = None
    print("| call | ms | model GFLOP/s | same-size MindSpore matmul GFLOP/s | ratio | same-size native GEMM "
          "GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, tokens, flops, batch in calls:
        references = [reference_matmul(tokens, flops)] + ([reference_matmul(tokens, flops, native)] if native else [])
        times = alternating_ms([lambda batch=batch: runner.step(batch)] + [call for call, _ in references],
                               args.repeats)
        model_rate = flops / times[0] / 1e6
        cells = [f"{done / ms_ / 1e6:.1f} | {model_rate / (done / ms_ / 1e6):.0%}"
                 for (_, done), ms_ in zip(references, times[1:])]
        print(f"| {name} | {times[0]:.1f} | {model_rate:.1f} | {' | '.join(cells)} |{'' if native else ' | |'}")
    print()
    return runner


class GreedyOnlyStep(LlamaStep):
    """The step graph as it was before sampling: only token ids and logprobs as outputs."""

    def construct(self, input_ids, positions, slot_mapping, lens, block_tables, last_index):
        token_rows, sequence_rows = self.model.real_rows(lens, self.is_prefill)
        hidden = self.model.hidden_states(input_ids, positions, slot_mapping, lens, block_tables, token_rows,
                                          self.is_prefill)
        return greedy_pick(self.model.logits(hidden, sequence_rows))


def all_sampled(batch: StepBatch) -> StepBatch:
    b = batch.batch_size
    sampling = SamplingBatch(np.full(b, 0.8, np.float32), np.full(b, 50, np.int32), np.full(b, 0.9, np.float32),
                             np.ones(b, np.float32), np.arange(b, dtype=np.int64), np.zeros(b, np.int32),
                             np.zeros(b + 1, np.int32), np.zeros(0, np.int32))
    return dataclasses.replace(batch, sampling=sampling)


def print_sampling(runner: ModelRunner, batch: StepBatch, repeats: int) -> None:
    """Decode step time: greedy before/after sampling support, and an all-sampled batch, in one run."""
    before = GreedyOnlyStep(runner.model, is_prefill=False)

    def greedy_before() -> None:
        _, arrays = runner.bucket_inputs(batch)
        for out in before(*[Tensor(a) for a in arrays]):
            out.asnumpy()

    sampled = all_sampled(batch)
    print(f"| decode B={batch.batch_size} step | ms |")
    print("|---|---|")
    print(f"| greedy, graph without logits output (before sampling) | {median_ms(greedy_before, repeats):.1f} |")
    print(f"| greedy, current graph | {median_ms(lambda: runner.step(batch), repeats):.1f} |")
    print(f"| all sampled (T=0.8, top_k=50, top_p=0.9) | {median_ms(lambda: runner.step(sampled), repeats):.1f} |")


if __name__ == "__main__":
    ms.set_context(mode=ms.GRAPH_MODE)
    main()
