"""What the mindformers backend feeds MindFormers' ``LlamaForCausalLM.construct``, from our ``StepBatch`` (numpy
only, so the layout is tested without MindFormers).

MindFormers 1.8.0 in predict mode (``use_past``, ``is_dynamic``, paged attention) takes four tensors per step,
as its own ``TextGenerator`` passes them:

- prefill: ``input_ids`` int32 ``[1, rows]`` (the prompts back to back: FlashAttention's TH layout),
  ``batch_valid_length`` int32 ``[seqs]`` (each prompt's length: FlashAttention's actual lengths, the rotary
  positions ``0..len-1`` and the last-token gather at ``cumsum - 1``), ``block_tables`` (not read by prefill) and
  ``slot_mapping`` int32 ``[rows]`` (where ReshapeAndCache writes each token's K and V);
- decode: ``input_ids`` ``[batch, 1]``, ``batch_valid_length`` ``[batch]`` (the context length with the new
  token: PagedAttention's lengths and the rotary position ``len - 1``), ``block_tables`` ``[batch, width]``,
  ``slot_mapping`` ``[batch]``.

Positions are implied (a prompt starts at 0, a decode token sits at ``len - 1``), so prefill takes whole prompts
only: no chunks, no cached prefix. Static buckets as in ``agents.runtime.runner``: a prefill graph ``("ragged", S, T)``
holds up to ``S`` prompts of ``T`` tokens in ``T + S`` rows and ``S + 1`` sequence slots, so every padding slot
gets a row of its own (FlashAttention needs every length positive and the lengths to cover every row) and the
last slot takes the rest; padding rows are token 0 written to slot 0 (the reserved dummy block). Decode padding
rows have length 1 over the dummy block.
"""

from __future__ import annotations

import numpy as np

from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.step import StepKind


def check_whole_prompts(batch: StepBatch) -> None:
    """Refuse prefills with cached context (chunks, prefix-cache hits): MindFormers' prefill starts at 0."""
    if batch.kind is StepKind.VERIFY:
        raise ValueError("the mindformers backend has no verify graphs: speculative decoding must be off")
    if batch.kind is StepKind.MIXED:
        raise ValueError("the mindformers backend prefills whole prompts from position 0: chunked prefill and "
                         "prefix caching must be off (scheduler.enable_chunked_prefill / enable_prefix_caching)")


def prefill_rows(max_seqs: int, tokens: int) -> int:
    """Rows of the ``("ragged", max_seqs, tokens)`` graph: the bucket plus one per possible padding slot."""
    return tokens + max_seqs


def prefill_arrays(batch: StepBatch, max_seqs: int, tokens: int) -> list[np.ndarray]:
    """Inputs of one prefill call of at most ``max_seqs`` prompts of at most ``tokens`` tokens in total."""
    n, used = batch.batch_size, int(batch.query_lens.sum())
    if n > max_seqs or used > tokens:
        raise ValueError(f"{n} prompts of {used} tokens do not fit the prefill bucket of {max_seqs} x {tokens}")
    rows = prefill_rows(max_seqs, tokens)
    ids, slots = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    ids[:used], slots[:used] = batch.input_ids, batch.slot_mapping
    lens = np.ones(max_seqs + 1, np.int32)
    lens[:n] = batch.query_lens
    lens[-1] = rows - used - (max_seqs - n)  # >= 1: tokens - used + n
    return [ids.reshape(1, rows), lens, np.zeros((max_seqs + 1, 1), np.int32), slots]


def decode_arrays(batch: StepBatch, size: int, width: int) -> list[np.ndarray]:
    """Inputs of one decode call padded to ``size`` sequences and ``width`` block-table columns."""
    n = batch.batch_size
    if n > size or batch.kind is not StepKind.DECODE:
        raise ValueError(f"a decode call of {n} sequences does not fit batch {size}")
    ids, lens, slots = np.zeros((size, 1), np.int32), np.ones(size, np.int32), np.zeros(size, np.int32)
    tables = np.zeros((size, width), np.int32)
    ids[:n, 0], lens[:n], slots[:n] = batch.input_ids, batch.context_lens, batch.slot_mapping
    cols = min(width, batch.block_tables.shape[1])
    tables[:n, :cols] = batch.block_tables[:, :cols]
    return [ids, lens, tables, slots]


def warmup_batch(kind: str, count: int, n: int) -> StepBatch:
    """A batch filling shape ``(kind, count, n)`` with real tokens: token 0 in slot 0 of the dummy block
    (prompts splitting the ``n`` tokens evenly; decode contexts of one token)."""
    if kind == "ragged":
        lens = np.array([len(p) for p in np.array_split(np.arange(n), count)], np.int32)
    else:
        lens = np.ones(count, np.int32)
    tokens = int(lens.sum())
    zeros = np.zeros(tokens, np.int32)
    return StepBatch(zeros, zeros, zeros, lens, lens.copy(), np.zeros((count, 1 if kind == "ragged" else n), np.int32),
                     kind=StepKind.PREFILL if kind == "ragged" else StepKind.DECODE)


def shape_arrays(shape: tuple, batch: StepBatch) -> list[np.ndarray]:
    """The inputs of graph ``shape`` for ``batch``."""
    kind, count, n = shape
    return prefill_arrays(batch, count, n) if kind == "ragged" else decode_arrays(batch, count, n)
