"""Sampling on the agent, right after the graph, from the step's logits (numpy; no MindSpore).

Why here: the logits are already in the agent's memory, and only token ids + logprobs cross to the master (no
``batch x vocab`` transfer per step). All-greedy steps never come here: they use the in-graph argmax.

Semantics follow Hugging Face ``generate`` / vLLM: the logit adjustments first (``logit_bias``; -inf on the end ids
of a sequence short of its ``min_tokens``; -inf on every token a structured-output row's mask bans), then the
repetition penalty over prompt + generated tokens (the CTRL rule: positive logits divided by the penalty, negative
ones multiplied), OpenAI's presence and frequency penalties over the generated tokens, then temperature, then
``min_p`` (tokens less likely than that fraction of the most likely one dropped), then top-k, then top-p (nucleus)
over what is left. Temperature 0 is greedy over the adjusted, penalised logits. The returned logprob is the chosen
token's log-softmax under the model's raw logits, as for greedy.

Containment: a row whose sampling raises gets ``FAILED_TOKEN`` and the other rows are sampled as usual, so one
request's parameters never fail its step's other requests. The reasons wait in ``take_failures`` (keyed by the
row's seed and draw index, which name a sequence within a step), for the agent to report after the step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from llm_serving.protocol.batch import FAILED_TOKEN, SamplingBatch, SamplingExtras, StepBatch, StepOutput

# Top-p looks at this many best candidates first and falls back to a full sort when they hold < top_p mass.
_TOP_P_CANDIDATES = 256

# Reasons of the rows that failed since the last ``take_failures``: an agent runs one step at a time.
_failures: dict[tuple[int, int], str] = {}


def _log_softmax_at(logits: np.ndarray, token: int) -> float:
    top = float(logits.max())
    return float(logits[token]) - top - float(np.log(np.exp(logits - top).sum(dtype=np.float64)))


def apply_repetition_penalty(logits: np.ndarray, token_ids: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL repetition penalty on a float64 copy of one row."""
    out = logits.astype(np.float64)
    if penalty != 1.0 and token_ids.size:
        seen = np.unique(token_ids)
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_min_p(scaled: np.ndarray, min_p: float) -> np.ndarray:
    """``scaled`` with -inf for tokens whose probability is below ``min_p`` times the most likely one's."""
    return np.where(scaled >= scaled.max() + np.log(min_p), scaled, -np.inf)


def filtered_probs(scaled: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate token ids and their renormalised probabilities after top-k, then top-p."""
    vocab = scaled.shape[0]
    pool = np.argpartition(-scaled, top_k - 1)[:top_k] if 0 < top_k < vocab else np.arange(vocab)
    weights = np.exp(scaled[pool] - scaled[pool].max())
    weights /= weights.sum()  # the distribution after top-k
    if top_p >= 1.0:
        return pool, weights
    n = min(_TOP_P_CANDIDATES, len(pool))
    best = np.argpartition(-weights, n - 1)[:n]
    best = best[np.argsort(-weights[best], kind="stable")]
    if n < len(pool) and weights[best].sum() < top_p:  # the nucleus is wider than the shortlist
        best = np.argsort(-weights, kind="stable")
    chosen = weights[best]
    keep = best[np.cumsum(chosen) - chosen < top_p]  # smallest prefix reaching top_p; never empty
    probs = weights[keep]
    return pool[keep], probs / probs.sum()


@dataclass(frozen=True)
class RowExtras:
    """One sequence's rarer controls (``protocol.batch.SamplingExtras``' row)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    output_start: int = 0  # where its generated ids start among its penalty ids
    adjust_ids: np.ndarray | None = None
    adjust_values: np.ndarray | None = None
    token_mask: np.ndarray | None = None  # int32 bitmask of the tokens it may produce; None: any

    @classmethod
    def of(cls, extras: SamplingExtras | None, i: int) -> RowExtras | None:
        if extras is None:
            return None
        lo, hi = extras.adjust_offsets[i], extras.adjust_offsets[i + 1]
        mask = extras.token_masks[i] if extras.token_masks is not None else None
        return cls(float(extras.presence_penalty[i]), float(extras.frequency_penalty[i]), float(extras.min_p[i]),
                   int(extras.output_start[i]), extras.adjust_ids[lo:hi], extras.adjust_values[lo:hi],
                   None if mask is None or (mask == -1).all() else mask)


