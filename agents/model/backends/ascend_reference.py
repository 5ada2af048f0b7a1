"""CPU stand-ins for the Ascend backend's fused primitives: each fused primitive's documented contract in MindSpore
graph ops, with the primitive's call signature, so the Ascend backend's graphs run on CPU unchanged but for these
cells (``AscendBackend(ReferenceOps())``).

Why: the fused kernels have no CPU implementation ("Unsupported op [PagedAttention] on CPU"), and exporting a graph
checks its types and shapes but not what it computes. These stand-ins are checked against numpy references of the
contracts (agents/tools/preflight/references.py), and the Ascend wiring with them against Hugging Face. They compute in
float32 and cast back, as the NPU kernels accumulate; they are for checks, not speed (the gathers copy).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from agents.model.backends.ascend_limits import FA_MASK_SIZE


def _f32(x: Tensor) -> Tensor:
    return x.astype(ms.float32)


def _poison(out: Tensor, valid: Tensor) -> Tensor:
    """``out`` where ``valid`` (broadcast), NaN elsewhere: inputs outside a kernel's documented preconditions give
    NaN here instead of a plausible answer, so the wiring tests fail on them."""
    return ops.select(valid.broadcast_to(out.shape), out, ops.full_like(out, float("nan")))


class RmsNormRef(nn.Cell):
    """``(x, gamma) -> (x / sqrt(mean(x^2) + eps) * gamma, rstd)``, in float32, cast back to ``x``'s dtype."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def construct(self, x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
        xf = _f32(x)
        rstd = ops.rsqrt(ops.mean(xf * xf, -1, keep_dims=True) + self.eps)
        return (xf * rstd * _f32(gamma)).astype(x.dtype), rstd


class SwigluRef(nn.Cell):
    """``(x, dim) -> silu(a) * b`` with ``a, b`` the first and second halves of ``x`` along the last axis."""

    def construct(self, x: Tensor, dim: int = -1) -> Tensor:
        half = x.shape[-1] // 2
        return (ops.silu(_f32(x[:, :half])) * _f32(x[:, half:])).astype(x.dtype)


