"""The rules of the MoE kernels (``agents.model.backends.ascend_moe``): MoeGatingTopKSoftmax, MoeInitRoutingV2,
GroupedMatmulV4 and MoeTokenUnpermute (exported as InnerMoeTokenUnpermute), as MindSpore 2.10's docstrings state
their modes and the working stack (vllm-mindspore 0.5.1's FusedExperts) wires them."""

from __future__ import annotations

from collections.abc import Iterator

from agents.tools.contracts.base import _SAME_VALUES, Expect, _dims, _dtype, _origin, _where
from agents.tools.mindir import GraphNodes, OpNode, Source

# argument order of each primitive in 2.10 (attributes passed as inputs)
GT_X, GT_FINISHED, GT_K = range(3)
IR_X, IR_IDS, IR_ACTIVE, IR_CAPACITY, IR_EXPERTS, IR_DROP_PAD, IR_COUNT_FLAG = range(7)
GM_X, GM_WEIGHT, GM_GROUP_LIST, GM_SPLIT_ITEM, GM_GROUP_TYPE, GM_LIST_TYPE = 0, 1, 8, 12, 13, 14
GM_ANTIQUANT_SCALE = 5
GM_EXTRAS = {2: "bias", 3: "scale", 4: "offset", 5: "antiquant_scale", 6: "antiquant_offset", 7: "pre_token_scale"}
UP_ROWS, UP_INDICES, UP_PROBS, UP_PADDED = range(4)
# MoeInitRoutingV2's expert_tokens_count_or_cumsum_flag -> the GroupedMatmulV4 group_list_type that reads it
_LIST_TYPE_OF_FLAG = {1: 0, 2: 1}
# ops that keep a tensor's values, or a prefix of them (the expert-parallel group list is the local counts' slice)
_KEEPS = (*_SAME_VALUES, "StridedSlice")
_FLOATS = ("float16", "bfloat16", "float32")


def _value(source: Source) -> object:
    return source.value if source.kind == "constant" else f"<{_where(source)}>"


def _output_of(graph: GraphNodes, source: Source) -> tuple[OpNode | None, int | None]:
    """The op and output index whose values ``source`` carries, through value-keeping ops and slices."""
    return _origin(graph, source, _KEEPS)


def _derives_from(graph: GraphNodes, source: Source, op: str, output: int, depth: int = 12) -> bool:
    """Whether output ``output`` of an ``op`` is among ``source``'s ancestors (the expert-parallel remapping of
    expert ids computes on them)."""
    frontier, seen = [source], set()
    for _ in range(depth):
        nxt = []
        for src in frontier:
            node = graph.producer(src)
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            if node.op == "TupleGetItem" and (of := graph.producer(node.inputs[0])) is not None and of.op == op:
                if node.inputs[1].value == output:
                    return True
                continue
            nxt += list(node.inputs)
        frontier = nxt
    return False


