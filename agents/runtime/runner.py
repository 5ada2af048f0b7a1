"""Model runner: numpy step batches in, next tokens out, over a fixed set of warmed-up graph shapes.

Static shape buckets rather than dynamic shapes: on MindSpore CPU a dynamic-shape graph compiled once but ran
3-13x slower per step, while a static graph compiles in 1-3 s and is re-used whenever its shape comes back. So the
runner pads every batch to the smallest bucket that fits (batch size x prompt length for prefill, batch size x
block-table width for decode), compiles all buckets in ``warmup()`` and refuses shapes it did not warm. One extra
prefill shape, batch 1 x ``max_model_len``, serves the recompute of a preempted sequence (prompt + generated
tokens can outgrow the prompt buckets); the scheduler sends such a prefill alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import mindspore as ms
import numpy as np
from mindspore import Tensor

from agents.model.backends import OpsBackend, select_backend
from agents.model.llama import LlamaModel, LlamaStep, load_weights_into
from agents.model.parallel import agreed_costs, sharded_graphs
from agents.runtime.bucket_plan import plan_groups, powers_of_two_up_to
from agents.runtime.device import apply_jit_config, setup_device
from agents.runtime.graph_call import CompiledCell
from agents.runtime.mixed_steps import (
    MixedStep,
    chunk_arrays,
    consecutive_groups,
    mixed_arrays,
    mixed_shapes,
    padded_kinds,
    warmup_arrays,
)
from agents.runtime.ragged_prefill import plan_ragged, ragged_arrays, token_buckets
from agents.runtime.sampler import step_output
from agents.runtime.verify_steps import VerifyStep, accept, verify_shapes, verify_warmup_arrays
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.model_config import (
    ASCEND_DTYPES,
    DEVICE_TARGETS,
    DTYPES,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    PRECISIONS,
    QUANTIZATIONS,
    LlamaConfig,
    blocks_needed,
)
from llm_serving.protocol.parallel import ShardPlan
from llm_serving.protocol.step import RowKind, StepKind

log = logging.getLogger(__name__)

MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}  # keyed by protocol DTYPES


@dataclass(frozen=True)
class RunnerConfig:
    """Cache geometry and shape buckets. ``decode_block_widths`` left empty is the runner's choice
    (``with_decode_widths``)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    prefill_batch_sizes: tuple[int, ...] = (1, 4, 8)
    prefill_seq_lengths: tuple[int, ...] = (64, 128, 256)
    decode_batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    decode_block_widths: tuple[int, ...] = field(default=())
    dtype: str = "float32"
    device_target: str = "CPU"
    device_id: int = 0
    kernels: str = "auto"  # the device's native ops (agents.model.backends; CPU float32: C++ ops), portable, or auto
    precision: str = "exact"  # half / fast: float16 / bfloat16 projection weights (OpsBackend.with_precision)
    quantization: str = "none"  # w8a16: int8 weights of the layers' projections (OpsBackend.with_quantization)
    kv_cache_dtype: str = "auto"  # int8: per token and kv head scales (native CPU), per channel (Ascend, static)
    # Steps with queries over cached context (chunked prefill, prefix caching; agents.runtime.mixed_steps), and the token
    # budget of one step they are bucketed up to (None: the ragged prefill's largest call)
    mixed_steps: bool = False
    max_num_batched_tokens: int | None = None
    # speculative decoding: the most proposals one sequence has verified in a step (agents.runtime.verify_steps);
    # 0: no verify graphs
    verify_tokens: int = 0
    verify_step_tokens: int | None = None  # the tokens one verify step carries at most (None: a full decode batch's)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels {self.kernels!r} is not one of {list(KERNEL_CHOICES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"model_config.precision {self.precision!r} is not one of {list(PRECISIONS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model_config.quantization {self.quantization!r} is not one of {list(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"model_config.kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{list(KV_CACHE_DTYPES)}")
        if self.device_target not in DEVICE_TARGETS:
            raise ValueError(f"device_target {self.device_target!r} is not one of {list(DEVICE_TARGETS)}")
        if self.device_target == "Ascend" and self.dtype not in ASCEND_DTYPES:
            raise ValueError(f"model_config.dtype {self.dtype} is not served on Ascend: its fused kernels take "
                             f"{' or '.join(ASCEND_DTYPES)}")
        for name in ("prefill_batch_sizes", "prefill_seq_lengths", "decode_batch_sizes"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive sizes, got {values}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if self.prefill_seq_lengths[-1] > self.max_model_len:
            raise ValueError(f"prefill seq length {self.prefill_seq_lengths[-1]} exceeds max_model_len "
                             f"{self.max_model_len}")

    def with_decode_widths(self, full_width: bool) -> RunnerConfig:
        """This config with ``decode_block_widths`` set where left empty: one full-width block table where a wider
        table costs nothing (native attention reads each row's own context: measured equal), so fewer shapes to
        compile; else powers of two up to the most blocks one sequence can hold (``max_model_len / block_size``)."""
        if self.decode_block_widths:
            return self
        top = self.max_blocks_per_seq
        return replace(self, decode_block_widths=(top,) if full_width else powers_of_two_up_to(top, 4))

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_needed(self.max_model_len, self.block_size)

    @property
    def mixed_max_seqs(self) -> int:
        """Sequences of one ragged mixed call: a full decode batch or prefill batch."""
        return max(self.decode_batch_sizes[-1], self.prefill_batch_sizes[-1])

    def mixed_shapes(self, ragged: bool) -> list[tuple]:
        """The mixed-step graph shapes (``agents.runtime.mixed_steps``), none unless ``mixed_steps``."""
        if not self.mixed_steps:
            return []
        top = self.max_num_batched_tokens or token_buckets(self.prefill_batch_sizes, self.prefill_seq_lengths,
                                                           self.max_model_len)[-1]
        return mixed_shapes(self.mixed_max_seqs, top, self.prefill_batch_sizes, self.prefill_seq_lengths,
                            min(top, self.max_model_len), ragged)


def warmup_shapes(rc: RunnerConfig, ragged_prefill: bool) -> list[tuple]:
    """Every compiled graph shape ``(kind, batch, n)``: ("prefill", batch, seq), ("ragged", max prefill batch,
    tokens) or ("decode", batch, block-table width); the runner warms these and ``agents.tools.export`` exports them."""
    if ragged_prefill:
        tokens = token_buckets(rc.prefill_batch_sizes, rc.prefill_seq_lengths, rc.max_model_len)
        shapes = [("ragged", rc.prefill_batch_sizes[-1], t) for t in tokens]
    else:
        shapes = [("prefill", b, s) for b in rc.prefill_batch_sizes for s in rc.prefill_seq_lengths]
        if rc.max_model_len > rc.prefill_seq_lengths[-1]:
            shapes.append(("prefill", 1, rc.max_model_len))  # recompute of one preempted sequence
    shapes += rc.mixed_shapes(ragged_prefill)
    shapes += verify_shapes(rc.mixed_max_seqs, rc.decode_batch_sizes[-1], rc.verify_tokens, rc.verify_step_tokens)
    return shapes + [("decode", b, w) for b in rc.decode_batch_sizes for w in rc.decode_block_widths]


def _fit(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``value``, or None."""
    return next((b for b in buckets if b >= value), None)


class ModelRunner:
    """Owns the MindSpore model, its KV cache and the compiled step graphs of one device."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], runner_config: RunnerConfig,
                 backend: OpsBackend | None = None, shard: ShardPlan | None = None) -> None:
        """``backend``: the device's by ``RunnerConfig.kernels`` when None (tests pass others). ``shard``: this
        rank's slice under tensor parallelism (``weights`` then hold only that slice; ``agents.weights.sharded``)."""
        setup_device(runner_config.device_target, runner_config.device_id)
        self.config = config
        self.shard = shard if shard is not None else ShardPlan(config)
        self.rc = runner_config
        rc = runner_config
        if backend is None:
            backend = select_backend(rc.kernels, rc.device_target, rc.dtype,
                                     self.shard.attention_config.hidden_size)  # this rank's heads' width
        backend = backend.with_precision(rc.precision).with_quantization(rc.quantization)
        backend = backend.with_kv_cache_dtype(rc.kv_cache_dtype)
        backend.check(config, rc.block_size, rc.prefill_batch_sizes[-1])
        self.backend = backend
        self.kernels = self.backend.kernels
        log.info("ops backend: %s (precision %s, quantization %s, kv cache %s)", self.backend.name, rc.precision,
                 rc.quantization, rc.kv_cache_dtype)
        # Where the projections skip a bucket's padding rows (the native CPU ones), a padded row costs next to
        # nothing and splitting a decode batch to save padding never pays.
        self.skips_padding = self.backend.skips_padding
        self.rc = rc = rc.with_decode_widths(full_width=self.skips_padding)
        self.token_buckets = token_buckets(rc.prefill_batch_sizes, rc.prefill_seq_lengths, rc.max_model_len)
        self.model = LlamaModel(config, rc.num_blocks, rc.block_size, rc.max_model_len, MS_DTYPES[rc.dtype],
                                self.backend, self.shard)
        load_weights_into(self.model, weights)
        prefill = LlamaStep(self.model, is_prefill=True)
        decode = LlamaStep(self.model, is_prefill=False)
        for step in (prefill, decode):
            apply_jit_config(step, rc.device_target)
        prefill, decode = CompiledCell(prefill), CompiledCell(decode)
        self.graphs = {"prefill": prefill, "ragged": prefill, "decode": decode}
        if rc.mixed_steps:
            if not self.backend.chunked_prefill:
                raise ValueError(f"the {self.backend.name} ops backend has no attention over cached context: set "
                                 "scheduler.enable_chunked_prefill and enable_prefix_caching to false")
            mixed = MixedStep(self.model)
            apply_jit_config(mixed, rc.device_target)
            mixed = CompiledCell(mixed)
            self.graphs.update(mixed=mixed, chunk=mixed)
        if rc.verify_tokens:
            if not self.backend.ragged_prefill:
                raise ValueError(f"speculative decoding verifies proposals in ragged mixed steps, which the "
                                 f"{self.backend.name} ops backend lacks (model_config.kernels: native)")
            verify = VerifyStep(self.model)
            apply_jit_config(verify, rc.device_target)
            self.graphs["verify"] = CompiledCell(verify)
        self.verify_shapes = [s for s in self.graph_shapes() if s[0] == "verify"]
        # the mixed-step shapes by kind, largest last: ragged ("mixed") or padded ("chunk")
        self.mixed_shapes = {kind: [s for s in rc.mixed_shapes(self.ragged_prefill) if s[0] == kind]
                             for kind in ("mixed", "chunk")}
        self._check_padding_reach()
        self.graphs = sharded_graphs(self.graphs, self.shard)  # tensor parallel: logits gathered when read
        self.warmed: set[tuple] = set()
        self.compile_times: dict[tuple, float] = {}
        self.step_costs: dict[tuple, float] = {}  # steady-state seconds per call, measured in warm-up
        self._costs: dict[tuple, float] = {}  # (kind, count, longest) -> cost, memoised for plan()

    def _check_padding_reach(self) -> None:
        """Where a mixed call's padding rows form a sequence of their own (``mixed_padding_slots``), that sequence
        reads as many positions through its table row as it has rows: at most a bucket's step up from the one
        below plus the appended rows, which must stay within one table's reach."""
        buckets = [s[2] for s in self.mixed_shapes["mixed"]]
        if not self.backend.mixed_padding_slots or not buckets:
            return
        reach = self.rc.max_blocks_per_seq * self.rc.block_size
        worst = max(t - below for t, below in zip(buckets, [0] + buckets[:-1])) + self.rc.mixed_max_seqs
        if worst > reach:
            raise ValueError(f"scheduler.max_num_batched_tokens: the mixed-step buckets {buckets} leave up to {worst} "
                             f"padding rows, more than one block table reaches ({reach} positions, max_model_len): "
                             "lower the token budget or raise max_model_len")

    @property
    def ragged_prefill(self) -> bool:
        """Whether prefill takes the prompts back to back (``agents.runtime.ragged_prefill``), as the backend says."""
        return self.backend.ragged_prefill

    # ---- shapes -------------------------------------------------------------------------------------------
    def graph_shapes(self) -> list[tuple]:
        """The shapes of ``warmup_shapes`` for this runner's backend."""
        return warmup_shapes(self.rc, self.ragged_prefill)

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        """Compile every graph shape and time one more call of it, every row a real token of dummy block 0.

        The timed call gives the per-shape costs that ``bucket_plan`` splits batches by. Shapes in
        ``known_costs`` (a warm compile cache's, ``agents.runtime.compile_cache``) are compiled (loaded) with those
        costs and not run: on the largest buckets the two calls cost more than loading the graph.
        """
        for shape in self.graph_shapes():
            kind, b, n = shape
            t0 = time.perf_counter()
            inputs = self.warmup_inputs(shape)
            self.warmed.add(shape)
            if known_costs and shape in known_costs:
                self.graphs[kind].compile(*[Tensor(a) for a in inputs])
                self.compile_times[shape] = time.perf_counter() - t0
                self.step_costs[shape] = known_costs[shape]
            else:
                self._run(kind, shape, inputs)
                self.compile_times[shape] = time.perf_counter() - t0
                t1 = time.perf_counter()
                self._run(kind, shape, inputs)[0].asnumpy()
                self.step_costs[shape] = time.perf_counter() - t1
            if progress:
                unit = {"prefill": "seq", "ragged": "tokens", "decode": "blocks", "mixed": "tokens", "chunk": "seq",
                        "verify": "tokens"}[kind]
                progress(f"warmed {kind} batch={b} {unit}={n} in {self.compile_times[shape]:.2f}s")
        self.step_costs = agreed_costs(self.step_costs, self.shard)  # tensor-parallel ranks plan alike
        self._costs.clear()
        return self.compile_times

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """The inputs ``warmup()`` runs ``shape`` with (``agents.tools.export`` exports each graph with them)."""
        kind, b, n = shape
        if kind == "verify":
            arrays = verify_warmup_arrays(b, n, self.rc.max_blocks_per_seq, self.rc.max_model_len,
                                          b - self.backend.mixed_padding_slots)
            arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], n)
            return arrays
        if kind in ("mixed", "chunk"):
            arrays = warmup_arrays(kind, b, n, self.rc.max_blocks_per_seq, self.rc.max_model_len,
                                   b - self.backend.mixed_padding_slots)
            if kind == "mixed":
                arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], n)
            return arrays
        arrays = self._warmup_inputs(kind, b, n)
        if kind == "ragged":
            arrays[3] = self.backend.ragged_lengths(arrays[3], n)
        return arrays

    @staticmethod
    def _padded_inputs(batch: int, tokens: int, width: int) -> list[np.ndarray]:
        """All-padding inputs: token 0 at position 0 writing to slot 0 of the dummy block."""
        last = (np.arange(batch, dtype=np.int32) * (tokens // batch)).astype(np.int32)
        return [np.zeros(tokens, np.int32) for _ in range(3)] + [
            np.zeros(batch, np.int32), np.zeros((batch, width), np.int32), last]

    @classmethod
    def _warmup_inputs(cls, kind: str, batch: int, n: int) -> list[np.ndarray]:
        """Inputs of shape ``(kind, batch, n)`` in which every row is a real token (the padding-skipping
        projections would otherwise be timed doing nothing): token 0 at position 0 in slot 0 of the dummy block,
        decode contexts of one token, prompts filling the bucket (a ragged call's ``n`` tokens split evenly)."""
        tokens = {"prefill": batch * n, "ragged": n, "decode": batch}[kind]
        arrays = cls._padded_inputs(batch, tokens, n if kind == "decode" else 1)
        lens, last = arrays[3], arrays[5]
        if kind == "decode":
            lens[:] = 1
        elif kind == "prefill":
            lens[:] = n
            last[:] = np.arange(batch) * n + n - 1
        else:
            lens[:] = [len(part) for part in np.array_split(np.arange(n), batch)]
            last[:] = np.cumsum(lens) - 1
        return arrays

    def _check_warmed(self, shape: tuple) -> None:
        if shape not in self.warmed:
            raise RuntimeError(f"graph shape {shape} was not warmed up; call warmup() first "
                               f"(the runner never compiles while serving)")

    def _run(self, kind: str, shape: tuple, arrays: list[np.ndarray]):
        self._check_warmed(shape)
        return self.graphs[kind](*[Tensor(a) for a in arrays])

    # ---- steps --------------------------------------------------------------------------------------------
    def shape_for(self, kind: StepKind, count: int, longest: int) -> tuple | None:
        """The compiled shape that runs ``count`` sequences whose longest prompt (a PREFILL step) or context (a
        DECODE step) is ``longest`` tokens, or None when none fits."""
        rc = self.rc
        if kind is StepKind.PREFILL:
            b = _fit(count, rc.prefill_batch_sizes)
            if count == 1 and rc.prefill_seq_lengths[-1] < longest <= rc.max_model_len:
                return ("prefill", 1, rc.max_model_len)  # a preempted sequence recomputing prompt + output
            s = _fit(longest, rc.prefill_seq_lengths)
            return ("prefill", b, s) if b and s else None
        b = _fit(count, rc.decode_batch_sizes)
        w = _fit(blocks_needed(longest, rc.block_size), rc.decode_block_widths)
        return ("decode", b, w) if b and w else None

    def _ragged_shape(self, tokens: int) -> tuple | None:
        """The ragged prefill shape holding ``tokens`` tokens, or None when no token bucket does."""
        t = _fit(tokens, self.token_buckets)
        return None if t is None else ("ragged", self.rc.prefill_batch_sizes[-1], t)

    def _memo_cost(self, key: tuple, shape_of: Callable[[], tuple | None]) -> float:
        """Measured cost of the shape ``shape_of()`` picks (``inf`` for none), memoised under ``key``."""
        if key not in self._costs:
            shape = shape_of()
            if shape is not None:
                self._check_warmed(shape)
            self._costs[key] = float("inf") if shape is None else self.step_costs.get(shape, 1.0)
        return self._costs[key]

    def _cost(self, kind: StepKind, count: int, longest: int) -> float:
        return self._memo_cost((kind, count, longest), lambda: self.shape_for(kind, count, longest))

    def _ragged_cost(self, tokens: int) -> float:
        return self._memo_cost(("ragged", tokens), lambda: self._ragged_shape(tokens))

    def plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Sequence index groups, one graph call each (``agents.runtime.bucket_plan``, ``agents.runtime.ragged_prefill``)."""
        kind = batch.kind
        if kind is StepKind.MIXED:
            return self._mixed_plan(batch)
        if kind is StepKind.VERIFY:
            raise ValueError("a verify step runs on the verify graphs (step), not planned buckets")
        prefill = kind is StepKind.PREFILL
        lengths = batch.query_lens if prefill else batch.context_lens
        if prefill and self.ragged_prefill:
            if int(lengths.max()) > self.rc.max_model_len:
                raise ValueError(f"prompt length {int(lengths.max())} exceeds max_model_len {self.rc.max_model_len}")
            return plan_ragged(lengths, self.rc.prefill_batch_sizes[-1], self._ragged_cost)
        try:
            if not prefill and self.skips_padding:
                return self._decode_chunks(lengths)
            buckets = self.rc.prefill_batch_sizes if prefill else self.rc.decode_batch_sizes
            return plan_groups(lengths, buckets, lambda n, longest: self._cost(kind, n, longest))
        except ValueError:
            what = "prompt" if prefill else "context"
            limit = (self.rc.prefill_seq_lengths[-1] if prefill
                     else self.rc.decode_block_widths[-1] * self.rc.block_size)
            raise ValueError(f"{what} length {int(lengths.max())} exceeds the largest compiled bucket {limit}"
                             f" (single sequences up to max_model_len {self.rc.max_model_len} can be prefilled"
                             " alone)") from None

    def _decode_chunks(self, context_lens: np.ndarray) -> list[np.ndarray]:
        """The decode plan when padding rows cost nothing: as few calls as the largest bucket allows, sequences
        in context order (the attention op reads each row's own context, so the table's width costs nothing)."""
        if self.shape_for(StepKind.DECODE, 1, int(context_lens.max())) is None:
            raise ValueError("no compiled width holds the longest context")
        calls = -(-len(context_lens) // self.rc.decode_batch_sizes[-1])
        if calls == 1:  # in batch order: the call takes the step as it is (StepBatch.take copies nothing)
            return [np.arange(len(context_lens))]
        return np.array_split(np.argsort(context_lens, kind="stable"), calls)

    def bucket_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """The batch padded to its bucket: ``((kind, batch, n), graph input arrays)`` (see ``graph_shapes``)."""
        kind = batch.kind
        if kind is StepKind.MIXED:
            return self._mixed_inputs(batch)
        if kind is StepKind.PREFILL and self.ragged_prefill:
            total = int(batch.query_lens.sum())
            shape = self._ragged_shape(total)
            if shape is None or batch.batch_size > shape[1]:
                raise ValueError(f"no ragged prefill bucket holds {batch.batch_size} prompts of {total} tokens")
            arrays = ragged_arrays(batch, shape[1], shape[2])
            arrays[3] = self.backend.ragged_lengths(arrays[3], shape[2])
            return shape, arrays
        prefill = kind is StepKind.PREFILL
        lengths = batch.query_lens if prefill else batch.context_lens
        shape = self.shape_for(kind, batch.batch_size, int(lengths.max()))
        if shape is None:
            raise ValueError(f"no compiled shape fits {batch.batch_size} sequences of length up to "
                             f"{int(lengths.max())}")
        return shape, (self._prefill_arrays if prefill else self._decode_arrays)(batch, shape)

    def _prefill_arrays(self, batch: StepBatch, shape: tuple) -> list[np.ndarray]:
        _, b, s = shape
        arrays = self._padded_inputs(b, b * s, 1)
        ids, pos, slots, lens, _, last = arrays
        start = 0
        for i, n in enumerate(batch.query_lens.tolist()):
            ids[i * s: i * s + n] = batch.input_ids[start: start + n]
            pos[i * s: i * s + n] = batch.positions[start: start + n]
            slots[i * s: i * s + n] = batch.slot_mapping[start: start + n]
            lens[i] = n
            last[i] = i * s + n - 1
            start += n
        # Padding tokens after a prompt still write somewhere harmless: slot 0 (dummy block).
        return arrays

    def _decode_arrays(self, batch: StepBatch, shape: tuple) -> list[np.ndarray]:
        _, b, w = shape
        arrays = self._padded_inputs(b, b, w)
        ids, pos, slots, lens, tables, _ = arrays
        n = batch.batch_size
        ids[:n], pos[:n], slots[:n], lens[:n] = batch.input_ids, batch.positions, batch.slot_mapping, \
            batch.context_lens
        lens[n:] = self.backend.decode_padding_length
        cols = min(w, batch.block_tables.shape[1])
        tables[:n, :cols] = batch.block_tables[:, :cols]
        return arrays

    # ---- mixed steps (agents.runtime.mixed_steps) --------------------------------------------------------------------
    def _mixed_shape(self, tokens: int) -> tuple | None:
        """The ragged mixed shape holding ``tokens`` tokens, or None."""
        return next((s for s in self.mixed_shapes["mixed"] if s[2] >= tokens), None)

    def _chunk_shape(self, count: int, longest: int) -> tuple | None:
        """The smallest padded chunk shape holding ``count`` chunks of up to ``longest`` tokens, or None."""
        fits = [s for s in self.mixed_shapes["chunk"] if s[1] >= count and s[2] >= longest]
        return min(fits, key=lambda s: (s[1] * s[2], s)) if fits else None

    def _chunk_cost(self, count: int, longest: int) -> float:
        return self._memo_cost(("chunk", count, longest), lambda: self._chunk_shape(count, longest))

    def _mixed_plan(self, batch: StepBatch) -> list[np.ndarray]:
        """Ragged: consecutive groups, one mixed call each. Padded: one-token queries, whole prompts and chunks
        each planned as their own graphs do."""
        if not self.rc.mixed_steps:
            raise ValueError("a step with queries over cached context needs the mixed-step graphs (mixed_steps)")
        if self.ragged_prefill:  # padding rows cost next to nothing here: as few calls as the largest bucket allows
            return consecutive_groups(batch.query_lens, self.rc.mixed_max_seqs - self.backend.mixed_padding_slots,
                                      self.mixed_shapes["mixed"][-1][2])
        groups = []
        for kind, rows in padded_kinds(batch).items():
            part = batch.take(rows)
            if kind is RowKind.CHUNK:
                planned = plan_groups(part.query_lens, self.rc.prefill_batch_sizes, self._chunk_cost)
            else:
                planned = self.plan(replace(part, kind=StepKind.DECODE if kind is RowKind.DECODE else StepKind.PREFILL))
            groups += [rows[g] for g in planned]
        return groups

    def _mixed_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """``bucket_inputs`` of a mixed step (or of one kind's group of it, padded)."""
        width = self.rc.max_blocks_per_seq
        if self.ragged_prefill:
            total = int(batch.query_lens.sum())
            shape = self._mixed_shape(total)
            if shape is None or batch.batch_size > shape[1] - self.backend.mixed_padding_slots:
                raise ValueError(f"no mixed-step bucket holds {batch.batch_size} sequences of {total} tokens")
            arrays = mixed_arrays(batch, shape[1], shape[2], width)
            arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], shape[2])
            return shape, arrays
        if np.all(batch.query_lens == 1):
            return self.bucket_inputs(replace(batch, kind=StepKind.DECODE))
        shape = self._chunk_shape(batch.batch_size, int(batch.query_lens.max()))
        if shape is None:
            raise ValueError(f"no chunk bucket holds {batch.batch_size} chunks of up to "
                             f"{int(batch.query_lens.max())} tokens")
        return shape, chunk_arrays(batch, shape, width)

    def _check_cache_indices(self, batch: StepBatch) -> None:
        """Refuse slots and blocks outside the cache before any graph runs: a bad index inside a graph either
        corrupts other sequences' KV or fails the MindSpore executor, which then refuses every later step."""
        rc = self.rc
        num_slots = rc.num_blocks * rc.block_size
        if batch.slot_mapping.size and (batch.slot_mapping.min() < 0 or batch.slot_mapping.max() >= num_slots):
            raise ValueError(f"slot_mapping has slots outside the KV cache [0, {num_slots})")
        if batch.kind is StepKind.PREFILL:
            return
        if batch.kind is not StepKind.DECODE and (np.any(batch.context_lens < batch.query_lens)
                                 or batch.context_lens.max() > rc.max_blocks_per_seq * rc.block_size):
            raise ValueError("context lengths must hold their queries and fit max_model_len")
        used = blocks_needed(batch.context_lens, rc.block_size)
        if batch.context_lens.size and (batch.context_lens.min() < 1 or used.max() > batch.block_tables.shape[1]):
            raise ValueError("decode context lengths must be >= 1 and covered by the block tables")
        in_use = np.arange(batch.block_tables.shape[1]) < used[:, None]
        blocks = batch.block_tables[in_use]
        if blocks.size and (blocks.min() < 0 or blocks.max() >= rc.num_blocks):
            raise ValueError(f"block tables reference blocks outside the KV cache [0, {rc.num_blocks})")

    def _parts(self, batch: StepBatch):
        """(indices, sub-batch, graph outputs) of each planned call."""
        groups = self.plan(batch)
        self._check_cache_indices(batch)
        for group in groups:
            part = batch.take(group)
            shape, arrays = self.bucket_inputs(part)
            yield group, part, self._run(shape[0], shape, arrays)

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one prefill or decode step as one or more bucketed graph calls (``plan``).

        All-greedy parts use the in-graph argmax; parts with sampled or penalised sequences read the logits and
        sample on the host (``agents.runtime.sampler``). The logits leave the device only for such parts and for parts
        with a sequence in ``want_logits``, whose rows (raw model logits, before any penalty) are returned.
        """
        if batch.kind is StepKind.VERIFY:
            return self._verify(batch)
        with self._device_step(batch):
            return step_output(batch.batch_size, self._parts(batch))

    def _verify(self, batch: StepBatch) -> StepOutput:
        """A step of proposals to verify (``agents.runtime.verify_steps``): consecutive groups, one verify call each."""
        if not self.verify_shapes:
            raise ValueError("a step with proposals to verify needs the verify graphs (runner_config verify_tokens)")
        self._check_cache_indices(batch)
        picks, logprobs = np.zeros(batch.num_tokens, np.int32), np.zeros(batch.num_tokens, np.float32)
        sampled = batch.sampling is not None and batch.sampling.needs_logits
        logits = np.zeros((batch.num_tokens, self.config.vocab_size), np.float32) if sampled else None
        starts = np.cumsum(batch.query_lens) - batch.query_lens
        max_seqs = self.verify_shapes[0][1] - self.backend.mixed_padding_slots
        with self._device_step(batch):
            for group in consecutive_groups(batch.query_lens, max_seqs, self.verify_shapes[-1][2]):
                part = batch.take(group)
                used = part.num_tokens
                shape = next(s for s in self.verify_shapes if s[2] >= used)
                arrays = mixed_arrays(part, shape[1], shape[2], self.rc.max_blocks_per_seq)[:6]
                arrays[3], arrays[4] = self.backend.mixed_lengths(arrays[3], arrays[4], shape[2])
                ids, lps, rows = self._run("verify", shape, arrays)
                first = int(starts[group[0]])
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
        self.backend.before_step(len(batch.slot_mapping))
        try:
            yield
        finally:
            self.backend.after_step()