class RopeRef(nn.Cell):
    """``ApplyRotaryPosEmb`` with ``cos_format=2``: per token ``t`` and head, ``x * cos[t] + rotate_half(x) *
    sin[t]`` (rotate_half(x) = [-x2, x1] of the halves); ``cos``/``sin`` hold one row per token."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        tokens = x.shape[0]
        heads = x.shape[1] // self.head_dim
        t = _f32(x).reshape(tokens, heads, self.head_dim)
        half = self.head_dim // 2
        rotated = ops.concat((-t[:, :, half:], t[:, :, :half]), -1)
        out = t * _f32(cos).expand_dims(1) + rotated * _f32(sin).expand_dims(1)
        return out.reshape(tokens, heads * self.head_dim).astype(x.dtype)

    def construct(self, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor):
        return self.rotate(query, cos, sin), self.rotate(key, cos, sin)


class ReshapeAndCacheRef(nn.Cell):
    """Row ``t`` of ``key``/``value`` ``[T, kv_heads * head_dim]`` into ``cache[slot // block_size, slot %
    block_size]`` of the ``[num_blocks, block_size, kv_heads, head_dim]`` caches, in place; returns ``key``."""

    def construct(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor):
        _, block_size, kv_heads, head_dim = key_cache.shape
        tokens = key.shape[0]
        where = ops.stack((slot_mapping // block_size, slot_mapping % block_size), -1)
        k = ops.scatter_nd_update(key_cache, where, key.reshape(tokens, kv_heads, head_dim))
        v = ops.scatter_nd_update(value_cache, where, value.reshape(tokens, kv_heads, head_dim))
        return ops.depend(key, (k, v))


class PagedAttentionRef(nn.Cell):
    """PagedAttention: sequence ``b`` attends over its context positions ``j < context_lens[b]``, position ``j`` at
    ``cache[block_tables[b, j // block_size], j % block_size]``; query head ``h`` reads kv head ``h // (N /
    kv_heads)``; softmax of ``scale * q.k``. Table entries past the context are never read.

    Decode (no ``q_seq_lens``): query ``[B, N, D]``, one token per sequence, the context's last. With
    ``q_seq_lens`` (the internal kernel's multi-token queries, as vllm-mindspore runs chunked prefill and
    prefix-cache hits): query ``[T, N, D]``, sequence ``b`` the next ``q_seq_lens[b]`` rows, the last of its
    context; ``attn_mask`` ``[T, L]`` is added to each row's scores (0 where visible, -10000 past the row's
    position). NaN where no kernel promises anything: an empty context, one longer than its table, or (with
    ``q_seq_lens``) an empty query, a query longer than its context, lengths not covering the rows."""

    def __init__(self, heads: int, scale: float, kv_heads: int, int8_direction: str = "multiply") -> None:
        super().__init__()
        self.heads = heads
        self.scale = scale
        self.kv_heads = kv_heads
        self.divides = int8_direction == "reciprocal"  # an int8 cache over its antiquant scale, not times it

    def context(self, cache: Tensor, tables: Tensor, scale: Tensor | None = None) -> Tensor:
        """``[rows, kv_heads, ctx, D]``: each row's table gathered from ``cache``; an int8 cache times its
        per-channel ``scale [kv_heads * D]`` (over it, standing in for a kernel that divides)."""
        rows, width = tables.shape
        _, block_size, kv_heads, head_dim = cache.shape
        gathered = ops.gather(cache, tables.reshape(-1), 0).reshape(rows, width * block_size, kv_heads, head_dim)
        values = _f32(gathered)
        if scale is not None:
            channel = _f32(scale).reshape(1, 1, kv_heads, head_dim)
            values = values / channel if self.divides else values * channel
        return values.transpose(0, 2, 1, 3)

    def attend(self, query: Tensor, key_cache: Tensor, value_cache: Tensor, tables: Tensor, context_lens: Tensor,
               mask: Tensor | None, scales: Tensor | None = None) -> Tensor:
        """One query row per table row: ``[rows, N, D]`` over that row's context of ``context_lens`` positions
        (``scales [2, kv_heads * D]``: int8 caches' per-channel scales, keys then values)."""
        rows, width = tables.shape
        _, block_size, kv_heads, head_dim = key_cache.shape
        ctx, rep = width * block_size, self.heads // self.kv_heads
        key_scale, value_scale = (scales[0], scales[1]) if scales is not None else (None, None)
        q = _f32(query).reshape(rows, kv_heads, rep, head_dim)
        scores = ops.BatchMatMul(transpose_b=True)(q, self.context(key_cache, tables, key_scale)) * self.scale
        if mask is not None:
            scores = scores + _f32(mask)[:, :ctx].reshape(rows, 1, 1, ctx)
        keep = ops.arange(ctx).astype(ms.int32).reshape(1, ctx) < context_lens.reshape(rows, 1)
        scores = ops.select(keep.reshape(rows, 1, 1, ctx).broadcast_to(scores.shape), scores,
                            ops.full_like(scores, -1e30))
        out = ops.BatchMatMul()(ops.softmax(scores, -1), self.context(value_cache, tables, value_scale))
        return out.reshape(rows, self.heads, head_dim)

    def construct(self, query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                  context_lens: Tensor, antiquant_scale=None, antiquant_offset=None, attn_mask=None,
                  q_seq_lens=None) -> Tensor:
        batch, width = block_tables.shape
        ctx = width * key_cache.shape[1]
        fits = ops.logical_and(context_lens >= 1, context_lens <= ctx)
        if antiquant_scale is not None:  # int8 caches: a non-zero offset, whose sign no source settles, poisons
            fits = ops.logical_and(fits, (antiquant_offset == 0).all())
        if q_seq_lens is None:
            out = self.attend(query, key_cache, value_cache, block_tables, context_lens, None, antiquant_scale)
            return _poison(out, fits.reshape(batch, 1, 1)).astype(query.dtype)
        rows = query.shape[0]
        q_lens = q_seq_lens.astype(ms.int64)
        ends = ops.cumsum(q_lens, 0)
        seq = (ops.arange(rows).astype(ms.int64).reshape(rows, 1) >= ends.reshape(1, -1)).astype(ms.int32).sum(1)
        seq = ops.minimum(seq.astype(ms.int32), batch - 1)  # rows past the last length (ill-formed: poisoned)
        out = self.attend(query, key_cache, value_cache, ops.gather(block_tables, seq, 0),
                          ops.gather(context_lens, seq, 0), attn_mask, antiquant_scale)
        valid = ops.logical_and(fits, ops.logical_and(q_seq_lens >= 1, q_seq_lens <= context_lens)).all()
        valid = ops.logical_and(valid, ends[-1] == rows)
        return _poison(out, valid).astype(query.dtype)


class FlashAttentionThRef(nn.Cell):
    """``FlashAttentionScore`` in layout ``TH`` as the internal kernel runs it with ``sparse_mode`` 0 and the 128 x
    128 causal mask: ``actual_seq_qlen``/``actual_seq_kvlen`` are per-sequence lengths, sequence ``i`` the next
    ``len[i]`` rows of each side; query position ``p`` of a sequence of ``Lq`` rows attends to its kv positions
    ``<= p + Lkv - Lq``; GQA as PagedAttention. Returns the primitive's four outputs, the attention at index 3
    (the softmax statistics are not computed: the backend never reads them). All NaN unless the mask is that
    causal mask (above the diagonal 1 in bfloat16, -10000 otherwise) and every sequence has rows on both sides,
    the lengths summing to the rows passed."""

    def __init__(self, heads: int, scale: float) -> None:
        super().__init__()
        self.heads = heads
        self.scale = scale
        self.causal = Tensor(np.triu(np.ones((FA_MASK_SIZE, FA_MASK_SIZE), np.float32), 1))

    @staticmethod
    def well_formed(rows: int, lengths: Tensor) -> Tensor:
        return ops.logical_and((lengths > 0).all(), lengths.astype(ms.int64).sum() == rows)

    @staticmethod
    def positions(rows: int, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per row: its sequence, its position in it and the sequence's length."""
        lengths = lengths.astype(ms.int64)
        ends = ops.cumsum(lengths, 0)
        idx = ops.arange(rows).astype(ms.int64)
        seq = (idx.reshape(rows, 1) >= ends.reshape(1, -1)).astype(ms.int32).sum(1).astype(ms.int32)
        seq = ops.minimum(seq, lengths.shape[0] - 1)  # rows past the last length (ill-formed: poisoned)
        start = ops.gather(ends - lengths, seq, 0)
        return seq, idx - start, ops.gather(lengths, seq, 0)

    def construct(self, query: Tensor, key: Tensor, value: Tensor, real_shift, drop_mask, padding_mask, attn_mask,
                  prefix, actual_seq_qlen: Tensor, actual_seq_kvlen: Tensor):
        tq, tk = query.shape[0], key.shape[0]
        head_dim = query.shape[1] // self.heads
        kv_heads = key.shape[1] // head_dim
        rep = self.heads // kv_heads
        q = _f32(query).reshape(tq, kv_heads, rep, head_dim).transpose(1, 2, 0, 3).reshape(kv_heads, rep * tq,
                                                                                              head_dim)
        k = _f32(key).reshape(tk, kv_heads, head_dim).transpose(1, 0, 2)
        v = _f32(value).reshape(tk, kv_heads, head_dim).transpose(1, 0, 2)
        scores = ops.BatchMatMul(transpose_b=True)(q, k).reshape(kv_heads, rep, tq, tk) * self.scale
        q_seq, q_pos, q_len = self.positions(tq, actual_seq_qlen)
        k_seq, k_pos, k_len = self.positions(tk, actual_seq_kvlen)
        same = q_seq.reshape(tq, 1) == k_seq.reshape(1, tk)
        # bottom-right causal within a sequence: k_pos <= q_pos + k_len - q_len (lengths of that sequence)
        causal = (k_pos - k_len).reshape(1, tk) <= (q_pos - q_len).reshape(tq, 1)
        keep = ops.logical_and(same, causal).reshape(1, 1, tq, tk).broadcast_to(scores.shape)
        scores = ops.select(keep, scores, ops.full_like(scores, -1e30))
        probs = ops.softmax(scores, -1).reshape(kv_heads, rep * tq, tk)
        out = ops.BatchMatMul()(probs, v).reshape(kv_heads, rep, tq, head_dim).transpose(2, 0, 1, 3)
        valid = ops.logical_and(self.well_formed(tq, actual_seq_qlen), self.well_formed(tk, actual_seq_kvlen))
        above = 1.0 if attn_mask.dtype == ms.bfloat16 else -10000.0  # ascend_limits.fa_mask_value
        valid = ops.logical_and(valid, (_f32(attn_mask) == self.causal * above).all())
        out = _poison(out.reshape(tq, self.heads * head_dim), valid).astype(query.dtype)
        return out, out, out, out


class WeightQuantMatmulRef(nn.Cell):
    """``WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=0)``: ``x [M, K] @
    (weight [N, K] int8 * antiquant_scale [N])^T`` in float32, cast back; an offset, output quantization or bias
    (which the backend never passes) gives NaN."""

    def construct(self, x: Tensor, weight: Tensor, antiquant_scale: Tensor, antiquant_offset=None, quant_scale=None,
                  quant_offset=None, bias=None) -> Tensor:
        w = _f32(weight) * _f32(antiquant_scale).reshape(-1, 1)
        out = ops.matmul(_f32(x), w.T)
        valid = Tensor(antiquant_offset is None and quant_scale is None and quant_offset is None and bias is None)
        return _poison(out, valid).astype(x.dtype)


class ReferenceOps:
    """``FusedOps``' factories returning the stand-ins; ``ArgMaxWithValue`` runs on CPU as it is."""

    name = "reference"

    def __init__(self, head_dim: int, int8_direction: str = "multiply") -> None:
        """``int8_direction``: how the PagedAttention stand-in applies an int8 cache's antiquant scale (an NPU
        either way, until its check: ``INT8_KV_DIRECTIONS``)."""
        self.head_dim = head_dim
        self.int8_direction = int8_direction

    def rms_norm(self, eps: float):
        return RmsNormRef(eps)

    def swiglu(self):
        return SwigluRef()

    def rope(self):
        return RopeRef(self.head_dim)

    def reshape_and_cache(self):
        return ReshapeAndCacheRef()

    def paged_attention(self, heads: int, scale: float, kv_heads: int):
        return PagedAttentionRef(heads, scale, kv_heads, self.int8_direction)

    def flash_attention(self, heads: int, scale: float):
        return FlashAttentionThRef(heads, scale)

    def argmax_with_value(self):
        return ops.ArgMaxWithValue(axis=-1)

    def weight_quant_matmul(self):
        return WeightQuantMatmulRef()
