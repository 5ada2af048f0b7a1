"""Fixed-layout shared-memory buffers that carry one step between the master and its device agents.

One POSIX shared-memory segment is allocated at start and never resized: a small int64 header, the token-flat input
arrays of a ``StepBatch`` at their maximum sizes, its optional per-sequence arrays (sampling parameters, the rarer
``SamplingExtras``, token masks of ``ceil(logits_width / 32)`` words a sequence, the rows that want logits, fed
rows, proposals, prompt-lookup history, rows' adapter slots), and an output area where rank 0 writes the next token
id and logprob of every sequence, and the float32 logits of the sequences whose ``want_logits`` is set
(``max_logits_rows`` rows of ``logits_width``). The header says what the step is: its kind
(``protocol.step.StepKind``, a KV copy's direction, or an adapter step: its slot and path), its sizes, and a bit per
optional area it fills, so a step copies only what it has (an all-greedy decode step none of the optional areas). A
step is then a handful of ``memcpy``s into numpy views; nothing is pickled. Signalling (whose turn it is) is not
done here but over pipes by ``agent_pool``.

Only the creating side (the master) registers the segment with Python's ``resource_tracker``, so a crashed
master still gets it unlinked; agents attach without tracking, since in Python < 3.13 an attaching
``SharedMemory`` would make the agent's own tracker unlink the master's segment when the agent exits.
Kept free of MindSpore: both sides import it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from llm_serving.protocol.arrays import AnyArray
from llm_serving.protocol.batch import (
    MAX_ADAPTER_PATH_BYTES,
    MAX_LOGIT_ADJUSTMENTS,
    AdapterStep,
    KvCopyStep,
    SamplingBatch,
    SamplingExtras,
    Step,
    StepBatch,
    StepOutput,
)
from llm_serving.protocol.step import StepKind

MAGIC = 0x4C4C4D53483C  # "LLMSH<": bump the digit when the layout changes
NAME_PREFIX = "llmserving_"
_ALIGN = 64
_HEADER_SLOTS = 27
# header slots (int64): the layout's capacities, then what the step is (its kind, sizes and which optional areas
# carry its arrays), then what its answer is
(_MAGIC, _MAX_TOKENS, _MAX_BATCH, _MAX_BLOCKS, _MAX_PENALTY, _MAX_LOGITS_ROWS, _LOGITS_WIDTH,
 _MAX_DECODE_STEPS) = range(8)
_STEP, _KIND, _NUM_TOKENS, _BATCH_SIZE, _WIDTH, _NUM_STEPS, _AREAS = range(8, 15)
_PENALTY_TOKENS, _ADJUSTMENTS, _HISTORY_IDS, _KV_BLOCKS = range(15, 19)
_OUT_STEP, _OUT_BATCH_SIZE, _OUT_MORE_STEPS, _OUT_AREAS, _OUT_LOGITS_ROWS = range(19, 24)
_ROUND_PROPOSALS = 24
_ADAPTER_SLOT, _ADAPTER_PATH_BYTES = 25, 26  # an AdapterStep's slot, and its path's length (-1: no path)
# _KIND: a model step's StepKind value, a KV copy's direction, or an adapter step
_KV_KINDS = {"export": -1, "import": -2}
_ADAPTER_KIND = -3
# _AREAS: the optional input areas a step fills (the others are stale and not read)
_SAMPLING, _EXTRAS, _MASKS, _WANT_LOGITS, _FED_ROWS, _HISTORY, _LORA_SLOTS = (1 << i for i in range(7))
# _OUT_AREAS: the optional output areas an answer fills
_OUT_NUM_MORE, _OUT_SPEC = 1, 2
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "seeds", "draw_index")
_EXTRA_FIELDS = ("presence_penalty", "frequency_penalty", "min_p", "output_start")


class ChannelError(RuntimeError):
    """A shared-memory segment that is missing, or whose layout does not match this build."""


@dataclass(frozen=True)
class ChannelLayout:
    """Capacities of one step; every field of the segment sits at a fixed, 64-byte aligned offset."""

    max_tokens: int  # tokens in one step (prefill token budget; >= decode batch)
    max_batch: int  # sequences in one step
    max_blocks_per_seq: int  # block-table width
    # repetition-penalty token ids in one step (prompt + generated ids of every penalised sequence), and as many
    # history ids (a verify step's rounds of prompt lookup); None: max_tokens
    max_penalty_tokens: int | None = None
    max_logits_rows: int = 0  # sequences of one step that may get their logits back (0: none can)
    logits_width: int = 0  # floats per logits row: the vocabulary size
    # the tokens one sequence may get back from a step: the decode steps one batch may ask for (StepBatch.num_steps),
    # or a verify step's rounds times one more than the proposals of a round (StepBatch.draft_lens)
    max_decode_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_penalty_tokens is None:
            object.__setattr__(self, "max_penalty_tokens", self.max_tokens)
        for name in ("max_tokens", "max_batch", "max_blocks_per_seq", "max_penalty_tokens", "max_decode_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"channel layout: {name} must be positive, got {getattr(self, name)}")
        if self.max_logits_rows < 0 or (self.max_logits_rows and self.logits_width <= 0):
            raise ValueError(f"channel layout: max_logits_rows {self.max_logits_rows} needs a positive "
                             f"logits_width, got {self.logits_width}")

    def fields(self) -> dict[str, tuple[int, np.dtype[Any], int]]:
        """name -> (byte offset, dtype, element count), in segment order."""
        t, b, p = self.max_tokens, self.max_batch, self.penalty_capacity
        spec: list[tuple[str, type[np.generic], int]] = [("header", np.int64, _HEADER_SLOTS),
                ("input_ids", np.int32, t), ("positions", np.int32, t),
                ("slot_mapping", np.int32, t), ("query_lens", np.int32, b), ("context_lens", np.int32, b),
                ("block_tables", np.int32, b * self.max_blocks_per_seq),
                ("temperature", np.float32, b), ("top_k", np.int32, b), ("top_p", np.float32, b),
                ("repetition_penalty", np.float32, b), ("seeds", np.int64, b), ("draw_index", np.int32, b),
                ("penalty_offsets", np.int32, b + 1), ("penalty_token_ids", np.int32, p),
                ("presence_penalty", np.float32, b), ("frequency_penalty", np.float32, b), ("min_p", np.float32, b),
                ("output_start", np.int32, b), ("adjust_offsets", np.int32, b + 1),
                ("adjust_ids", np.int32, b * MAX_LOGIT_ADJUSTMENTS),
                ("adjust_values", np.float32, b * MAX_LOGIT_ADJUSTMENTS),
                ("token_masks", np.int32, b * self.mask_words),
                ("want_logits", np.uint8, b), ("draft_lens", np.int32, b), ("fed_rows", np.int32, b),
                ("kv_block_ids", np.int32, self.max_blocks_per_seq), ("lora_slots", np.int32, b),
                ("adapter_path", np.uint8, MAX_ADAPTER_PATH_BYTES),
                ("history_offsets", np.int32, b + 1), ("history_ids", np.int32, p),
                ("out_token_ids", np.int32, b), ("out_logprobs", np.float32, b),
                ("out_more_ids", np.int32, b * (self.max_decode_steps - 1)),
                ("out_more_logprobs", np.float32, b * (self.max_decode_steps - 1)), ("out_num_more", np.int32, b),
                ("out_spec_counts", np.int32, b * 3),
                ("out_logits_rows", np.int32, self.max_logits_rows),
                ("out_logits", np.float32, self.max_logits_rows * self.logits_width)]
        out: dict[str, tuple[int, np.dtype[Any], int]] = {}
        offset = 0
        for name, dtype, count in spec:
            out[name] = (offset, np.dtype(dtype), count)
            offset += -(-count * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return out

    @property
    def penalty_capacity(self) -> int:
        """``max_penalty_tokens`` as set (``__post_init__`` fills it in when None)."""
        return self.max_penalty_tokens if self.max_penalty_tokens is not None else self.max_tokens

    @property
    def mask_words(self) -> int:
        """int32 words of one sequence's token mask (a bit per logit)."""
        return (self.logits_width + 31) // 32

    @property
    def nbytes(self) -> int:
        offset, dtype, count = list(self.fields().values())[-1]
        return offset + -(-count * dtype.itemsize // _ALIGN) * _ALIGN


class Attached:
    """An untracked mapping of an existing segment (agent side)."""

    def __init__(self, name: str) -> None:
        try:
            fd = _shm_open(name)
        except FileNotFoundError:
            raise ChannelError(f"shared memory segment {name!r} does not exist (has the master exited?)") \
                from None
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def _shm_open(name: str) -> int:
    try:
        import _posixshmem  # type: ignore[import-not-found]  # multiprocessing.shared_memory's own (no stub)
    except ImportError:  # pragma: no cover - non-POSIX
        raise ChannelError("POSIX shared memory is not available on this platform") from None
    return int(_posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600))


