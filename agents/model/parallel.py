"""Tensor parallelism inside the Llama graph: the cells that make one rank's slice of the model compute the
whole model's answer (the plan: ``llm_serving.protocol.parallel.ShardPlan``).

Why explicit collectives: MindSpore's semi-auto parallel (``shard()``) does not run on CPU, so the graph holds
``ops.AllReduce`` / ``ops.AllGather`` itself, Megatron style:
- row-parallel projections (attention output, MLP down) are followed by an all-reduce of their partial sums;
  rank 0 alone adds the residual inside its fused projection, the others compute only their partial sum
  (``OpsBackend.partial_linear``; a zero residual instead cost 110 MiB more on those ranks here: a tensor per
  projection in every compiled graph);
- the embedding is split by vocabulary: a rank looks up only its own ids (the others give zero rows, exactly)
  and the all-reduce assembles every row;
- the greedy pick is exact across ranks: each rank picks over its vocabulary (the backend's op), one
  all-gather brings every rank's (max logit, log-sum-exp, token), and the winner is the first rank holding the
  global max, as an argmax over the whole row would pick; its log-probability is ``-log sum exp(lse_r - max)``;
- the full logits are gathered only when read (``GatheredLogits.asnumpy``: sampling, logits checks); all-greedy
  steps never move them.

At ``tp == 1`` none of these cells is in the graph (the backend's own stand where they would), so the graphs stay
op-for-op the same.
Every rank runs the same graphs on the same batches, so they issue the same collectives in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from agents.model.backends import OpsBackend
from llm_serving.protocol.parallel import ShardPlan


class StepGraph(Protocol):
    """A compiled step graph (``agents.runtime.graph_call.CompiledCell``, which this layer may not import): its
    cell, its compile for a warm start, and the call."""

    cell: Any

    def compile(self, *inputs: Tensor) -> None: ...

    def __call__(self, *inputs: Tensor) -> Any: ...


def _world_group() -> str:
    from mindspore.communication.management import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def all_gather(ranks: int) -> ops.AllGather:
    """An all-gather over the world group of ``ranks`` ranks. Its ``rank_size`` (which shapes its output) comes
    from the group MindSpore joined; where none was joined (a rank's graph exported on a CPU,
    ``agents.tools.export``) it would read 1, so the plan's count is set."""
    gather = ops.AllGather(_world_group())
    if gather.rank_size != ranks:
        gather.add_prim_attr("rank_size", ranks)
        gather.rank_size = ranks
    return gather


class AllReduceSum(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.op = ops.AllReduce(ops.ReduceOp.SUM, _world_group())

    def construct(self, x: Tensor) -> Tensor:
        return self.op(x)


class ReducedResidual(nn.Cell):
    """Rank 0's row-parallel projection: ``all_reduce(residual + x @ W_0^T)``."""

    def __init__(self, residual_linear: nn.Cell) -> None:
        super().__init__()
        self.linear, self.reduce = residual_linear, AllReduceSum()

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor) -> Tensor:
        return self.reduce(self.linear(x, weight, residual, rows))


class ReducedPartial(nn.Cell):
    """Another rank's row-parallel projection: ``all_reduce(x @ W_r^T)``, the residual left to rank 0."""

    def __init__(self, partial_linear: nn.Cell) -> None:
        super().__init__()
        self.linear, self.reduce = partial_linear, AllReduceSum()

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor) -> Tensor:
        return self.reduce(self.linear(x, weight, rows))


def row_parallel(plan: ShardPlan, backend: OpsBackend, residual_linear: nn.Cell, out_dim: int,
                 lora: bool = False) -> nn.Cell:
    """``(x, weight, residual, rows) -> residual + x @ W^T`` over all ranks: the backend's ``residual_linear``
    itself at tp 1, else this rank's share of it followed by the all-reduce. ``lora``: every rank adds the
    ``residual`` it is given (the others' is their partial LoRA update, ``agents.model.lora``)."""
    if plan.tp == 1:
        return residual_linear
    if plan.rank == 0 or lora:
        return ReducedResidual(residual_linear)
    return ReducedPartial(backend.partial_linear(out_dim))


class Embedding(nn.Cell):
    """``(table, ids) -> rows``: the whole table's lookup."""

    def construct(self, table: Tensor, ids: Tensor) -> Tensor:
        return ops.gather(table, ids, 0)


