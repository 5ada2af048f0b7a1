import numpy as np
import pytest

from llm_serving.core.block_manager import DUMMY_BLOCK, BlockManager
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.protocol.batch import kv_slots


def make_seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_new_tokens=8))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_grow_covers_all_tokens_and_never_hands_out_block_zero():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert (bm.num_usable_blocks, bm.num_free_blocks, bm.num_used_blocks) == (5, 5, 0)
    a, b = make_seq("a", 9), make_seq("b", 8)
    assert bm.can_grow(a, a.num_tokens)
    bm.grow(a, a.num_tokens)
    assert len(a.block_table) == 3
    bm.grow(b, b.num_tokens)
    assert len(b.block_table) == 2
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 5 and bm.usage == 1.0
    assert DUMMY_BLOCK not in a.block_table + b.block_table
    assert sorted(a.block_table + b.block_table) == [1, 2, 3, 4, 5]
    c = make_seq("c", 1)
    assert not bm.can_grow(c, 1)
    with pytest.raises(RuntimeError, match="only 0 free"):
        bm.grow(c, 1)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.share(a, [])


def test_grow_takes_a_block_only_when_a_token_starts_one():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 4)
    bm.grow(seq, 4)
    assert len(seq.block_table) == 1 and bm.can_grow(seq, 4)
    bm.grow(seq, 4)  # 4 tokens fit in one block: nothing to do
    assert len(seq.block_table) == 1
    bm.grow(seq, 5)  # position 4 starts block 2
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    for n in range(6, 9):  # positions 5..7 stay in block 2
        bm.grow(seq, n)
        assert len(seq.block_table) == 2
    bm.grow(seq, 9)  # position 8: the last free block
    assert bm.num_free_blocks == 0
    bm.grow(seq, 12)  # positions 9..11 fit
    assert not bm.can_grow(seq, 13)  # position 12 needs a 4th block: none free
    with pytest.raises(RuntimeError, match="cannot grow sequence 'a' by 1 blocks: only 0 free"):
        bm.grow(seq, 13)
    assert len(seq.block_table) == 3


def test_grow_takes_several_blocks_at_once_for_a_chunk():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq("a", 2)
    bm.grow(seq, 2)
    bm.grow(seq, 7)
    assert len(seq.block_table) == 4 and bm.num_used_blocks == 4


def test_free_returns_blocks_and_is_strict():
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_seq("a", 3), make_seq("b", 2)
    bm.grow(a, a.num_tokens)
    bm.grow(b, b.num_tokens)
    table = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3 and bm.accounting()["held"] == 1
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)
    a.block_table = table  # a stale copy of freed blocks
    with pytest.raises(RuntimeError, match="which is a free block"):
        bm.free(a)
    a.block_table = list(b.block_table)  # blocks of another sequence
    with pytest.raises(RuntimeError, match="owned by 'b'"):
        bm.free(a)
    dup = make_seq("b", 1)
    dup.block_table = [b.block_table[0], b.block_table[0]]
    with pytest.raises(RuntimeError, match="twice"):
        bm.free(dup)
    assert bm.num_used_blocks == 1  # the failed frees released nothing
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0


def test_truncate_frees_the_tail_and_is_strict():
    bm = BlockManager(num_blocks=6, block_size=2)
    seq = make_seq("a", 3)
    bm.grow(seq, 9)  # blocks for positions grown ahead (proposals)
    head = seq.block_table[:2]
    bm.truncate(seq, 2)
    assert seq.block_table == head and bm.num_used_blocks == 2 and bm.num_free_blocks == 3
    bm.truncate(seq, 2)  # nothing past the second block: nothing to do
    seq.block_table.append(5 if 5 not in head else 4)  # a block it does not hold
    with pytest.raises(RuntimeError, match="does not hold"):
        bm.truncate(seq, 2)


def test_slots_map_positions_through_the_block_table():
    tables = np.array([[5, 2]])
    positions = np.arange(8)
    assert kv_slots(tables, np.zeros(8, np.intp), positions, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=3, block_size=1)
    for i in range(5):
        s = make_seq(f"s{i}", 2)
        bm.grow(s, s.num_tokens)
        assert sorted(s.block_table) == [1, 2]
        bm.free(s)
    assert bm.num_free_blocks == 2


def test_shared_blocks_are_counted_once_and_freed_by_their_last_holder():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq("a", 4)
    bm.grow(a, a.num_tokens)
    prefix = list(a.block_table)
    b = make_seq("b", 5)
    bm.share(b, prefix)  # b starts with a's two full blocks
    assert bm.num_used_blocks == 2 and bm.can_grow(b, b.num_tokens)
    bm.grow(b, b.num_tokens)  # b's fifth token goes to a block of its own
    assert b.block_table[:2] == prefix and b.block_table[2] not in prefix and bm.num_used_blocks == 3
    bm.free(a)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 2  # still held by b
    with pytest.raises(RuntimeError, match="owned by 'b'"):
        a.block_table = prefix
        bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 0
    c = make_seq("c", 2)
    with pytest.raises(RuntimeError, match="cannot share block .* it is free"):
        bm.share(c, prefix)
    assert c.block_table == []
