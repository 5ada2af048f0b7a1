"""Mixed steps: queries over cached context, for chunked prefill and prefix caching.

A ``StepBatch`` of kind MIXED (``protocol.step``) has queries over cached context: a chunk of a prompt whose earlier
chunks are in the KV cache, the rest of a prompt after a prefix-cache hit, or a decode token riding along in a step
with prefill work. Each query attends to its
sequence's context up to its own position, read through the block table, the chunk's own K/V written first.

Ragged backends (the native CPU ops) run a mixed step as one graph ``("mixed", max_seqs, tokens)``: the tokens
back to back (bucketed by total as the ragged prefill is), per-sequence query and context lengths and full-width
block tables, so a step of 64 decode tokens and a 192-token chunk is one call whose projections read each weight
once. Padded backends (the portable graph ops) split it: one-token rows go to the decode graph, whole prompts to
the prefill graph, and chunks to ``("chunk", batch, seq)`` graphs, a padded ``[batch, seq]`` bucket with
full-width block tables. Prefill and decode steps that are not mixed keep their own graphs, unchanged.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from agents.runtime.bucket_plan import bucket_ladder
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.step import RowKind, row_kinds


def mixed_token_buckets(top: int) -> tuple[int, ...]:
    """Token totals of the ragged mixed graphs: the ladder from 16 with half steps, up to ``top``."""
    return bucket_ladder(top, 16, half_steps=True)


def mixed_shapes(max_seqs: int, token_top: int, prefill_batch_sizes: tuple[int, ...],
                 seq_lengths: tuple[int, ...], chunk_top: int, ragged: bool) -> list[tuple]:
    """The graph shapes of mixed steps: ragged ``("mixed", max_seqs, tokens)`` up to ``token_top`` tokens, or padded
    ``("chunk", batch, seq)`` for the prompt buckets below ``chunk_top`` (the longest chunk) and ``chunk_top``
    itself, alone unless it is a prompt bucket (as the padded prefill's recompute shape)."""
    if ragged:
        return [("mixed", max_seqs, t) for t in mixed_token_buckets(token_top)]
    shapes = [("chunk", b, s) for b in prefill_batch_sizes for s in seq_lengths if s <= chunk_top]
    return shapes if chunk_top in seq_lengths else shapes + [("chunk", 1, chunk_top)]


def consecutive_groups(query_lens: np.ndarray, max_seqs: int, max_tokens: int) -> list[np.ndarray]:
    """Sequence indices cut into consecutive groups of at most ``max_seqs`` sequences and ``max_tokens`` tokens,
    each as full as it can be (one ragged mixed call each). A sequence of more than ``max_tokens`` raises."""
    if query_lens.size and int(query_lens.max()) > max_tokens:
        raise ValueError(f"a chunk of {int(query_lens.max())} tokens exceeds the largest mixed-step bucket "
                         f"{max_tokens} (the step token budget)")
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(query_lens.tolist()):
        if i - start == max_seqs or tokens + n > max_tokens:
            groups.append(np.arange(start, i))
            start, tokens = i, 0
        tokens += n
    return groups + [np.arange(start, len(query_lens))] if len(query_lens) else groups


def warmup_arrays(kind: str, batch: int, n: int, width: int, max_model_len: int,
                  max_real: int | None = None) -> list[np.ndarray]:
    """Inputs of a mixed or chunk shape in which every row is a real token of dummy block 0 (as the runner's
    other warm-up inputs): ragged, ``n`` tokens in as few sequences as the model length allows (the most
    attention a call of that many tokens can do: its timing bounds the step timeout), at most ``max_real`` of
    them; padded, ``batch`` sequences of ``n`` tokens each."""
    tokens = n if kind == "mixed" else batch * n
    ids, pos, slots = (np.zeros(tokens, np.int32) for _ in range(3))
    if kind == "mixed":
        seqs = batch if max_real is None else max_real
        real = min(n, seqs * max_model_len)  # no sequence longer than the model
        parts = np.array_split(np.arange(real), min(seqs, -(-real // max_model_len)))
        lens = np.zeros(batch, np.int32)
        lens[: len(parts)] = [len(p) for p in parts]
        last = np.maximum(np.cumsum(lens) - 1, 0).astype(np.int32)
    else:
        lens = np.full(batch, n, np.int32)
        last = (np.arange(batch) * n + n - 1).astype(np.int32)
    return [ids, pos, slots, lens, lens.copy(), np.zeros((batch, width), np.int32), last]


def mixed_arrays(batch: StepBatch, max_seqs: int, tokens: int, width: int) -> list[np.ndarray]:
    """Graph inputs of one ragged mixed call: ids, positions, slots ``[tokens]`` (zero padding after the real
    tokens, which the kernel neither writes nor attends), query and context lengths, last-token indices
    ``[max_seqs]`` (0 for padding sequences) and block tables ``[max_seqs, width]``."""
    used, n = int(batch.query_lens.sum()), batch.batch_size
    ids, pos, slots = (np.zeros(tokens, np.int32) for _ in range(3))
    ids[:used], pos[:used], slots[:used] = batch.input_ids, batch.positions, batch.slot_mapping
    query, context, last = (np.zeros(max_seqs, np.int32) for _ in range(3))
    query[:n], context[:n], last[:n] = batch.query_lens, batch.context_lens, np.cumsum(batch.query_lens) - 1
    tables = np.zeros((max_seqs, width), np.int32)
    cols = min(width, batch.block_tables.shape[1])
    tables[:n, :cols] = batch.block_tables[:, :cols]
    return [ids, pos, slots, query, context, tables, last]


def chunk_arrays(batch: StepBatch, shape: tuple, width: int) -> list[np.ndarray]:
    """Graph inputs of one padded chunk call ``("chunk", b, s)``: each sequence's chunk at row ``i * s``, padding
    tokens writing to slot 0 of the dummy block; lengths, last-token indices and block tables ``[b, width]``."""
    _, b, s = shape
    ids, pos, slots = (np.zeros(b * s, np.int32) for _ in range(3))
    query, context, last = (np.zeros(b, np.int32) for _ in range(3))
    start = 0
    for i, n in enumerate(batch.query_lens.tolist()):
        ids[i * s: i * s + n] = batch.input_ids[start: start + n]
        pos[i * s: i * s + n] = batch.positions[start: start + n]
        slots[i * s: i * s + n] = batch.slot_mapping[start: start + n]
        query[i], context[i], last[i] = n, batch.context_lens[i], i * s + n - 1
        start += n
    tables = np.zeros((b, width), np.int32)
    cols = min(width, batch.block_tables.shape[1])
    tables[: batch.batch_size, :cols] = batch.block_tables[:, :cols]
    return [ids, pos, slots, query, context, tables, last]


def padded_kinds(batch: StepBatch) -> dict[RowKind, np.ndarray]:
    """A mixed step's sequence indices by the graph a padded backend runs them in: one-token queries over
    context (decode), whole prompts (prefill) and chunks over cached context; empty kinds left out."""
    kinds = row_kinds(batch.query_lens, batch.context_lens)
    return {kind: rows for kind in (RowKind.DECODE, RowKind.PROMPT, RowKind.CHUNK)
            if (rows := np.flatnonzero(kinds == kind)).size}


class MixedStep(nn.Cell):
    """One compiled mixed (or chunk) step of ``agents.model.llama.LlamaModel``: inputs ``input_ids``, ``positions``,
    ``slot_mapping`` ``[tokens]``, ``q_seq_lens`` (query lengths), ``batch_valid_length`` (context lengths, the
    query included) ``[batch]``, ``block_tables`` ``[batch, width]``, ``last_index`` ``[batch]``; returns what
    ``LlamaStep`` does (greedy ids, logprobs, logits)."""

    def __init__(self, model: nn.Cell, adapters: bool = False) -> None:
        super().__init__()
        self.model = model
        self.adapters = adapters  # the LoRA adapter graph (LlamaModel.hidden_states)

    def construct(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, q_seq_lens: Tensor,
                  batch_valid_length: Tensor, block_tables: Tensor, last_index: Tensor):
        # query and context lengths under the graph input names Ascend's internal kernels read them by
        # (agents.tools.contracts); not rebound to shorter names, since MindSpore names the inputs after that
        token_rows, sequence_rows = self.model.real_rows(q_seq_lens, True)
        hidden = self.model.hidden_states(input_ids, positions, slot_mapping, q_seq_lens, block_tables,
                                          token_rows, True, batch_valid_length, self.adapters)
        logits = self.model.logits(ops.gather(hidden, last_index, 0), sequence_rows)
        token_ids, logprobs = self.model.greedy(logits)
        return token_ids, logprobs, logits

    def logits_rows(self, *inputs: Tensor) -> int:
        """The rows of the logits these inputs give (one per ``last_index``), known without running."""
        return int(inputs[6].shape[0])
