"""What a step computes, named once: its kind and the sizes its graph bucket is chosen by.

A step is described by its content, not by a phase flag: each row's query length (tokens computed now) and
context length (its tokens after the step), and its proposals to verify. The kind follows from them:

- ``PREFILL``: every row computes its whole context (prompts from position 0: nothing cached);
- ``DECODE``: every row computes one token, its last (over its cached context, if it has any);
- ``MIXED``: anything else: prompt chunks and prefix-cache hits over cached context, decode rows among them;
- ``VERIFY``: each row's last token followed by its proposals (``StepBatch.draft_lens``).

``step_kind`` is the only place a kind is decided: the master's builders, the agents, the simulator and the
shared-memory header all read ``StepBatch.kind`` (vLLM v1's ``BatchDescriptor`` plays this part there). How many
rounds a step runs (multi-step decoding, verify rounds) and whether its inputs are the agents' own picks
(asynchronous scheduling) are content too (``StepBatch.num_steps``, ``StepBatch.fed_rows``), not kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from llm_serving.protocol.arrays import Integers


class StepKind(IntEnum):
    """The graph family a model step runs on (values are the shared-memory header's codes)."""

    PREFILL = 1
    MIXED = 2
    DECODE = 3
    VERIFY = 4


class RowKind(IntEnum):
    """What one row of a step computes (a mixed step's rows on padded backends run in their own graphs)."""

    PROMPT = 1  # its whole context, from position 0
    CHUNK = 2  # several tokens over cached context
    DECODE = 3  # one token over cached context


def row_kinds(query_lens: Integers, context_lens: Integers) -> npt.NDArray[np.int8]:
    """int8 ``RowKind`` of each row."""
    kinds = np.full(query_lens.shape, RowKind.CHUNK, np.int8)
    kinds[query_lens == context_lens] = RowKind.PROMPT
    kinds[(query_lens == 1) & (context_lens > 1)] = RowKind.DECODE
    return kinds


def step_kind(query_lens: Integers, context_lens: Integers, verifies: bool) -> StepKind:
    """The kind of a model step of these rows; ``verifies``: it carries proposals to verify."""
    if verifies:
        return StepKind.VERIFY
    if np.array_equal(query_lens, context_lens):
        return StepKind.PREFILL
    if bool(np.all(query_lens == 1)):
        return StepKind.DECODE
    return StepKind.MIXED


def part_kind(kind: StepKind, query_lens: Integers, context_lens: Integers) -> StepKind:
    """The kind of some rows of a step of ``kind`` run as one graph call: a decode or verify step's rows keep it;
    a prefill or mixed step's rows are a PREFILL part when they are whole prompts (the prompt graphs run them),
    else MIXED (a group of its decode rows stays on the mixed graph its step was planned on)."""
    if kind in (StepKind.DECODE, StepKind.VERIFY):
        return kind
    return StepKind.PREFILL if np.array_equal(query_lens, context_lens) else StepKind.MIXED


def check_kind(kind: StepKind, query_lens: Integers, context_lens: Integers, verifies: bool) -> None:
    """Raise ValueError when ``kind`` cannot describe these rows. A kind may be more general than ``step_kind``
    derives (a mixed step's part of only decode rows stays mixed: it runs on the mixed graph its step chose; a
    decode warm-up batch of one-token contexts is a decode step), never wrong for the graph it names."""
    if (kind is StepKind.VERIFY) != verifies:
        raise ValueError("a step verifies proposals (draft_lens) exactly when its kind is VERIFY")
    if kind is StepKind.PREFILL and not np.array_equal(query_lens, context_lens):
        raise ValueError("a PREFILL step computes every row's whole context (query_lens == context_lens)")
    if kind is StepKind.DECODE and not bool(np.all(query_lens == 1)):
        raise ValueError("a DECODE step takes exactly one token per sequence")
    if bool(np.any(context_lens < query_lens)):
        raise ValueError("context lengths must hold their queries")


@dataclass(frozen=True)
class StepDescriptor:
    """A step as the graph runtime and the cost models see it: its family and the sizes that pick a bucket."""

    kind: StepKind
    num_seqs: int
    num_tokens: int
    longest_query: int
    longest_context: int
    num_steps: int = 1  # rounds run before answering (multi-step decoding, verify rounds)
    fed: bool = False  # its input ids are the agents' picks of the step before

    @property
    def computes_prompts(self) -> bool:
        """Whether it computes prompt tokens (a prefill or mixed step: it admits or continues prompts)."""
        return self.kind in (StepKind.PREFILL, StepKind.MIXED)
