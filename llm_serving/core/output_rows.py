"""What one row of a step's output gives its sequence: a prompt position's score, the generated token (with the
later ones of a multi-step or verify step) and the logits the request reads back, and the end it reaches.

Apart from the scheduler, which decides who runs and how much: this only reads an answer. The scheduler applies
a row once the row's tokens are computed (``Scheduler.postprocess``) and acts on the end this returns (free the
blocks, finish the request).
"""

from __future__ import annotations

from llm_serving.core.logprobs import prompt_logprob, top_logprobs, with_chosen
from llm_serving.core.sequence import Sequence
from llm_serving.protocol.arrays import Float32s
from llm_serving.protocol.batch import StepOutput


class OutputRows:
    """Applies rows of step outputs to their sequences; ``eos_ids`` end a request (unless it ignores EOS)."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids

    def score_prompt(self, seq: Sequence, row: int, output: StepOutput, scoring: bool) -> None:
        """The logprob of the prompt token after the positions now computed, when the request scores its prompt
        (``scoring``: it still did when the step was scheduled) and this row gives the next one."""
        k, computed = seq.params.prompt_logprobs, seq.num_computed_tokens
        if scoring and k is not None and len(seq.prompt_scores) == computed - 1:
            seq.prompt_scores.append(prompt_logprob(logits_row(output, row, seq), seq.prompt_ids[computed], k))

    def generate(self, seq: Sequence, row: int, output: StepOutput, token: int, logprob: float) -> str | None:
        """Append the row's token (its logits kept where the request reads them) and the later tokens the step
        gives (multi-step, accepted proposals) up to an end; the finish reason reached, if any."""
        if seq.wants_logits_row():  # the step asked for this row
            logits = logits_row(output, row, seq)
            if seq.num_output_tokens < seq.logits_tokens:
                seq.logits.append(logits)
            if seq.params.top_logprobs:
                seq.output_top.append(with_chosen(top_logprobs(logits, seq.params.top_logprobs), token, logprob))
        reason = self.append(seq, token, logprob)
        more, more_logprobs = output.more_token_ids, output.more_logprobs
        if reason is None and more is not None and more_logprobs is not None:
            count = more.shape[1] if output.num_more is None else int(output.num_more[row])
            for later, later_logprob in zip(more[row, :count].tolist(), more_logprobs[row, :count].tolist()):
                seq.num_computed_tokens += 1
                reason = self.append(seq, later, later_logprob)
                if reason is not None:
                    break
        return reason

    def append(self, seq: Sequence, token: int, logprob: float) -> str | None:
        """Append a generated token; the finish reason it brings, if any."""
        seq.append_token(token, logprob)
        complete = seq.constraint is not None and seq.constraint.advance(token)
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "eos"
        if token in seq.params.stop_token_ids or complete:  # a stop id, or the whole structured answer
            return "stop"
        if seq.num_output_tokens >= seq.params.max_new_tokens:
            return "length"
        return None


def logits_row(output: StepOutput, row: int, seq: Sequence) -> Float32s:
    """The logits ``output`` returned for ``row``; ValueError when the agents left out a row the step asked for."""
    if row not in output.logits:
        raise ValueError(f"step output has no logits for row {row} ({seq.request_id!r}), which want_logits asked for")
    return output.logits[row]