class VocabParallelEmbedding(nn.Cell):
    """This rank's rows for the ids in its vocabulary range, zero rows for the others, summed over ranks."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.reduce = AllReduceSum()

    def construct(self, table: Tensor, ids: Tensor) -> Tensor:
        inside = ops.logical_and(ids >= self.start, ids < self.end)
        local = ops.select(inside, ids - self.start, ops.zeros_like(ids))
        rows = ops.gather(table, local, 0)
        return self.reduce(rows * inside.astype(rows.dtype).expand_dims(1))


def embedding(plan: ShardPlan) -> nn.Cell:
    return Embedding() if plan.tp == 1 else VocabParallelEmbedding(*plan.vocab_range)


class ShardedGreedy(nn.Cell):
    """The greedy pick over the whole vocabulary from each rank's pick over its own (see the module doc)."""

    def __init__(self, local: nn.Cell, plan: ShardPlan) -> None:
        super().__init__()
        self.local = local
        self.start = plan.vocab_range[0]
        self.tp = plan.tp
        self.gather = all_gather(plan.tp)

    def construct(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        ids, logprob = self.local(logits)
        top = ops.gather_elements(logits, 1, ids.reshape(-1, 1)).reshape(-1)
        lse = top - logprob  # this rank's log-sum-exp (the pick's logprob is top - lse)
        mine = ops.stack((top, lse, (ids + self.start).astype(ms.float32)), 1)  # ids < 2^24: exact in float32
        every = self.gather(mine).reshape(self.tp, -1, 3)
        tops, lses, tokens = every[:, :, 0], every[:, :, 1], every[:, :, 2]
        best = ops.max(tops, 0)[0]
        winner = ops.argmax(tops, 0).astype(ms.int32).reshape(-1, 1)  # first max: the lowest token id
        token = ops.gather_elements(tokens.transpose(1, 0), 1, winner).reshape(-1).astype(ms.int32)
        return token, -ops.log(ops.sum(ops.exp(lses - best.reshape(1, -1)), 0))


def greedy(plan: ShardPlan, local: nn.Cell) -> nn.Cell:
    """The model's greedy pick: the backend's ``local`` one, made exact across ranks when there are several."""
    return local if plan.tp == 1 else ShardedGreedy(local, plan)


class _GatherCell(nn.Cell):
    """``[rows, vocab of this rank] -> [tp * rows, vocab_per_rank]``, the last ranges padded with zeros."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad
        self.gather = ops.AllGather(_world_group())

    def construct(self, logits: Tensor) -> Tensor:
        if self.pad > 0:
            logits = ops.concat((logits, ops.zeros((logits.shape[0], self.pad), logits.dtype)), 1)
        return self.gather(logits)


class LogitsGather:
    """Assembles the full ``[rows, vocab]`` logits from every rank's slice (one all-gather, then host-side
    reordering). Each row count compiles its own small graph, the first time it is seen (in warm-up)."""

    def __init__(self, plan: ShardPlan) -> None:
        self.tp, self.width, self.vocab = plan.tp, plan.vocab_per_rank, plan.config.vocab_size
        start, end = plan.vocab_range
        self.cell = _GatherCell(self.width - (end - start))
        self.seen: set[int] = set()

    def full(self, local: Tensor) -> np.ndarray:
        rows = local.shape[0]
        self.seen.add(rows)
        every = self.cell(local).asnumpy().reshape(self.tp, rows, self.width)
        return every.transpose(1, 0, 2).reshape(rows, self.tp * self.width)[:, : self.vocab]

    def compile(self, rows: int) -> None:
        """Compile (or load from the compile cache) the gather of ``rows`` rows without running it."""
        self.seen.add(rows)
        self.cell.compile(Tensor(np.zeros((rows, self.width), np.float32)))


class GatheredLogits:
    """A step's logits output: this rank's slice, gathered from every rank when read. Every rank must read
    it for the same steps (they do: all ranks run the same batches through the same code)."""

    def __init__(self, local: Tensor, gather: LogitsGather) -> None:
        self.local, self.gather = local, gather

    @property
    def shape(self) -> tuple[int, int]:
        return self.local.shape[0], self.gather.vocab

    def asnumpy(self) -> np.ndarray:
        return self.gather.full(self.local)


class ShardedStep:
    """A step graph whose third output (logits) is a ``GatheredLogits``. A row count seen for the first time
    gathers once right away, so that warm-up compiles every gather graph and serving compiles none.

    ``compile`` (a warm start from the compile cache) compiles the gather graph of a new row count right after its
    step graph, as running the step does: the cache hands out saved graphs in the order they were first compiled.
    """

    def __init__(self, step: StepGraph, gather: LogitsGather) -> None:
        self.step, self.gather = step, gather

    def compile(self, *inputs: Tensor) -> None:
        self.step.compile(*inputs)
        rows = self.step.cell.logits_rows(*inputs)
        if rows not in self.gather.seen:
            self.gather.compile(rows)

    def __call__(self, *inputs: Tensor):
        ids, logprobs, local = self.step(*inputs)
        if local.shape[0] not in self.gather.seen:
            self.gather.full(local)
        return ids, logprobs, GatheredLogits(local, self.gather)


def sharded_graphs(graphs: dict[str, StepGraph], plan: ShardPlan) -> dict:
    """The runner's step graphs with their logits gathered on read (unchanged at ``tp == 1``)."""
    if plan.tp == 1:
        return graphs
    gather = LogitsGather(plan)
    wrapped = {id(g): ShardedStep(g, gather) for g in graphs.values()}
    return {kind: wrapped[id(g)] for kind, g in graphs.items()}


class _GatherVector(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.gather = ops.AllGather(_world_group())

    def construct(self, x: Tensor) -> Tensor:
        return self.gather(x)


def every_rank(flag: bool, tp: int) -> bool:
    """Whether ``flag`` holds on every one of the ``tp`` ranks (one all-gather).

    Why: ranks must take the same path through their collectives; where a rank-local fact picks the path (a
    compile cache hit: warm-up then loads graphs without running them), the ranks decide on it together.
    """
    if tp == 1:
        return flag
    every = _GatherVector()(Tensor(np.array([1.0 if flag else 0.0], np.float32))).asnumpy()
    return bool(np.all(every > 0.5))


def agreed_costs(costs: dict[tuple, float], plan: ShardPlan) -> dict[tuple, float]:
    """The warm-up step costs every rank plans with: each shape's slowest rank's (one all-gather).

    Why: the runner splits a batch into graph calls by measured cost, and each rank measures its own; ranks
    that planned differently would run different graphs and wait forever in each other's collectives.
    """
    if plan.tp == 1 or not costs:
        return costs
    mine = Tensor(np.array(list(costs.values()), np.float32))
    every = _GatherVector()(mine).asnumpy().reshape(plan.tp, len(costs))
    return dict(zip(costs, every.max(axis=0).astype(float).tolist()))