def _gating(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    x, k = _dims(node.inputs[GT_X]), node.inputs[GT_K]
    if x is None or len(x) != 2:
        yield f"the router logits must be 2-D (tokens, experts), got shape {x}"
    if _dtype(node.inputs[GT_X]) not in _FLOATS:
        yield f"the router logits must be one of {', '.join(_FLOATS)}, got {_dtype(node.inputs[GT_X])}"
    if k.kind != "constant" or not isinstance(k.value, int) or not (x and 1 <= k.value <= x[-1]):
        yield f"k must be a constant in 1..experts ({x[-1] if x else '?'}), got {_value(k)}"
    if node.inputs[GT_FINISHED].kind != "constant" or node.inputs[GT_FINISHED].value is not None:
        yield f"finished must be None (every row routed), got {_where(node.inputs[GT_FINISHED])}"


def _dropless(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    for index, what, want in ((IR_ACTIVE, "active_num", 0), (IR_CAPACITY, "expert_capacity", 0),
                              (IR_DROP_PAD, "drop_pad_mode", 0)):
        if _value(node.inputs[index]) != want:
            yield f"{what} must be {want} (dropless: every pick routed), got {_value(node.inputs[index])}"
    if _value(node.inputs[IR_COUNT_FLAG]) not in _LIST_TYPE_OF_FLAG:
        yield ("expert_tokens_count_or_cumsum_flag must be 1 or 2 (the grouped matmul needs the group sizes), got "
               f"{_value(node.inputs[IR_COUNT_FLAG])}")


def _routing_ids(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    x, ids = _dims(node.inputs[IR_X]), _dims(node.inputs[IR_IDS])
    if _dtype(node.inputs[IR_IDS]) != "int32" or ids is None or len(ids) != 2:
        yield f"expert_idx must be int32 (tokens, k), got {_dtype(node.inputs[IR_IDS])} {ids}"
    elif x and x[0] != ids[0]:
        yield f"expert_idx's {ids[0]} rows are not x's {x[0]} tokens"
    if not _derives_from(graph, node.inputs[IR_IDS], "MoeGatingTopKSoftmax", 1):
        yield ("expert_idx must be MoeGatingTopKSoftmax's output 1 (the expert ids; output 2 holds row ids), "
               f"got {_where(node.inputs[IR_IDS])}")


def _grouped_mode(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    for index, what, want in ((GM_SPLIT_ITEM, "split_item", 3), (GM_GROUP_TYPE, "group_type", 0)):
        if _value(node.inputs[index]) != want:
            yield f"{what} must be {want} (one tensor grouped along its rows), got {_value(node.inputs[index])}"
    group_list = node.inputs[GM_GROUP_LIST]
    if _dtype(group_list) != "int64" or len(_dims(group_list) or ()) != 1:
        yield f"group_list must be int64 and 1-D, got {_dtype(group_list)} {_dims(group_list)}"
    routing, output = _output_of(graph, group_list)
    if routing is None or routing.op != "MoeInitRoutingV2" or output != 2:
        where = f"output {output} of {routing.op}" if routing is not None else _where(group_list)
        yield f"group_list must be MoeInitRoutingV2's output 2 (tokens per expert), got {where}"
        return
    flag = routing.inputs[IR_COUNT_FLAG].value
    want = _LIST_TYPE_OF_FLAG.get(flag) if isinstance(flag, int) else None
    if want is not None and _value(node.inputs[GM_LIST_TYPE]) != want:
        yield (f"group_list_type {_value(node.inputs[GM_LIST_TYPE])} does not read the routing's "
               f"{'counts' if flag == 2 else 'cumulative sums'} (flag {flag}): it must be {want}")


def _grouped_weights(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    x, weight, group_list = (_dims(node.inputs[i]) for i in (GM_X, GM_WEIGHT, GM_GROUP_LIST))
    if x is None or len(x) != 2:
        yield f"x must be 2-D (rows, in), got shape {x}"
    if weight is None or len(weight) != 3:
        yield f"the weight must be 3-D (experts, in, out), got shape {weight}"
    elif x and len(x) == 2 and weight[1] != x[1]:
        yield (f"the weight {weight} is not (experts, in {x[1]}, out): a weight stored (experts, out, in) must be "
               "transposed when loaded")
    elif group_list and group_list[0] != weight[0]:
        yield f"group_list's {group_list[0]} groups are not the weight's {weight[0]} experts"
    int8 = _dtype(node.inputs[GM_WEIGHT]) == "int8"
    for index, what in GM_EXTRAS.items():
        if index == GM_ANTIQUANT_SCALE and int8:
            continue
        if node.inputs[index].kind != "constant" or node.inputs[index].value is not None:
            why = "float experts" if index == GM_ANTIQUANT_SCALE else "unbiased experts, int8 by antiquant_scale only"
            yield f"{what} must be None ({why}), got {_where(node.inputs[index])}"
    if int8:
        yield from _antiquant(node, x, weight)
    elif _dtype(node.inputs[GM_WEIGHT]) not in _FLOATS:
        yield f"the weight must be int8 or one of {', '.join(_FLOATS)}, got {_dtype(node.inputs[GM_WEIGHT])}"


def _antiquant(node: OpNode, x: tuple[int, ...] | None, weight: tuple[int, ...] | None) -> Iterator[str]:
    """An int8 weight (A16W8, w8a16): antiquant_scale (experts, out) per output column, in x's dtype."""
    scale = node.inputs[GM_ANTIQUANT_SCALE]
    if scale.kind == "constant" and scale.value is None:
        yield "an int8 weight needs antiquant_scale (experts, out): without it the int8 values are the weights"
        return
    dims, want = _dims(scale), (weight[0], weight[2]) if weight is not None and len(weight) == 3 else None
    if dims != want:
        yield f"antiquant_scale must be (experts, out) {want} for the weight {weight}, got {dims}"
    if _dtype(scale) != _dtype(node.inputs[GM_X]):
        yield f"antiquant_scale must be in x's dtype {_dtype(node.inputs[GM_X])}, got {_dtype(scale)}"


def _unpermute(graph: GraphNodes, node: OpNode, expect: Expect) -> Iterator[str]:
    routing, output = _output_of(graph, node.inputs[UP_INDICES])
    if routing is None or routing.op != "MoeInitRoutingV2" or output != 1:
        where = f"output {output} of {routing.op}" if routing is not None else _where(node.inputs[UP_INDICES])
        yield f"sorted_indices must be MoeInitRoutingV2's output 1 (expanded_row_idx), got {where}"
    rows, probs = _dims(node.inputs[UP_ROWS]), _dims(node.inputs[UP_PROBS])
    if probs is None or len(probs) != 2 or (rows and rows[0] != probs[0] * probs[1]):
        yield f"probs must be (tokens, k) with tokens x k = the {rows[0] if rows else '?'} rows, got {probs}"
    if _value(node.inputs[UP_PADDED]) is not False:
        yield f"padded_mode must be False (dropless routing), got {_value(node.inputs[UP_PADDED])}"
