"""Verify rounds on the agent: a verify step with ``num_steps`` R > 1 verifies, proposes again after the tokens it
accepted and verifies again, R rounds before the master hears back. So the master's turnaround, the round trip and
the idle agent's slower start are paid once per R rounds, as multi-step decoding (``multi_step``) does for plain
decode steps; one stream then speculates at the model's speed instead of the master's.

The first round verifies the master's proposals. Each later one gives every sequence still short of its
``R * (k + 1)`` tokens (the positions the master reserved, ``StepBatch.num_steps``) up to ``k`` proposals, fewer
where they would pass that limit: prompt lookup over its history and the tokens it has so far, or placeholders
that the draft model fills (``speculative_runner``). A round without proposals for a sequence is a plain decode
step of it. Greedy only: every tensor-parallel rank runs the same rounds (the lookup and the greedy picks agree
across ranks). A sequence that ends on the way (EOS, a stop string) is cut by the master, its later tokens and
their KV slots discarded with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from llm_serving.protocol.batch import FAILED_TOKEN, StepBatch, StepOutput, verify_batch
from llm_serving.protocol.prompt_lookup import NgramProposer


def run_verify_rounds(step: Callable[[StepBatch], StepOutput], batch: StepBatch, block_size: int | None,
                      lookup: NgramProposer | None) -> StepOutput:
    """``batch.num_steps`` verify rounds through ``step`` (a runner's) of up to ``batch.round_proposals``
    proposals a sequence; ``lookup``: prompt lookup over ``batch.history_ids``, or None for placeholders."""
    if not block_size:
        raise ValueError("verify rounds need the KV block size (runner_config block_size)")
    if lookup is not None and batch.history_ids is None:
        raise ValueError("verify rounds of prompt lookup need each sequence's history (StepBatch.history_ids)")
    k = batch.round_proposals
    n, limit = batch.batch_size, batch.num_steps * (k + 1)
    first = step(replace(batch, num_steps=1, history_offsets=None, history_ids=None, round_proposals=0))
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    counts = np.zeros((n, 3), np.int32)  # drafts verified, proposed, accepted
    counts[:, 0], counts[:, 1] = batch.draft_lens > 0, batch.draft_lens
    _take(first, range(n), tokens, logprobs, counts)
    last_position = batch.context_lens - batch.draft_lens - 1  # of each sequence's last token before the step
    history = (None if lookup is None else
               [batch.history_ids[a:b] for a, b in zip(batch.history_offsets[:-1].tolist(),
                                                       batch.history_offsets[1:].tolist())])
    for _ in range(batch.num_steps - 1):
        active = [i for i in range(n) if len(tokens[i]) < limit and tokens[i][-1] != FAILED_TOKEN]
        if not active:
            break
        proposals = []
        for i in active:
            room = min(k, limit - len(tokens[i]) - 1)  # the pick after the last proposal is a token too
            if lookup is None:
                proposals.append([0] * room)
            else:
                proposals.append(lookup.propose(np.concatenate([history[i], tokens[i]]), room))
        rows = np.array(active, np.intp)
        num_tokens = last_position[rows] + 1 + np.array([len(tokens[i]) for i in active], np.int32)
        round_batch = verify_batch((tokens[i][-1] for i in active), proposals, num_tokens,
                                   batch.block_tables[rows], block_size)
        out = step(round_batch)
        counts[rows, 0] += round_batch.draft_lens > 0
        counts[rows, 1] += round_batch.draft_lens
        _take(out, active, tokens, logprobs, counts)
    most = max(map(len, tokens)) - 1
    more_ids, more_lps = np.zeros((n, max(most, 1)), np.int32), np.zeros((n, max(most, 1)), np.float32)
    for i in range(n):
        more_ids[i, : len(tokens[i]) - 1], more_lps[i, : len(tokens[i]) - 1] = tokens[i][1:], logprobs[i][1:]
    return StepOutput(first.token_ids, first.logprobs, first.errors, more_token_ids=more_ids, more_logprobs=more_lps,
                      num_more=np.array([len(t) - 1 for t in tokens], np.int32), spec_counts=counts)


def _take(out: StepOutput, rows, tokens: list[list[int]], logprobs: list[list[float]], counts: np.ndarray) -> None:
    """Append a round's tokens (the pick after the last token, then those after each accepted proposal) to the
    sequences at ``rows``, and count the accepted proposals."""
    for j, i in enumerate(rows):
        more = int(out.num_more[j]) if out.num_more is not None else 0
        tokens[i] += [int(out.token_ids[j]), *(out.more_token_ids[j, :more].tolist() if more else [])]
        logprobs[i] += [float(out.logprobs[j]), *(out.more_logprobs[j, :more].tolist() if more else [])]
        counts[i, 2] += more
