"""The Ascend backend: MindSpore's fused NPU primitives (``mindspore.ops.auto_generate``) and the KV-cache layout
they take, ``[num_blocks, block_size, kv_heads, head_dim]`` per layer for K and for V.

Per layer and step: ``ApplyRotaryPosEmb`` ropes Q and K, ``ReshapeAndCache`` writes K/V at ``slot_mapping``, then
``FlashAttentionScore`` (layout ``TH``: the prompts back to back) attends in prefill, ``PagedAttention`` (GQA,
through the block tables) in decode, and ``PagedAttention`` with ``q_seq_lens`` over cached context (chunks,
prefix-cache hits). Projections are ``RmsNorm`` + one fused QKV or gate/up ``MatMul`` (+ ``Swiglu``), or with int8
weights (``model_config.quantization: w8a16``) ``WeightQuantBatchMatmul``; the greedy pick is ``ArgMaxWithValue`` over
float32 logits. These kernels have no CPU implementation; on CPU their graphs are exported (``agents.tools.export``),
checked against the contracts the internal kernels read (``agents.tools.contracts``) and their wiring runs with
stand-ins of the same contracts (``agents.model.backends.ascend_reference``), see docs/ascend.md.

Conventions, as MindSpore 2.10's internal kernels (``infer_boost`` on) read them and the working 910B stacks pass
them (MindFormers 1.8, vllm-mindspore):
- both attention kernels take each sequence's length from the step's graph input ``batch_valid_length`` itself
  (its host values, by name; query lengths from ``q_seq_lens``), so the graph never computes lengths: the runner
  prepares them (``decode_padding_length``, ``ragged_lengths``, ``mixed_lengths``);
- prefill FlashAttention: ``sparse_mode`` 0 with the 128 x 128 causal mask in the compute dtype, per-sequence
  lengths (not cumulative) that cover every row passed, none empty: the graph appends ``max_seqs`` zero rows to
  the bucket's ``tokens``, each padding sequence gets one row and the last sequence the rest. Real prompts come
  first and are causal, so rows after them never reach them;
- the cache write stays in a graph only where its result is consumed on that graph's path, so the query depends
  on it before the prefill/decode branch (tests/test_ascend_export.py);
- padding tokens write to slot 0 of the dummy block 0, which no sequence reads; padding decode rows get context
  length 1 and attend over that slot, so no kernel sees an empty context.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer
from mindspore.ops.auto_generate import (
    ApplyRotaryPosEmb,
    ArgMaxWithValue,
    FlashAttentionScore,
    PagedAttention,
    ReshapeAndCache,
    RmsNorm,
    Swiglu,
    WeightQuantBatchMatmul,
)

from agents.model.backends import graph_ops
from agents.model.backends.ascend_limits import (
    CHUNK_MASK_VALUE,
    FA_CAUSAL_HEAD_DIMS,
    FA_MASK_SIZE,
    MAX_HEADS,
    MAX_TH_BATCH,
    PA_BLOCK_SIZES,
    PA_MAX_HEAD_DIM_X_BLOCK,
    fa_mask_value,
)
from agents.model.backends.ascend_moe import AscendRoutedExperts, ExpertSlice, MoeOps
from agents.model.backends.ascend_moe_reference import MoeReferenceOps
from agents.model.backends.base import Attention, OpsBackend
from llm_serving.protocol.ascend_env import INT8_KV_DIRECTIONS
from llm_serving.protocol.model_config import ASCEND_DTYPES, LlamaConfig
from llm_serving.protocol.moe_config import MoeSpec


@lru_cache(maxsize=3)
def causal_mask(dtype: ms.Type) -> Tensor:
    """The causal mask the internal FlashAttention takes with ``sparse_mode`` 0 (``ascend_limits.fa_mask_value``),
    in the compute dtype; one for all layers."""
    value = fa_mask_value("bfloat16" if dtype == ms.bfloat16 else "float16")
    return Tensor(np.triu(np.ones((FA_MASK_SIZE, FA_MASK_SIZE)), 1) * value, dtype)


class FusedOps:
    """The fused primitives, one factory each. The backend's cells get theirs from here, so CPU tests can pass
    stand-ins with the same call contracts (``agents.model.backends.ascend_reference.ReferenceOps``)."""

    name = "fused"

    def rms_norm(self, eps: float):
        """``(x, gamma) -> (y, rstd)``."""
        return RmsNorm(eps)

    def swiglu(self):
        """``(x, dim) -> silu(first half) * second half``."""
        return Swiglu()

    def rope(self):
        """``(q [T, N*D], k [T, Nkv*D], cos [T, D], sin [T, D], seq_lens) -> (q, k)``: cos/sin gathered per token,
        rotate-half layout (``cos_format=2``, as MindFormers' Llama)."""
        return ApplyRotaryPosEmb(cos_format=2)

    def reshape_and_cache(self):
        """``(key, value [T, Nkv*D], key_cache, value_cache, slot_mapping [T] int32)``, caches written in place."""
        return ReshapeAndCache()

    def paged_attention(self, heads: int, scale: float, kv_heads: int):
        """``(query [B, N, D], key_cache, value_cache, block_tables [B, W] int32, context_lens [B] int32)``."""
        return PagedAttention(heads, scale, kv_heads)

    def flash_attention(self, heads: int, scale: float):
        """``(q [T, N*D], k, v [T, Nkv*D], ..., attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen)``, output 3;
        causal within each sequence of the per-sequence lengths (``sparse_mode`` 0 with the 128 x 128 mask)."""
        return FlashAttentionScore(heads, scale_value=scale, next_tokens=0, input_layout="TH", sparse_mode=0)

    def argmax_with_value(self):
        """``(x) -> (index, max)`` over the last axis."""
        return ArgMaxWithValue(axis=-1)

    def weight_quant_matmul(self):
        """``(x [M, K], weight int8 [N, K], antiquant_scale [N] in x's dtype, antiquant_offset, quant_scale,
        quant_offset, bias) -> x @ (weight * scale)^T``: W8A16 per output channel, the weight as Hugging Face holds
        it (``transpose_weight``), no offset, bias or output quantization (Golden Stick's and MindFormers'
        weight-only int8 layers; ACLNN's aclnnWeightQuantBatchMatmulV2 runs it)."""
        return WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=0)


