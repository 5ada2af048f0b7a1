"""The interface every ops backend implements: what the Llama layer and the runner may ask of a device's ops.

Why a seam: the layer's maths is the same everywhere, but the KV-cache layout, the attention ops, whether prefill
takes prompts back to back and whether the projections are native differ per device and dtype. A backend owns
those choices; the layer (``agents.model.llama``) calls the cells a backend makes and never asks which backend it has.

The cells are built once per layer at model construction, so every choice is a Python-time one and each backend's
graphs contain only its own ops. A graph-mode ``construct`` may branch only on literals such as ``is_prefill``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from agents.model.backends import graph_ops
from agents.model.backends.ascend_moe import ExpertSlice
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.moe_config import MoeSpec


class Attention(nn.Cell):
    """One layer's paged KV cache (Parameters in the backend's layout, created here) and attention over it.

    ``construct(qkv, cos, sin, slot_mapping, lens, block_tables, is_prefill)``: ``qkv`` token-flat
    ``[tokens, hidden + 2 * kv_dim]`` before the rotary embedding, ``cos``/``sin`` ``[tokens, head_dim]`` gathered
    at the tokens' positions. Writes the step's K/V at ``slot_mapping`` (flat slot ``block * block_size +
    offset``) and returns the attention output ``[tokens, hidden]``. ``lens``: prompt lengths (prefill) or
    context lengths (decode), ``[batch]``; ``block_tables`` ``[batch, width]`` (decode). ``is_prefill`` is a graph
    constant; prefill inputs are ragged or a padded bucket as the backend's ``ragged_prefill`` says.
    """

    def caches(self) -> tuple[Parameter, ...]:
        """Every cache Parameter of this layer (for checks that the cache is or is not written)."""
        raise NotImplementedError

    def cache_blocks(self, block_size: int) -> list[np.ndarray]:
        """Every cache of this layer as a host array with the blocks on its first axis, sharing the cache's memory
        (KV-copy steps, ``agents.runtime.kv_copy``). Only where the device's memory is the host's: on CPU a
        Parameter's ``asnumpy()`` is the cache itself (``tests/test_disaggregation.py`` checks it both ways)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy its KV cache by block on the host")

    def chunked(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, query_lens: Tensor,
                context_lens: Tensor, block_tables: Tensor, positions: Tensor) -> Tensor:
        """Queries over cached context (chunked prefill, prefill after a prefix-cache hit, decode tokens mixed in;
        ``agents.runtime.mixed_steps``): sequence ``b`` has ``query_lens[b]`` tokens at positions ``context_lens[b] -
        query_lens[b]`` on; each writes its K/V at ``slot_mapping`` and attends to its context up to itself, read
        through ``block_tables``. Tokens are back to back where the backend's ``ragged_prefill`` says so, else in
        a padded ``[batch, seq]`` bucket; ``positions`` are theirs (for kernels that take a mask by position).
        Backends with ``chunked_prefill`` implement it; ``positions`` is what ``chunk_input`` made of them."""
        raise NotImplementedError(f"{type(self).__name__} has no attention over cached context")

    def chunk_input(self, positions: Tensor, block_tables: Tensor, query_lens: Tensor) -> Tensor:
        """What ``chunked`` takes last, made once per step graph before the layer loop (every layer shares it): the
        tokens' positions here; a backend whose kernel takes a mask built from them returns that mask instead."""
        return positions


@dataclass(frozen=True)
class LoraProjections:
    """Projections that add each row's LoRA update in the same op (``OpsBackend.lora_projections``): each makes a
    cell taking the base projection's inputs followed by every slot's ``a`` and ``b`` (the backend's layout,
    ``agents.model.lora``) and ``slots`` (int32 ``[rows]``, each row's slot; < 0: none)."""

    norm_linear: Callable[[int, float], nn.Cell]  # (out_dim, eps)
    norm_swiglu: Callable[[int, float], nn.Cell]  # (ffn_dim, eps)
    residual_linear: Callable[[], nn.Cell]
    partial_linear: Callable[[int], nn.Cell]  # (out_dim)


