"""The fused Ascend ops' real contracts, checked on an exported graph (``mindir.read_graph``): an export proves
only that MindSpore's front end could infer types and shapes, and it accepts graphs that no 910B kernel would run
as meant (swapped caches, heads and kv heads swapped, lengths computed in the graph, int64 tables). Each rule
says where it was read; a violation names the op, the node and the rule.

The rules cover ReshapeAndCache, PagedAttention, FlashAttentionScore and ApplyRotaryPosEmb as MindSpore 2.10 runs
them with ``infer_boost`` on, and WeightQuantBatchMatmul (int8 weights; an ACLNN kernel) (the internal kernels every
working 910B stack uses): inputs, attributes, dtypes, layouts, what feeds each length input, the kernels' size limits,
and which tensors are roped, cached and attended (docs/ascend.md, "What is verified without hardware"). Some rules
depend on which PagedAttention kernel is selected (ATB, the stacks' default, or the custom one): the caller says.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agents.model.backends.ascend_limits import (
    CHUNK_MASK_VALUE,
    FA_MASK_SIZE,
    HEAD_DIM_MULTIPLE,
    MAX_HEAD_DIM,
    PA_BLOCK_SIZES,
    PA_MAX_HEAD_DIM_X_BLOCK,
    WQ_MAX_DIM,
    fa_mask_value,
)
from agents.tools.mindir import GraphNodes, OpNode, Source, TensorInfo, read_graph

# PagedAttention's inputs in MindSpore 2.10's order (ops.auto_generate.PagedAttention; the internal kernel reads
# head_num, scale and kv_head_num at indices 10-12: ops/kernel/ascend/internal/paged_attention.cc, CreateKernel)
PA_QUERY, PA_KEY_CACHE, PA_VALUE_CACHE, PA_BLOCK_TABLES, PA_CONTEXT_LENS = range(5)
PA_ANTIQUANT_SCALE, PA_ANTIQUANT_OFFSET, PA_MASK, PA_Q_LENS = 5, 6, 7, 8
PA_HEAD_NUM, PA_SCALE, PA_KV_HEAD_NUM, PA_KV_QUANT_MODE = 10, 11, 12, 13
PA_ALIBI_MASK, PA_MASK_MODE, PA_MLA_V_DIM = 9, 14, 15
# Which PagedAttention kernel runs: 2.10's PagedAttentionOp runs the custom (internal) kernel unless
# MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST names PagedAttention, else the ATB one. Both working stacks name it
# (MindFormers 1.8 core/context/build_context.py in predict mode; vllm-mindspore "FlashAttentionScore,PagedAttention"),
# so ATB is the default the rules are checked against.
PA_KERNELS = ("atb", "custom")
DEFAULT_PA_KERNEL = "atb"
PA_DEFAULT_QUANT_MODE = 0  # kv_cache_quant_mode "DEFAULT" as the graph holds it (per-channel antiquant scales)
# the graph input the internal PagedAttention takes each sequence's query length from (multi-token queries)
Q_LENGTHS_INPUT = "q_seq_lens"
# ReshapeAndCache(key, value, key_cache, value_cache, slot_mapping)
RC_KEY, RC_VALUE, RC_KEY_CACHE, RC_VALUE_CACHE, RC_SLOTS = range(5)
# the graph input the internal PagedAttention takes each sequence's context length from, by name
KV_LENGTHS_INPUT = "batch_valid_length"
# FlashAttentionScore(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen,
# actual_seq_kvlen, head_num, keep_prob, scale_value, pre_tokens, next_tokens, inner_precise, input_layout,
# sparse_mode): the internal kernel's indices (ops/kernel/ascend/internal/flash_attention_score.cc, CreateKernel)
FA_MASK, FA_Q_LENS, FA_KV_LENS, FA_SPARSE_MODE = 6, 8, 9, 17
FA_QUERY, FA_KEY, FA_VALUE, FA_HEAD_NUM, FA_SCALE = 0, 1, 2, 10, 12
# the graph inputs the internal FlashAttentionScore reads per-sequence lengths from when they are not a tuple
FA_KV_LENGTH_INPUTS, FA_Q_LENGTH_INPUTS = ("batch_valid_length", "actual_seq_kvlen"), ("q_seq_lens", "actual_seq_qlen")
# ApplyRotaryPosEmb(query, key, cos, sin, position_ids, cos_format): the internal kernel reads all five tensors and
# cos_format at index 5 (ops/kernel/ascend/internal/apply_rotary_pos_emb.cc)
ROPE_QUERY, ROPE_KEY, ROPE_COS, ROPE_SIN, ROPE_POSITIONS, ROPE_COS_FORMAT = range(6)
ROTATE_HALF = 2  # cos_format of the rotate-half (Llama, NeoX) layout with full-width cos/sin rows
# WeightQuantBatchMatmul(x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset, bias, transpose_x,
# transpose_weight, antiquant_group_size): the init attributes follow the inputs (ops.auto_generate, 2.10)
WQ_X, WQ_WEIGHT, WQ_SCALE, WQ_OFFSET, WQ_QUANT_SCALE, WQ_QUANT_OFFSET, WQ_BIAS = range(7)
WQ_TRANSPOSE_X, WQ_TRANSPOSE_WEIGHT, WQ_GROUP_SIZE = 7, 8, 9


@dataclass(frozen=True)
class Violation:
    op: str
    node: str
    rule: str
    message: str

    def __str__(self) -> str:
        parts = self.node.split(":")  # "<graph>:CNode_14:10": the node's own name is the middle part
        return f"{self.op} ({parts[-2] if len(parts) > 2 else parts[-1]}): [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Expect:
    """What the exporter knows beyond the graph: the ranks of a tensor-parallel rank's graph (1: no collectives)
    and which PagedAttention kernel the serving environment selects (the rules differ per kernel)."""

    tensor_parallel: int = 1
    paged_attention: str = DEFAULT_PA_KERNEL  # the PagedAttention kernel selected (PA_KERNELS)


Check = Callable[[GraphNodes, OpNode, Expect], Iterator[str]]


@dataclass(frozen=True)
class Rule:
    op: str
    name: str
    source: str  # where the contract was read
    check: Check


def _dims(source: Source) -> tuple[int, ...] | None:
    return source.info.shape if source.info is not None else None


def _dtype(source: Source) -> str | None:
    return source.info.dtype if source.info is not None else None


def _where(source: Source) -> str:
    if source.kind == "node":
        return f"computed by {source.op}"
    return f"{source.kind} {source.name!r}"


_SAME_VALUES = ("Reshape", "Cast", "ExpandDims", "Squeeze", "Contiguous")


def _origin(graph: GraphNodes, source: Source) -> tuple[OpNode | None, int | None]:
    """The op (and its output index, for ops with several) whose values ``source`` carries: reshapes and casts are
    looked through, and a ``Concat``'s first part (rows of padding appended after the real ones)."""
    while True:
        node = graph.producer(source)
        if node is None:
            return None, None
        if node.op in _SAME_VALUES:
            source = node.inputs[0]
        elif node.op == "Concat" and (parts := graph.producer(node.inputs[0])) is not None and parts.op == "MakeTuple":
            source = parts.inputs[0]
        elif node.op == "TupleGetItem":
            return graph.producer(node.inputs[0]), node.inputs[1].value
        else:
            return node, None


