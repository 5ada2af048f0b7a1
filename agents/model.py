"""Llama-2 as MindSpore Cells for serving: fused projections, paged KV cache, in-graph greedy argmax.

Layout choices (measured on CPU, see docs/model.md and shared notes):
- Activations stay token-flat ``[tokens, hidden]`` for every projection (3-D activations hit a slow matmul path).
- The ``num_blocks x block_size x kv_heads x head_dim`` K and V caches of a layer are held as one 2-D Parameter
  ``[num_blocks * block_size, head_dim]`` per kv head, so that ``scatter_update`` writes in place and a row
  gather reads a sequence's slots without copying the cache or transposing heads.
- Prefill attends over the prompt's own K/V (padded ``[batch, seq]`` bucket, causal + length mask) while writing
  them to the cache; decode reads every sequence's context back through its block table.
- Attention has two implementations of the same maths: portable graph ops (rope, per-head scatter, row gather,
  batched matmuls; any device and dtype) and, on CPU with float32, native C++ ops (``agents.native_kernels``),
  one per layer and step, that rope, write the cache in place and attend without copying the context. With the
  native ops, prefill is ragged: the prompts back to back (token-flat, no per-prompt padding).
- Where the native projections are vectorized (AVX-512 builds), the rest of the layer is native too: RMSNorm +
  QKV, output projection + residual, RMSNorm + gate/up + SwiGLU, down projection + residual, and the final norm +
  lm_head, with weights packed once at load (``agents.packed_weights``). MindSpore's CPU MatMul repacked its
  weight on every call and ran small-batch decode at a third of the machine's matmul rate (docs/model.md).
- The graph ends in a greedy argmax and the chosen token's log-probability, so an all-greedy step reads only
  ``2 x batch`` numbers back. The logits are a third output, read only for sampled batches and logits checks.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from agents import packed_weights
from agents.native_kernels import NativeOps
from llm_serving.protocol.model_config import LlamaConfig

_NEG_INF = -1e30


def rotary_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[max_positions, head_dim]`` in Hugging Face's rotate-half layout (frequencies repeated twice)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RMSNorm(nn.Cell):
    def __init__(self, hidden: int, eps: float, dtype: ms.Type) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden), dtype), name="weight")
        self.eps = eps

    def construct(self, x: Tensor) -> Tensor:
        xf = x.astype(ms.float32)
        variance = ops.mean(xf * xf, -1, keep_dims=True)
        return (xf * ops.rsqrt(variance + self.eps)).astype(x.dtype) * self.weight


class Linear(nn.Cell):
    """``y = x @ W^T`` with ``W`` kept in Hugging Face's ``[out, in]`` layout, or, for the native ops, in their
    panel layout (``packed``; ``swiglu`` for the fused ``[gate; up]`` weight, see ``agents.packed_weights``). A packed
    weight is read by the native ops only: ``construct`` (MindSpore's MatMul) is for the unpacked layout."""

    def __init__(self, in_dim: int, out_dim: int, dtype: ms.Type, packed: bool = False, swiglu: bool = False) -> None:
        super().__init__()
        self.shape = (out_dim, in_dim)
        self.packed = packed
        self.swiglu = swiglu
        stored = packed_weights.packed_shape(out_dim, in_dim, swiglu) if packed else self.shape
        self.weight = Parameter(Tensor(np.zeros(stored), dtype), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight)

    def stored(self, w: np.ndarray) -> np.ndarray:
        """The ``[out, in]`` weight ``w`` as this cell holds it."""
        return packed_weights.pack(w, self.swiglu) if self.packed else w

    def unstored(self, held: np.ndarray) -> np.ndarray:
        """The ``[out, in]`` weight back from what this cell holds."""
        return packed_weights.unpack(held, self.shape[0], self.swiglu) if self.packed else held


class LlamaLayer(nn.Cell):
    """One decoder layer owning its slice of the paged KV cache. ``native``: the native ops
    (``agents.native_kernels.NativeOps``; prefill then takes prompts back to back, ragged), or None for the
    portable graph ops (prefill takes a padded ``[batch, seq]`` bucket)."""

    def __init__(self, config: LlamaConfig, num_slots: int, block_size: int, dtype: ms.Type,
                 native: NativeOps | None = None) -> None:
        super().__init__()
        self.native = native is not None
        self.decode_kernel = native.decode if native else None
        self.prefill_kernel = native.prefill if native else None
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.rep = self.n_heads // self.n_kv
        self.head_dim = config.head_dim
        self.hidden = config.hidden_size
        self.kv_dim = config.kv_dim
        self.ffn = config.intermediate_size
        self.block_size = block_size
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        packed = self.native_projections = native is not None and native.projections
        self.w_qkv = Linear(config.hidden_size, config.qkv_dim, dtype, packed)
        self.wo = Linear(config.hidden_size, config.hidden_size, dtype, packed)
        self.w_gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, dtype, packed, swiglu=True)
        self.w_down = Linear(config.intermediate_size, config.hidden_size, dtype, packed)
        if packed:
            self.eps = Tensor(np.array([config.rms_norm_eps], np.float32))
            self.qkv_kernel = native.norm_linear(config.qkv_dim)
            self.gate_up_kernel = native.norm_swiglu(config.intermediate_size)
            self.residual_kernel = native.residual_linear()
        zeros = np.zeros((num_slots, self.head_dim))
        self.key_cache = ParameterTuple([Parameter(Tensor(zeros, dtype), name=f"key_cache_{h}", requires_grad=False)
                                         for h in range(self.n_kv)])
        self.value_cache = ParameterTuple([Parameter(Tensor(zeros, dtype), name=f"value_cache_{h}",
                                                     requires_grad=False) for h in range(self.n_kv)])
        self.bmm = ops.BatchMatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.block_offsets = Tensor(np.arange(block_size, dtype=np.int32))

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
        """Rotate-half rotary embedding on token-flat ``[tokens, heads * head_dim]``."""
        t = x.reshape(x.shape[0], heads, self.head_dim)
        half = self.head_dim // 2
        rotated = ops.concat((-t[:, :, half:], t[:, :, :half]), -1)
        out = t * cos.expand_dims(1) + rotated * sin.expand_dims(1)
        return out.reshape(x.shape[0], heads * self.head_dim)

    def softmax_masked(self, scores: Tensor, keep: Tensor) -> Tensor:
        scores = ops.select(keep, scores.astype(ms.float32) * self.scale, ops.full_like(scores, _NEG_INF,
                                                                                       dtype=ms.float32))
        return ops.softmax(scores, -1)

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor, batch: int) -> Tensor:
        """Causal attention inside each padded prompt: q/k/v token-flat over a ``[batch, seq]`` bucket."""
        seq = q.shape[0] // batch
        qh = q.reshape(batch, seq, self.n_kv, self.rep, self.head_dim).transpose(0, 2, 3, 1, 4)
        qh = qh.reshape(batch, self.n_kv, self.rep * seq, self.head_dim)
        kh = k.reshape(batch, seq, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        vh = v.reshape(batch, seq, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        scores = self.bmm_t(qh, kh).reshape(batch, self.n_kv, self.rep, seq, seq)
        idx = ops.arange(seq).astype(ms.int32)
        causal = idx.reshape(1, seq) <= idx.reshape(seq, 1)
        in_prompt = idx.reshape(1, seq) < valid_lens.reshape(batch, 1)
        keep = ops.logical_and(causal.reshape(1, seq, seq), in_prompt.reshape(batch, 1, seq))
        probs = self.softmax_masked(scores, keep.reshape(batch, 1, 1, seq, seq)).astype(v.dtype)
        probs = probs.reshape(batch, self.n_kv, self.rep * seq, seq)
        out = self.bmm(probs, vh).reshape(batch, self.n_kv, self.rep, seq, self.head_dim)
        return out.transpose(0, 3, 1, 2, 4).reshape(batch * seq, self.hidden)

    def write_cache(self, k: Tensor, v: Tensor, slot_mapping: Tensor) -> tuple:
        """Scatter each kv head's new rows into its cache in place; returns the write results for ordering."""
        written = ()
        for h in range(self.n_kv):
            cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
            written += (ops.scatter_update(self.key_cache[h], slot_mapping, k[:, cols]),
                        ops.scatter_update(self.value_cache[h], slot_mapping, v[:, cols]))
        return written

    def decode_attention(self, q: Tensor, written: tuple, block_tables: Tensor, context_lens: Tensor) -> Tensor:
        """One query per sequence over its paged context, gathered row-wise through the block table.

        Per kv head: the gather yields ``[batch, context, head_dim]`` directly, with no transpose (2.4x faster
        than one wide cache per layer at batch 128, context 256).
        """
        batch, width = block_tables.shape
        ctx = width * self.block_size
        slots = (block_tables.reshape(batch, width, 1) * self.block_size
                 + self.block_offsets.reshape(1, 1, self.block_size)).reshape(batch * ctx)
        keep = (ops.arange(ctx).astype(ms.int32).reshape(1, ctx) < context_lens.reshape(batch, 1))
        keep = keep.reshape(batch, 1, ctx)
        qh = q.reshape(batch, self.n_kv, self.rep, self.head_dim)
        outs = ()
        for h in range(self.n_kv):
            key_cache = ops.depend(self.key_cache[h], written)
            value_cache = ops.depend(self.value_cache[h], written)
            kh = ops.gather(key_cache, slots, 0).reshape(batch, ctx, self.head_dim)
            vh = ops.gather(value_cache, slots, 0).reshape(batch, ctx, self.head_dim)
            probs = self.softmax_masked(self.bmm_t(qh[:, h], kh), keep).astype(vh.dtype)
            outs += (self.bmm(probs, vh),)
        return ops.stack(outs, 1).reshape(batch, self.hidden)

    def native_construct(self, x: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                         block_tables: Tensor, rows: Tensor, is_prefill: bool) -> Tensor:
        """The layer as five native ops: norm + QKV, attention, output projection + residual, norm + gate/up +
        SwiGLU, down projection + residual. ``rows`` [1]: the real (leading) token rows; padding rows are
        skipped and come out as zeros."""
        qkv = self.qkv_kernel(x, self.attention_norm.weight, self.eps, self.w_qkv.weight, rows)
        attn = self.attention(qkv, cos, sin, slot_mapping, lens, block_tables, is_prefill)
        x = self.residual_kernel(attn, self.wo.weight, x, rows)
        act = self.gate_up_kernel(x, self.ffn_norm.weight, self.eps, self.w_gate_up.weight, rows)
        return self.residual_kernel(act, self.w_down.weight, x, rows)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, rows: Tensor, is_prefill: bool) -> Tensor:
        if self.native_projections:
            return self.native_construct(x, cos, sin, slot_mapping, lens, block_tables, rows, is_prefill)
        qkv = self.w_qkv(self.attention_norm(x))
        attn = self.attention(qkv, cos, sin, slot_mapping, lens, block_tables, is_prefill)
        x = x + self.wo(attn)
        gate_up = self.w_gate_up(self.ffn_norm(x))
        act = ops.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:]
        return x + self.w_down(act)

    def attention(self, qkv: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, is_prefill: bool) -> Tensor:
        """Rope, cache write and attention: one native op, or graph ops (any device and dtype)."""
        if self.native and is_prefill:
            return self.prefill_kernel(qkv, cos, sin, slot_mapping, lens, *self.key_cache, *self.value_cache)
        if self.native:
            return self.decode_kernel(qkv, cos, sin, slot_mapping, block_tables, lens, self.block_offsets,
                                      *self.key_cache, *self.value_cache)
        q = self.rope(qkv[:, : self.hidden], cos, sin, self.n_heads)
        k = self.rope(qkv[:, self.hidden: self.hidden + self.kv_dim], cos, sin, self.n_kv)
        v = qkv[:, self.hidden + self.kv_dim:]
        written = self.write_cache(k, v, slot_mapping)
        if is_prefill:
            return ops.depend(self.prefill_attention(q, k, v, lens, lens.shape[0]), written)
        return self.decode_attention(q, written, block_tables, lens)


