"""Speculative decoding with a draft model in the agent: a target runner and a draft runner side by side.

The draft is a small model of the same vocabulary (``draft_model_path``) or the target's own first layers with its
final norm and lm_head (self-speculation: no second model, ``layer_prefix``). Both keep a KV cache of the same
geometry, addressed by the same block tables. Every prefill or chunk step the target runs, the draft runs too (greedy,
its output unused), so the draft's cache holds every prompt. Plain decode steps (the scheduler chose not to speculate:
the batch is large, or speculation measured slower) run the target alone, so that they cost what they cost without a
draft; the draft's K/V of the tokens they produced are missing (stale slots), which can only lower its acceptance,
never change the output (the target verifies every token). A verify step (``StepBatch.draft_lens``, the
proposals left as placeholders by the master) becomes:

1. the draft's proposals: ``k = max(draft_lens)`` greedy decode steps of the sequences with proposals, each feeding
   the token the previous one chose (the draft writes its K/V of the last token and the proposals but the last).
   Where the draft runner warmed a looped graph of ``k`` steps or more (``draft_loops``; CPU), they are one graph
   call (``agents.runtime.looped_decode``): a graph call costs about as much as the draft's arithmetic here, so k
   calls made a round cost 4-5 target decode calls (docs/speculative.md). A sequence wanting fewer than the loop's
   steps runs them all and keeps its first ones: the steps past its proposals write K/V only past its end, into
   its own last block (a block shared by prefix caching is always full and before a sequence's end) or the dummy
   block (its table's columns past its blocks), where they are overwritten before anything reads them. Else (no
   such graph, Ascend, or a step past ``max_model_len``) one decode call per step, each over the sequences still
   short of their proposals;
2. the target's verify step over the last token and the proposals (``agents.runtime.verify_steps``);
3. for the sequences that accepted every proposal, one more draft decode step over the last proposal, whose K/V
   the draft has not written yet (the others' next input is at or before it; a sequence the loop ran past its
   last proposal has it written already).

So one master round trip gives up to ``draft_lens + 1`` tokens per sequence for one target call and one (or ``k``)
draft calls, +1, all in the agent. Under tensor parallelism each rank runs the draft sliced as the target (its
greedy picks are exact across ranks, as the target's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from llm_serving.protocol.batch import StepBatch, StepOutput, verify_round_proposals
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.step import StepKind

_LAYER = "layers."


def layer_prefix(config: LlamaConfig, weights: dict[str, np.ndarray], n: int) -> tuple[LlamaConfig, dict]:
    """The model of the first ``n`` layers with the final norm and lm_head (early exit): its config and weights
    (canonical fused names, ``agents.weights.checkpoints``)."""
    if not 1 <= n <= config.num_hidden_layers:
        raise ValueError(f"early exit at layer {n}: the model has layers 1..{config.num_hidden_layers}")
    kept = {k: v for k, v in weights.items() if not (k.startswith(_LAYER) and int(k.split(".")[1]) >= n)}
    return replace(config, num_hidden_layers=n), kept


def draft_loops(num_tokens: int, step_tokens: int | None, batch_sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(proposals k > 1, most sequences) of each round size a verify step of up to ``batch_sizes[-1]`` sequences
    gives (``protocol.batch.verify_round_proposals``): the looped graphs a draft runner warms
    (``RunnerConfig.draft_loops``)."""
    most: dict[int, int] = {}
    for b in range(1, batch_sizes[-1] + 1):
        k = verify_round_proposals(num_tokens, step_tokens or num_tokens * b + b, b)
        if k > 1:
            most[k] = b
    return tuple(sorted(most.items()))


