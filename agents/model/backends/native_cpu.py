"""The native CPU backend (float32): our C++ ops (``agents.model.native_kernels``) as MindSpore AOT Custom ops.

Attention is one op per layer and step that ropes, writes the cache in place and attends without copying the
context; each layer's cache is one Parameter holding every kv head's keys and values. Prefill takes the prompts
back to back (``agents.runtime.ragged_prefill``). Where the projection kernel is vectorized (AVX-512 builds), the
projections are native too, fused with the norms, SwiGLU and residual adds, with weights in the panel layout of
``agents.weights.packed`` and a bucket's padding rows skipped; elsewhere MindSpore's MatMul stays (our plain-loop
kernel is slower than it), see docs/model.md. ``with_precision`` gives the same backend with float16 (``half``) or
bfloat16 (``fast``, AVX512_BF16) projection weights: docs/benchmarks.md "Fast precision mode";
``with_quantization`` with int8 layer weights and ``with_kv_cache_dtype`` with an int8 KV cache: docs/quantization.md.
"""

from __future__ import annotations

import copy

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from agents.model.backends.base import Attention, LoraProjections, OpsBackend
from agents.model.native_kernels import NativeOps, native_ops
from llm_serving.protocol.model_config import LlamaConfig

# Steps of up to this many tokens keep the kernels' helper threads polling between their ops: such a step's ops
# are short, so a helper's wake-up is much of each (bench model, in process: batch 1 and 8 ~0.5 ms faster per
# step). In a larger step the wake-ups are a small share of each op, and a polling helper would take the core
# the master's HTTP writes and scheduling use meanwhile (polling at every size, served saturation's second runs
# were slower in two of three rounds: docs/benchmarks.md, "Where a saturated step goes, and one helper pool").
POLL_MAX_TOKENS = 16


