"""Weights between our fused layout and MindFormers' Llama names, both ways, exactly (numpy only).

Ours (``agents.weights.checkpoints``): ``layers.{i}.w_qkv`` is ``[q; k; v]`` stacked, ``layers.{i}.w_gate_up`` is
``[gate; up]`` stacked. MindFormers 1.8.0 names them ``attention.wq/wk/wv`` and ``feed_forward.w1/w3`` or, with
``qkv_concat``, ``attention.w_qkv`` and ``feed_forward.w_gate_hidden`` in its own interleaved order (read from its
``LLamaAttention.construct`` and ``FeedForward.construct``, which split the fused output that way):

- ``w_qkv``: per kv head ``g``, the ``n_rep`` query heads of group ``g``, then k head ``g``, then v head ``g``
  (``[kv_heads, (n_rep + 2) * head_dim, hidden]``);
- ``w_gate_hidden``: gate row ``j`` then up row ``j``, for every ``j`` (``[intermediate, 2, hidden]``).

So a fused MindFormers tensor is a permutation of rows of ours, never a plain concatenation: loading it as one
would scramble the heads silently.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from llm_serving.protocol.model_config import LlamaConfig

_L = "model.layers.{i}."
# canonical name (per layer where it has "{i}") <-> MindFormers name, for the tensors that are only renamed
RENAMED = {
    "embed_tokens": "model.tok_embeddings.embedding_weight",
    "layers.{i}.attention_norm": _L + "attention_norm.weight",
    "layers.{i}.wo": _L + "attention.wo.weight",
    "layers.{i}.ffn_norm": _L + "ffn_norm.weight",
    "layers.{i}.w_down": _L + "feed_forward.w2.weight",
    "norm": "model.norm_out.weight",
    "lm_head": "lm_head.weight",
}
SPLIT_QKV = tuple(_L + f"attention.{p}.weight" for p in ("wq", "wk", "wv"))
SPLIT_GATE_UP = (_L + "feed_forward.w1.weight", _L + "feed_forward.w3.weight")
FUSED_QKV = _L + "attention.w_qkv.weight"
FUSED_GATE_UP = _L + "feed_forward.w_gate_hidden.weight"


def _qkv_parts(config: LlamaConfig) -> tuple[int, int]:
    """(query heads per kv head, head_dim)."""
    return config.num_attention_heads // config.num_key_value_heads, config.head_dim


def qkv_to_mindformers(w_qkv: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """Our ``[q; k; v]`` rows in MindFormers' per-kv-group order."""
    rep, d = _qkv_parts(config)
    g, hidden = config.num_key_value_heads, w_qkv.shape[-1]
    q, k, v = np.split(w_qkv, [config.q_dim, config.q_dim + config.kv_dim])
    grouped = np.concatenate([q.reshape(g, rep * d, hidden), k.reshape(g, d, hidden), v.reshape(g, d, hidden)],
                             axis=1)
    return grouped.reshape(w_qkv.shape)


