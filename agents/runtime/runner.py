"""Model runner: numpy step batches in, next tokens out, over a fixed set of warmed-up graph shapes.

Static shape buckets rather than dynamic shapes: on MindSpore CPU a dynamic-shape graph compiled once but ran
3-13x slower per step, while a static graph compiles in 1-3 s and is re-used whenever its shape comes back. So the
runner pads every batch to the smallest bucket that fits (batch size x prompt length for prefill, batch size x
block-table width for decode), compiles all buckets in ``warmup()`` and refuses shapes it did not warm. One extra
prefill shape, batch 1 x ``max_model_len``, serves the recompute of a preempted sequence (prompt + generated
tokens can outgrow the prompt buckets); the scheduler sends such a prefill alone.

Which graph, shapes, plan and inputs each step kind gets is its graph family's (``agents.runtime.graph_family``): the
runner builds the model and graphs and picks the registry ``StepKind -> GraphFamily`` from its backend (ragged or
padded prefill); warming every family's shapes, checking a step's cache indices and running it through one loop are
``agents.runtime.graph_runner.FamilyRunner``'s, shared with MindFormers' runner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from agents.model.backends import OpsBackend, select_backend
from agents.model.llama import LlamaModel, LlamaStep, load_weights_into
from agents.model.lora import LoraShape
from agents.model.parallel import agreed_costs, sharded_graphs
from agents.runtime.adapters import AdapterSlotTable
from agents.runtime.decode_family import Decode
from agents.runtime.device import apply_jit_config, setup_device
from agents.runtime.graph_call import CompiledCell
from agents.runtime.graph_family import (
    CostTable,
    GraphFamily,
    by_graph,
    check_cache_indices,
    planned_calls,
    warmup_shapes_of,
)
from agents.runtime.graph_runner import FamilyRunner
from agents.runtime.looped_decode import LoopedDecode, LoopedDecodeStep
from agents.runtime.mixed_families import PaddedMixed, RaggedMixed
from agents.runtime.mixed_steps import MixedStep
from agents.runtime.prefill_families import PaddedPrefill, RaggedPrefill
from agents.runtime.runner_config import RunnerConfig
from agents.runtime.verify_family import Verify
from agents.runtime.verify_steps import VerifyStep, accept
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan
from llm_serving.protocol.step import StepKind

__all__ = ["ModelRunner", "RunnerConfig", "graph_families", "warmup_shapes"]

log = logging.getLogger(__name__)

MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}  # keyed by protocol DTYPES


def graph_families(rc: RunnerConfig, ragged: bool, backend: OpsBackend | None = None,
                   costs: CostTable | None = None) -> dict[StepKind, GraphFamily]:
    """The registry ``StepKind -> GraphFamily`` of a backend whose prefill is ``ragged`` or padded, in warm-up order
    (prefill, mixed, verify, decode). ``backend`` None: for the shapes only."""
    costs = costs if costs is not None else CostTable()
    decode = Decode(rc, backend, costs)
    if ragged:
        prefill: GraphFamily = RaggedPrefill(rc, backend, costs)
        mixed: GraphFamily = RaggedMixed(rc, backend, costs)
    else:
        prefill = PaddedPrefill(rc, backend, costs)
        mixed = PaddedMixed(rc, backend, costs, prefill, decode)
    return {StepKind.PREFILL: prefill, StepKind.MIXED: mixed, StepKind.VERIFY: Verify(rc, backend, costs),
            StepKind.DECODE: decode}


def looped_families(rc: RunnerConfig, backend: OpsBackend | None = None,
                    costs: CostTable | None = None) -> dict[int, LoopedDecode]:
    """The looped decode families by their steps: of ``rc.decode_steps`` steps a call (every batch bucket), and of
    a draft's round sizes (``rc.draft_loops``, the buckets up to their most sequences); none of one step, and none
    on Ascend: there PagedAttention reads the context lengths from the graph input's host values and the rotary
    embedding wants the input positions, which a later step's in-graph lengths and positions are not (the export's
    contract check says so), so multi-step batches and draft rounds take the host loop."""
    costs = costs if costs is not None else CostTable()
    if rc.device_target != "CPU":
        return {}
    sizes = {k: most for k, most in rc.draft_loops if k > 1}
    if rc.decode_steps > 1:
        sizes[rc.decode_steps] = rc.decode_batch_sizes[-1]
    return {k: LoopedDecode(rc, backend, costs, k, sizes[k]) for k in sorted(sizes)}


def warmup_shapes(rc: RunnerConfig, ragged_prefill: bool) -> list[tuple]:
    """Every compiled graph shape ``(kind, batch, n)``: ("prefill", batch, seq), ("ragged", max prefill batch,
    tokens), mixed, verify, ("decode", batch, block-table width) or looped decode ("loop<k>", batch, width); the
    runner warms these and ``agents.tools.export`` exports them."""
    return warmup_shapes_of(graph_families(rc, ragged_prefill)) + [
        shape for family in looped_families(rc).values() for shape in family.shapes()]


def compiled_graphs(rc: RunnerConfig, ragged_prefill: bool) -> dict[str, int]:
    """The graphs warm-up compiles, by family: one per warm-up shape, or one per family with ``dynamic_shapes``."""
    counts = {name: len(family.shapes()) for name, family in by_graph(graph_families(rc, ragged_prefill)).items()}
    return {name: min(n, 1) if rc.dynamic_shapes else n for name, n in counts.items() if n}


class ModelRunner(FamilyRunner):
    """Owns the MindSpore model, its KV cache and the compiled step graphs of one device; its graph families
    (``graph_families``) decide the shapes, the plans and the inputs of each step kind."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], runner_config: RunnerConfig,
                 backend: OpsBackend | None = None, shard: ShardPlan | None = None,
                 lora: Mapping[str, Any] | None = None) -> None:
        """``backend``: the device's by ``RunnerConfig.kernels`` when None (tests pass others). ``shard``: this
        rank's slice under tensor parallelism (``weights`` then hold only that slice; ``agents.weights.sharded``).
        ``lora``: ``AgentSpec.lora``, the LoRA adapter slots the graphs hold (``load_adapter`` fills them)."""
        setup_device(runner_config.device_target, runner_config.device_id, runner_config.device_environment,
                     runner_config.max_device_memory)
        self.config = config
        self.shard = shard if shard is not None else ShardPlan(config)
        self.rc = runner_config
        rc = runner_config
        if backend is None:
            backend = select_backend(rc.kernels, rc.device_target, rc.dtype,
                                     self.shard.attention_config.hidden_size)  # this rank's heads' width
        backend = backend.with_precision(rc.precision).with_quantization(rc.quantization)
        backend = backend.with_kv_cache_dtype(rc.kv_cache_dtype, rc.int8_kv_direction)
        backend.check(config, rc.block_size, rc.prefill_batch_sizes[-1])
        self.backend = backend
        self.kernels = self.backend.kernels
        log.info("ops backend: %s (precision %s, quantization %s, kv cache %s)", self.backend.name, rc.precision,
                 rc.quantization, rc.kv_cache_dtype)
        # Where the projections skip a bucket's padding rows (the native CPU ones), a padded row costs next to
        # nothing and splitting a decode batch to save padding never pays.
        self.skips_padding = self.backend.skips_padding
        self.rc = rc = rc.with_decode_widths(full_width=self.skips_padding)
        shape = LoraShape(int(lora["max_loras"]), int(lora["max_lora_rank"])) if lora is not None else None
        self.model = LlamaModel(config, rc.num_blocks, rc.block_size, rc.max_model_len, MS_DTYPES[rc.dtype],
                                self.backend, self.shard, shape)
        load_weights_into(self.model, weights)
        self.adapters = AdapterSlotTable(self.model, config, self.shard, shape) if shape is not None else None
        if rc.mixed_steps and not self.backend.chunked_prefill:
            raise ValueError(f"the {self.backend.name} ops backend has no attention over cached context: set "
                             "scheduler.enable_chunked_prefill and enable_prefix_caching to false")
        if rc.verify_tokens and not self.backend.ragged_prefill:
            raise ValueError(f"speculative decoding verifies proposals in ragged mixed steps, which the "
                             f"{self.backend.name} ops backend lacks (model_config.kernels: native)")
        cells = self._step_cells(adapters=False)
        # with adapter slots, a second set of the same graphs computing each token's LoRA update: the steps whose
        # rows use an adapter run on it, the others on the plain graphs (they pay nothing for the slots)
        adapter_cells = self._step_cells(adapters=True) if shape is not None else {}
        super().__init__(rc, sharded_graphs(cells, self.shard),  # tensor parallel: logits gathered when read
                         lambda costs: graph_families(rc, self.ragged_prefill, self.backend, costs))
        self.adapter_graphs = sharded_graphs(adapter_cells, self.shard) if adapter_cells else None
        self._adapter_step = False  # the step in progress runs on the adapter graphs
        if rc.dynamic_shapes:  # one graph per family: its first warm-up shape compiles it for every shape
            for name, family in by_graph(self.families).items():
                if shapes := family.shapes():
                    for graphs in (cells, adapter_cells):
                        if graphs:
                            graphs[name].set_dynamic(family.warmup_inputs(shapes[0]))
        self.looped = looped_families(rc, self.backend, self.costs)
        self._by_graph.update({family.graph: family for family in self.looped.values()})

    def _step_cells(self, adapters: bool) -> dict[str, CompiledCell]:
        """The step graphs by name (plain, or computing the LoRA updates: ``adapters``)."""
        rc = self.rc

        def compiled(cell: nn.Cell) -> CompiledCell:
            apply_jit_config(cell, rc.device_target)
            return CompiledCell(cell)

        prefill = compiled(LlamaStep(self.model, True, adapters))
        cells = {"prefill": prefill, "ragged": prefill, "decode": compiled(LlamaStep(self.model, False, adapters))}
        if rc.mixed_steps:
            mixed = compiled(MixedStep(self.model, adapters))
            cells.update(mixed=mixed, chunk=mixed)
        if rc.verify_tokens:
            cells["verify"] = compiled(VerifyStep(self.model, adapters))
        for k in looped_families(rc):
            cells[f"loop{k}"] = compiled(LoopedDecodeStep(self.model, k, rc.block_size, adapters))
        return cells

    def graph(self, kind: str) -> Any:
        """The step graph of ``kind``: the adapter graph while a step with adapters runs."""
        if self._adapter_step and self.adapter_graphs is not None:
            return self.adapter_graphs[kind]
        return self.graphs[kind]

    def graph_shapes(self) -> list[tuple]:
        """Every family's warm-up shapes, the looped decode ones last."""
        return super().graph_shapes() + [shape for family in self.looped.values() for shape in family.shapes()]

    @property
    def ragged_prefill(self) -> bool:
        """Whether prefill takes the prompts back to back (``agents.runtime.ragged_prefill``), as the backend says."""
        return self.backend.ragged_prefill

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        """``FamilyRunner.warmup`` (with adapter slots: of the plain graphs, then of the adapter graphs, the
        plans costing each shape by the slower), then the costs every tensor-parallel rank plans alike (the slowest
        rank's)."""
        compile_times = super().warmup(progress, known_costs)
        if self.adapter_graphs is not None:
            plain = dict(self.step_costs)
            self._adapter_step = True
            try:
                more = super().warmup(progress and (lambda line: progress(f"{line} (adapters)")), known_costs)
            finally:
                self._adapter_step = False
            compile_times = {shape: seconds + more.get(shape, 0.0) for shape, seconds in compile_times.items()}
            self.step_costs = {shape: max(cost, self.step_costs.get(shape, cost)) for shape, cost in plain.items()}
        self.step_costs = agreed_costs(self.step_costs, self.shard)
        return compile_times

    def load_adapter(self, slot: int, path: str | None) -> None:
        """``step_runner.AdapterSlots``: the adapter at ``path`` into ``slot`` (``agents.runtime.adapters``)."""
        if self.adapters is None:
            raise ValueError("this runner was built without LoRA adapter slots (AgentSpec lora)")
        self.adapters.load(slot, path)

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one step as one or more bucketed graph calls (``plan``).

        All-greedy parts use the in-graph argmax; parts with sampled or penalised sequences read the logits and
        sample on the host (``agents.runtime.sampler``). The logits leave the device only for such parts and for parts
        with a sequence in ``want_logits``, whose rows (raw model logits, before any penalty) are returned. A verify
        step's answer is its accepted proposals (``_verify``).
        """
        if batch.kind is StepKind.VERIFY:
            return self._verify(batch)
        with self._device_step(batch):
            return super().step(batch)

    def decode_steps(self, batch: StepBatch) -> StepOutput | None:
        """A decode batch of ``num_steps`` k > 1 as looped graph calls (``agents.runtime.looped_decode``), or None
        where no looped graph of k steps was compiled (the caller then loops single steps)."""
        family = self.looped.get(batch.num_steps)
        if family is None:
            return None
        rc, k, n = self.rc, batch.num_steps, batch.batch_size
        last = family.last_contexts(batch)

        def check(part: StepBatch) -> None:  # the blocks of every step's position, not only the first's
            check_cache_indices(part, rc.num_blocks, rc.block_size, rc.max_blocks_per_seq)
            check_cache_indices(replace(part, context_lens=last), rc.num_blocks, rc.block_size,
                                rc.max_blocks_per_seq)

        ids, logprobs = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
        with self._device_step(batch):
            for group, part, (part_ids, part_lps, _) in planned_calls({StepKind.DECODE: family}, batch, check,
                                                                       self._run):
                used = part.batch_size
                ids[group], logprobs[group] = part_ids.asnumpy()[:used], part_lps.asnumpy()[:used]
        return StepOutput(ids[:, 0].copy(), logprobs[:, 0].copy(), more_token_ids=ids[:, 1:].copy(),
                          more_logprobs=logprobs[:, 1:].copy())

    def draft_steps(self, batch: StepBatch, steps: int) -> np.ndarray | None:
        """Greedy ids ``[n, k]`` of ``k >= steps`` decode steps from each row's token in looped graph calls (a draft
        round's proposals, ``speculative_runner``), or None where no looped graph holds the batch.

        Unlike ``decode_steps``, the block tables need only cover each row's first step: a row's later steps may
        pass its end, their K/V written past it into its own last block or the dummy block (table columns past a
        row's blocks are the dummy block; the bucket's width covers every step, so none is clamped onto a real
        column). None where a later step would pass ``max_model_len``."""
        fits = [k for k, family in self.looped.items() if k >= steps and family.holds(batch.batch_size)]
        if not fits or int(batch.positions.max(initial=0)) + min(fits) > self.rc.max_model_len:
            return None
        rc, family, n = self.rc, self.looped[min(fits)], batch.batch_size

        def check(part: StepBatch) -> None:
            check_cache_indices(part, rc.num_blocks, rc.block_size, rc.max_blocks_per_seq)

        ids = np.zeros((n, family.steps), np.int32)
        with self._device_step(batch):
            for group, part, (part_ids, _, _) in planned_calls({StepKind.DECODE: family}, batch, check, self._run):
                ids[group] = part_ids.asnumpy()[: part.batch_size]
        return ids

    def _verify(self, batch: StepBatch) -> StepOutput:
        """A step of proposals to verify (``agents.runtime.verify_steps``): the picks after every token of each
        call, then ``accept``."""
        picks, logprobs = np.zeros(batch.num_tokens, np.int32), np.zeros(batch.num_tokens, np.float32)
        sampled = batch.sampling is not None and batch.sampling.needs_logits
        logits = np.zeros((batch.num_tokens, self.config.vocab_size), np.float32) if sampled else None
        starts = np.cumsum(batch.query_lens) - batch.query_lens
        with self._device_step(batch):
            for group, part, (ids, lps, rows) in self._parts(batch):
                first, used = int(starts[group[0]]), part.num_tokens
                picks[first:first + used], logprobs[first:first + used] = ids.asnumpy()[:used], lps.asnumpy()[:used]
                if sampled:
                    logits[first:first + used] = rows.asnumpy()[:used]
        return accept(batch, picks, logprobs, logits)

    def step_logits(self, batch: StepBatch) -> np.ndarray:
        """Like ``step`` (the KV cache is written the same way) but returns float32 logits ``[B, vocab]`` of each
        sequence's last token, for logits checks."""
        out = np.zeros((batch.batch_size, self.config.vocab_size), np.float32)
        with self._device_step(batch):
            for group, part, outputs in self._parts(batch):
                out[group] = outputs[2].asnumpy()[: part.batch_size]
        return out

    @contextmanager
    def _device_step(self, batch: StepBatch) -> Iterator[None]:
        """A step's graph calls, between the backend's ``before_step`` and ``after_step`` (also on errors)."""
        if self.adapters is not None:
            self.adapters.route(batch)
            self._adapter_step = batch.lora_slots is not None
        self.backend.before_step(len(batch.slot_mapping))
        try:
            yield
        finally:
            self._adapter_step = False
            self.backend.after_step()
