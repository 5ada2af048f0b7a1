"""numpy references of the Ascend fused primitives' documented contracts, written as plainly as the docs state
them (loops over sequences, positions and heads, float64): what ``llm-serving preflight`` holds the NPU's kernels
to, and the tests the CPU stand-ins of ``agents.model.backends.ascend_reference`` on Ascend-layout tensors. Shipped
in the package (an installed wheel has no tests/).

Sources: the primitives' docstrings in MindSpore 2.10 (``mindspore.ops.auto_generate``) and what the internal
kernels read (``agents.tools.contracts`` cites each); see docs/ascend.md for the table of contracts.
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` per row, and ``rstd = 1 / sqrt(mean(x^2) + eps)``."""
    x = x.astype(np.float64)
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * rstd * gamma.astype(np.float64), rstd


def swiglu(x: np.ndarray) -> np.ndarray:
    """``Swish(a) * b`` with ``a`` the first half of the last axis, ``b`` the second."""
    x = x.astype(np.float64)
    a, b = np.split(x, 2, axis=-1)
    return a / (1.0 + np.exp(-a)) * b


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int) -> np.ndarray:
    """``ApplyRotaryPosEmb`` (cos_format 2) on one of query/key ``[T, heads * head_dim]``: per token and head,
    ``x * cos[t] + [-x2, x1] * sin[t]`` with ``x1, x2`` the halves of the head."""
    out = np.zeros(x.shape, np.float64)
    half = head_dim // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1] // head_dim):
            v = x[t, h * head_dim:(h + 1) * head_dim].astype(np.float64)
            rotated = np.concatenate([-v[half:], v[:half]])
            out[t, h * head_dim:(h + 1) * head_dim] = v * cos[t] + rotated * sin[t]
    return out


def reshape_and_cache(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                      slot_mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New caches: token ``t``'s ``[kv_heads * head_dim]`` row at block ``slot // block_size``, offset ``slot %
    block_size`` (``[num_blocks, block_size, kv_heads, head_dim]``); every other entry unchanged."""
    key_cache, value_cache = key_cache.copy(), value_cache.copy()
    _, block_size, kv_heads, head_dim = key_cache.shape
    for t, slot in enumerate(slot_mapping):
        key_cache[slot // block_size, slot % block_size] = key[t].reshape(kv_heads, head_dim)
        value_cache[slot // block_size, slot % block_size] = value[t].reshape(kv_heads, head_dim)
    return key_cache, value_cache


def paged_attention(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale: float) -> np.ndarray:
    """Decode: query ``[B, heads, head_dim]``; sequence ``b`` attends to its positions ``j < context_lens[b]``,
    stored at ``cache[block_tables[b, j // block_size], j % block_size]``; query head ``h`` reads kv head
    ``h // (heads / kv_heads)`` (GQA). Table entries past the context are never read."""
    batch, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    out = np.zeros((batch, heads, head_dim))
    for b in range(batch):
        places = [(block_tables[b, j // block_size], j % block_size) for j in range(context_lens[b])]
        for h in range(heads):
            keys = np.array([key_cache[blk, off, h // group] for blk, off in places], np.float64)
            values = np.array([value_cache[blk, off, h // group] for blk, off in places], np.float64)
            out[b, h] = softmax(scale * keys @ query[b, h].astype(np.float64)) @ values
    return out


def paged_attention_queries(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                            block_tables: np.ndarray, context_lens: np.ndarray, q_seq_lens: np.ndarray,
                            mask: np.ndarray, scale: float) -> np.ndarray:
    """PagedAttention with multi-token queries (``q_seq_lens``, the internal kernel's path for chunks and
    prefix-cache hits): sequence ``b`` is the next ``q_seq_lens[b]`` query rows, the last of its
    ``context_lens[b]`` positions (so ``q_seq_lens[b] <= context_lens[b]``); each row's scores over its context
    are scaled, ``mask`` (``[T, >= context]``, 0 or -10000) added, then softmaxed; GQA and block reads as
    ``paged_attention``."""
    assert (q_seq_lens >= 1).all() and (q_seq_lens <= context_lens).all() and q_seq_lens.sum() == len(query)
    rows, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    out = np.zeros((rows, heads, head_dim))
    row = 0
    for b, (n, ctx) in enumerate(zip(q_seq_lens, context_lens)):
        places = [(block_tables[b, j // block_size], j % block_size) for j in range(ctx)]
        for _ in range(n):
            for h in range(heads):
                keys = np.array([key_cache[blk, off, h // group] for blk, off in places], np.float64)
                values = np.array([value_cache[blk, off, h // group] for blk, off in places], np.float64)
                scores = scale * keys @ query[row, h].astype(np.float64) + mask[row, :ctx].astype(np.float64)
                out[row, h] = softmax(scores) @ values
            row += 1
    return out


def flash_attention_th(query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray, mask_dtype: str,
                       q_lens: np.ndarray, kv_lens: np.ndarray, heads: int, scale: float) -> np.ndarray:
    """``FlashAttentionScore`` layout ``TH`` (rows ``[T, heads * head_dim]``) on the internal kernel's path:
    ``sparse_mode`` 0, ``mask`` the 128 x 128 causal mask (0 on and below the diagonal; above it 1 in bfloat16,
    -10000 in float16, as vllm-mindspore's and MindFormers' masks hold), per-sequence lengths: sequence
    ``i`` is the next ``q_lens[i]`` rows of the query and ``kv_lens[i]`` of key and value; query position ``p`` of
    a sequence of ``Lq`` rows attends to its kv positions ``<= p + Lkv - Lq``; GQA as ``paged_attention``."""
    above = 1.0 if mask_dtype == "bfloat16" else -10000.0
    assert mask.shape == (128, 128) and (mask == np.triu(np.ones((128, 128)), 1) * above).all(), "not the mask"
    assert (q_lens > 0).all() and (kv_lens > 0).all(), "an empty sequence"
    assert q_lens.sum() == len(query) and kv_lens.sum() == len(key), "the lengths do not cover the rows"
    head_dim = query.shape[1] // heads
    kv_heads = key.shape[1] // head_dim
    group = heads // kv_heads
    out = np.zeros(query.shape)
    q_start = kv_start = 0
    for lq, lk in zip(q_lens, kv_lens):
        for p in range(lq):
            visible = range(kv_start, kv_start + min(lk, p + lk - lq + 1))
            for h in range(heads):
                g = h // group
                q = query[q_start + p, h * head_dim:(h + 1) * head_dim].astype(np.float64)
                keys = np.array([key[r, g * head_dim:(g + 1) * head_dim] for r in visible], np.float64)
                values = np.array([value[r, g * head_dim:(g + 1) * head_dim] for r in visible], np.float64)
                out[q_start + p, h * head_dim:(h + 1) * head_dim] = softmax(scale * keys @ q) @ values
        q_start, kv_start = q_start + lq, kv_start + lk
    return out


def weight_quant_matmul(x: np.ndarray, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=0)`` without offset:
    ``x [M, K] @ (weight [N, K] * scale [N])^T``."""
    return x.astype(np.float64) @ (weight.astype(np.float64) * scale.astype(np.float64)[:, None]).T


def argmax_with_value(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of the first maximum along the last axis, and the maximum."""
    index = np.array([next(i for i, v in enumerate(row) if v == row.max()) for row in x])
    return index, x.max(-1)