def _roped(graph: GraphNodes, source: Source, output: int) -> bool:
    """Whether ``source`` is output ``output`` (0: query, 1: key) of an ApplyRotaryPosEmb."""
    node, index = _origin(graph, source)
    return node is not None and node.op == "ApplyRotaryPosEmb" and index == output


def _from_rope(graph: GraphNodes, source: Source) -> bool:
    node, _ = _origin(graph, source)
    return node is not None and node.op == "ApplyRotaryPosEmb"


def _head_dim(graph: GraphNodes) -> int | None:
    """head_dim as the paged caches hold it (their last dimension), or None in a graph without them."""
    for node in graph.of("ReshapeAndCache") + graph.of("PagedAttention"):
        cache = _dims(node.inputs[RC_KEY_CACHE if node.op == "ReshapeAndCache" else PA_KEY_CACHE])
        if cache and len(cache) == 4:
            return cache[3]
    return None


_CLAMPS = ("ClampScalar", "ClipByValue", "Minimum", "Maximum")


def _quantized_from(graph: GraphNodes, source: Source) -> Source | None:
    """The float tensor an int8 ``source`` quantizes, where it is ``Cast(clamp(Round(x * inverse scale)), int8)``
    (``AscendAttention.quantized``), else None."""
    node = graph.producer(source)
    while node is not None and node.op == "Reshape":
        node = graph.producer(node.inputs[0])
    if node is None or node.op != "Cast":
        return None
    node = graph.producer(node.inputs[0])
    while node is not None and node.op in _CLAMPS:
        node = graph.producer(node.inputs[0])
    if node is None or node.op != "Round" or (scaled := graph.producer(node.inputs[0])) is None or scaled.op != "Mul":
        return None
    return scaled.inputs[0]


def _roped_inputs(graph: GraphNodes, node: OpNode, query: int, key: int, value: int) -> Iterator[str]:
    """The query and key roped by an ApplyRotaryPosEmb, its outputs 0 and 1; the value never roped."""
    if not _roped(graph, node.inputs[query], 0):
        yield f"the query must be output 0 of ApplyRotaryPosEmb (the roped query), got {_where(node.inputs[query])}"
    if not _roped(graph, node.inputs[key], 1):
        yield f"the key must be output 1 of ApplyRotaryPosEmb (the roped key), got {_where(node.inputs[key])}"
    if _from_rope(graph, node.inputs[value]):
        yield "the value must not be roped, but it comes from ApplyRotaryPosEmb"