class LlamaModel(nn.Cell):
    """Weights and KV cache of the whole model; ``LlamaStep`` cells run it as prefill or decode graphs."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, max_positions: int,
                 dtype: ms.Type = ms.float32, native: NativeOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Parameter(Tensor(np.zeros((config.vocab_size, config.hidden_size)), dtype),
                                      name="embed_tokens")
        self.layers = nn.CellList([LlamaLayer(config, num_blocks * block_size, block_size, dtype, native)
                                   for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.native_greedy = native.greedy if native else None
        projections = native is not None and native.projections
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, packed=projections)
        self.native_lm_head = native.norm_linear(config.vocab_size) if projections else None
        if projections:
            self.eps = Tensor(np.array([config.rms_norm_eps], np.float32))
        cos, sin = rotary_tables(config, max_positions)
        self.cos = Tensor(cos, dtype)
        self.sin = Tensor(sin, dtype)

    @staticmethod
    def real_rows(lens: Tensor, is_prefill: bool) -> tuple[Tensor, Tensor]:
        """``[1]`` int32 counts of the real token rows and sequence rows of a step, which lead its padded
        bucket: sequences with a length > 0; tokens are one per sequence in decode, the prompts' sum in a
        (ragged) prefill."""
        sequences = (lens > 0).astype(ms.int32).sum().astype(ms.int32).reshape(1)  # sum gives int64
        return (lens.sum().astype(ms.int32).reshape(1) if is_prefill else sequences), sequences

    def hidden_states(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, lens: Tensor,
                      block_tables: Tensor, token_rows: Tensor, is_prefill: bool) -> Tensor:
        x = ops.gather(self.embed_tokens, input_ids, 0)
        cos = ops.gather(self.cos, positions, 0)
        sin = ops.gather(self.sin, positions, 0)
        for layer in self.layers:
            x = layer(x, cos, sin, slot_mapping, lens, block_tables, token_rows, is_prefill)
        return x

    def logits(self, last_hidden: Tensor, sequence_rows: Tensor) -> Tensor:
        if self.native_lm_head is not None:
            return self.native_lm_head(last_hidden, self.norm.weight, self.eps, self.lm_head.weight, sequence_rows)
        return self.lm_head(self.norm(last_hidden)).astype(ms.float32)


def greedy_pick(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Argmax token and its log-softmax value; the max logit is the chosen one, so no gather is needed."""
    token_ids = ops.argmax(logits, -1).astype(ms.int32)
    top = ops.max(logits, -1, keepdims=True)[0]
    logprob = -ops.log(ops.sum(ops.exp(logits - top), -1))
    return token_ids, logprob