class AscendAttention(Attention):
    """One layer's block-layout K/V caches and its rope, cache write and attention by the fused primitives."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: ms.Type, fused: FusedOps,
                 kv_int8: bool = False, int8_direction: str = "multiply") -> None:
        """``int8_direction``: how PagedAttention applies ``kv_scale`` to the int8 caches (``INT8_KV_DIRECTIONS``,
        the device check's finding: ``AscendBackend.with_kv_cache_dtype`` requires it)."""
        super().__init__()
        if int8_direction not in INT8_KV_DIRECTIONS:
            raise ValueError(f"int8_direction must be one of {', '.join(INT8_KV_DIRECTIONS)}, got {int8_direction!r}")
        self.int8_direction = int8_direction
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.hidden = config.hidden_size
        self.kv_dim = config.kv_dim
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, self.n_kv, self.head_dim)
        cache_dtype = ms.int8 if kv_int8 else dtype
        self.key_cache = Parameter(initializer("zeros", shape, cache_dtype), name="key_cache", requires_grad=False)
        self.value_cache = Parameter(initializer("zeros", shape, cache_dtype), name="value_cache", requires_grad=False)
        self.kv_int8 = kv_int8
        self.kv_scale = self.kv_offset = self.kv_inverse = None
        if kv_int8:  # static scales per channel, row 0 the keys', row 1 the values' (load_kv_scales)
            rows = (2, self.kv_dim)
            self.kv_scale = Parameter(initializer("ones", rows, ms.float16), name="kv_scale", requires_grad=False)
            self.kv_offset = Parameter(initializer("zeros", rows, ms.float16), name="kv_offset", requires_grad=False)
            self.kv_inverse = Parameter(initializer("ones", rows, ms.float32), name="kv_inverse", requires_grad=False)
        scale = 1.0 / float(np.sqrt(self.head_dim))
        self.rope = fused.rope()
        self.cache_write = fused.reshape_and_cache()
        self.paged = fused.paged_attention(self.n_heads, scale, self.n_kv)
        self.flash = fused.flash_attention(self.n_heads, scale)
        self.causal_mask = causal_mask(dtype)

    def caches(self) -> tuple[Parameter, ...]:
        return (self.key_cache, self.value_cache)

    def load_kv_scales(self, scales: np.ndarray) -> None:
        """``scales [2, kv_dim]``: each cached channel's dequantization scale (keys, then values). PagedAttention
        takes its antiquant_scale in float16 (the kernel takes no bfloat16): the scales themselves where it
        multiplies, their inverses where it divides (``int8_direction``). The cache is written with the factor
        the float16 value makes exact (its inverse, or itself), so a row dequantizes to what was written to within
        half a step whichever way the kernel applies it."""
        step = np.asarray(scales, np.float32)
        with np.errstate(divide="ignore", over="ignore"):
            held = (step if self.int8_direction == "multiply" else 1.0 / step).astype(np.float16)
        if held.shape != (2, self.kv_dim) or not (np.isfinite(held) & (held > 0)).all():
            raise ValueError(f"KV cache scales: expected (2, {self.kv_dim}) values positive as float16 (and their "
                             f"inverses: {self.int8_direction}), got {held.shape}, min "
                             f"{float(step.min()) if step.size else None}")
        self.kv_scale.set_data(Tensor(held, ms.float16))
        write = 1.0 / held.astype(np.float32) if self.int8_direction == "multiply" else held.astype(np.float32)
        self.kv_inverse.set_data(Tensor(write, ms.float32))

    def quantized(self, x: Tensor, row: int) -> Tensor:
        """``x`` (keys: ``row`` 0, values: 1) as the int8 cache holds it: ``round(x / scale)`` within [-127, 127]
        by plain ops, which leaves no doubt about the direction of the scale (QuantV2's docstring multiplies by
        it, the stacks pass it the dequantization scale: docs/quantization.md). In float32: a bfloat16 product
        (8 significant bits) would land up to half a step off near the ends of the range."""
        q = ops.round(x.astype(ms.float32) * self.kv_inverse[row])
        return ops.clamp(q, -127.0, 127.0).astype(ms.int8)

    def attend_paged(self, q: Tensor, block_tables: Tensor, context_lens: Tensor, mask=None, q_lens=None) -> Tensor:
        """PagedAttention over the caches; an int8 cache with its antiquant scale and a zero offset (symmetric: a
        zero offset reads the same whichever way the kernel applies it)."""
        if self.kv_int8:
            return self.paged(q, self.key_cache, self.value_cache, block_tables, context_lens, self.kv_scale,
                              self.kv_offset, mask, q_lens)
        return self.paged(q, self.key_cache, self.value_cache, block_tables, context_lens, None, None, mask, q_lens)

    def rope_and_write(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
                       lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V of the step's tokens, Q and K roped, K and V written to the cache; the query depends on the
        write, which keeps it in the graph, before the attention reads the cache."""
        q = qkv[:, : self.hidden]
        k = qkv[:, self.hidden: self.hidden + self.kv_dim]
        v = qkv[:, self.hidden + self.kv_dim:]
        q, k = self.rope(q, k, cos, sin, lens)
        if self.kv_int8:
            written = self.cache_write(self.quantized(k, 0), self.quantized(v, 1), self.key_cache, self.value_cache,
                                       slot_mapping)
        else:
            written = self.cache_write(k, v, self.key_cache, self.value_cache, slot_mapping)
        return ops.depend(q, written), k, v

    @staticmethod
    def appended(x: Tensor, seqs: int) -> Tensor:
        """``x`` with ``seqs`` zero rows after it: the padding sequences' own rows (see the module doc)."""
        return ops.concat((x, ops.zeros((seqs, x.shape[1]), x.dtype)))

    def construct(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, is_prefill: bool) -> Tensor:
        q, k, v = self.rope_and_write(qkv, cos, sin, slot_mapping, lens)
        if is_prefill:
            return self.prefill(q, k, v, lens)
        return self.decode(q, block_tables, lens)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, lens: Tensor) -> Tensor:
        """Causal attention within each prompt, prompts back to back (``TH``); ``lens`` is the graph input
        ``batch_valid_length`` as ``ragged_lengths`` fills it, covering the bucket plus the rows appended here."""
        tokens, seqs = q.shape[0], lens.shape[0]
        q, k, v = self.appended(q, seqs), self.appended(k, seqs), self.appended(v, seqs)
        out = self.flash(q, k, v, None, None, None, self.causal_mask, None, lens, lens)[3]
        return out[:tokens]

    def decode(self, q: Tensor, block_tables: Tensor, context_lens: Tensor) -> Tensor:
        """One query per sequence over its paged context; padding rows (length 1 from the runner) read the dummy
        slot. ``context_lens`` must be the graph input ``batch_valid_length`` itself, not computed from it."""
        batch = q.shape[0]
        out = self.attend_paged(q.reshape(batch, self.n_heads, self.head_dim), block_tables, context_lens)
        return out.reshape(batch, self.hidden)

    def chunked(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, query_lens: Tensor,
                context_lens: Tensor, block_tables: Tensor, mask: Tensor) -> Tensor:
        """Queries over cached context by PagedAttention's multi-token path, as vllm-mindspore runs chunked prefill
        and prefix-cache hits: ``q_seq_lens`` (``query_lens``) rows per sequence, the last of its
        ``batch_valid_length`` (``context_lens``) positions, each row masked past its position. The lengths are the
        step's graph inputs of those names, filled by ``mixed_lengths`` to cover the bucket and ``max_seqs``
        appended rows (as ``prefill``). ``mask``: the step's ``chunk_input``."""
        q, _, _ = self.rope_and_write(qkv, cos, sin, slot_mapping, context_lens)
        tokens, seqs = q.shape[0], query_lens.shape[0]
        rows = tokens + seqs
        q = self.appended(q, seqs).reshape(rows, self.n_heads, self.head_dim)
        out = self.attend_paged(q, block_tables, context_lens, mask, query_lens)
        return out.reshape(rows, self.hidden)[:tokens]

    def chunk_input(self, positions: Tensor, block_tables: Tensor, query_lens: Tensor) -> Tensor:
        """The mask rows PagedAttention's multi-token path reads, built once per step graph and shared by every
        layer (an 8,320 x 4,096 float16 mask in the largest mixed bucket of the 910B config: 68 MB per build):
        each query row masks the kv positions after its own, over all the block table reaches; the rows
        ``chunked`` appends sit at position 0."""
        seqs = query_lens.shape[0]
        at = ops.concat((positions, ops.zeros(seqs, positions.dtype)))  # appended rows: position 0
        span = block_tables.shape[1] * self.block_size  # the kv positions a table reaches
        later = ops.arange(span).astype(at.dtype).reshape(1, span) > at.reshape(-1, 1)
        return later.astype(self.dtype) * CHUNK_MASK_VALUE