# ---- PagedAttention ---------------------------------------------------------------------------------------------
def _pa_lengths_from_graph_input(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    lens = node.inputs[PA_CONTEXT_LENS]
    if not (lens.kind == "input" and lens.name == KV_LENGTHS_INPUT):
        yield (f"context_lens must be the graph input {KV_LENGTHS_INPUT!r} (the internal kernel reads the lengths "
               f"from that input's host values, not from the tensor passed), got {_where(lens)}")


def _pa_queries(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    """Multi-token queries: ``q_seq_lens`` from its graph input and a mask row per query token; one token per
    sequence: no mask."""
    q_lens, mask = node.inputs[PA_Q_LENS], node.inputs[PA_MASK]
    query = _dims(node.inputs[PA_QUERY])
    if q_lens.kind == "constant" and q_lens.value is None:
        if not (mask.kind == "constant" and mask.value is None):
            yield "a decode step (no q_seq_lens) passes no mask"
        return
    if not (q_lens.kind == "input" and q_lens.name == Q_LENGTHS_INPUT):
        yield (f"q_seq_lens must be the graph input {Q_LENGTHS_INPUT!r} (the internal kernel reads it by name), got "
               f"{_where(q_lens)}")
    elif _dtype(q_lens) not in (None, "int32"):
        yield f"q_seq_lens must be int32, got {_dtype(q_lens)}"
    info = mask.value if isinstance(mask.value, TensorInfo) else mask.info
    dims, dtype = (info.shape, info.dtype) if info is not None else (None, None)
    if dims == (1, 1):
        return  # vllm-mindspore's "hard mask" for steps of one-token queries: no mask
    if mask.kind == "constant" and mask.value is None:
        yield "multi-token queries (q_seq_lens) need a mask row per query token, got none"
    elif dims is None or len(dims) != 2 or dtype != _dtype(node.inputs[PA_QUERY]):
        yield f"the mask must be 2-D (query tokens, positions) in the compute dtype, got {info or _where(mask)}"
    elif query and dims[0] != query[0]:
        yield f"the mask has {dims[0]} rows for {query[0]} query tokens"


def _chunk_mask(node: OpNode) -> Source | None:
    """The mask of a multi-token step (None: a decode step, no mask, or vllm-mindspore's (1, 1) hard mask)."""
    q_lens, mask = node.inputs[PA_Q_LENS], node.inputs[PA_MASK]
    info = mask.value if isinstance(mask.value, TensorInfo) else mask.info
    if (q_lens.kind == "constant" and q_lens.value is None) or info is None or len(info.shape) != 2:
        return None
    return None if info.shape == (1, 1) else mask


def _pa_mask_width(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    mask = _chunk_mask(node)
    cache, tables = _dims(node.inputs[PA_KEY_CACHE]), _dims(node.inputs[PA_BLOCK_TABLES])
    info = mask.value if mask is not None and isinstance(mask.value, TensorInfo) else mask.info if mask else None
    if info is None or not cache or not tables or len(cache) != 4 or len(tables) != 2:
        return
    width, reach = info.shape[1], tables[1] * cache[1]
    if width < reach:
        yield f"the mask's {width} positions do not reach the {reach} a block table covers"
    elif width > reach and expect.paged_attention == "custom":
        yield (f"the mask's {width} positions are wider than the {reach} a block table reaches (the custom kernel "
               "refuses a mask wider than the key cache's max kv_seq_len)")


def _through(graph: GraphNodes, source: Source) -> tuple[Source, OpNode | None]:
    """``source`` looked through value-keeping ops (and a Concat's first part), with the op producing it."""
    while True:
        node = graph.producer(source)
        if node is not None and node.op in _SAME_VALUES:
            source = node.inputs[0]
        elif (node is not None and node.op == "Concat" and (parts := graph.producer(node.inputs[0])) is not None
              and parts.op == "MakeTuple"):
            source = parts.inputs[0]
        else:
            return source, node


POSITIONS_INPUT = "positions"  # the step's graph input holding each query token's position (agents/model/llama.py)
_MASKED_LATER = {"Greater": (0, 1), "Less": (1, 0)}  # (index of the kv positions row, of the query positions column)


def _mask_rows_ok(rows: np.ndarray) -> str | None:
    """None if each row is 0 up to some position and -10000 after it, the query's own position unmasked."""
    values = sorted({float(v) for v in np.unique(rows)} - {0.0, CHUNK_MASK_VALUE})
    if values:
        return f"values other than 0 and {CHUNK_MASK_VALUE:g}: {', '.join(f'{v:g}' for v in values[:3])}"
    masked = rows == CHUNK_MASK_VALUE
    if (masked[:, :-1] & ~masked[:, 1:]).any():
        return "a row masks an earlier position and not a later one (direction flipped)"
    if masked[:, 0].any():
        return "a row masks position 0 (every query sees at least the first position)"
    return None


def _pa_mask_values(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    """The mask's producer traced: a constant (its rows checked), or ``Cast(later) * -10000`` with ``later`` the
    comparison ``kv_position > query_position`` of a ``0..W-1`` row against a column of query positions."""
    mask = _chunk_mask(node)
    if mask is None:
        return
    if mask.array is not None:
        if (why := _mask_rows_ok(np.asarray(mask.array, np.float64))) is not None:
            yield f"the constant mask holds {why}"
        return
    source, scaled = _through(graph, mask)
    if scaled is None or scaled.op not in ("Muls", "Mul") or len(scaled.inputs) < 2:
        yield f"the mask's producer is not traceable to 0/{CHUNK_MASK_VALUE:g} rows: {_where(source)}"
        return
    factor, flags = scaled.inputs[1], scaled.inputs[0]
    if factor.kind != "constant" or factor.value is None:
        factor, flags = scaled.inputs[0], scaled.inputs[1]
    value = factor.value if factor.array is None else float(np.asarray(factor.array).reshape(-1)[0])
    if not isinstance(value, (int, float)) or value != CHUNK_MASK_VALUE:
        yield f"the mask's masked positions hold {value}, not {CHUNK_MASK_VALUE:g} (0/{CHUNK_MASK_VALUE:g} rows)"
    _, compare = _through(graph, flags)
    if compare is None or compare.op not in _MASKED_LATER:
        yield (f"the mask must mask the positions after each query's own (kv_position > query_position), got "
               f"{compare.op if compare is not None else _where(flags)}")
        return
    row_at, col_at = _MASKED_LATER[compare.op]
    row, col = _through(graph, compare.inputs[row_at])[0], compare.inputs[col_at]
    row_dims, col_dims = _dims(row) or getattr(row.value, "shape", None), _dims(col)
    if not (row_dims and len(row_dims) == 2 and row_dims[0] == 1 and col_dims and col_dims[-1] == 1):
        yield (f"the mask's direction is flipped: {compare.op} must compare the kv positions row (1, W) against the "
               f"query positions column (T, 1), got {row_dims} against {col_dims}")
    elif row.array is not None and not np.array_equal(np.asarray(row.array).reshape(-1), np.arange(row_dims[1])):
        yield f"the mask's kv positions row must be 0..{row_dims[1] - 1}, got {np.asarray(row.array).reshape(-1)[:4]}"
    elif (at := _through(graph, col)[0]).kind != "input" or at.name != POSITIONS_INPUT:
        yield f"the mask's query positions must be the graph input {POSITIONS_INPUT!r}, got {_where(at)}"


def _pa_plain_attention(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    alibi, mode = node.inputs[PA_ALIBI_MASK], node.inputs[PA_MASK_MODE].value if len(node.inputs) > PA_MASK_MODE else 0
    mla = node.inputs[PA_MLA_V_DIM].value if len(node.inputs) > PA_MLA_V_DIM else 0
    if not (alibi.kind == "constant" and alibi.value is None):
        yield f"Llama attention passes no alibi_mask, got {_where(alibi)}"
    if mode not in (0, None):
        yield f"mask_mode must be MASK_DEFAULT (0): TRAPEZOIDAL ({mode}) ignores the mask passed"
    if mla not in (0, None):
        yield f"mla_v_dim must be 0 (not MLA: its head_dim limits and value layout differ), got {mla}"


def _pa_int32(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    for index, what in ((PA_BLOCK_TABLES, "block_tables"), (PA_CONTEXT_LENS, "context_lens")):
        dtype = _dtype(node.inputs[index])
        if dtype is not None and dtype != "int32":
            yield f"{what} must be int32, got {dtype}"


def _pa_heads(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    heads, kv_heads = node.inputs[PA_HEAD_NUM].value, node.inputs[PA_KV_HEAD_NUM].value
    query, cache = _dims(node.inputs[PA_QUERY]), _dims(node.inputs[PA_KEY_CACHE])
    if cache is None or len(cache) != 4:
        yield f"the caches must be 4-D (num_blocks, block_size, kv_heads, head_dim), got shape {cache}"
        return
    head_dim = cache[3]
    if cache[2] != kv_heads:
        yield f"kv_head_num {kv_heads} differs from the caches' {cache[2]} kv heads (dim 2 of BSND blocks)"
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads and heads % kv_heads:
        yield f"head_num {heads} is not a multiple of kv_head_num {kv_heads}"
    if query and len(query) == 2 and expect.paged_attention == "atb":
        if query[1] != heads * head_dim:
            yield f"query {query} is not (tokens, head_num {heads} x head_dim {head_dim})"
    elif query is None or len(query) != 3:
        yield f"query must be 3-D, (tokens, head_num, head_dim) or (batch, 1, head_num * head_dim), got {query}"
    elif query[1:] not in ((heads, head_dim), (1, heads * head_dim)):
        yield (f"query {query} is neither (tokens, head_num {heads}, head_dim {head_dim}) nor (batch, 1, "
               f"{heads * head_dim}) for head_num {heads}")


def _pa_scale(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    cache, scale = _dims(node.inputs[PA_KEY_CACHE]), node.inputs[PA_SCALE].value
    if cache and len(cache) == 4 and isinstance(scale, float) and not math.isclose(scale, cache[3] ** -0.5,
                                                                                     rel_tol=1e-6):
        yield f"scale_value {scale:g} is not 1/sqrt(head_dim {cache[3]}) = {cache[3] ** -0.5:g}"


def _pa_limits(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    cache = _dims(node.inputs[PA_KEY_CACHE])
    if not cache or len(cache) != 4:
        return
    block_size, head_dim = cache[1], cache[3]
    if block_size not in PA_BLOCK_SIZES:
        yield f"block_size {block_size} (dim 1 of the caches) is not one of {', '.join(map(str, PA_BLOCK_SIZES))}"
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        yield f"head_dim {head_dim} must be a multiple of {HEAD_DIM_MULTIPLE} and at most {MAX_HEAD_DIM}"
    elif head_dim * block_size > PA_MAX_HEAD_DIM_X_BLOCK:
        yield f"head_dim {head_dim} x block_size {block_size} exceeds {PA_MAX_HEAD_DIM_X_BLOCK}"


def _pa_roped_query(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    if not _roped(graph, node.inputs[PA_QUERY], 0):
        yield (f"the query must be output 0 of ApplyRotaryPosEmb (the roped query), got "
               f"{_where(node.inputs[PA_QUERY])}")


def _pa_int8_cache(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    """int8 caches: both int8, with antiquant_scale and antiquant_offset (2, kv_heads * head_dim) in float16 and
    kv_cache_quant_mode DEFAULT; caches in the compute dtype: no antiquant inputs."""
    key, value = node.inputs[PA_KEY_CACHE], node.inputs[PA_VALUE_CACHE]
    scale, offset = node.inputs[PA_ANTIQUANT_SCALE], node.inputs[PA_ANTIQUANT_OFFSET]
    int8 = [_dtype(c) == "int8" for c in (key, value)]
    if not any(int8):
        if not (_none(scale) and _none(offset)):
            yield "antiquant_scale and antiquant_offset are for int8 caches; these caches are not int8"
        return
    if not all(int8):
        yield f"key_cache and value_cache must both be int8, got {_dtype(key)} and {_dtype(value)}"
    cache = _dims(key)
    rows = (2, cache[2] * cache[3]) if cache and len(cache) == 4 else None
    for source, what in ((scale, "antiquant_scale"), (offset, "antiquant_offset")):
        if _none(source):
            yield f"int8 caches are read through antiquant_scale and antiquant_offset, but {what} is not passed"
        elif _dims(source) != rows or _dtype(source) != "float16":
            yield (f"{what} must be {rows} (keys' row, values' row, a value per cached channel) in float16, got "
                   f"{_dims(source)} {_dtype(source)}")
    mode = node.inputs[PA_KV_QUANT_MODE].value
    if mode not in (PA_DEFAULT_QUANT_MODE, "DEFAULT"):
        yield f"kv_cache_quant_mode must be DEFAULT (a scale per channel), got {mode!r}"


def _written_caches(graph: GraphNodes) -> list[tuple[str, str]]:
    return [(w.inputs[RC_KEY_CACHE].name, w.inputs[RC_VALUE_CACHE].name) for w in graph.of("ReshapeAndCache")]


def _pa_reads_what_was_written(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    key, value = node.inputs[PA_KEY_CACHE], node.inputs[PA_VALUE_CACHE]
    if key.kind != "parameter" or value.kind != "parameter":
        yield f"the caches must be Parameters written in place, got {_where(key)} and {_where(value)}"
        return
    written = _written_caches(graph)
    if (key.name, value.name) in written:
        return
    if (value.name, key.name) in written:
        yield f"key_cache and value_cache are swapped against the ReshapeAndCache that writes {key.name!r}"
    else:
        yield f"no ReshapeAndCache writes the caches {key.name!r}, {value.name!r} in this graph"


# ---- FlashAttentionScore ----------------------------------------------------------------------------------------
def _per_sequence_lengths(graph: GraphNodes, source: Source, names: tuple[str, ...]) -> str | None:
    """None if ``source`` is a constant tuple or one of the named graph inputs (through the ``TensorToTuple`` that
    MindSpore inserts for a tensor passed as a tuple, and a ``Cast``, which keeps the values), else what it is."""
    if source.kind == "constant" and isinstance(source.value, tuple):
        return None
    producer = graph.producer(source)
    while producer is not None and producer.op in ("TensorToTuple", "Cast") and producer.inputs:
        source = producer.inputs[0]
        producer = graph.producer(source)
    if source.kind == "input" and source.name in names:
        return None
    return _where(source)


def _fa_lengths(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    for index, what, names in ((FA_Q_LENS, "actual_seq_qlen", FA_Q_LENGTH_INPUTS + FA_KV_LENGTH_INPUTS),
                               (FA_KV_LENS, "actual_seq_kvlen", FA_KV_LENGTH_INPUTS)):
        got = _per_sequence_lengths(graph, node.inputs[index], names)
        if got is not None:
            yield (f"{what} must be each sequence's length, the graph input {' or '.join(map(repr, names))} (the "
                   f"internal kernel reads per-sequence lengths), got {got}")


def _fa_mask_and_sparse_mode(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    sparse_mode, mask, query = node.inputs[FA_SPARSE_MODE].value, node.inputs[FA_MASK], _dtype(node.inputs[0])
    if sparse_mode != 0:
        yield f"sparse_mode must be 0 on the internal kernel's variable-length path, got {sparse_mode}"
    info = mask.value if mask.kind == "constant" else mask.info
    shape = getattr(info, "shape", None)
    if shape != (FA_MASK_SIZE, FA_MASK_SIZE) or getattr(info, "dtype", None) != query:
        yield (f"the causal mask must be {FA_MASK_SIZE} x {FA_MASK_SIZE} in the compute dtype ({query}), got "
               f"{info if info is not None else _where(mask)}")
    elif mask.array is not None and query is not None:
        value = fa_mask_value(query)
        want = np.triu(np.ones((FA_MASK_SIZE, FA_MASK_SIZE)), 1) * value
        if not np.array_equal(mask.array.astype(np.float64), want):
            above = sorted({float(v) for v in mask.array[np.triu_indices(FA_MASK_SIZE, 1)]})[:3]
            yield (f"the causal mask must hold 0 on and below the diagonal and {value:g} above it in {query}, got "
                   f"{', '.join(f'{v:g}' for v in above)} above it")


def _fa_heads_and_scale(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    head_dim, heads = _head_dim(graph), node.inputs[FA_HEAD_NUM].value
    query, key = _dims(node.inputs[FA_QUERY]), _dims(node.inputs[FA_KEY])
    if query is None or len(query) != 2:
        yield f"the query must be 2-D (tokens, head_num * head_dim) in layout TH, got {query}"
        return
    if head_dim is None or not isinstance(heads, int):
        return
    if query[1] != heads * head_dim:
        yield f"head_num {heads} x head_dim {head_dim} (the caches') is not the query's width {query[1]}"
    if key and (key[-1] % head_dim or heads % max(key[-1] // head_dim, 1)):
        yield f"the key's width {key[-1]} is not a number of kv heads of {head_dim} dividing head_num {heads}"
    scale = node.inputs[FA_SCALE].value
    if isinstance(scale, float) and not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
        yield f"scale_value {scale:g} is not 1/sqrt(head_dim {head_dim}) = {head_dim ** -0.5:g}"


def _fa_roped(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    yield from _roped_inputs(graph, node, FA_QUERY, FA_KEY, FA_VALUE)


# ---- ApplyRotaryPosEmb ------------------------------------------------------------------------------------------
def _rope_format(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    cos_format = node.inputs[ROPE_COS_FORMAT].value
    if cos_format != ROTATE_HALF:
        yield (f"cos_format must be {ROTATE_HALF} (rotate-half with full-width cos/sin rows, Llama's layout), "
               f"got {cos_format}")


def _rope_tables(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    query, key = _dims(node.inputs[ROPE_QUERY]), _dims(node.inputs[ROPE_KEY])
    cos, sin = _dims(node.inputs[ROPE_COS]), _dims(node.inputs[ROPE_SIN])
    if node.inputs[ROPE_COS].kind == "constant" and isinstance(node.inputs[ROPE_COS].value, TensorInfo):
        cos = node.inputs[ROPE_COS].value.shape  # the whole table, folded into the graph
        sin = getattr(node.inputs[ROPE_SIN].value, "shape", sin)
    head_dim, positions = _head_dim(graph), node.inputs[ROPE_POSITIONS]
    if cos is None or len(cos) != 2 or cos != sin:
        yield f"cos and sin must be 2-D and alike, (rows, head_dim), got {cos} and {sin}"
        return
    if head_dim is not None and cos[1] != head_dim:
        yield f"cos/sin rows of {cos[1]} values are not head_dim {head_dim} wide (the caches')"
    if not (positions.kind == "input" and positions.name == KV_LENGTHS_INPUT):
        yield (f"position_ids must be the graph input {KV_LENGTHS_INPUT!r}, as MindFormers 1.8 and vllm-mindspore "
               f"pass it, got {_where(positions)}")
    if query and key:
        tokens = math.prod(query[:-1])
        if math.prod(key[:-1]) != tokens:
            yield f"query {query} and key {key} differ in tokens"
        if head_dim is not None and (query[-1] % head_dim or key[-1] % head_dim):
            yield f"query {query} and key {key} are not whole heads of head_dim {head_dim}"
        whole_table = node.inputs[ROPE_COS].kind == "constant"
        if cos[0] != tokens and not whole_table:
            yield (f"cos/sin have {cos[0]} rows for {tokens} tokens: one row per token, or the whole table as a "
                   "constant")


# ---- WeightQuantBatchMatmul (w8a16) ------------------------------------------------------------------------------
def _none(source: Source) -> bool:
    return source.kind == "constant" and source.value is None


def _wq_weight(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    x, weight = node.inputs[WQ_X], node.inputs[WQ_WEIGHT]
    if node.inputs[WQ_TRANSPOSE_X].value is not False or node.inputs[WQ_TRANSPOSE_WEIGHT].value is not True:
        yield (f"transpose_x must be False and transpose_weight True (the int8 weight held [out, in]), got "
               f"{node.inputs[WQ_TRANSPOSE_X].value} and {node.inputs[WQ_TRANSPOSE_WEIGHT].value}")
    if weight.kind != "parameter" or _dtype(weight) != "int8":
        yield f"the weight must be an int8 Parameter (quantized at load), got {_where(weight)} {_dtype(weight)}"
    dims, rows = _dims(weight), _dims(x)
    if dims is None or len(dims) != 2:
        yield f"the weight must be 2-D (out, in), got shape {dims}"
    elif rows and rows[-1] != dims[1]:
        yield f"x's {rows[-1]} inputs are not the weight's {dims[1]} (dim 1 of (out, in))"


def _wq_scale(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    scale, weight, x = node.inputs[WQ_SCALE], _dims(node.inputs[WQ_WEIGHT]), node.inputs[WQ_X]
    group = node.inputs[WQ_GROUP_SIZE].value
    if group != 0:
        yield f"antiquant_group_size must be 0 (a scale per output channel), got {group}"
    if scale.kind != "parameter":
        yield f"antiquant_scale must be a Parameter (the scales loaded with the weight), got {_where(scale)}"
    if _dtype(scale) != _dtype(x):
        yield f"antiquant_scale must be in x's dtype {_dtype(x)}, got {_dtype(scale)}"
    out = weight[0] if weight and len(weight) == 2 else None
    if out is not None and _dims(scale) not in ((out,), (1, out)):
        yield f"antiquant_scale must be (n,) or (1, n) for the weight's n = {out} output channels, got {_dims(scale)}"


def _wq_plain(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    for index, what, why in ((WQ_OFFSET, "antiquant_offset", "symmetric weights have none"),
                             (WQ_QUANT_SCALE, "quant_scale", "it makes the output int8"),
                             (WQ_QUANT_OFFSET, "quant_offset", "it makes the output int8"),
                             (WQ_BIAS, "bias", ("on A2 a bfloat16 x needs a float32 bias, which MindSpore's "
                                                "inference refuses: the stacks add biases after it"))):
        if not _none(node.inputs[index]):
            yield f"{what} must be None ({why}), got {_where(node.inputs[index])}"


def _wq_limits(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    x, weight = _dims(node.inputs[WQ_X]), _dims(node.inputs[WQ_WEIGHT])
    if x is None or len(x) != 2:
        yield f"x must be 2-D (tokens, in), got shape {x}"
    if _dtype(node.inputs[WQ_X]) not in ("float16", "bfloat16"):
        yield f"x must be float16 or bfloat16, got {_dtype(node.inputs[WQ_X])}"
    if weight and len(weight) == 2 and max(weight) > WQ_MAX_DIM:
        yield f"the weight's (n, k) = {weight} exceeds {WQ_MAX_DIM} (n and k of the ACLNN kernel)"


# ---- collectives (tensor parallelism) ---------------------------------------------------------------------------
WORLD_GROUP = "hccl_world_group"  # the group MindSpore's init() creates over every rank on Ascend (HCCL)


def _collective_group(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    if expect.tensor_parallel == 1:
        yield f"a graph of one device holds no {node.op} (tensor_parallel_size 1)"
        return
    group = node.attrs.get("group")
    if group != WORLD_GROUP:
        yield f"group must be {WORLD_GROUP!r}, the world group of the tensor-parallel ranks on Ascend, got {group!r}"
    if node.op == "AllReduce" and node.attrs.get("op") != "sum":
        yield f"a row-parallel projection's partial sums are added: op must be 'sum', got {node.attrs.get('op')!r}"
    if node.op == "AllGather" and node.attrs.get("rank_size") != expect.tensor_parallel:
        yield (f"rank_size {node.attrs.get('rank_size')} is not the {expect.tensor_parallel} ranks (the gathered "
               "rows would be cut short)")


def _rc_slots(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    slots, key, cache = _dims(node.inputs[RC_SLOTS]), _dims(node.inputs[RC_KEY]), _dims(node.inputs[RC_KEY_CACHE])
    if _dtype(node.inputs[RC_SLOTS]) not in (None, "int32"):
        yield f"slot_mapping must be int32, got {_dtype(node.inputs[RC_SLOTS])}"
    if slots is not None and len(slots) != 1:
        yield f"slot_mapping must be 1-D (one slot per token), got shape {slots}"
    elif slots and key and cache and len(cache) == 4 and math.prod(key) != slots[0] * cache[2] * cache[3]:
        yield (f"slot_mapping's {slots[0]} slots are not one per token of the key {key} "
               f"({math.prod(key) // max(cache[2] * cache[3], 1)} tokens of {cache[2]} x {cache[3]})")


def _rc_roped(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    key, value = node.inputs[RC_KEY], node.inputs[RC_VALUE]
    key = _quantized_from(graph, key) or key  # an int8 cache's: what was quantized (_rc_int8)
    value = _quantized_from(graph, value) or value
    if not _roped(graph, key, 1):
        yield f"the key must be output 1 of ApplyRotaryPosEmb (the roped key), got {_where(key)}"
    if _from_rope(graph, value):
        yield "the value must not be roped, but it comes from ApplyRotaryPosEmb"


def _rc_int8(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    """The op only copies: key and value in their caches' dtype; into int8 caches, rounded then cast."""
    for index, cache, what in ((RC_KEY, RC_KEY_CACHE, "key"), (RC_VALUE, RC_VALUE_CACHE, "value")):
        source, held = node.inputs[index], _dtype(node.inputs[cache])
        if _dtype(source) not in (None, held):
            yield (f"the {what} is {_dtype(source)} but its cache holds {held}: "
                   "ReshapeAndCache copies, it does not convert")
        elif held == "int8" and _quantized_from(graph, source) is None:
            yield (f"the int8 {what} must be round(x * inverse scale), clamped, then cast (a Cast alone truncates), "
                   f"got {_where(source)}")


def _rc_layout(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    key, cache = _dims(node.inputs[RC_KEY]), _dims(node.inputs[RC_KEY_CACHE])
    if cache is None or len(cache) != 4:
        yield f"the caches must be 4-D (num_blocks, block_size, kv_heads, head_dim), got shape {cache}"
    elif key and key[-1] not in (cache[3], cache[2] * cache[3]):
        yield (f"the key's last dimension {key[-1]} is neither head_dim {cache[3]} nor a token's row "
               f"{cache[2]} x {cache[3]} of the cache")
    if _dims(node.inputs[RC_KEY_CACHE]) != _dims(node.inputs[RC_VALUE_CACHE]):
        yield "key_cache and value_cache differ in shape"


_INTERNAL_LIB = "MindSpore 2.10 lib/plugin/ascend/ms_kernels_internal/internal_kernel/lib/libms_kernels_internal.so"
_ROPE_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/apply_rotary_pos_emb.cc"
_STACKS_ROPE = ("MindFormers 1.8 modules/infer_rotary_embedding (exported graphs in tests_mindformers) and "
                "vllm-mindspore model_executor/layers/rotary_embedding.py (InferRotaryEmbedding, MRotaryEmbedding)")
_PA_DOC = "mindspore.ops.auto_generate.PagedAttention (2.10 docstring)"
_PA_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/paged_attention.cc"
_RC_DOC = "mindspore.ops.auto_generate.reshape_and_cache (2.10 docstring)"
_FA_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/flash_attention_score.cc"
_MF_ATTENTION = "MindFormers 1.8 modules/infer_attention.py, whose exported prefill graphs pass it (tests_mindformers)"
_WQ_DOC = ("CANN aclnnWeightQuantBatchMatmulV2 (hicann ops-nn matmul/weight_quant_batch_matmul_v2/docs), the kernel "
           "MindSpore 2.10 runs it with (ops/kernel/ascend/aclnn/kernel_mod_impl/customize/"
           "weight_quant_batch_matmul_aclnn_kernel.h; no internal kernel)")
_WQ_STACKS = ("Golden Stick ptq/ptq/hal.py WeightQuantMatmul: WeightQuantBatchMatmul(False, linear.transpose_b, "
              "group_size) on the int8 weight [out, in]; MindFormers r1.7 quantization/golden_stick: "
              "WeightQuantBatchMatmul(False, True, group_size), offset None")
RULES = (
    Rule("PagedAttention", "lengths-from-graph-input",
         f"{_PA_KERNEL}: CreateKernel/UpdateParam take kv_seq_len from GetSeqLenFromGraphAndCheckUpadate("
         f"{{\"{KV_LENGTHS_INPUT}\"}}), i.e. LLMManager's copy of the graph input of that name",
         _pa_lengths_from_graph_input),
    Rule("PagedAttention", "multi-token-queries",
         f"{_PA_KERNEL} (q_seq_len from GetSeqLenFromGraphAndCheckUpadate({{\"{Q_LENGTHS_INPUT}\"}})); vllm-mindspore "
         "attention/layer.py and models/attention_mask.py: chunks and prefix-cache hits pass q_seq_lens with a mask "
         "row per query token in the compute dtype (decode_mask rows gathered by position; ATB: \"mask data type "
         "not consitent with q\" in libatb_mixops_ms.so), decode no mask",
         _pa_queries),
    Rule("PagedAttention", "chunk-mask-width",
         f"both kernels read row i's scores against mask[i, :context_len], so a row spans every position the table "
         f"reaches (table width x block_size); custom only: {_INTERNAL_LIB} refuses a wider mask (\"max kv_seq_len of "
         "key cache is smaller than mask's kv length\"): width <= reach, not >=", _pa_mask_width),
    Rule("PagedAttention", "chunk-mask-values-and-direction",
         "the mask's producer traced (constant rows, or Cast(kv_position > query_position) * -10000): vllm-mindspore "
         "models/attention_mask.py (\"normal + Q_seqlen > 1: BF16 mask(0/-10000), FP16 mask(0/-10000)\"), 0 up to "
         "each query's own position, -10000 after it (both kernels add it to the scores)", _pa_mask_values),
    Rule("PagedAttention", "plain-attention-mode",
         "MindSpore 2.10 internal_kernel/include/op_param.h:214-218 (MaskType kMaskTypeAlibi, MaskMode "
         f"kTrapezoidalMask) and {_PA_DOC} (\"No need to pass a real mask tensor if TRAPEZOIDAL is set\"; "
         "mla_v_dim for MLA): Llama passes no alibi_mask, MASK_DEFAULT, mla_v_dim 0", _pa_plain_attention),
    Rule("PagedAttention", "int32-tables-and-lengths",
         f"{_PA_DOC}: block_tables and context_lens int32; internal_kernel_utils.cc reads the lengths as int32_t",
         _pa_int32),
    Rule("PagedAttention", "head-counts-and-layout",
         f"{_PA_DOC}: query (num_tokens, num_head, head_dim), caches (num_blocks, block_size, num_head, "
         f"head_dim); MindFormers 1.8's decode passes the query as (batch, 1, num_head * head_dim); {_PA_KERNEL}: "
         "head_num and kv_head_num read from inputs 10 and 12; a 2-D query (tokens, num_head * head_dim) only on "
         "the ATB kernel: MindSpore 2.10 lib/plugin/ascend/ms_kernels_internal/asdops/lib/libatb_mixops_ms.so, its "
         "strings beside \"check pageattention param fail\": \"Input0 dim num ... invalid, should be 2 or 3\", "
         "\"param kvHead must equal key_cache dim2\", \"... key_cache ... must be [numBlocks, blockSize, numHeads, "
         "headSize]\"; the custom kernel's docstring layout is 3-D", _pa_heads),
    Rule("PagedAttention", "scale", "the Llama attention: scores scaled by 1/sqrt(head_dim)", _pa_scale),
    Rule("PagedAttention", "kernel-limits",
         f"{_INTERNAL_LIB}, its error strings: \"table block size can only in {{16,32,64,128}}\", \"head_dim * "
         "table_block_size > 16384 is not supported\", \"PA: 'head_dim' must be an integer multiple of 16\", "
         "\"... less than or equal to 256 when is not MLA mode\"", _pa_limits),
    Rule("PagedAttention", "roped-query",
         "the Llama attention: queries are roped before attending (MindFormers 1.8 and vllm-mindspore pass "
         "ApplyRotaryPosEmb's output 0)", _pa_roped_query),
    Rule("PagedAttention", "int8-cache-antiquant",
         "MindSpore 2.10 ops_func_impl/paged_attention.cc InferType: int8 key/value caches only with infer_boost, "
         "antiquant scale/offset pairs (float16, float16), (int64, int32) or (float32, int32); "
         f"{_PA_DOC}: (2, num_head * head_dim) for kv_cache_quant_mode DEFAULT; vllm-mindspore "
         "quantization/kv_cache.py KVCacheInt8Method and Golden Stick's paged-attention deploy cell: kv_scale and "
         "kv_offset Parameters (2, kv_heads * head_dim) float16, row 0 keys, row 1 values", _pa_int8_cache),
    Rule("PagedAttention", "reads-the-written-caches",
         "the paged cache: PagedAttention must read, as key and value, the Parameters ReshapeAndCache wrote",
         _pa_reads_what_was_written),
    Rule("FlashAttentionScore", "per-sequence-lengths",
         f"{_FA_KERNEL}: UpdateSeqLen takes q_seq_len/kv_seq_len from inputs 8 and 9 as tuples (else from the graph "
         f"inputs batch_valid_length/actual_seq_kvlen, q_seq_lens/actual_seq_qlen): one length per sequence; "
         f"{_MF_ATTENTION}: batch_valid_length", _fa_lengths),
    Rule("FlashAttentionScore", "mask-and-sparse-mode",
         f"{_FA_KERNEL} (sparse_mode, mask dtype and dims handed to the kernel); {_MF_ATTENTION}: sparse_mode 0 "
         "with a 128 x 128 causal mask in the compute dtype; its values, 0/1 in bfloat16 and 0/-10000 in "
         "float16: vllm-mindspore model_executor/models/attention_mask.py (\"FA: normal: mask BF16(0/1), FP16 "
         "mask(0/-10000)\") and MindFormers 1.8 LowerTriangularMaskWithDynamic", _fa_mask_and_sparse_mode),
    Rule("FlashAttentionScore", "heads-scale-and-head-dim",
         f"{_FA_KERNEL}: head_num and scale_value read from inputs 10 and 12; layout TH: query (T, head_num * "
         "head_dim) (no head_dim limit here: the custom kernel's \"lower triangle mode can only support head_dim = "
         "(64, 128, 256)\" is for its BSH/BNSD layouts, not the TH this graph passes)",
         _fa_heads_and_scale),
    Rule("FlashAttentionScore", "roped-query-and-key",
         "the Llama attention: query and key roped (ApplyRotaryPosEmb's outputs 0 and 1), the value not",
         _fa_roped),
    Rule("ApplyRotaryPosEmb", "cos-format",
         f"{_ROPE_KERNEL}: cos_format read from input 5; {_STACKS_ROPE}: ApplyRotaryPosEmb(2) for Llama's "
         "rotate-half layout with cos/sin rows of head_dim values (the halves repeated)", _rope_format),
    Rule("ApplyRotaryPosEmb", "tables-and-positions",
         f"{_ROPE_KERNEL}: query, key, cos, sin, position_ids passed to the kernel as inputs 0-4; {_STACKS_ROPE}: "
         "cos/sin (rows, head_dim), one row per token gathered at its position or the whole table with "
         "batch_valid_length as position_ids (prefill in both), query and key (..., heads * head_dim)", _rope_tables),
    Rule("ReshapeAndCache", "caches-the-roped-key",
         "the paged cache holds keys after the rotary embedding (PagedAttention does not rope them again) and "
         "values without it: MindFormers 1.8's graphs write ApplyRotaryPosEmb's output 1 and the raw value",
         _rc_roped),
    Rule("WeightQuantBatchMatmul", "int8-weight-out-by-in",
         f"{_WQ_STACKS}; MindSpore 2.10 ops_func_impl/weight_quant_batch_matmul.cc: transpose_weight reads the weight "
         "as (n, k), x's last dim must be its k", _wq_weight),
    Rule("WeightQuantBatchMatmul", "per-channel-scale",
         f"{_WQ_DOC}: per-channel antiquantScale (n,) or (1, n) with antiquantGroupSize 0, in x's dtype "
         "(weight_quant_batch_matmul.cc checks only the dtype)", _wq_scale),
    Rule("WeightQuantBatchMatmul", "no-offset-bias-or-output-quantization",
         f"{_WQ_DOC}: y = x @ ((w + offset) * scale) + bias, int8 y with quant_scale; on A2 a bfloat16 x wants a "
         f"float32 bias; {_WQ_STACKS} pass no bias", _wq_plain),
    Rule("WeightQuantBatchMatmul", "quant-matmul-limits",
         f"{_WQ_DOC}, A2/A3: x 2-D (m, k) float16 or bfloat16, k and n in [1, {WQ_MAX_DIM}]", _wq_limits),
    Rule("AllReduce", "world-group-collectives",
         "MindSpore 2.10 communication/management.py: init() on Ascend creates HCCL's world group "
         f"{WORLD_GROUP!r} (GlobalComm.WORLD_COMM_GROUP); agents/model/parallel.py: partial sums all-reduced, the "
         "greedy pick's candidates all-gathered from every rank", _collective_group),
    Rule("AllGather", "world-group-collectives-gather", "as world-group-collectives; AllGather's rank_size shapes "
         "its output (ops.AllGather reads it from the group joined)", _collective_group),
    Rule("ReshapeAndCache", "int8-cache-quantized",
         f"{_RC_DOC}: key/value and caches of one dtype (the op copies); vllm-mindspore KVCacheInt8Method "
         "quantizes K and V to int8 before it (QuantV2 ROUND; we round, clamp and cast, docs/quantization.md)",
         _rc_int8),
    Rule("ReshapeAndCache", "int32-slots", f"{_RC_DOC}: slot_mapping int32 (num_tokens,); the tokens are the key's "
         "rows however it is shaped (MindFormers 1.8 passes (1, tokens, kv_heads * head_dim) in prefill)", _rc_slots),
    Rule("ReshapeAndCache", "cache-layout",
         f"{_RC_DOC}: caches (num_blocks, block_size, num_head, head_dim), key/value (num_tokens, num_head, "
         "head_dim) or, as MindFormers passes them, (..., num_head * head_dim)", _rc_layout),
)


def check_graph(graph: GraphNodes, rules: tuple[Rule, ...] = RULES, tensor_parallel: int = 1,
                paged_attention: str = DEFAULT_PA_KERNEL) -> list[Violation]:
    """Every rule on every node of its op, in graph order; ``tensor_parallel``: the ranks the graph is one of;
    ``paged_attention``: the PagedAttention kernel selected (``PA_KERNELS``)."""
    if paged_attention not in PA_KERNELS:
        raise ValueError(f"paged_attention must be one of {', '.join(PA_KERNELS)}, got {paged_attention!r}")
    expect = Expect(tensor_parallel, paged_attention)
    out = []
    for node in graph.nodes:
        for rule in rules:
            if rule.op == node.op:
                out += [Violation(node.op, node.name, rule.name, msg) for msg in rule.check(graph, node, expect)]
    return out


def add_check_argument(parser: argparse.ArgumentParser) -> None:
    """``--check`` of both exporters (ours and the mindformers backend's)."""
    parser.add_argument("--check", action="store_true", help="check every exported graph against the fused ops' "
                        "contracts (agents.tools.contracts); exit 1 on a violation")
    parser.add_argument("--paged-attention-kernel", choices=PA_KERNELS, default=DEFAULT_PA_KERNEL,
                        help="the PagedAttention kernel the check assumes runs: atb (the working stacks' default, "
                        "custom kernel named in MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST) or custom")


def check_exported(files: Iterable[Path], tensor_parallel: int = 1, paged_attention: str = DEFAULT_PA_KERNEL) -> int:
    """An exporter's exit status after ``--check``: 1 if any exported file breaks a rule (each printed), else 0."""
    return 1 if report(files, lambda line: print(line, flush=True), tensor_parallel, paged_attention) else 0


def report(paths: Iterable[Path], out: Callable[[str], None], tensor_parallel: int = 1,
           paged_attention: str = DEFAULT_PA_KERNEL) -> int:
    """``export --check``: check each MindIR file, write one line per violation (or that the file passed) and
    return how many violations there were."""
    total = 0
    for path in paths:
        found = check_graph(read_graph(path), tensor_parallel=tensor_parallel, paged_attention=paged_attention)
        total += len(found)
        out(f"check {path.name}: " + ("every contract rule holds" if not found else f"{len(found)} violation(s)"))
        for v in found:
            out(f"  {v}")
    return total