def qkv_from_mindformers(w_qkv: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """MindFormers' per-kv-group rows back to our ``[q; k; v]``."""
    rep, d = _qkv_parts(config)
    g, hidden = config.num_key_value_heads, w_qkv.shape[-1]
    grouped = w_qkv.reshape(g, (rep + 2) * d, hidden)
    q, k, v = np.split(grouped, [rep * d, (rep + 1) * d], axis=1)
    return np.concatenate([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])


def gate_up_to_mindformers(w_gate_up: np.ndarray) -> np.ndarray:
    """Our ``[gate; up]`` rows interleaved as MindFormers' ``w_gate_hidden`` (gate j, up j, ...)."""
    gate, up = np.split(w_gate_up, 2)
    return np.stack([gate, up], axis=1).reshape(w_gate_up.shape)


def gate_up_from_mindformers(w_gate_hidden: np.ndarray) -> np.ndarray:
    """MindFormers' interleaved ``w_gate_hidden`` back to our ``[gate; up]``."""
    pairs = w_gate_hidden.reshape(-1, 2, w_gate_hidden.shape[-1])
    return np.concatenate([pairs[:, 0], pairs[:, 1]])


def to_mindformers(weights: Mapping[str, np.ndarray], config: LlamaConfig, fused: bool) -> dict[str, np.ndarray]:
    """Our canonical weights under MindFormers' names; ``fused`` as its ``qkv_concat`` (``w_qkv`` and
    ``w_gate_hidden``) or split (``wq/wk/wv``, ``w1/w3``)."""
    out: dict[str, np.ndarray] = {}
    for ours, theirs in RENAMED.items():
        if "{i}" not in ours:
            out[theirs] = weights[ours]
    for i in range(config.num_hidden_layers):
        for ours, theirs in RENAMED.items():
            if "{i}" in ours:
                out[theirs.format(i=i)] = weights[ours.format(i=i)]
        qkv, gate_up = weights[f"layers.{i}.w_qkv"], weights[f"layers.{i}.w_gate_up"]
        if fused:
            out[FUSED_QKV.format(i=i)] = qkv_to_mindformers(qkv, config)
            out[FUSED_GATE_UP.format(i=i)] = gate_up_to_mindformers(gate_up)
        else:
            parts = np.split(qkv, [config.q_dim, config.q_dim + config.kv_dim])
            out.update((name.format(i=i), part) for name, part in zip(SPLIT_QKV, parts))
            out.update((name.format(i=i), part) for name, part in zip(SPLIT_GATE_UP, np.split(gate_up, 2)))
    return out


def from_mindformers(tensors: Mapping[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """MindFormers-named weights (each layer split or fused) in our canonical layout; a missing tensor is a
    ``KeyError`` naming it."""
    view = SplitView(tensors, config)
    out: dict[str, np.ndarray] = {}
    for i in range(config.num_hidden_layers):
        names = {ours.format(i=i): theirs.format(i=i) for ours, theirs in RENAMED.items() if "{i}" in ours}
        out.update((ours, view[theirs]) for ours, theirs in names.items())
        out[f"layers.{i}.w_qkv"] = np.concatenate([view[n.format(i=i)] for n in SPLIT_QKV])
        out[f"layers.{i}.w_gate_up"] = np.concatenate([view[n.format(i=i)] for n in SPLIT_GATE_UP])
    out.update((ours, view[theirs]) for ours, theirs in RENAMED.items() if "{i}" not in ours)
    return out


class SplitView(Mapping):
    """MindFormers tensors with every fused ``w_qkv`` / ``w_gate_hidden`` also readable under the split names
    (``wq/wk/wv``, ``w1/w3``), un-interleaved when read; other tensors pass through unread (for loaders that
    name the tensors they want, such as ``agents.weights.checkpoints``)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], config: LlamaConfig) -> None:
        self._tensors = tensors
        self._config = config
        self._split: dict[str, tuple[str, int]] = {}  # split name -> (fused name, part index)
        for i in range(config.num_hidden_layers):
            for fused, split in ((FUSED_QKV, SPLIT_QKV), (FUSED_GATE_UP, SPLIT_GATE_UP)):
                if fused.format(i=i) in tensors:
                    self._split.update((s.format(i=i), (fused.format(i=i), j)) for j, s in enumerate(split))

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._split:
            fused, part = self._split[name]
            return self._parts(fused)[part]
        return self._tensors[name]

    def _parts(self, fused: str) -> list[np.ndarray]:
        value = np.asarray(self._tensors[fused])
        c = self._config
        if fused.endswith("w_qkv.weight"):
            return np.split(qkv_from_mindformers(value, c), [c.q_dim, c.q_dim + c.kv_dim])
        return np.split(gate_up_from_mindformers(value), 2)

    def __contains__(self, name: object) -> bool:
        return name in self._split or name in self._tensors

    def __iter__(self) -> Iterator[str]:
        fused = {f for f, _ in self._split.values()}
        yield from (n for n in self._tensors if n not in fused)
        yield from self._split

    def __len__(self) -> int:
        return sum(1 for _ in self)
