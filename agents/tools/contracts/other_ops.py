"""The rules of FlashAttentionScore, ApplyRotaryPosEmb, WeightQuantBatchMatmul (w8a16), the tensor-parallel
collectives and ReshapeAndCache."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from agents.model.backends.ascend_limits import (
    FA_MASK_SIZE,
    WQ_MAX_DIM,
    fa_mask_value,
)
from agents.tools.contracts.base import (
    FA_HEAD_NUM,
    FA_KEY,
    FA_KV_LENGTH_INPUTS,
    FA_KV_LENS,
    FA_MASK,
    FA_Q_LENGTH_INPUTS,
    FA_Q_LENS,
    FA_QUERY,
    FA_SCALE,
    FA_SPARSE_MODE,
    FA_VALUE,
    KV_LENGTHS_INPUT,
    RC_KEY,
    RC_KEY_CACHE,
    RC_SLOTS,
    RC_VALUE,
    RC_VALUE_CACHE,
    ROPE_COS,
    ROPE_COS_FORMAT,
    ROPE_KEY,
    ROPE_POSITIONS,
    ROPE_QUERY,
    ROPE_SIN,
    ROTATE_HALF,
    WQ_BIAS,
    WQ_GROUP_SIZE,
    WQ_OFFSET,
    WQ_QUANT_OFFSET,
    WQ_QUANT_SCALE,
    WQ_SCALE,
    WQ_TRANSPOSE_WEIGHT,
    WQ_TRANSPOSE_X,
    WQ_WEIGHT,
    WQ_X,
    Expect,
    _dims,
    _dtype,
    _from_rope,
    _head_dim,
    _quantized_from,
    _roped,
    _roped_inputs,
    _where,
)
from agents.tools.mindir import GraphNodes, OpNode, Source, TensorInfo


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
