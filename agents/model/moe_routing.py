"""Mixture-of-experts routing in the order a grouped kernel consumes it (issue 54): top-k experts per token with
the family's normalisation, the (token, choice) pairs sorted by expert so each expert's rows are contiguous, and
the unpermute that sums each token's weighted expert outputs. Only the experts some token chose are visited, so a
decode step reads the weights of at most ``tokens x top_k`` experts, not all of them. numpy here: the reference
that the graph and native paths are held to, and the plan they take."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutePlan:
    """``order`` [tokens*top_k]: flat (token, choice) indices sorted by expert (stable); ``tokens``: the token of
    each sorted row; ``weights``: its routing weight; ``experts``/``starts``/``counts``: the experts chosen at
    least once, each with its slice of the sorted rows."""

    order: np.ndarray
    tokens: np.ndarray
    weights: np.ndarray
    experts: np.ndarray
    starts: np.ndarray
    counts: np.ndarray


def top_k(router_logits: np.ndarray, k: int, normalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(weights [t, k] float32, ids [t, k])``: softmax over all experts in float32, the k largest (ties: the
    lower id, as torch.topk on CPU), renormalised to sum 1 where the family does (norm_topk_prob; Mixtral always)."""
    logits = router_logits.astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, -1)
    if normalise:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, ids


def plan(weights: np.ndarray, ids: np.ndarray) -> RoutePlan:
    """The permutation that groups the rows by expert."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    return RoutePlan(order, order // ids.shape[1], weights.reshape(-1)[order], experts, starts, counts)


def swiglu_expert(gate_up: np.ndarray, down: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """One expert's MLP from its fused ``[gate; up]`` ``[2f, h]`` and ``down [h, f]`` weights."""
    f = down.shape[1]

    def run(x: np.ndarray) -> np.ndarray:
        gu = x @ gate_up.T
        gate = gu[:, :f]
        return (gate / (1.0 + np.exp(-gate)) * gu[:, f:]) @ down.T
    return run


def moe_forward(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, k: int,
                normalise: bool) -> np.ndarray:
    """The routed experts' weighted sum for ``x [t, h]``: ``router [E, h]``, ``gate_up [E, 2f, h]``,
    ``down [E, h, f]``; permute, one matmul pair per chosen expert over its rows, unpermute."""
    route = plan(*top_k(x @ router.T, k, normalise))
    out = np.zeros_like(x, dtype=np.float32)
    rows = x[route.tokens]  # permuted: each expert's rows contiguous
    for expert, start, count in zip(route.experts, route.starts, route.counts):
        sl = slice(start, start + count)
        y = swiglu_expert(gate_up[expert], down[expert])(rows[sl]) * route.weights[sl, None]
        np.add.at(out, route.tokens[sl], y)
    return out


def shared_expert(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Qwen2-MoE's shared expert, run for every token and scaled by ``sigmoid(x @ gate [1, h].T)``."""
    return swiglu_expert(gate_up, down)(x) / (1.0 + np.exp(-(x @ gate.T)))


def sparse_block(x: np.ndarray, weights: Mapping[str, np.ndarray], layer: int, top_k_experts: int,
                 normalise: bool) -> np.ndarray:
    """Layer ``layer``'s whole MoE block from canonical weights (``agents.weights.moe_weights``): the routed
    experts, plus the gated shared expert where the layer has one."""
    p = f"layers.{layer}."
    out = moe_forward(x, weights[p + "router"], weights[p + "experts_gate_up"], weights[p + "experts_down"],
                      top_k_experts, normalise)
    if p + "shared_gate_up" in weights:
        out = out + shared_expert(x, weights[p + "shared_gate_up"], weights[p + "shared_down"],
                                  weights[p + "shared_gate"])
    return out
