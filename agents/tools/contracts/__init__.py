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

from agents.tools.contracts.base import DEFAULT_PA_KERNEL, PA_KERNELS, Expect, Rule, Violation
from agents.tools.contracts.rules import (
    RULES,
    add_check_argument,
    check_exported,
    check_graph,
    report,
    selected_paged_attention,
)

__all__ = ["DEFAULT_PA_KERNEL", "PA_KERNELS", "RULES", "Expect", "Rule", "Violation", "add_check_argument",
           "check_exported", "check_graph", "report", "selected_paged_attention"]