class LlamaStep(nn.Cell):
    """One compiled step (``is_prefill`` is a graph constant).

    Inputs (static bucket shapes): input_ids/positions/slot_mapping ``[tokens]``; ``lens`` ``[batch]`` (prefill:
    prompt lengths, decode: context lengths); ``block_tables`` ``[batch, width]``; ``last_index`` ``[batch]``
    flat index of each sequence's last token (prefill only; decode uses every token).

    Returns greedy token ids, their log-probabilities and the float32 logits ``[batch, vocab]``. The logits are
    an output the caller may leave on the device: only sampled batches and logits checks read them (returning
    them did not change decode step time measurably, and it saves compiling a second graph per shape).
    """

    def __init__(self, model: LlamaModel, is_prefill: bool) -> None:
        super().__init__()
        self.model = model
        self.is_prefill = is_prefill

    def construct(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, last_index: Tensor):
        token_rows, sequence_rows = self.model.real_rows(lens, self.is_prefill)
        hidden = self.model.hidden_states(input_ids, positions, slot_mapping, lens, block_tables, token_rows,
                                          self.is_prefill)
        if self.is_prefill:
            hidden = ops.gather(hidden, last_index, 0)
        logits = self.model.logits(hidden, sequence_rows)
        if self.model.native_greedy is not None:
            token_ids, logprobs = self.model.native_greedy(logits)
        else:
            token_ids, logprobs = greedy_pick(logits)
        return token_ids, logprobs, logits