class AscendProjection(nn.Cell):
    """``x @ W^T`` for a projection's operands (``agents.model.projection.ProjectionWeight.operands``): ``MatMul`` of a
    float weight, or the weight-quant matmul of an ``(int8 weight, scale)`` pair (w8a16)."""

    def __init__(self, fused: FusedOps) -> None:
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.quant_matmul = fused.weight_quant_matmul()

    def construct(self, x: Tensor, weight) -> Tensor:
        if isinstance(weight, tuple):
            return self.quant_matmul(x, weight[0], weight[1], None, None, None, None)
        return self.matmul(x, weight)


class AscendNormLinear(nn.Cell):
    """``(x, norm_weight, weight, rows) -> RmsNorm(x) @ W^T`` (``rows`` unread: every row is computed)."""

    def __init__(self, eps: float, fused: FusedOps) -> None:
        super().__init__()
        self.norm = fused.rms_norm(eps)
        self.project = AscendProjection(fused)

    def construct(self, x: Tensor, norm_weight: Tensor, weight, rows: Tensor) -> Tensor:
        return self.project(self.norm(x, norm_weight)[0], weight)


class AscendNormSwiGlu(nn.Cell):
    """``(x, norm_weight, [gate; up] weight, rows) -> Swiglu(RmsNorm(x) @ W^T)``."""

    def __init__(self, eps: float, fused: FusedOps) -> None:
        super().__init__()
        self.norm = fused.rms_norm(eps)
        self.project = AscendProjection(fused)
        self.swiglu = fused.swiglu()

    def construct(self, x: Tensor, norm_weight: Tensor, weight, rows: Tensor) -> Tensor:
        return self.swiglu(self.project(self.norm(x, norm_weight)[0], weight), -1)


