"""The most likely tokens of one step and their log-probabilities, from the logits the agent returned.

Only requests that ask for alternatives (OpenAI's ``logprobs`` > 0 on completions, ``top_logprobs`` on chat) get
their rows' logits back (``StepBatch.want_logits``); every other step keeps the in-graph greedy pick and reads no
logits. The distribution is the model's raw one (log-softmax of the logits, before temperature, penalties and
top-k/top-p), as vLLM reports by default and as the chosen token's own logprob is computed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on alternatives per position

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
PromptLogprob = tuple[float, TopLogprobs]  # a prompt token's logprob, and its position's most likely tokens


def prompt_logprob(logits: npt.NDArray[np.float32], token: int, k: int) -> PromptLogprob:
    """The logprob of prompt ``token`` under the row of the position before it, and that row's ``k`` best."""
    x, lse = _with_logsumexp(logits)
    return float(x[token] - lse), _best(x, lse, k) if k else ()


def top_logprobs(logits: npt.NDArray[np.float32], k: int) -> TopLogprobs:
    """The ``k`` most likely tokens of one float32 ``[vocab]`` row, best first (ties: lower id first)."""
    return _best(*_with_logsumexp(logits), k)


def with_chosen(top: TopLogprobs, token: int, logprob: float) -> TopLogprobs:
    """``top`` with the chosen ``token``'s entry set to ``logprob``, the number its ``token_logprobs`` reports (the
    agent's float32 one; recomputing here in float64 differed by up to 8e-7): one value per token, and the same
    whether or not the request asks for alternatives."""
    return tuple((i, logprob if i == token else lp) for i, lp in top)


def _with_logsumexp(logits: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float64], float]:
    """The row in float64 and its log-sum-exp (a logit minus it is that token's logprob)."""
    x = np.asarray(logits, dtype=np.float64)
    top = float(x.max())
    return x, top + float(np.log(np.exp(x - top).sum()))


def _best(x: npt.NDArray[np.float64], lse: float, k: int) -> TopLogprobs:
    k = min(k, x.shape[0])
    ids = np.argpartition(-x, k - 1)[:k]
    ids = ids[np.lexsort((ids, -x[ids]))]
    return tuple((int(i), float(x[i] - lse)) for i in ids)
