"""What every contract rule is built of: the fused ops' input indices as MindSpore 2.10 orders them, the
rule and violation types, and what the rules read off a graph (where a tensor's values come from, looked
through reshapes and casts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agents.tools.mindir import GraphNodes, OpNode, Source
from llm_serving.protocol.ascend_env import ascend_environment, paged_attention_kernel

# PagedAttention's inputs in MindSpore 2.10's order (ops.auto_generate.PagedAttention; the internal kernel reads
# head_num, scale and kv_head_num at indices 10-12: ops/kernel/ascend/internal/paged_attention.cc, CreateKernel)
PA_QUERY, PA_KEY_CACHE, PA_VALUE_CACHE, PA_BLOCK_TABLES, PA_CONTEXT_LENS = range(5)
PA_ANTIQUANT_SCALE, PA_ANTIQUANT_OFFSET, PA_MASK, PA_Q_LENS = 5, 6, 7, 8
PA_HEAD_NUM, PA_SCALE, PA_KV_HEAD_NUM, PA_KV_QUANT_MODE = 10, 11, 12, 13
PA_ALIBI_MASK, PA_MASK_MODE, PA_MLA_V_DIM = 9, 14, 15
# Which PagedAttention kernel runs: 2.10's PagedAttentionOp runs the custom (internal) kernel unless
# MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST names PagedAttention, else the ATB one. Both working stacks name it
# (MindFormers 1.8 core/context/build_context.py in predict mode; vllm-mindspore "FlashAttentionScore,PagedAttention"),
# so ATB is the default the rules are checked against: the one the agents' environment table selects
# (llm_serving.protocol.ascend_env), so the checker and the agents never disagree.
PA_KERNELS = ("atb", "custom")
DEFAULT_PA_KERNEL = paged_attention_kernel(ascend_environment(1, {}))
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


def _origin(graph: GraphNodes, source: Source,
            keeps: tuple[str, ...] = _SAME_VALUES) -> tuple[OpNode | None, int | None]:
    """The op (and its output index, for ops with several) whose values ``source`` carries: reshapes and casts
    (``keeps``) are looked through, and a ``Concat``'s first part (rows of padding appended after the real ones)."""
    while True:
        node = graph.producer(source)
        if node is None:
            return None, None
        if node.op in keeps:
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
