"""The PagedAttention rules (either kernel: ATB, the stacks' default, or the custom one, ``Expect.paged_attention``),
the chunk mask's producer traced for its width, values and direction."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from agents.model.backends.ascend_limits import (
    CHUNK_MASK_VALUE,
    HEAD_DIM_MULTIPLE,
    MAX_HEAD_DIM,
    PA_BLOCK_SIZES,
    PA_MAX_HEAD_DIM_X_BLOCK,
)
from agents.tools.contracts.base import (
    KV_LENGTHS_INPUT,
    PA_ALIBI_MASK,
    PA_ANTIQUANT_OFFSET,
    PA_ANTIQUANT_SCALE,
    PA_BLOCK_TABLES,
    PA_CONTEXT_LENS,
    PA_DEFAULT_QUANT_MODE,
    PA_HEAD_NUM,
    PA_KEY_CACHE,
    PA_KV_HEAD_NUM,
    PA_KV_QUANT_MODE,
    PA_MASK,
    PA_MASK_MODE,
    PA_MLA_V_DIM,
    PA_Q_LENS,
    PA_QUERY,
    PA_SCALE,
    PA_VALUE_CACHE,
    Q_LENGTHS_INPUT,
    RC_KEY_CACHE,
    RC_VALUE_CACHE,
    Expect,
    _dims,
    _dtype,
    _roped,
    _through,
    _where,
)
from agents.tools.contracts.other_ops import (
    _none,
)
from agents.tools.mindir import GraphNodes, OpNode, Source, TensorInfo


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
    elif query and _known(dims[0], query[0]) and dims[0] != query[0]:
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
    if not _known(width, tables[1]):
        return  # a dynamic-shape graph: the values rule traces the width to the table's reach instead
    if width < reach:
        yield f"the mask's {width} positions do not reach the {reach} a block table covers"
    elif width > reach and expect.paged_attention == "custom":
        yield (f"the mask's {width} positions are wider than the {reach} a block table reaches (the custom kernel "
               "refuses a mask wider than the key cache's max kv_seq_len)")


def _known(*dims: int) -> bool:
    """Whether every one of ``dims`` is a size, not a dynamic-shape graph's -1 (which matches nothing)."""
    return all(d >= 0 for d in dims)


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
    row_src, col = compare.inputs[row_at], compare.inputs[col_at]
    row, row_producer = _through(graph, row_src)
    row_dims = _dims(row_src) or _dims(row) or getattr(row.value, "shape", None)
    col_dims = _dims(col)
    if not (row_dims and len(row_dims) == 2 and row_dims[0] == 1 and col_dims and col_dims[-1] == 1):
        yield (f"the mask's direction is flipped: {compare.op} must compare the kv positions row (1, W) against the "
               f"query positions column (T, 1), got {row_dims} against {col_dims}")
    elif row.array is not None:
        if not np.array_equal(np.asarray(row.array).reshape(-1), np.arange(row_dims[1])):
            yield (f"the mask's kv positions row must be 0..{row_dims[1] - 1}, got "
                   f"{np.asarray(row.array).reshape(-1)[:4]}")
    elif (why := _range_over_reach(graph, row, row_producer, node)) is not None:
        yield why
    if (at := _through(graph, col)[0]).kind != "input" or at.name != POSITIONS_INPUT:
        yield f"the mask's query positions must be the graph input {POSITIONS_INPUT!r}, got {_where(at)}"


def _range_over_reach(graph: GraphNodes, row: Source, producer: OpNode | None, node: OpNode) -> str | None:
    """None if the kv positions row of a dynamic-shape graph is ``Range(0, block_tables.shape[1] * block_size, 1)``
    (the positions a table reaches: the width both kernels read rows to), else what it is."""
    if producer is None or producer.op != "Range":
        return f"the mask's kv positions row must be 0..W-1 (a constant or a Range), got {_where(row)}"
    start, limit, delta = producer.inputs[:3]
    if start.value != 0 or delta.value != 1:
        return f"the mask's kv positions row must count from 0 by 1, got Range({start.value}, ..., {delta.value})"
    cache, tables = _dims(node.inputs[PA_KEY_CACHE]), node.inputs[PA_BLOCK_TABLES]
    product = _scalar_origin(graph, limit)
    if product is None or product.op != "ScalarMul":
        return f"the mask's width must be the block table's width x block_size, got {_where(limit)}"
    factors = [f.value if f.kind == "constant" else _shape_dim_of(graph, f) for f in product.inputs[:2]]
    want = {cache[1] if cache and len(cache) == 4 else None, ("width of", _through(graph, tables)[0].name)}
    if set(factors) != want:
        return (f"the mask's width must be the block table's width x block_size {cache[1] if cache else '?'}, got "
                f"the product of {factors}")
    return None


def _scalar_origin(graph: GraphNodes, source: Source) -> OpNode | None:
    """The op computing a scalar, through the tensor/scalar conversions MindSpore inserts."""
    node = graph.producer(source)
    while node is not None and node.op in ("TensorToScalar", "ScalarToTensor", "ScalarCast"):
        node = graph.producer(node.inputs[0])
    return node


def _shape_dim_of(graph: GraphNodes, source: Source) -> tuple[str, str] | None:
    """``("width of", name)`` when ``source`` is ``Shape(x)[1]`` of the tensor named ``name``, else None."""
    item = graph.producer(source)
    if item is None or item.op != "TupleGetItem" or item.inputs[1].value != 1:
        return None
    shape = graph.producer(item.inputs[0])
    if shape is None or shape.op != "Shape":
        return None
    return "width of", _through(graph, shape.inputs[0])[0].name


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
