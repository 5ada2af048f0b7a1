"""The projections, norms and greedy pick as MindSpore graph ops: any device and dtype.

These are the ``OpsBackend`` defaults. Weights arrive in Hugging Face's ``[out, in]`` layout and every row of a
bucket is computed (``rows`` is accepted for the common signature and not read, so the graph drops it).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from llm_serving.protocol.model_config import LlamaConfig


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, in float32 as Hugging Face's ``LlamaRMSNorm``, cast back before the weight."""
    xf = x.astype(ms.float32)
    variance = ops.mean(xf * xf, -1, keep_dims=True)
    return (xf * ops.rsqrt(variance + eps)).astype(x.dtype) * weight


def greedy_pick(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Argmax token and its log-softmax value; the max logit is the chosen one, so no gather is needed."""
    token_ids = ops.argmax(logits, -1).astype(ms.int32)
    top = ops.max(logits, -1, keepdims=True)[0]
    logprob = -ops.log(ops.sum(ops.exp(logits - top), -1))
    return token_ids, logprob


class SwiGlu(nn.Cell):
    """``[gate; up] -> silu(gate) * up`` on the halves of the last axis."""

    def __init__(self, ffn_dim: int) -> None:
        super().__init__()
        self.ffn = ffn_dim

    def construct(self, gate_up: Tensor) -> Tensor:
        return ops.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:]


class NormLinear(nn.Cell):
    """``(x, norm_weight, weight, rows) -> rmsnorm(x) @ W^T``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor, norm_weight: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
        return self.matmul(rms_norm(x, norm_weight, self.eps), weight)


class NormSwiGlu(nn.Cell):
    """``(x, norm_weight, [gate; up] weight, rows) -> silu(gate) * up`` with the gate and up halves fused."""

    def __init__(self, ffn_dim: int, eps: float) -> None:
        super().__init__()
        self.ffn = ffn_dim
        self.eps = eps
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor, norm_weight: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
        gate_up = self.matmul(rms_norm(x, norm_weight, self.eps), weight)
        return ops.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:]


class ResidualLinear(nn.Cell):
    """``(x, weight, residual, rows) -> residual + x @ W^T``."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor) -> Tensor:
        return residual + self.matmul(x, weight)


class Linear(nn.Cell):
    """``(x, weight, rows) -> x @ W^T``."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
        return self.matmul(x, weight)


class HeadNorm(nn.Cell):
    """``(qkv, q_weight, k_weight) -> qkv`` with every query and key head RMS-normalized over its ``head_dim`` and
    V as it is: Qwen3's q/k norms, before the rotary embedding. ``config``: the heads as the attention sees them
    (one rank's under tensor parallelism)."""

    def __init__(self, config: LlamaConfig, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.q_dim, self.kv_dim = config.q_dim, config.kv_dim
        self.eps = eps

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        """``rms_norm`` over the last axis of ``[tokens, heads, head_dim]``."""
        return rms_norm(x, weight, self.eps)

    def construct(self, qkv: Tensor, q_weight: Tensor, k_weight: Tensor) -> Tensor:
        tokens = qkv.shape[0]
        q = self.normalize(qkv[:, : self.q_dim].reshape(tokens, self.heads, self.head_dim), q_weight)
        k = self.normalize(qkv[:, self.q_dim: self.q_dim + self.kv_dim].reshape(tokens, self.kv_heads, self.head_dim),
                           k_weight)
        return ops.concat((q.reshape(tokens, self.q_dim), k.reshape(tokens, self.kv_dim),
                           qkv[:, self.q_dim + self.kv_dim:]), 1)


class GreedyPick(nn.Cell):
    """``greedy_pick`` as a cell."""

    def construct(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return greedy_pick(logits)
