"""StepBatch.take: the sequences picked, each with all its tokens, in the order asked."""

from __future__ import annotations

import numpy as np

from llm_serving.protocol.batch import StepBatch


def prefill_batch(lens: list[int]) -> StepBatch:
    n = sum(lens)
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    return StepBatch((100 * seq_of_token + np.arange(n)).astype(np.int32), np.arange(n, dtype=np.int32),
                     np.arange(n, dtype=np.int32) + 16, np.array(lens, np.int32), np.array(lens, np.int32) + 3,
                     np.arange(len(lens) * 2, dtype=np.int32).reshape(len(lens), 2),
                     want_logits=np.array([i == 2 for i in range(len(lens))]))


def test_take_keeps_each_sequence_whole_in_the_order_asked() -> None:
    batch = prefill_batch([3, 1, 4, 2])
    starts = [0, 3, 4, 8]
    indices = np.array([2, 0, 3])
    part = batch.take(indices)
    tokens = np.concatenate([np.arange(starts[i], starts[i] + batch.query_lens[i]) for i in indices])
    np.testing.assert_array_equal(part.input_ids, batch.input_ids[tokens])
    np.testing.assert_array_equal(part.slot_mapping, batch.slot_mapping[tokens])
    np.testing.assert_array_equal(part.query_lens, [4, 3, 2])
    np.testing.assert_array_equal(part.context_lens, [7, 6, 5])
    np.testing.assert_array_equal(part.block_tables, batch.block_tables[indices])
    np.testing.assert_array_equal(part.want_logits, [True, False, False])
    assert batch.take(np.array([1])).want_logits is None  # nobody in the part asks


def test_taking_every_sequence_in_order_is_the_step_itself() -> None:
    batch = prefill_batch([2, 5])
    assert batch.take(np.arange(2)) is batch
    reordered = batch.take(np.array([1, 0]))
    np.testing.assert_array_equal(reordered.input_ids, np.concatenate([batch.input_ids[2:], batch.input_ids[:2]]))