class AscendSwiGlu(nn.Cell):
    """``[gate; up] -> Swiglu``."""

    def __init__(self, fused: FusedOps) -> None:
        super().__init__()
        self.swiglu = fused.swiglu()

    def construct(self, gate_up: Tensor) -> Tensor:
        return self.swiglu(gate_up, -1)


class AscendResidualLinear(nn.Cell):
    """``(x, weight, residual, rows) -> residual + x @ W^T``."""

    def __init__(self, fused: FusedOps) -> None:
        super().__init__()
        self.project = AscendProjection(fused)

    def construct(self, x: Tensor, weight, residual: Tensor, rows: Tensor) -> Tensor:
        return residual + self.project(x, weight)


class AscendLinear(nn.Cell):
    """``(x, weight, rows) -> x @ W^T`` (a tensor-parallel rank's partial sum)."""

    def __init__(self, fused: FusedOps) -> None:
        super().__init__()
        self.project = AscendProjection(fused)

    def construct(self, x: Tensor, weight, rows: Tensor) -> Tensor:
        return self.project(x, weight)


class AscendHeadNorm(graph_ops.HeadNorm):
    """Qwen3's per-head q/k norms by the fused ``RmsNorm``, which normalizes over the last axis (``head_dim``)."""

    def __init__(self, config: LlamaConfig, eps: float, fused: FusedOps) -> None:
        super().__init__(config, eps)
        self.norm = fused.rms_norm(eps)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.norm(x, weight)[0]