def adjusted_logits(logits: np.ndarray, penalty: float, penalty_ids: np.ndarray,
                    extras: RowExtras | None) -> np.ndarray:
    """float64 logits of one row after the adjustments and every penalty (before temperature)."""
    if extras is None:
        return apply_repetition_penalty(logits, penalty_ids, penalty)
    out = logits.astype(np.float64)
    if extras.adjust_ids is not None and extras.adjust_ids.size:
        np.add.at(out, extras.adjust_ids, extras.adjust_values.astype(np.float64))
    if extras.token_mask is not None:
        allowed = np.unpackbits(extras.token_mask.view(np.uint8), bitorder="little")[: out.shape[0]]
        out[allowed == 0] = -np.inf
    out = apply_repetition_penalty(out, penalty_ids, penalty)
    if extras.presence_penalty or extras.frequency_penalty:
        ids, counts = np.unique(penalty_ids[extras.output_start:], return_counts=True)
        out[ids] -= extras.frequency_penalty * counts + extras.presence_penalty
    return out


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, penalty: float,
               penalty_ids: np.ndarray, seed: int, draw_index: int,
               extras: RowExtras | None = None) -> tuple[int, float]:
    """Next token of one sequence and its raw-logits logprob."""
    penalised = adjusted_logits(logits, penalty, penalty_ids, extras)
    if temperature <= 0:
        token = int(np.argmax(penalised))
    else:
        scaled = penalised / temperature
        if extras is not None and extras.min_p > 0:
            scaled = apply_min_p(scaled, extras.min_p)
        token = _drawn_token(scaled, top_k, top_p, seed, draw_index)
    return token, _log_softmax_at(logits, token)


def _drawn_token(scaled: np.ndarray, top_k: int, top_p: float, seed: int, draw_index: int) -> int:
    """The token a seeded sampled sequence draws at output position ``draw_index`` from tempered logits."""
    ids, probs = filtered_probs(scaled, top_k, top_p)
    return _pick(ids, probs, _draw(seed, draw_index))


def _draw(seed: int, draw_index: int) -> float:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, draw_index]).random()


def _pick(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    return int(ids[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(ids) - 1)])


def speculative_sample_row(logits: np.ndarray, proposals: list[int], temperature: float, top_k: int, top_p: float,
                           seed: int, draw_index: int) -> list[int]:
    """The tokens a plainly sampled sequence keeps from a verify step. ``logits`` ``[len(proposals) + 1, vocab]``:
    the model's after its last token and after each proposal.

    Each position draws its token exactly as ``sample_row`` would there (the same distribution, the same draw of
    the seed and output position), and the proposal is kept when the draw equals it; the first that differs ends
    the step with the drawn token. For proposals chosen deterministically (prompt lookup, a greedy draft) this is
    speculative sampling's rejection rule (a proposal ``d`` is kept with probability ``p(d)``, else replaced by a
    draw from ``p`` without ``d``) with the draws coupled to plain sampling's: a seeded request gives the same
    tokens whether or not its steps speculate.
    """
    out = []
    for j, row in enumerate(logits[: len(proposals) + 1]):
        out.append(_drawn_token(row.astype(np.float64) / temperature, top_k, top_p, seed, draw_index + j))
        if j == len(proposals) or out[-1] != proposals[j]:
            break
    return out


