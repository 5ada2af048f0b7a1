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
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Tensor

from agents.device import setup_device
from agents.model import LlamaModel, LlamaStep, load_weights_into
from agents.model_config import LlamaConfig
from agents.sampler import sample
from llm_serving.batch import StepBatch, StepOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def _powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    out, v = [], start
    while v < limit:
        out.append(v)
        v *= 2
    return tuple(out) + (limit,)


@dataclass(frozen=True)
class RunnerConfig:
    """Cache geometry and shape buckets. ``decode_block_widths`` defaults to powers of two up to the most
    blocks one sequence can hold (``max_model_len / block_size``)."""

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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        for name in ("prefill_batch_sizes", "prefill_seq_lengths", "decode_batch_sizes"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive sizes, got {values}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if self.prefill_seq_lengths[-1] > self.max_model_len:
            raise ValueError(f"prefill seq length {self.prefill_seq_lengths[-1]} exceeds max_model_len "
                             f"{self.max_model_len}")
        if not self.decode_block_widths:
            object.__setattr__(self, "decode_block_widths", _powers_of_two_up_to(self.max_blocks_per_seq, 4))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _bucket(value: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{what} {value} exceeds the largest compiled bucket {buckets[-1]}")


def _chunks(batch: StepBatch, size: int) -> Iterator[StepBatch]:
    """Split a batch into consecutive sub-batches of at most ``size`` sequences."""
    if batch.batch_size <= size:
        yield batch
        return
    token_starts = np.concatenate([[0], np.cumsum(batch.query_lens)])
    for s in range(0, batch.batch_size, size):
        e = min(s + size, batch.batch_size)
        t0, t1 = token_starts[s], token_starts[e]
        yield StepBatch(batch.is_prefill, batch.input_ids[t0:t1], batch.positions[t0:t1],
                        batch.slot_mapping[t0:t1], batch.query_lens[s:e], batch.context_lens[s:e],
                        batch.block_tables[s:e], batch.sampling.rows(s, e) if batch.sampling else None)


class ModelRunner:
    """Owns the MindSpore model, its KV cache and the compiled step graphs of one device."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], runner_config: RunnerConfig) -> None:
        setup_device(runner_config.device_target, runner_config.device_id)
        self.config = config
        self.rc = runner_config
        self.model = LlamaModel(config, runner_config.num_blocks, runner_config.block_size,
                                runner_config.max_model_len, DTYPES[runner_config.dtype])
        load_weights_into(self.model, weights)
        self.graphs = {"prefill": LlamaStep(self.model, is_prefill=True),
                       "decode": LlamaStep(self.model, is_prefill=False)}
        self.warmed: set[tuple] = set()
        self.compile_times: dict[tuple, float] = {}

    # ---- shapes -------------------------------------------------------------------------------------------
    def graph_shapes(self) -> list[tuple]:
        shapes = [("prefill", b, s) for b in self.rc.prefill_batch_sizes for s in self.rc.prefill_seq_lengths]
        if self.rc.max_model_len > self.rc.prefill_seq_lengths[-1]:
            shapes.append(("prefill", 1, self.rc.max_model_len))  # recompute of one preempted sequence
        shapes += [("decode", b, w) for b in self.rc.decode_batch_sizes for w in self.rc.decode_block_widths]
        return shapes

    def warmup(self, progress: Callable[[str], None] | None = None) -> dict[tuple, float]:
        """Compile and run every graph shape once on padding (which only touches the dummy block 0)."""
        for shape in self.graph_shapes():
            kind, b, n = shape
            t0 = time.perf_counter()
            is_prefill = kind == "prefill"
            tokens = b * n if is_prefill else b
            inputs = self._padded_inputs(b, tokens, n if not is_prefill else 1)
            self.warmed.add(shape)
            self._run(kind, shape, inputs)
            self.compile_times[shape] = time.perf_counter() - t0
            if progress:
                progress(f"warmed {kind} batch={b} {'seq' if is_prefill else 'blocks'}={n} "
                         f"in {self.compile_times[shape]:.2f}s")
        return self.compile_times

    @staticmethod
    def _padded_inputs(batch: int, tokens: int, width: int) -> list[np.ndarray]:
        """All-padding inputs: token 0 at position 0 writing to slot 0 of the dummy block."""
        last = (np.arange(batch, dtype=np.int32) * (tokens // batch)).astype(np.int32)
        return [np.zeros(tokens, np.int32) for _ in range(3)] + [
            np.zeros(batch, np.int32), np.zeros((batch, width), np.int32), last]

    def _run(self, kind: str, shape: tuple, arrays: list[np.ndarray]):
        if shape not in self.warmed:
            raise RuntimeError(f"graph shape {shape} was not warmed up; call warmup() first "
                               f"(the runner never compiles while serving)")
        return self.graphs[kind](*[Tensor(a) for a in arrays])

    # ---- steps --------------------------------------------------------------------------------------------
    def _prefill_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        b = _bucket(batch.batch_size, self.rc.prefill_batch_sizes, "prefill batch size")
        longest = int(batch.query_lens.max())
        if batch.batch_size == 1 and self.rc.prefill_seq_lengths[-1] < longest <= self.rc.max_model_len:
            b, s = 1, self.rc.max_model_len  # a preempted sequence recomputing prompt + generated tokens
        else:
            s = _bucket(longest, self.rc.prefill_seq_lengths, "prompt length")
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
        # Padding tokens after a prompt must still write somewhere harmless: slot 0 (dummy block).
        return ("prefill", b, s), arrays

    def _decode_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        b = _bucket(batch.batch_size, self.rc.decode_batch_sizes, "decode batch size")
        need = -(-int(batch.context_lens.max()) // self.rc.block_size)
        w = _bucket(need, self.rc.decode_block_widths, "blocks per sequence")
        arrays = self._padded_inputs(b, b, w)
        ids, pos, slots, lens, tables, _ = arrays
        n = batch.batch_size
        ids[:n], pos[:n], slots[:n], lens[:n] = batch.input_ids, batch.positions, batch.slot_mapping, \
            batch.context_lens
        cols = min(w, batch.block_tables.shape[1])
        tables[:n, :cols] = batch.block_tables[:, :cols]
        return ("decode", b, w), arrays

    def bucket_inputs(self, batch: StepBatch) -> tuple[tuple, list[np.ndarray]]:
        """The batch padded to its bucket: ``((kind, batch, seq-or-width), graph input arrays)``."""
        return self._prefill_inputs(batch) if batch.is_prefill else self._decode_inputs(batch)

    def _max_batch(self, batch: StepBatch) -> int:
        return self.rc.prefill_batch_sizes[-1] if batch.is_prefill else self.rc.decode_batch_sizes[-1]

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one prefill or decode step; batches larger than the biggest bucket run as several calls.

        All-greedy parts use the in-graph argmax; parts with sampled or penalised sequences read the logits and
        sample on the host (``agents.sampler``).
        """
        ids, logprobs = [], []
        for part in _chunks(batch, self._max_batch(batch)):
            shape, arrays = self.bucket_inputs(part)
            tok, lp, logits = self._run(shape[0], shape, arrays)
            n = part.batch_size
            tok, lp = tok.asnumpy()[:n], lp.asnumpy()[:n]
            if part.sampling is not None and part.sampling.needs_logits:
                tok, lp = sample(logits.asnumpy()[:n], tok, lp, part.sampling)
            ids.append(tok)
            logprobs.append(lp)
        return StepOutput(np.concatenate(ids).astype(np.int32), np.concatenate(logprobs).astype(np.float32))

    def step_logits(self, batch: StepBatch) -> np.ndarray:
        """Like ``step`` (the KV cache is written the same way) but returns float32 logits ``[B, vocab]`` of each
        sequence's last token, for logits checks."""
        out = []
        for part in _chunks(batch, self._max_batch(batch)):
            shape, arrays = self.bucket_inputs(part)
            out.append(self._run(shape[0], shape, arrays)[2].asnumpy()[: part.batch_size])
        return np.concatenate(out)