class AscendGreedy(nn.Cell):
    """``logits -> (int32 ids, float32 logprobs)``: ``ArgMaxWithValue`` gives the id and its logit at once, and
    logit - logsumexp = -log(sum(exp(logits - max))) since the chosen logit is the max."""

    def __init__(self, fused: FusedOps) -> None:
        super().__init__()
        self.argmax = fused.argmax_with_value()

    def construct(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits.astype(ms.float32)
        index, top = self.argmax(logits)
        logprob = -ops.log(ops.sum(ops.exp(logits - top.reshape(-1, 1)), -1))
        return index.astype(ms.int32), logprob


class AscendBackend(OpsBackend):
    """The fused primitives of ``fused`` (the NPU's by default); prefill ragged (``TH``); chunks and prefix-cache
    hits ragged through PagedAttention's ``q_seq_lens``."""

    name = "ascend"
    kernels = "native"
    ragged_prefill = True
    chunked_prefill = True
    decode_padding_length = 1
    mixed_padding_slots = 1

    @staticmethod
    def mixed_lengths(query_lens: np.ndarray, context_lens: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """``q_seq_lens`` and ``batch_valid_length`` of a ragged mixed call as PagedAttention reads them: the rows
        of the bucket after the real tokens and the ``len(query_lens)`` rows ``chunked`` appends belong to the
        padding sequences (at least the last slot, ``mixed_padding_slots``): one row over one position of the
        dummy block each, the last slot the rest, as a prompt of its own."""
        query, context = query_lens.astype(np.int32), context_lens.astype(np.int32)
        pad = query == 0
        if not pad[-1]:
            raise ValueError("a mixed call on Ascend keeps its last sequence slot for the padding rows")
        query[pad], context[pad] = 1, 1
        query[-1] += tokens + len(query) - int(query.sum())
        context[-1] = query[-1]
        return query, context

    @staticmethod
    def ragged_lengths(lens: np.ndarray, tokens: int) -> np.ndarray:
        """``batch_valid_length`` of a ragged prefill as FlashAttention reads it: every sequence at least one row,
        the lengths summing to the ``tokens + len(lens)`` rows it attends over (``AscendAttention.prefill``)."""
        out = np.maximum(lens, 1).astype(np.int32)
        out[-1] += tokens + len(lens) - int(out.sum())
        return out

    def __init__(self, fused: FusedOps | None = None) -> None:
        self.fused = fused if fused is not None else FusedOps()
        # MoE layers: MindSpore's MoE kernels, or their stand-ins beside the other ops' stand-ins
        self.moe = MoeOps() if self.fused.name == "fused" else MoeReferenceOps()
        self.int8_direction = INT8_KV_DIRECTIONS[0]  # with_kv_cache_dtype's
        if self.fused.name != "fused":
            self.name = f"ascend ({self.fused.name} stand-ins)"

    def with_quantization(self, quantization: str) -> AscendBackend:
        """``w8a16``: the layers' projections hold int8 ``[out, in]`` weights and a scale per output row in the
        compute dtype, multiplied by the weight-quant matmul (``FusedOps.weight_quant_matmul``)."""
        if quantization not in ("none", "w8a16"):
            raise ValueError(f"model_config.quantization {quantization!r} is not one of none, w8a16")
        quantized = copy.copy(self)  # the same backend (a subclass stays one), its layers' weights quantized
        quantized.layer_quantization = quantization
        return quantized

    def check(self, config: LlamaConfig, block_size: int, max_prefill_batch: int) -> None:
        problems = model_problems(config, block_size, max_prefill_batch)
        if problems:
            raise ValueError("the Ascend kernels cannot run this model: " + "; ".join(problems))

    def with_kv_cache_dtype(self, kv_cache_dtype: str, int8_direction: str | None = None) -> AscendBackend:
        """``int8``: int8 caches with static per-channel scales (``AscendAttention.load_kv_scales``), written by
        ReshapeAndCache after the attention quantizes K and V, read by PagedAttention with its antiquant scale,
        which ``int8_direction`` says how the kernel applies (``INT8_KV_DIRECTIONS``; required: unverified)."""
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"model_config.kv_cache_dtype {kv_cache_dtype!r} is not one of auto, int8")
        if kv_cache_dtype == "int8" and int8_direction not in INT8_KV_DIRECTIONS:
            raise ValueError(f"model_config.ascend_int8_kv_direction: expected one of {', '.join(INT8_KV_DIRECTIONS)} "
                             f"for an int8 KV cache on Ascend, got {int8_direction!r}")
        changed = copy.copy(self)
        changed.kv_cache_dtype = kv_cache_dtype
        changed.int8_direction = int8_direction or INT8_KV_DIRECTIONS[0]
        return changed

    def attention(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: ms.Type) -> Attention:
        return AscendAttention(config, num_blocks, block_size, dtype, self.fused, self.kv_cache_dtype == "int8",
                               self.int8_direction)

    def norm_linear(self, out_dim: int, eps: float) -> nn.Cell:
        return AscendNormLinear(eps, self.fused)

    def norm_swiglu(self, ffn_dim: int, eps: float) -> nn.Cell:
        return AscendNormSwiGlu(eps, self.fused)

    def swiglu(self, ffn_dim: int) -> nn.Cell:
        return AscendSwiGlu(self.fused)

    def head_norm(self, config: LlamaConfig, eps: float) -> nn.Cell:
        return AscendHeadNorm(config, eps, self.fused)

    def residual_linear(self) -> nn.Cell:
        return AscendResidualLinear(self.fused)

    def partial_linear(self, out_dim: int) -> nn.Cell:
        return AscendLinear(self.fused)

    def routed_experts(self) -> AscendMoeKernels:
        return AscendMoeKernels(self.moe)

    def greedy(self) -> nn.Cell:
        return AscendGreedy(self.fused)


class AscendMoeKernels:
    """``base.RoutedExperts`` on Ascend: a sparse layer's routing and experts as MindSpore's MoE kernels."""

    def __init__(self, moe: MoeOps | MoeReferenceOps) -> None:
        self.moe = moe

    def cell(self, spec: MoeSpec, experts: ExpertSlice) -> AscendRoutedExperts:
        return AscendRoutedExperts(self.moe, spec.top_k, spec.norm_topk_prob, experts)


def model_problems(config: LlamaConfig, block_size: int, max_prefill_batch: int) -> list[str]:
    """What the fused kernels' limits (``ascend_limits``) refuse in this model and cache; MindSpore's export checks
    none of these."""
    problems = []
    if config.head_dim not in FA_CAUSAL_HEAD_DIMS:
        problems.append(f"head_dim {config.head_dim} must be one of "
                        f"{', '.join(map(str, FA_CAUSAL_HEAD_DIMS))} (causal FlashAttentionScore)")
    if block_size not in PA_BLOCK_SIZES:
        problems.append(f"pa_config.block_size {block_size} must be one of {', '.join(map(str, PA_BLOCK_SIZES))} "
                        "(PagedAttention)")
    elif config.head_dim * block_size > PA_MAX_HEAD_DIM_X_BLOCK:
        problems.append(f"pa_config.block_size {block_size} x head_dim {config.head_dim} exceeds "
                        f"{PA_MAX_HEAD_DIM_X_BLOCK} (PagedAttention)")
    if config.num_attention_heads > MAX_HEADS:
        problems.append(f"num_attention_heads {config.num_attention_heads} exceeds {MAX_HEADS} per device "
                        "(FlashAttentionScore)")
    if max_prefill_batch > MAX_TH_BATCH:
        problems.append(f"model_config.prefill_batch_size {max_prefill_batch} exceeds {MAX_TH_BATCH} prompts per "
                        "call (FlashAttentionScore TH)")
    return problems


def create(dtype: str, hidden_size: int) -> AscendBackend:
    """The backend of the NPU's fused primitives; ``ValueError`` for a dtype they do not take."""
    if dtype not in ASCEND_DTYPES:
        raise ValueError(f"the Ascend kernels take float16 or bfloat16 (model_config.dtype), got {dtype}")
    return AscendBackend()