def sample(logits: np.ndarray, greedy_ids: np.ndarray, greedy_logprobs: np.ndarray,
           sampling: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and logprobs for a batch: rows without sampling or penalty keep the in-graph greedy result."""
    ids = greedy_ids.astype(np.int32).copy()
    logprobs = greedy_logprobs.astype(np.float32).copy()
    special = np.nonzero(sampling.special_rows())[0]
    for i in special.tolist():
        lo, hi = sampling.penalty_offsets[i], sampling.penalty_offsets[i + 1]
        try:
            ids[i], logprobs[i] = sample_row(
                logits[i], float(sampling.temperature[i]), int(sampling.top_k[i]), float(sampling.top_p[i]),
                float(sampling.repetition_penalty[i]), sampling.penalty_token_ids[lo:hi], int(sampling.seeds[i]),
                int(sampling.draw_index[i]), RowExtras.of(sampling.extras, i))
        except Exception as exc:  # noqa: BLE001 - this row fails alone; the others are unaffected
            ids[i], logprobs[i] = FAILED_TOKEN, 0.0
            record_failure(sampling, i, exc)
    return ids, logprobs


def sample_verified(logits: np.ndarray, proposals: list[int], sampling: SamplingBatch, i: int) -> list[int]:
    """Row ``i``'s tokens from a verify step (``logits``: after its last token and each proposal): rejection
    sampling over its proposals, or with none the usual draw with every control."""
    seed, index = int(sampling.seeds[i]), int(sampling.draw_index[i])
    if not proposals:
        lo, hi = sampling.penalty_offsets[i], sampling.penalty_offsets[i + 1]
        return [sample_row(logits[0], float(sampling.temperature[i]), int(sampling.top_k[i]),
                           float(sampling.top_p[i]), float(sampling.repetition_penalty[i]),
                           sampling.penalty_token_ids[lo:hi], seed, index, RowExtras.of(sampling.extras, i))[0]]
    return speculative_sample_row(logits, proposals, float(sampling.temperature[i]), int(sampling.top_k[i]),
                                  float(sampling.top_p[i]), seed, index)


def raw_logprob(logits: np.ndarray, token: int) -> float:
    """A token's log-softmax under the model's raw logits (the logprob every path reports)."""
    return _log_softmax_at(logits, token)


def record_failure(sampling: SamplingBatch, i: int, exc: BaseException) -> None:
    """Remember why row ``i`` failed (``take_failures`` reports it after the step)."""
    reason = (f"sampling failed: {type(exc).__name__}: {exc} (temperature {sampling.temperature[i]}, "
              f"top_k {sampling.top_k[i]}, top_p {sampling.top_p[i]}, "
              f"repetition_penalty {sampling.repetition_penalty[i]})")
    _failures[(int(sampling.seeds[i]), int(sampling.draw_index[i]))] = reason
    print(f"sampler: {reason}", file=sys.stderr, flush=True)


def take_failures(sampling: SamplingBatch | None, token_ids: np.ndarray) -> dict[int, str]:
    """Why each row of a step's answer marked ``FAILED_TOKEN`` failed (by row), forgetting every recorded
    reason. ``sampling`` is the whole step's (the sampler may have seen it in parts)."""
    recorded = dict(_failures)
    _failures.clear()
    rows = np.flatnonzero(np.asarray(token_ids) == FAILED_TOKEN).tolist()
    if not rows:
        return {}
    unknown = "failed on the agent (no reason recorded)"
    if sampling is None:
        return dict.fromkeys(rows, unknown)
    return {r: recorded.get((int(sampling.seeds[r]), int(sampling.draw_index[r])), unknown) for r in rows}


def step_output(batch_size: int, parts: Iterable[tuple[np.ndarray, StepBatch, tuple]]) -> StepOutput:
    """A step's output from its graph calls: ``(rows of the batch, their sub-batch, (ids, logprobs, logits))``
    each, the outputs device tensors padded to the call's bucket. The logits leave the device only for calls with
    a sampled sequence (sampled here) or a row in ``want_logits`` (returned raw, before any penalty)."""
    ids = np.zeros(batch_size, np.int32)
    logprobs = np.zeros(batch_size, np.float32)
    wanted: dict[int, np.ndarray] = {}
    for group, part, (tok, lp, logits) in parts:
        n = part.batch_size
        tok, lp = tok.asnumpy()[:n], lp.asnumpy()[:n]
        sampled = part.sampling is not None and part.sampling.needs_logits
        if sampled or part.want_logits is not None:
            host = logits.asnumpy()[:n]
            if sampled:
                tok, lp = sample(host, tok, lp, part.sampling)
            if part.want_logits is not None:
                wanted.update((int(group[i]), host[i].copy()) for i in np.flatnonzero(part.want_logits))
        ids[group], logprobs[group] = tok, lp
    return StepOutput(ids, logprobs, logits=wanted)
