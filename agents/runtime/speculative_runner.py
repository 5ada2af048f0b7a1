"""Speculative decoding with a draft model in the agent: a target runner and a draft runner side by side.

The draft is a small model of the same vocabulary (``draft_model_path``) or the target's own first layers with its
final norm and lm_head (self-speculation: no second model, ``layer_prefix``). Both keep a KV cache of the same
geometry, addressed by the same block tables. Every prefill or chunk step the target runs, the draft runs too (greedy,
its output unused), so the draft's cache holds every prompt. Plain decode steps (the scheduler chose not to speculate:
the batch is large, or speculation measured slower) run the target alone, so that they cost what they cost without a
draft; the draft's K/V of the tokens they produced are missing (stale slots), which can only lower its acceptance,
never change the output (the target verifies every token). A verify step (``StepBatch.draft_lens``, the
proposals left as placeholders by the master) becomes:

1. ``max(draft_lens)`` draft decode steps, each over the sequences still short of their proposals, each feeding the
   token the previous one chose (the draft writes its K/V of the last token and the proposals but the last);
2. the target's verify step over the last token and the proposals (``agents.runtime.verify_steps``);
3. for the sequences that accepted every proposal, one more draft decode step over the last proposal, whose K/V
   the draft has not written yet (the others' next input is at or before it).

So one master round trip gives up to ``draft_lens + 1`` tokens per sequence for one target call and ``k`` (+1) draft
calls, all in the agent. Under tensor parallelism each rank runs the draft sliced as the target (its greedy picks
are exact across ranks, as the target's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from llm_serving.protocol.batch import StepBatch, StepOutput
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


class SpeculativeRunner:
    """The ``ModelRunner`` interface the agent serves through, over a target and a draft runner."""

    def __init__(self, target, draft) -> None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
                             f"({target.config.vocab_size}): a draft must share the target's tokenizer")
        self.target, self.draft = target, draft
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
        last = np.cumsum(batch.query_lens) - lens - 1  # each sequence's last real token among the step's tokens
        ids = batch.input_ids.copy()
        for j in range(int(lens.max(initial=0))):
            rows = np.flatnonzero(lens > j)
            self._draft_decode(batch, rows, last[rows] + j, ids)
        output = self.target.step(replace(batch, input_ids=ids))
        done = np.flatnonzero((output.num_more == lens) & (lens > 0))
        if done.size:  # the last proposal's K/V, which the draft never took as input
            self._draft_decode(batch, done, last[done] + lens[done], ids, write_back=False)
        return output

    def _draft_decode(self, batch: StepBatch, rows: np.ndarray, tokens: np.ndarray, ids: np.ndarray,
                      write_back: bool = True) -> None:
        """One draft decode step of ``rows`` on the step's tokens at ``tokens``; its picks become the next ones."""
        step = StepBatch(ids[tokens], batch.positions[tokens], batch.slot_mapping[tokens],
                         np.ones(len(rows), np.int32), batch.positions[tokens] + 1, batch.block_tables[rows],
                         kind=StepKind.DECODE)
        picks = self.draft.step(step).token_ids
        if write_back:
            ids[tokens + 1] = picks