def attach_untracked(name: str) -> shared_memory.SharedMemory | Attached:
    """Map an existing segment without registering it with any resource tracker (in Python < 3.13 an attaching
    ``SharedMemory`` would have the attaching process's tracker unlink the creator's segment when it exits)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    return Attached(name)


class StepChannel:
    """Numpy views over one step segment; ``create`` on the master, ``attach`` in each agent.

    Master: ``write_step`` then (after rank 0 signals) ``read_output``. Agent: ``read_step`` (zero-copy
    views, valid until the master writes the next step) and, on rank 0, ``write_output``.
    """

    def __init__(self, segment: shared_memory.SharedMemory | Attached, layout: ChannelLayout,
                 owner: bool) -> None:
        self.layout = layout
        self.name = segment.name.lstrip("/")
        self._segment: shared_memory.SharedMemory | Attached | None = segment
        self._owner = owner
        self._views: dict[str, AnyArray] = {
            name: np.ndarray((count,), dtype, buffer=segment.buf, offset=offset)
            for name, (offset, dtype, count) in layout.fields().items()
        }
        self.header = self._views["header"]

    # ---- lifetime ------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, layout: ChannelLayout, prefix: str = NAME_PREFIX) -> StepChannel:
        """Allocate and zero a new segment named ``<prefix><pid>_<random>`` (owned: ``close`` unlinks it)."""
        name = f"{prefix}{os.getpid()}_{secrets.token_hex(4)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=layout.nbytes)
        channel = cls(segment, layout, owner=True)
        h = channel.header
        h[:] = 0
        h[_MAGIC], h[_MAX_TOKENS], h[_MAX_BATCH], h[_MAX_BLOCKS], h[_MAX_PENALTY] = (
            MAGIC, layout.max_tokens, layout.max_batch, layout.max_blocks_per_seq, layout.max_penalty_tokens)
        h[_MAX_LOGITS_ROWS], h[_LOGITS_WIDTH] = layout.max_logits_rows, layout.logits_width
        h[_MAX_DECODE_STEPS] = layout.max_decode_steps
        h[_STEP] = h[_OUT_STEP] = -1
        return channel

    @classmethod
    def attach(cls, name: str, layout: ChannelLayout) -> StepChannel:
        """Map an existing segment without registering it with any resource tracker."""
        segment = attach_untracked(name)
        if segment.size < layout.nbytes:
            segment.close()
            raise ChannelError(f"shared memory segment {name!r} holds {segment.size} bytes, the layout "
                               f"{layout} needs {layout.nbytes}")
        channel = cls(segment, layout, owner=False)
        h = channel.header
        found = tuple(int(h[i]) for i in (_MAGIC, _MAX_TOKENS, _MAX_BATCH, _MAX_BLOCKS, _MAX_PENALTY,
                                          _MAX_LOGITS_ROWS, _LOGITS_WIDTH, _MAX_DECODE_STEPS))
        wanted = (MAGIC, layout.max_tokens, layout.max_batch, layout.max_blocks_per_seq, layout.max_penalty_tokens,
                  layout.max_logits_rows, layout.logits_width, layout.max_decode_steps)
        if found != wanted:
            channel.close()
            raise ChannelError(f"shared memory segment {name!r} has layout (magic, max_tokens, max_batch, "
                               f"max_blocks_per_seq, max_penalty_tokens, max_logits_rows, logits_width, "
                               f"max_decode_steps) = "
                               f"{found}, expected {wanted}")
        return channel

    def close(self) -> None:
        """Drop the views and unmap; the owner also unlinks the segment. Idempotent."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        self._views.clear()
        self.header = None  # type: ignore[assignment]
        try:
            segment.close()
        except BufferError:
            pass  # a caller still holds a view (e.g. a batch from read_step); the mapping goes with it
        if self._owner and isinstance(segment, shared_memory.SharedMemory):
            try:
                segment.unlink()  # also unregisters it from the resource tracker
            except FileNotFoundError:
                pass

    @property
    def closed(self) -> bool:
        return self._segment is None

    # ---- master side ---------------------------------------------------------------------------------------
    def check_fits(self, step: Step) -> None:
        """Raise ValueError when ``step`` exceeds the capacities the segment was allocated with."""
        lay = self.layout
        if isinstance(step, AdapterStep):
            return  # its path's length is checked when it is made
        if isinstance(step, KvCopyStep):
            if step.block_ids.shape[0] > lay.max_blocks_per_seq:
                raise ValueError(f"a KV copy of {step.block_ids.shape[0]} blocks exceeds the shared memory's "
                                 f"{lay.max_blocks_per_seq} (one sequence's blocks: AgentSpec max_blocks_per_seq)")
            return
        batch = step
        width = batch.block_tables.shape[1] if batch.block_tables.ndim == 2 else -1
        penalty = batch.sampling.penalty_token_ids.shape[0] if batch.sampling is not None else 0
        history = batch.history_ids.shape[0] if batch.history_ids is not None else 0
        extras = batch.sampling.extras if batch.sampling is not None else None
        adjustments = extras.adjust_ids.shape[0] if extras is not None else 0
        want = batch.want_logits
        logits_rows = int(np.count_nonzero(want)) if want is not None else 0
        for what, value, limit in (("num_tokens", batch.num_tokens, lay.max_tokens),
                                   ("batch_size", batch.batch_size, lay.max_batch),
                                   ("block table width", width, lay.max_blocks_per_seq),
                                   ("repetition-penalty token count", penalty, lay.penalty_capacity),
                                   ("history token count", history, lay.penalty_capacity),
                                   ("logit adjustment count", adjustments, lay.max_batch * MAX_LOGIT_ADJUSTMENTS),
                                   ("logits row count", logits_rows, lay.max_logits_rows)):
            if value > limit:
                raise ValueError(f"step {what} {value} exceeds the shared-memory capacity {limit} (AgentSpec "
                                 f"max_tokens/max_batch/max_blocks_per_seq/max_penalty_tokens/max_logits_rows)")
        masks = extras.token_masks if extras is not None else None
        if masks is not None and (lay.mask_words == 0 or masks.shape != (batch.batch_size, lay.mask_words)):
            raise ValueError(f"token_masks has shape {masks.shape}, expected ({batch.batch_size}, {lay.mask_words}) "
                             "(AgentSpec llama_config vocab_size)")
        if want is not None and want.shape != (batch.batch_size,):
            raise ValueError(f"want_logits has shape {want.shape}, expected ({batch.batch_size},)")
        if not 1 <= batch.num_steps <= lay.max_decode_steps:
            raise ValueError(f"step asks for {batch.num_steps} decode steps; the shared memory holds 1 to "
                             f"{lay.max_decode_steps} (AgentSpec max_decode_steps)")
        drafts = batch.draft_lens
        if drafts is not None and (drafts.shape != (batch.batch_size,)
                                   or batch.num_steps * (int(drafts.max(initial=0)) + 1) > lay.max_decode_steps):
            raise ValueError(f"draft_lens {drafts.tolist()} in {batch.num_steps} round(s) exceed the shared memory's "
                             f"{lay.max_decode_steps} tokens a sequence (AgentSpec max_decode_steps)")
        if batch.num_steps * (batch.round_proposals + 1) > lay.max_decode_steps:
            raise ValueError(f"{batch.num_steps} rounds of {batch.round_proposals} proposals exceed the shared "
                             f"memory's {lay.max_decode_steps} tokens a sequence (AgentSpec max_decode_steps)")
        sampling = batch.sampling
        if sampling is not None and sampling.penalty_offsets.shape != (batch.batch_size + 1,):
            raise ValueError(f"sampling.penalty_offsets has shape {sampling.penalty_offsets.shape}, expected "
                             f"({batch.batch_size + 1},)")

    def write_step(self, number: int, step: Step) -> None:
        """Copy ``step`` into the segment as step number ``number`` (a block table compactly, ``[B, W]``)."""
        self.check_fits(step)
        h, v = self.header, self._views
        if isinstance(step, AdapterStep):
            path = step.path.encode() if step.path is not None else b""
            v["adapter_path"][: len(path)] = np.frombuffer(path, np.uint8)
            h[_KIND], h[_ADAPTER_SLOT] = _ADAPTER_KIND, step.slot
            h[_ADAPTER_PATH_BYTES] = len(path) if step.path is not None else -1
            h[_NUM_TOKENS] = h[_BATCH_SIZE] = h[_WIDTH] = h[_AREAS] = 0
            h[_NUM_STEPS] = 1
            h[_STEP] = number
            return
        if isinstance(step, KvCopyStep):
            v["kv_block_ids"][: step.block_ids.shape[0]] = step.block_ids
            h[_KIND], h[_KV_BLOCKS] = _KV_KINDS[step.direction], step.block_ids.shape[0]
            h[_NUM_TOKENS] = h[_BATCH_SIZE] = h[_WIDTH] = h[_AREAS] = 0
            h[_NUM_STEPS] = 1
            h[_STEP] = number
            return
        batch = step
        n, b = batch.num_tokens, batch.batch_size
        width = batch.block_tables.shape[1]
        v["input_ids"][:n] = batch.input_ids
        v["positions"][:n] = batch.positions
        v["slot_mapping"][:n] = batch.slot_mapping
        v["query_lens"][:b] = batch.query_lens
        v["context_lens"][:b] = batch.context_lens
        v["block_tables"][: b * width].reshape(b, width)[:] = batch.block_tables
        areas = 0
        sampling = batch.sampling
        if sampling is not None:
            for name in _SAMPLING_FIELDS:
                v[name][:b] = getattr(sampling, name)
            v["penalty_offsets"][: b + 1] = sampling.penalty_offsets
            p = sampling.penalty_token_ids.shape[0]
            v["penalty_token_ids"][:p] = sampling.penalty_token_ids
            h[_PENALTY_TOKENS] = p
            areas |= _SAMPLING
        extras = sampling.extras if sampling is not None else None
        if extras is not None:
            for name in _EXTRA_FIELDS:
                v[name][:b] = getattr(extras, name)
            v["adjust_offsets"][: b + 1] = extras.adjust_offsets
            a = extras.adjust_ids.shape[0]
            v["adjust_ids"][:a], v["adjust_values"][:a] = extras.adjust_ids, extras.adjust_values
            h[_ADJUSTMENTS] = a
            areas |= _EXTRAS
            if extras.token_masks is not None:
                v["token_masks"][: extras.token_masks.size] = extras.token_masks.ravel()
                areas |= _MASKS
        if batch.want_logits is not None:
            v["want_logits"][:b] = batch.want_logits
            areas |= _WANT_LOGITS
        if batch.draft_lens is not None:  # a VERIFY step's
            v["draft_lens"][:b] = batch.draft_lens
        if batch.fed_rows is not None:
            v["fed_rows"][:b] = batch.fed_rows
            areas |= _FED_ROWS
        if batch.history_ids is not None and batch.history_offsets is not None:
            m = batch.history_ids.shape[0]
            v["history_offsets"][: b + 1], v["history_ids"][:m] = batch.history_offsets, batch.history_ids
            h[_HISTORY_IDS] = m
            areas |= _HISTORY
        if batch.lora_slots is not None:
            v["lora_slots"][:b] = batch.lora_slots
            areas |= _LORA_SLOTS
        h[_KIND], h[_NUM_TOKENS], h[_BATCH_SIZE], h[_WIDTH] = batch.kind, n, b, width
        h[_NUM_STEPS], h[_AREAS], h[_ROUND_PROPOSALS] = batch.num_steps, areas, batch.round_proposals
        h[_STEP] = number

    def read_output(self, step: int, batch_size: int) -> StepOutput:
        """Copies of rank 0's answer to step ``step``; ChannelError if the segment holds another step's."""
        h = self.header
        if h[_OUT_STEP] != step or h[_OUT_BATCH_SIZE] != batch_size:
            raise ChannelError(f"output area holds step {int(h[_OUT_STEP])} with {int(h[_OUT_BATCH_SIZE])} "
                               f"sequences, expected step {step} with {batch_size}")
        v = self._views
        output = StepOutput(v["out_token_ids"][:batch_size].copy(), v["out_logprobs"][:batch_size].copy())
        more = int(h[_OUT_MORE_STEPS])
        if more:
            output.more_token_ids = v["out_more_ids"][: batch_size * more].reshape(batch_size, more).copy()
            output.more_logprobs = v["out_more_logprobs"][: batch_size * more].reshape(batch_size, more).copy()
            if h[_OUT_AREAS] & _OUT_NUM_MORE:
                output.num_more = v["out_num_more"][:batch_size].copy()
        if h[_OUT_AREAS] & _OUT_SPEC:
            output.spec_counts = v["out_spec_counts"][: batch_size * 3].reshape(batch_size, 3).copy()
        k = int(h[_OUT_LOGITS_ROWS])
        if k:
            logits = v["out_logits"][: k * self.layout.logits_width].reshape(k, -1).copy()
            output.logits = dict(zip(v["out_logits_rows"][:k].tolist(), logits))
        return output

    # ---- agent side ----------------------------------------------------------------------------------------
    def read_step(self) -> tuple[int, Step]:
        """The current step number and step, its arrays zero-copy views (do not keep them past the step)."""
        h, v = self.header, self._views
        code = int(h[_KIND])
        if code == _ADAPTER_KIND:
            size = int(h[_ADAPTER_PATH_BYTES])
            path = bytes(v["adapter_path"][:size]).decode() if size >= 0 else None
            return int(h[_STEP]), AdapterStep(int(h[_ADAPTER_SLOT]), path)
        if code < 0:
            direction = next(name for name, value in _KV_KINDS.items() if value == code)
            return int(h[_STEP]), KvCopyStep(direction, v["kv_block_ids"][: int(h[_KV_BLOCKS])])
        kind = StepKind(code)
        n, b, width, areas = int(h[_NUM_TOKENS]), int(h[_BATCH_SIZE]), int(h[_WIDTH]), int(h[_AREAS])
        sampling = None
        if areas & _SAMPLING:
            extras = None
            if areas & _EXTRAS:
                a, words = int(h[_ADJUSTMENTS]), self.layout.mask_words
                masks = v["token_masks"][: b * words].reshape(b, words) if areas & _MASKS else None
                extras = SamplingExtras(v["presence_penalty"][:b], v["frequency_penalty"][:b], v["min_p"][:b],
                                        v["output_start"][:b], v["adjust_offsets"][: b + 1], v["adjust_ids"][:a],
                                        v["adjust_values"][:a], masks)
            sampling = SamplingBatch(v["temperature"][:b], v["top_k"][:b], v["top_p"][:b],
                                     v["repetition_penalty"][:b], v["seeds"][:b], v["draw_index"][:b],
                                     v["penalty_offsets"][: b + 1], v["penalty_token_ids"][: int(h[_PENALTY_TOKENS])],
                                     extras)
        kept = bool(areas & _HISTORY)
        batch = StepBatch(v["input_ids"][:n], v["positions"][:n], v["slot_mapping"][:n], v["query_lens"][:b],
                          v["context_lens"][:b], v["block_tables"][: b * width].reshape(b, width), sampling,
                          v["want_logits"][:b].view(np.bool_) if areas & _WANT_LOGITS else None, int(h[_NUM_STEPS]),
                          v["draft_lens"][:b] if kind is StepKind.VERIFY else None,
                          v["fed_rows"][:b] if areas & _FED_ROWS else None,
                          v["history_offsets"][: b + 1] if kept else None,
                          v["history_ids"][: int(h[_HISTORY_IDS])] if kept else None, int(h[_ROUND_PROPOSALS]),
                          kind=kind, lora_slots=v["lora_slots"][:b] if areas & _LORA_SLOTS else None)
        return int(h[_STEP]), batch

    def write_output(self, step: int, output: StepOutput) -> None:
        """Rank 0 only: write the answer of step ``step`` (the master reads it after the signal)."""
        b = output.token_ids.shape[0]
        if b > self.layout.max_batch or output.logprobs.shape != (b,):
            raise ValueError(f"output of {b} tokens / logprobs {output.logprobs.shape} does not fit "
                             f"max_batch {self.layout.max_batch}")
        lay, rows = self.layout, sorted(output.logits)
        if len(rows) > lay.max_logits_rows:
            raise ValueError(f"{len(rows)} logits rows exceed the capacity max_logits_rows {lay.max_logits_rows}")
        v = self._views
        v["out_token_ids"][:b] = output.token_ids
        v["out_logprobs"][:b] = output.logprobs
        more_ids, more_logprobs = output.more_token_ids, output.more_logprobs
        more = 0 if more_ids is None else more_ids.shape[1]
        if more_ids is not None and more:
            if more >= lay.max_decode_steps or more_ids.shape != (b, more) or more_logprobs is None:
                raise ValueError(f"later steps' tokens of shape {more_ids.shape} do not fit "
                                 f"max_decode_steps {lay.max_decode_steps} for {b} sequences")
            v["out_more_ids"][: b * more] = more_ids.ravel()
            v["out_more_logprobs"][: b * more] = more_logprobs.ravel()
            if output.num_more is not None:
                v["out_num_more"][:b] = output.num_more
        if output.spec_counts is not None:
            if output.spec_counts.shape != (b, 3):
                raise ValueError(f"spec_counts of shape {output.spec_counts.shape}, expected ({b}, 3)")
            v["out_spec_counts"][: b * 3] = output.spec_counts.ravel()
        self.header[_OUT_AREAS] = ((_OUT_NUM_MORE if more and output.num_more is not None else 0)
                                   | (_OUT_SPEC if output.spec_counts is not None else 0))
        self.header[_OUT_MORE_STEPS] = more
        if rows:
            v["out_logits_rows"][: len(rows)] = rows
            area = v["out_logits"][: len(rows) * lay.logits_width].reshape(len(rows), lay.logits_width)
            for i, row in enumerate(rows):
                values = output.logits[row]
                if np.shape(values) != (lay.logits_width,) or not 0 <= row < b:
                    raise ValueError(f"logits of row {row} have shape {np.shape(values)}, expected "
                                     f"({lay.logits_width},) for a row of the {b} in the step")
                area[i] = values
        self.header[_OUT_LOGITS_ROWS] = len(rows)
        self.header[_OUT_BATCH_SIZE] = b
        self.header[_OUT_STEP] = step
