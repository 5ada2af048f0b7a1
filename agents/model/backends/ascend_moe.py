"""A sparse layer's routed experts on Ascend (issue 54): MindSpore 2.10's MoE kernels in the order the working
MindSpore stack runs them for Qwen3-MoE (vllm-mindspore 0.5.1, model_executor/layers/fused_moe/fused_moe.py:
``fused_topk`` and ``FusedExperts.run_tp`` / ``run_tp_mix_ep``):

1. ``MoeGatingTopKSoftmax(router_logits, None, k)``: softmax over the experts, the k largest (weights, expert ids
   int32, row ids); renormalised to sum 1 where the family does (``norm_topk_prob``; Mixtral always: the softmax of
   the k largest logits is the top k of the softmax renormalised);
2. ``MoeInitRoutingV2(x, ids, 0, 0, experts, 0, 2, True)``: dropless (``drop_pad_mode`` 0, ``active_num`` and
   ``expert_capacity`` 0), each token's row copied once per pick and sorted by expert, ``expanded_row_idx`` (where
   each (token, pick) went) and the per-expert counts (flag 2: counts, not their cumulative sum);
3. ``GroupedMatmulV4`` (``split_item`` 3: one tensor; ``group_type`` 0: groups along the rows; ``group_list_type``
   1: counts, int64) of each expert's rows by its ``[in, out]`` weight: gate/up ``[E, h, 2f]``, ``Swiglu``, down
   ``[E, f, h]``; under w8a16 the weights int8 with ``antiquant_scale [E, out]`` in x's dtype (the A16W8 form of
   the 2.10 docstring: each weight dequantized as q * scale per output column, no offset);
4. ``MoeTokenUnpermute(expert rows, expanded_row_idx, weights)``: each token's k rows gathered back and summed
   with their weights.

Expert parallelism (``ExpertSlice``): a rank holds experts ``[first, first + count)`` and returns its part of the
sum, which the block all-reduces. Picks of other ranks' experts go to one extra group after the local ones (their
weight 0) that the grouped matmul never reads (the group list holds the local counts only); the rows it leaves
unwritten are zeroed before the sum, since their contents are undefined and 0 x NaN is NaN (vllm-mindspore zeroes
them with ``nan_to_num``). The ops are ``MoeOps`` factories, so CPU tests run this same cell on the stand-ins of
``agents.model.backends.ascend_moe_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.auto_generate import (
    GroupedMatmulV4,
    MoeGatingTopKSoftmax,
    MoeInitRoutingV2,
    MoeTokenUnpermute,
    Swiglu,
)

# MoeInitRoutingV2's mode: dropless, no active-token cap, no capacity; counts per expert (not cumulative)
DROPLESS, COUNTS = 0, 2
# GroupedMatmulV4's mode: one x and one stacked weight, grouped along x's rows by per-group counts
SINGLE_TENSOR, ROW_GROUPS, GROUP_COUNTS = 3, 0, 1


class MoeOps:
    """The fused MoE primitives, one factory each (``ascend_moe_reference.MoeReferenceOps``: CPU stand-ins)."""

    name = "fused"

    def gating_top_k_softmax(self):
        """``(logits [T, E], finished None, k) -> (weights [T, k], ids [T, k] int32, row ids [T, k] int32)``."""
        return MoeGatingTopKSoftmax()

    def init_routing(self):
        """``(x [T, h], ids [T, k] int32, active_num, expert_capacity, expert_num, drop_pad_mode, count_flag,
        before_capacity_flag) -> (rows [T*k, h], expanded_row_idx [T*k] int32, counts [E] int32, counts)``."""
        return MoeInitRoutingV2()

    def grouped_matmul(self):
        """``([x [M, K]], [w [E, K, N]], None x 3, antiquant_scale, None x 2, group_list [E] int64, None x 3,
        split_item, group_type, group_list_type) -> (y [M, N],)``: rows of group ``e`` times ``w[e]`` (int8 ``w``
        times ``antiquant_scale[0] [E, N]`` per output column where given)."""
        return GroupedMatmulV4()

    def token_unpermute(self):
        """``(rows [T*k, h], expanded_row_idx [T*k] int32, probs [T, k], padded_mode, restore_shape) -> [T, h]``:
        ``out[t] = sum_j probs[t, j] * rows[expanded_row_idx[t*k + j]]``."""
        return MoeTokenUnpermute()

    def swiglu(self):
        """``(x, dim) -> silu(first half) * second half``."""
        return Swiglu()


@dataclass(frozen=True)
class ExpertSlice:
    """The experts this rank holds: ``[first, first + count)`` of ``total`` (all of them without expert
    parallelism)."""

    first: int
    count: int
    total: int

    @classmethod
    def of_rank(cls, total: int, ranks: int, rank: int) -> ExpertSlice:
        if total % ranks:
            raise ValueError(f"{total} experts do not split evenly over {ranks} expert-parallel ranks")
        per = total // ranks
        return cls(rank * per, per, total)

    @property
    def whole(self) -> bool:
        return self.count == self.total


class AscendRoutedExperts(nn.Cell):
    """The routed experts' weighted sum of one sparse layer for ``x [tokens, hidden]``, from the router's logits
    and the rank's experts ``gate_up [count, hidden, 2f]``, ``down [count, f, hidden]`` (``[in, out]``, as the
    grouped matmul reads them)."""

    def __init__(self, moe: MoeOps, top_k: int, normalise: bool, experts: ExpertSlice) -> None:
        super().__init__()
        self.k, self.normalise, self.experts = top_k, normalise, experts
        self.gating, self.routing = moe.gating_top_k_softmax(), moe.init_routing()
        self.grouped, self.unpermute, self.swiglu = moe.grouped_matmul(), moe.token_unpermute(), moe.swiglu()

    def construct(self, x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor,
                  gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
        """``gate_up_scale [count, 2f]``, ``down_scale [count, h]``: int8 experts' antiquant scales (w8a16)."""
        weights, ids, _ = self.gating(router_logits, None, self.k)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        groups = self.experts.count
        if not self.experts.whole:  # other ranks' picks: one more group, after the local ones, weighted 0
            local = ids - self.experts.first
            elsewhere = ops.logical_or(local < 0, local >= groups)
            ids = ops.select(elsewhere, ops.full_like(local, groups), local)
            weights = ops.select(elsewhere, ops.zeros_like(weights), weights)
            groups = groups + 1
        rows, where, counts, _ = self.routing(x, ids, 0, 0, groups, DROPLESS, COUNTS, True)
        counts = counts[: self.experts.count].astype(ms.int64)
        hidden = self._grouped(rows, gate_up, counts, gate_up_scale)
        out = self._grouped(self.swiglu(hidden, -1), down, counts, down_scale)
        if not self.experts.whole:  # rows of the extra group were never computed
            computed = ops.arange(out.shape[0]).reshape(-1, 1) < counts.sum()
            out = ops.select(computed.broadcast_to(out.shape), out, ops.zeros_like(out))
        return self.unpermute(out, where, weights.astype(out.dtype), False, None)

    def _grouped(self, x: Tensor, weight: Tensor, counts: Tensor, scale: Tensor | None) -> Tensor:
        antiquant = None if scale is None else [scale.astype(x.dtype)]
        return self.grouped([x], [weight], None, None, None, antiquant, None, None, counts, None, None, None,
                            SINGLE_TENSOR, ROW_GROUPS, GROUP_COUNTS)[0]
