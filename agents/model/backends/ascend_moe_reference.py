"""CPU stand-ins for the MoE kernels of ``ascend_moe`` (MindSpore 2.10 docstrings of MoeGatingTopKSoftmax,
MoeInitRoutingV2, GroupedMatmulV4, MoeTokenUnpermute and CANN's MoeInitRoutingV2 formulas), in MindSpore graph ops
with the kernels' call signatures, so ``AscendRoutedExperts`` runs on CPU unchanged but for these cells and is held
to the numpy reference (``agents.model.moe_routing``). Only the modes ``ascend_moe`` uses are modelled (dropless
routing with per-expert counts; grouped matmul of one tensor grouped along its rows by counts); the contract
checker (``agents.tools.contracts``) holds the exported graphs to those modes. For checks, not speed.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from agents.model.backends.ascend_reference import SwigluRef

# the routing sorts (expert, position) keys as float32, exact below 2 ** 24
_EXACT_KEYS = 1 << 24


class GatingTopKSoftmaxRef(nn.Cell):
    """Softmax over the experts in float32, the k largest (ties: the lower id), in ``x``'s dtype; row ids
    ``j * T + t`` (CANN's rowIdx)."""

    def construct(self, x: Tensor, finished=None, k: int = 1) -> tuple[Tensor, Tensor, Tensor]:
        tokens = x.shape[0]
        weights, ids = ops.topk(ops.softmax(x.astype(ms.float32), -1), k)
        rows = ops.arange(k).reshape(1, k) * tokens + ops.arange(tokens).reshape(tokens, 1)
        return weights.astype(x.dtype), ids.astype(ms.int32), rows.astype(ms.int32)


class InitRoutingV2Ref(nn.Cell):
    """Dropless routing: the flat (token, pick) pairs sorted by expert, stable (CANN: sortedRowIdx), each token's
    row copied to its sorted place (``expanded_x[i] = x[sortedRowIdx[i] // k]``), ``expanded_row_idx[sortedRowIdx[i]]
    = i``, and the count of rows per expert."""

    def construct(self, x: Tensor, expert_idx: Tensor, active_num: int, expert_capacity: int, expert_num: int,
                  drop_pad_mode: int, count_flag: int, before_capacity_flag: bool):
        pairs = expert_idx.shape[0] * expert_idx.shape[1]
        if pairs * expert_num >= _EXACT_KEYS:
            raise ValueError(f"the routing stand-in sorts {pairs} pairs of {expert_num} experts as float32 keys")
        flat = expert_idx.reshape(-1)
        keys = flat.astype(ms.float32) * pairs + ops.arange(pairs).astype(ms.float32)
        _, order = ops.sort(keys)  # sortedRowIdx: ascending expert, then position
        _, where = ops.sort(order.astype(ms.float32))  # its inverse permutation: expanded_row_idx
        rows = ops.gather(x, order // expert_idx.shape[1], 0)
        counts = ops.one_hot(flat, expert_num, Tensor(1, ms.int32), Tensor(0, ms.int32)).sum(0)
        return rows, where.astype(ms.int32), counts.astype(ms.int32), counts.astype(ms.int32)


class GroupedMatmulV4Ref(nn.Cell):
    """One x grouped along its rows by per-group counts: row ``r`` of group ``e`` times ``weight[e] [K, N]``, in
    float32, cast back; rows past the counts' sum come out 0 (the kernel leaves them unwritten). An int8 weight
    with ``antiquant_scale [[E, N]]`` (A16W8): each weight q * its output column's scale, in float32."""

    def construct(self, x, weight, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                  pre_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                  activation_quant_offset=None, split_item=0, group_type=-1, group_list_type=0):
        rows, w = x[0], weight[0].astype(ms.float32)
        if antiquant_scale is not None:
            scale = antiquant_scale[0].astype(ms.float32)
            w = w * scale.reshape(scale.shape[0], 1, scale.shape[1])
        ends = ops.cumsum(group_list, 0).reshape(1, -1)  # [1, E]
        group = (ops.arange(rows.shape[0]).reshape(-1, 1).astype(ends.dtype) >= ends).astype(ms.int32).sum(1)
        padded = ops.concat((w, ops.zeros((1,) + w.shape[1:], ms.float32)))  # group E: none
        y = ops.BatchMatMul()(rows.astype(ms.float32).reshape(rows.shape[0], 1, -1), ops.gather(padded, group, 0))
        return (y.reshape(rows.shape[0], -1).astype(rows.dtype),)


class TokenUnpermuteRef(nn.Cell):
    """``out[t] = sum_j probs[t, j] * rows[sorted_indices[t*k + j]]`` in float32, cast back."""

    def construct(self, permuted_tokens: Tensor, sorted_indices: Tensor, probs=None, padded_mode: bool = False,
                  restore_shape=None) -> Tensor:
        tokens, k = probs.shape
        picked = ops.gather(permuted_tokens.astype(ms.float32), sorted_indices, 0).reshape(tokens, k, -1)
        return (picked * probs.astype(ms.float32).reshape(tokens, k, 1)).sum(1).astype(permuted_tokens.dtype)


class MoeReferenceOps:
    """``ascend_moe.MoeOps``' factories returning the stand-ins."""

    name = "reference"

    def gating_top_k_softmax(self):
        return GatingTopKSoftmaxRef()

    def init_routing(self):
        return InitRoutingV2Ref()

    def grouped_matmul(self):
        return GroupedMatmulV4Ref()

    def token_unpermute(self):
        return TokenUnpermuteRef()

    def swiglu(self):
        return SwigluRef()