class NativeAttention(Attention):
    """The native prefill (ragged) and decode attention ops over per-kv-head caches."""

    def __init__(self, native: NativeOps, config: LlamaConfig, num_blocks: int, block_size: int,
                 dtype: ms.Type, kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.prefill_op = native.prefill
        self.decode_op = native.decode
        self.chunked_op = native.chunked
        # One Parameter per layer, [2 * kv_heads, slots, head_dim] (the key heads, then the value heads): every
        # Parameter a graph reads costs MindSpore's runtime microseconds on each call, and a step reads every
        # layer's cache (one per kv head and kind made a batch-1 decode step measurably slower).
        # An int8 cache row holds head_dim int8 values and a float32 scale (4 bytes): kernels/paged_attention.cc.
        int8 = kv_cache_dtype == "int8"
        shape = (2 * config.num_key_value_heads, num_blocks * block_size, config.head_dim + (4 if int8 else 0))
        self.kv_cache = Parameter(initializer("zeros", shape, ms.int8 if int8 else dtype), name="kv_cache",
                                  requires_grad=False)
        self.block_offsets = Tensor(np.arange(block_size, dtype=np.int32))

    def caches(self) -> tuple[Parameter, ...]:
        return (self.kv_cache,)

    def cache_blocks(self, block_size: int) -> list[np.ndarray]:
        heads, slots, row = self.kv_cache.shape  # [2 * kv_heads, slots, row] -> [blocks, 2 * kv_heads, block, row]
        return [self.kv_cache.asnumpy().reshape(heads, slots // block_size, block_size, row).transpose(1, 0, 2, 3)]

    def construct(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, is_prefill: bool) -> Tensor:
        if is_prefill:
            return self.prefill_op(qkv, cos, sin, slot_mapping, lens, self.kv_cache)
        return self.decode_op(qkv, cos, sin, slot_mapping, block_tables, lens, self.block_offsets, self.kv_cache)

    def chunked(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, query_lens: Tensor,
                context_lens: Tensor, block_tables: Tensor, positions: Tensor) -> Tensor:
        """Ragged chunks over cached context: one native op (``ChunkedPrefillAttention``)."""
        return self.chunked_op(qkv, cos, sin, slot_mapping, query_lens, context_lens, block_tables,
                               self.block_offsets, self.kv_cache)


class NativeNormOp(nn.Cell):
    """A fused native ``(x, norm_weight, eps, packed w, rows)`` op with its ``eps`` held here."""

    def __init__(self, op: ops.Custom, eps: float) -> None:
        super().__init__()
        self.op = op
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x: Tensor, norm_weight: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
        return self.op(x, norm_weight, self.eps, weight, rows)


class NativeResidualLinear(nn.Cell):
    """The native ``(x, packed w, residual, rows) -> residual + x @ W^T`` op."""

    def __init__(self, op: ops.Custom) -> None:
        super().__init__()
        self.op = op

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor) -> Tensor:
        return self.op(x, weight, residual, rows)


class NativePartialLinear(nn.Cell):
    """The native ``(x, packed w, rows) -> x @ W^T`` op."""

    def __init__(self, op: ops.Custom) -> None:
        super().__init__()
        self.op = op

    def construct(self, x: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
        return self.op(x, weight, rows)


class NativeLoraNormOp(nn.Cell):
    """A fused native ``(x, norm_weight, eps, packed w, rows, a, b, slots)`` op (a LoRA update added) with its
    ``eps`` held here."""

    def __init__(self, op: ops.Custom, eps: float) -> None:
        super().__init__()
        self.op = op
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x: Tensor, norm_weight: Tensor, weight: Tensor, rows: Tensor, a: Tensor, b: Tensor,
                  slots: Tensor) -> Tensor:
        return self.op(x, norm_weight, self.eps, weight, rows, a, b, slots)


class NativeLoraResidualLinear(nn.Cell):
    """The native ``(x, packed w, residual, rows, a, b, slots) -> residual + x @ W^T + update`` op."""

    def __init__(self, op: ops.Custom) -> None:
        super().__init__()
        self.op = op

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor, a: Tensor, b: Tensor,
                  slots: Tensor) -> Tensor:
        return self.op(x, weight, residual, rows, a, b, slots)


class NativeLoraPartialLinear(nn.Cell):
    """The native ``(x, packed w, rows, a, b, slots) -> x @ W^T + update`` op."""

    def __init__(self, op: ops.Custom) -> None:
        super().__init__()
        self.op = op

    def construct(self, x: Tensor, weight: Tensor, rows: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
        return self.op(x, weight, rows, a, b, slots)


class NativeGreedy(nn.Cell):
    """The native greedy pick: ``logits -> (token ids, log-probabilities)``."""

    def __init__(self, op: ops.Custom) -> None:
        super().__init__()
        self.op = op

    def construct(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return self.op(logits)


class NativeCpuBackend(OpsBackend):
    """Native attention and greedy pick; native projections where ``native.projections`` (AVX-512)."""

    name = "native_cpu"
    kernels = "native"
    ragged_prefill = True
    chunked_prefill = True

    # a sparse layer's MLP slot as MoeLayer (True), or its routing in MindSpore's ops around MoeExperts: the path
    # before it, kept as scripts/bench_moe.py's baseline (--moe-op experts)
    fused_moe = True

    def __init__(self, native: NativeOps) -> None:
        self.native = native
        # (int8 weights use the native projections on any CPU, ``with_quantization``: the plain-loop build is their
        # portable fallback, MindSpore's MatMul having no int8-weight form on CPU)
        self.panel_weights = self.skips_padding = native.projections
        self.poll_max_tokens = POLL_MAX_TOKENS  # the largest step whose ops the helpers poll for (0: none)

    def with_precision(self, precision: str) -> NativeCpuBackend:
        """``half``: the projections read float16 weights (half the bytes; every product and sum float32).
        ``fast``: they read bfloat16 weights and round their inputs to bfloat16 (float32 sums, AVX512_BF16's
        vdpbf16ps: about twice the float32 GEMM's rate). Attention, norms, the KV cache and the greedy pick stay
        float32. Refused where the projections are not native (no AVX-512), and ``fast`` where the CPU lacks
        AVX512_BF16 (its fallback loops would be slower than exact mode, not what the key asks for)."""
        if precision == "exact":
            return self
        if precision not in ("fast", "half"):
            raise ValueError(f"model_config.precision {precision!r} is not one of exact, half, fast")
        if not self.native.projections:
            raise ValueError(f"model_config.precision {precision} needs the native projections (an AVX-512 CPU); "
                             "use exact")
        if precision == "fast" and not self.native.bf16:
            raise ValueError("model_config.precision fast needs a CPU with AVX512_BF16 (the native projections' "
                             "bfloat16 dot products): use exact")
        changed = copy.copy(self)
        changed.panel_dtype = "bfloat16" if precision == "fast" else "float16"
        return changed

    def with_quantization(self, quantization: str) -> NativeCpuBackend:
        """``w8a16``: the decoder layers' projections read int8 weights with a float32 scale per output channel
        (``agents.weights.packed.pack_int8``), each formed as float(q) * scale and used as a float32 weight, so the
        model computes what the float32 model on the dequantized weights computes, reading a quarter of the bytes.
        The lm_head, embeddings, norms, attention and KV cache stay float32. Only with precision exact (the
        kernels' int8 tiles take float32 inputs)."""
        if quantization == "none":
            return self
        if quantization != "w8a16":
            raise ValueError(f"model_config.quantization {quantization!r} is not one of none, w8a16")
        if self.panel_dtype is not None:
            raise ValueError("model_config.quantization w8a16 takes float32 activations: set model_config.precision "
                             "exact")
        changed = copy.copy(self)
        changed.layer_quantization = quantization
        changed.panel_weights = changed.skips_padding = True  # the plain-loop build's int8 projections included
        return changed

    def with_kv_cache_dtype(self, kv_cache_dtype: str, int8_direction: str | None = None) -> NativeCpuBackend:
        """``int8``: each layer's cache holds int8 keys and values with a float32 scale per token and kv head,
        quantized as the attention ops write them and dequantized block by block as they read them
        (``kernels/paged_attention.cc``): a quarter of the bytes per cached token (plus its scales). Our own kernel
        multiplies: ``int8_direction`` is for fused kernels."""
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"model_config.kv_cache_dtype {kv_cache_dtype!r} is not one of auto, int8")
        changed = copy.copy(self)
        changed.kv_cache_dtype = kv_cache_dtype
        return changed

    def before_step(self, tokens: int) -> None:
        self.native.poll_helpers(tokens <= self.poll_max_tokens)

    def after_step(self) -> None:
        self.native.poll_helpers(False)

    def attention(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: ms.Type) -> Attention:
        return NativeAttention(self.native, config, num_blocks, block_size, dtype, self.kv_cache_dtype)

    def norm_linear(self, out_dim: int, eps: float) -> nn.Cell:
        if not self.panel_weights:
            return super().norm_linear(out_dim, eps)
        return NativeNormOp(self.native.norm_linear(out_dim), eps)

    def norm_swiglu(self, ffn_dim: int, eps: float) -> nn.Cell:
        if not self.panel_weights:
            return super().norm_swiglu(ffn_dim, eps)
        return NativeNormOp(self.native.norm_swiglu(ffn_dim), eps)

    def residual_linear(self) -> nn.Cell:
        if not self.panel_weights:
            return super().residual_linear()
        return NativeResidualLinear(self.native.residual_linear())

    def partial_linear(self, out_dim: int) -> nn.Cell:
        if not self.panel_weights:
            return super().partial_linear(out_dim)
        return NativePartialLinear(self.native.partial_linear(out_dim))

    def lora_projections(self) -> LoraProjections | None:
        # where the projections are ours: the update inside them (kernels/linear.cc, LoraCall), one op per
        # projection as without adapters
        if not self.panel_weights:
            return None
        native = self.native
        return LoraProjections(
            norm_linear=lambda out_dim, eps: NativeLoraNormOp(native.lora_norm_linear(out_dim), eps),
            norm_swiglu=lambda ffn_dim, eps: NativeLoraNormOp(native.lora_norm_swiglu(ffn_dim), eps),
            residual_linear=lambda: NativeLoraResidualLinear(native.lora_residual_linear()),
            partial_linear=lambda out_dim: NativeLoraPartialLinear(native.lora_partial_linear(out_dim)))

    def greedy(self) -> nn.Cell:
        return NativeGreedy(self.native.greedy)

    def moe_layer(self) -> nn.Cell | None:
        # norm, router, top-k, experts and residual in one op: no MindSpore op left between ours, yet the helpers'
        # polling still made batch-1 steps 1.6-2.7 ms slower (two runs on the loaded 2-core machine, docs/model.md
        # "Speed: MoE against the dense model of the same active size"), so it stays off for MoE models
        if not self.fused_moe:
            return None
        self.poll_max_tokens = 0
        return self.native.moe_layer(self.layer_quantization != "none")

    def moe_experts(self) -> nn.Cell | None:
        # the unfused path (fused_moe off) runs MindSpore's own ops (router softmax, top-k, norm) between ours:
        # helpers polling for our next op would take their cores (decode B=1 2.4x slower then, docs/model.md)
        self.poll_max_tokens = 0
        # w8a16: the experts held int8 with a scale per row (agents.model.moe.ExpertsHeld), read as such
        return self.native.moe_experts_int8() if self.layer_quantization != "none" else self.native.moe_experts()


def create(dtype: str, hidden_size: int) -> NativeCpuBackend:
    """The backend with its kernels built (or reused from the cache); ``KernelBuildError`` when they cannot be,
    ``ValueError`` for a dtype the kernels do not handle."""
    if dtype != "float32":
        raise ValueError(f"native kernels run on CPU with float32 only (got CPU, {dtype}); use auto or portable")
    return NativeCpuBackend(native_ops(hidden_size))
