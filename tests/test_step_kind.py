"""The step protocol: a step's kind follows from its rows, once, and travels with it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from llm_serving.protocol.batch import KvCopyStep, StepBatch, verify_batch
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from llm_serving.protocol.step import RowKind, StepKind, check_kind, part_kind, row_kinds, step_kind


def rows(query: list[int], context: list[int], **fields) -> StepBatch:
    q, ctx = np.array(query, np.int32), np.array(context, np.int32)
    n = int(q.sum())
    positions = np.concatenate([np.arange(c - a, c) for a, c in zip(q, ctx)]).astype(np.int32)
    width = max(1, -(-int(ctx.max()) // 4))
    return StepBatch(np.arange(n, dtype=np.int32), positions, np.arange(n, dtype=np.int32) + 4, q, ctx,
                     np.ones((len(q), width), np.int32), **fields)


@pytest.mark.parametrize("query,context,kind", [
    ([3, 5], [3, 5], StepKind.PREFILL),  # whole prompts
    ([1], [1], StepKind.PREFILL),  # a one-token prompt computes its whole context
    ([1, 1], [7, 2], StepKind.DECODE),
    ([1, 4], [7, 4], StepKind.MIXED),  # a decode row beside a new prompt
    ([4], [9], StepKind.MIXED),  # a chunk over cached context
    ([1, 1], [7, 1], StepKind.DECODE),  # one token each: a one-token prompt decodes as well
    ([1, 2], [7, 2], StepKind.MIXED),
])
def test_the_kind_follows_from_the_rows(query, context, kind) -> None:
    batch = rows(query, context)
    assert batch.kind is kind
    batch.validate()
    described = batch.describe()
    assert (described.kind, described.num_seqs, described.num_tokens) == (kind, len(query), sum(query))
    assert (described.longest_query, described.longest_context) == (max(query), max(context))
    assert described.computes_prompts == (kind in (StepKind.PREFILL, StepKind.MIXED))


def test_a_verify_step_is_the_one_with_proposals_and_its_rounds_are_content() -> None:
    tables = np.array([[1, 2], [3, 4]], np.int32)
    batch = verify_batch([5, 6], [[7, 8], []], np.array([6, 3]), tables, 4, num_steps=3)
    assert batch.kind is StepKind.VERIFY and batch.num_steps == 3
    assert batch.describe().num_steps == 3 and not batch.describe().computes_prompts
    batch.validate()
    assert step_kind(batch.query_lens, batch.context_lens, verifies=False) is StepKind.MIXED
    with pytest.raises(ValueError, match="VERIFY"):
        check_kind(StepKind.MIXED, batch.query_lens, batch.context_lens, verifies=True)


def test_a_kind_given_must_fit_the_rows() -> None:
    warm = rows([1, 1], [1, 1], kind=StepKind.DECODE)  # a decode warm-up over one-token contexts
    warm.validate()
    with pytest.raises(ValueError, match="PREFILL"):
        rows([1, 4], [7, 4], kind=StepKind.PREFILL).validate()
    with pytest.raises(ValueError, match="one token per sequence"):
        rows([3], [3], kind=StepKind.DECODE).validate()
    with pytest.raises(ValueError, match="hold their queries"):
        check_kind(StepKind.MIXED, np.array([3]), np.array([2]), verifies=False)


def test_rounds_and_fed_rows_belong_to_decode_and_verify_steps() -> None:
    decode = rows([1, 1], [5, 6], num_steps=4, fed_rows=np.array([1, 0], np.int32))
    decode.validate()
    assert decode.describe().fed and decode.feeds_previous
    with pytest.raises(ValueError, match="several steps"):
        rows([3], [3], num_steps=2).validate()
    with pytest.raises(ValueError, match="round_proposals"):
        rows([1, 1], [5, 6], num_steps=2, round_proposals=2).validate()
    with pytest.raises(ValueError, match="step before"):
        rows([1, 4], [7, 4], fed_rows=np.array([0, 1], np.int32)).validate()


def test_a_part_keeps_its_steps_family_but_whole_prompts_run_as_prompts() -> None:
    mixed = rows([1, 4, 1], [7, 4, 9])
    assert mixed.take(np.array([0, 2])).kind is StepKind.MIXED  # decode rows of a mixed call stay on its graph
    assert mixed.take(np.array([1])).kind is StepKind.PREFILL
    decode = rows([1, 1], [1, 5], kind=StepKind.DECODE)
    assert decode.take(np.array([0])).kind is StepKind.DECODE
    assert replace(decode, num_steps=2).kind is StepKind.DECODE  # a copy keeps its kind
    assert part_kind(StepKind.PREFILL, np.array([2]), np.array([5])) is StepKind.MIXED


def test_row_kinds_name_what_each_row_computes() -> None:
    kinds = row_kinds(np.array([3, 1, 1, 4], np.int32), np.array([3, 1, 8, 9], np.int32))
    assert kinds.tolist() == [RowKind.PROMPT, RowKind.PROMPT, RowKind.DECODE, RowKind.CHUNK]


def test_the_shared_memory_header_carries_the_kind_and_a_kv_copy_is_its_own_step() -> None:
    channel = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=4,
                                               max_decode_steps=8))
    try:
        sent = [rows([3, 5], [3, 5]), rows([1, 4], [7, 4]), rows([1, 1], [1, 1], kind=StepKind.DECODE),
                verify_batch([5], [[7, 8]], np.array([6]), np.array([[1, 2]], np.int32), 4, num_steps=2,
                             round_proposals=3),
                KvCopyStep("export", [3, 1])]
        for number, step in enumerate(sent):
            channel.write_step(number, step)
            seen, got = channel.read_step()
            assert seen == number and type(got) is type(step)
            if isinstance(step, StepBatch):
                assert got.kind is step.kind and got.num_steps == step.num_steps
                assert got.round_proposals == step.round_proposals
                assert (got.draft_lens is None) == (step.draft_lens is None)
            else:
                assert got.direction == "export" and got.block_ids.tolist() == [3, 1]
    finally:
        channel.close()