class RoutedExperts(Protocol):
    """A backend's kernels for a sparse layer's routed experts (``OpsBackend.routed_experts``, run by
    ``agents.model.moe.MoeBlock``)."""

    def cell(self, spec: MoeSpec, experts: ExpertSlice) -> nn.Cell:
        """``(x, router_logits, gate_up [e, h, 2f], down [e, f, h]) -> the experts' weighted sum``."""
        ...


class OpsBackend:
    """The ops of one device and dtype. Subclasses set the flags and override ``attention``; the projections
    and the greedy pick default to MindSpore graph ops (``agents.model.backends.graph_ops``).

    The projection cells take the layer's weights as inputs, so the layer keeps the Parameters (and loaders
    their names), while the backend decides their layout (``panel_weights``) and the ops that read them.
    Each takes ``rows`` ``[1]`` int32 last: the count of real leading rows of ``x`` (a bucket's padding
    follows); a backend with ``skips_padding`` computes only those and returns zeros after them.
    """

    name = "base"  # for logs
    kernels = "portable"  # the ``RunnerConfig.kernels`` choice this backend is: "portable" or "native"
    ragged_prefill = False  # prefill takes the prompts back to back (``agents.runtime.ragged_prefill``), not padded
    panel_weights = False  # projection weights held in ``agents.weights.packed``' panel layout
    skips_padding = False  # projections skip a bucket's padding rows, so padding rows cost next to nothing
    chunked_prefill = False  # its attention cell has ``chunked`` (queries over cached context)
    # a padding decode row's context length as the runner passes it: 0 where the graph clamps it, 1 where the
    # attention kernel takes the lengths as given (Ascend: the internal PagedAttention reads the graph input
    # ``batch_valid_length`` itself, so a clamp inside the graph would not reach it)
    decode_padding_length = 0
    # sequence slots of a ragged mixed call kept for its padding rows (Ascend: their own sequence, see
    # ``mixed_lengths``), so at most ``mixed_max_seqs`` minus these carry real sequences
    mixed_padding_slots = 0
    # panel weights' storage where it is not the model's dtype: "float16", or "bfloat16" (int32 pairs,
    # ``agents.weights.packed.pack_bf16``); set by ``with_precision``
    panel_dtype: str | None = None
    # model_config.quantization of the decoder layers' projections ("none" or "w8a16": int8 weights with a scale per
    # output row, ``agents.model.projection.ProjectionWeight``); set by ``with_quantization``
    layer_quantization: str = "none"
    kv_cache_dtype: str = "auto"  # model_config.kv_cache_dtype: "auto" (the model's dtype) or "int8"

    def with_precision(self, precision: str) -> OpsBackend:
        """This backend for ``model_config.precision`` (``exact``, ``half`` or ``fast``); ``ValueError`` where it has
        no such mode. Only the native CPU backend has the faster ones."""
        if precision != "exact":
            raise ValueError(f"model_config.precision {precision} needs the native CPU kernels (model_config.kernels "
                             f"auto or native, on CPU with g++); the {self.name} ops backend computes exactly only")
        return self

    def with_quantization(self, quantization: str) -> OpsBackend:
        """This backend for ``model_config.quantization`` (``none`` or ``w8a16``); ``ValueError`` where it has no
        such kernels."""
        if quantization != "none":
            raise ValueError(f"model_config.quantization {quantization} needs the native CPU projections "
                             f"(model_config.kernels auto or native, on an AVX-512 CPU with g++); the {self.name} "
                             "ops backend has no int8 projections")
        return self

    def with_kv_cache_dtype(self, kv_cache_dtype: str, int8_direction: str | None = None) -> OpsBackend:
        """This backend with its attention's KV cache in ``kv_cache_dtype`` (``auto``: the model's dtype, or
        ``int8``); ``ValueError`` where its attention has no such cache. ``int8_direction``: how a fused kernel
        applies its dequantization scale (Ascend: ``INT8_KV_DIRECTIONS``)."""
        if kv_cache_dtype != "auto":
            raise ValueError(f"model_config.kv_cache_dtype {kv_cache_dtype} is held by the native CPU attention only "
                             f"(model_config.kernels auto or native, on CPU with g++); the {self.name} ops backend "
                             "keeps the cache in the model's dtype")
        return self

    @staticmethod
    def mixed_lengths(query_lens: np.ndarray, context_lens: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``q_seq_lens`` and ``batch_valid_length`` inputs of a ragged mixed call of ``tokens`` rows (0 for
        padding sequences): as they are, where the graph reads them (see ``ragged_lengths``)."""
        return query_lens, context_lens

    @staticmethod
    def ragged_lengths(lens: np.ndarray, tokens: int) -> np.ndarray:
        """The ``batch_valid_length`` input of a ragged prefill of ``tokens`` rows from its prompt lengths (0 for
        padding sequences): as they are, where the graph reads them; a backend whose kernel reads the lengths
        itself fills them as that kernel requires (Ascend)."""
        return lens

    def check(self, config: LlamaConfig, block_size: int, max_prefill_batch: int) -> None:
        """Raise ``ValueError`` naming what this backend's kernels cannot run (before any graph is built)."""

    def attention(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: ms.Type) -> Attention:
        """The attention cell of one layer, owning that layer's slice of the paged KV cache."""
        raise NotImplementedError

    def norm_linear(self, out_dim: int, eps: float) -> nn.Cell:
        """``(x, norm_weight, weight, rows) -> rmsnorm(x) @ W^T`` of width ``out_dim`` (QKV, lm_head)."""
        return graph_ops.NormLinear(eps)

    def norm_swiglu(self, ffn_dim: int, eps: float) -> nn.Cell:
        """``(x, norm_weight, [gate; up] weight, rows) -> silu(gate) * up`` of width ``ffn_dim``."""
        return graph_ops.NormSwiGlu(ffn_dim, eps)

    def swiglu(self, ffn_dim: int) -> nn.Cell:
        """``[gate; up] -> silu(gate) * up`` alone (after a LoRA update of the gate/up projection)."""
        return graph_ops.SwiGlu(ffn_dim)

    def head_norm(self, config: LlamaConfig, eps: float) -> nn.Cell:
        """``(qkv, q_norm_weight, k_norm_weight) -> qkv`` with each query and key head RMS-normalized (Qwen3's q/k
        norms); ``config``: the heads as the attention sees them."""
        return graph_ops.HeadNorm(config, eps)

    def residual_linear(self) -> nn.Cell:
        """``(x, weight, residual, rows) -> residual + x @ W^T`` (output and down projections)."""
        return graph_ops.ResidualLinear()

    def partial_linear(self, out_dim: int) -> nn.Cell:
        """``(x, weight, rows) -> x @ W^T`` of width ``out_dim``: under tensor parallelism, the partial sum of a
        row-parallel projection on a rank that does not add the residual (``agents.model.parallel``)."""
        return graph_ops.Linear()

    def lora_projections(self) -> LoraProjections | None:
        """Projections that add each row's LoRA update in the same op (``agents.model.lora``), or None: the
        update then runs beside them as the backend's own products."""
        return None

    def greedy(self) -> nn.Cell:
        """``logits [batch, vocab] float32 -> (int32 token ids, float32 log-probabilities)``."""
        return graph_ops.GreedyPick()

    def moe_experts(self) -> nn.Cell | None:
        """A MoE layer's picked experts as one op (``NativeOps.moe_experts``'s inputs, or ``moe_experts_int8``'s
        under ``layer_quantization`` w8a16), float32; None: the expert block's own graph ops (``agents.model.moe``)."""
        return None

    def moe_layer(self) -> nn.Cell | None:
        """A sparse layer's MLP slot as one op, a shared expert aside (``agents.model.moe.MoeMlp``):
        ``NativeOps.moe_layer``'s inputs, the experts int8 under ``layer_quantization`` w8a16; float32.
        None: ``moe_experts``, or the block's graph ops."""
        return None

    def routed_experts(self) -> RoutedExperts | None:
        """A MoE layer's routing and experts as the backend's kernels (``RoutedExperts``: Ascend's
        MoE kernels); None: the expert block's own routing."""
        return None

    def before_step(self, tokens: int) -> None:
        """Called before a step's graph calls, with the step's token count."""

    def after_step(self) -> None:
        """Called when a step's graph calls are done (and their outputs read): the device is idle until the next."""