class SpeculativeRunner:
    """The ``ModelRunner`` interface the agent serves through, over a target and a draft runner."""

    def __init__(self, target, draft, looped: bool = True) -> None:
        """``looped``: a round's proposals in one looped draft call where the draft warmed one (``propose``)."""
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
                             f"({target.config.vocab_size}): a draft must share the target's tokenizer")
        self.target, self.draft = target, draft
        self.looped = looped
        self.rc = target.rc
        self.config = target.config

    @property
    def num_blocks(self) -> int:
        return self.target.num_blocks  # the draft's cache has as many

    @property
    def step_costs(self) -> dict[tuple, float]:
        return {**self.target.step_costs, **{("draft", *k): v for k, v in self.draft.step_costs.items()}}

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        known = known_costs or {}
        own = {k: v for k, v in known.items() if k[0] != "draft"}
        drafts = {k[1:]: v for k, v in known.items() if k[0] == "draft"}
        times = self.target.warmup(progress, own or None)
        tell = (lambda line: progress(f"draft {line}")) if progress else None
        draft_times = self.draft.warmup(tell, drafts or None)
        return {**times, **{("draft", *k): v for k, v in draft_times.items()}}

    def step(self, batch: StepBatch) -> StepOutput:
        if batch.kind is StepKind.VERIFY:
            return self._speculate(batch)
        output = self.target.step(batch)
        if batch.describe().computes_prompts:  # prompts and chunks: the same K/V slots in the draft's cache
            self.draft.step(replace(batch, sampling=None, want_logits=None))
        return output

    def _speculate(self, batch: StepBatch) -> StepOutput:
        lens = batch.draft_lens
        ids, written = self.propose(batch)
        output = self.target.step(replace(batch, input_ids=ids))
        done = np.flatnonzero((output.num_more == lens) & (lens > 0) & ~written)
        if done.size:  # the last proposal's K/V, which the draft never took as input
            last = np.cumsum(batch.query_lens) - lens - 1
            self._draft_decode(batch, done, last[done] + lens[done], ids, write_back=False)
        return output

    def propose(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        """The verify step's input ids with the draft's proposals in place of the placeholders, and for each
        sequence whether the draft has written the K/V of its last proposal (a looped round ran past it)."""
        lens = batch.draft_lens
        last = np.cumsum(batch.query_lens) - lens - 1  # each sequence's last real token among the step's tokens
        ids = batch.input_ids.copy()
        most = int(lens.max(initial=0))
        rows = np.flatnonzero(lens > 0)
        looped = self.looped and most > 1
        picks = self.draft.draft_steps(self._decode_batch(batch, rows, last[rows], ids), most) if looped else None
        if picks is None:
            for j in range(most):
                rows = np.flatnonzero(lens > j)
                self._draft_decode(batch, rows, last[rows] + j, ids)
            return ids, np.zeros(batch.batch_size, np.bool_)
        taken = np.arange(picks.shape[1]) < lens[rows, None]  # each row's first draft_lens picks
        ids[(last[rows, None] + 1 + np.arange(picks.shape[1]))[taken]] = picks[taken]
        written = np.zeros(batch.batch_size, np.bool_)
        written[rows] = lens[rows] < picks.shape[1]
        return ids, written

    def _draft_decode(self, batch: StepBatch, rows: np.ndarray, tokens: np.ndarray, ids: np.ndarray,
                      write_back: bool = True) -> None:
        """One draft decode step of ``rows`` on the step's tokens at ``tokens``; its picks become the next ones."""
        picks = self.draft.step(self._decode_batch(batch, rows, tokens, ids)).token_ids
        if write_back:
            ids[tokens + 1] = picks

    @staticmethod
    def _decode_batch(batch: StepBatch, rows: np.ndarray, tokens: np.ndarray, ids: np.ndarray) -> StepBatch:
        """A decode step of ``rows`` on the step's tokens at ``tokens`` (their K/V slots, their sequences' tables)."""
        return StepBatch(ids[tokens], batch.positions[tokens], batch.slot_mapping[tokens],
                         np.ones(len(rows), np.int32), batch.positions[tokens] + 1, batch.block_tables[rows],
                         kind=StepKind.DECODE)