def _canonical_parameters(model: LlamaModel) -> dict[str, tuple[Parameter, Linear | None]]:
    """The model's Parameters under their canonical fused weight names (see ``agents.weights``), each with its
    Linear cell where it is a projection (which may hold it packed)."""
    params = {"embed_tokens": (model.embed_tokens, None), "norm": (model.norm.weight, None),
              "lm_head": (model.lm_head.weight, model.lm_head)}
    for i, layer in enumerate(model.layers):
        for name in ("attention_norm", "ffn_norm"):
            params[f"layers.{i}.{name}"] = (getattr(layer, name).weight, None)
        for name in ("w_qkv", "wo", "w_gate_up", "w_down"):
            cell = getattr(layer, name)
            params[f"layers.{i}.{name}"] = (cell.weight, cell)
    return params


def load_weights_into(model: LlamaModel, weights: dict[str, np.ndarray]) -> None:
    """Copy a canonical fused weight dict into the model's Parameters."""
    targets = _canonical_parameters(model)
    missing = sorted(set(targets) - set(weights))
    if missing:
        raise KeyError(f"weights are missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name, (param, linear) in targets.items():
        value = weights[name]
        expected = linear.shape if linear is not None else tuple(param.shape)
        if tuple(value.shape) != tuple(expected):
            raise ValueError(f"parameter {name}: expected shape {tuple(expected)}, got {tuple(value.shape)}")
        if linear is not None:
            value = linear.stored(value)
        param.set_data(Tensor(np.ascontiguousarray(value), model.dtype))


def model_weights(model: LlamaModel) -> dict[str, np.ndarray]:
    """The model's weights as a canonical fused dict (e.g. to save a converted ``.ckpt``)."""
    return {name: linear.unstored(param.asnumpy()) if linear is not None else param.asnumpy()
            for name, (param, linear) in _canonical_parameters(model).items()}
