"""The thinking budget (vLLM's ``thinking_token_budget``): a reasoning model's ``<think>`` block may run this many
tokens; then the end tag's ids are forced, one a step, and the answer goes on freely.

It rides the structured-output path (``OutputConstraint`` kind "thinking_budget", a matcher per sequence whose
mask the step carries: ``core.grammar``), so the agents need nothing new: all tokens allowed while the budget lasts,
only the next end-tag id while it is forced. The block starts open where the prompt opened it (``inside``), else
where the answer's first tokens are the start tag's ids; the model's own end tag (its ids in a row) closes it early.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from llm_serving.core.sequence import OutputConstraint

KIND = "thinking_budget"


@dataclass(frozen=True)
class BudgetSpec:
    budget: int  # reasoning tokens before the end tag is forced
    start_ids: tuple[int, ...]  # the start tag as the served tokenizer spells it
    end_ids: tuple[int, ...]
    inside: bool  # the prompt opened the block

    def constraint(self, field: str = "thinking_token_budget") -> OutputConstraint:
        return OutputConstraint(KIND, json.dumps([self.budget, self.start_ids, self.end_ids, self.inside]), field)

    @classmethod
    def parse(cls, spec: str) -> BudgetSpec:
        budget, start, end, inside = json.loads(spec)
        return cls(int(budget), tuple(start), tuple(end), bool(inside))


class ThinkingBudget:
    """One sequence's budget (``core.sequence.AnswerMatcher``): it never completes the answer itself."""

    def __init__(self, spec: BudgetSpec, vocab_size: int) -> None:
        if not spec.end_ids or not spec.start_ids or spec.budget < 0:
            raise ValueError(f"a thinking budget needs start and end ids and a budget >= 0, got {spec}")
        self.mask_words = (vocab_size + 31) // 32
        self._spec = spec
        self._inside = spec.inside
        self._opening = 0 if not spec.inside else len(spec.start_ids)  # start-tag ids of the answer seen so far
        self._spent = 0  # reasoning tokens
        self._forced = -1  # end-tag ids forced so far, -1 while the budget lasts
        self._tail: list[int] = []  # the last reasoning tokens, to see the model's own end tag

    def _forcing(self) -> int | None:
        """The id the next token must be, while the end tag is forced."""
        if self._inside and self._spent >= self._spec.budget:
            return self._spec.end_ids[max(self._forced, 0)]
        return None

    def fill_mask(self, row: npt.NDArray[np.int32]) -> None:
        forced = self._forcing()
        if forced is None:
            row[:] = -1
            return
        row[:] = 0
        row[forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))

    def allows(self, token: int) -> bool:
        forced = self._forcing()
        return forced is None or token == forced

    def advance(self, token: int) -> bool:
        if not self.allows(token):
            raise ValueError(f"token {token} is not allowed here: the thinking budget forces its end tag")
        start, end = self._spec.start_ids, self._spec.end_ids
        if not self._inside:
            if 0 <= self._opening < len(start) and token == start[self._opening]:
                self._opening += 1
                self._inside = self._opening == len(start)
            else:
                self._opening = -1  # the answer did not open a block: nothing to count
            return False
        if self._forcing() is not None:
            self._forced = max(self._forced, 0) + 1
            if self._forced == len(end):
                self._inside, self._opening = False, -1
            return False
        self._spent += 1
        self._tail = [*self._tail, token][-len(end):]
        if tuple(self._tail) == end:
            self._inside, self._opening = False, -1
        return False

    @property
    def error(self) -> str:
        return ""
