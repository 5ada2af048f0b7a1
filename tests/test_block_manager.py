import pytest

from llm_serving.core.block_manager import DUMMY_BLOCK, BlockManager
from llm_serving.core.sequence import SamplingParams, Sequence


def make_seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_new_tokens=8))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_covers_all_tokens_and_never_hands_out_block_zero():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert (bm.num_usable_blocks, bm.num_free_blocks, bm.num_used_blocks) == (5, 5, 0)
    a, b = make_seq("a", 9), make_seq("b", 8)
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3
    bm.allocate(b)
    assert len(b.block_table) == 2
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 5 and bm.usage == 1.0
    assert DUMMY_BLOCK not in a.block_table + b.block_table
    assert sorted(a.block_table + b.block_table) == [1, 2, 3, 4, 5]
    c = make_seq("c", 1)
    assert not bm.can_allocate(c)
    with pytest.raises(RuntimeError, match="only 0 free"):
        bm.allocate(c)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(a)


def test_allocate_needs_tokens():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="no tokens"):
        bm.allocate(Sequence("e", [], SamplingParams()))


def test_append_slot_grows_only_when_the_next_token_starts_a_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 4)
    bm.allocate(seq)
    assert len(seq.block_table) == 1 and bm.can_append(seq)
    bm.append_slot(seq)  # 4 tokens fit in one block: nothing to do
    assert len(seq.block_table) == 1
    seq.append_token(7, -0.1)  # 5th token (position 4) starts block 2
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    for _ in range(3):  # positions 5..7 stay in block 2
        seq.append_token(7, -0.1)
        bm.append_slot(seq)
        assert len(seq.block_table) == 2
    seq.append_token(7, -0.1)
    bm.append_slot(seq)  # position 8: the last free block
    assert bm.num_free_blocks == 0
    seq.append_token(7, -0.1)  # positions 9..11 fit
    seq.append_token(7, -0.1)
    seq.append_token(7, -0.1)
    seq.append_token(7, -0.1)  # position 12 needs a 4th block: none free
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError, match="no free KV block"):
        bm.append_slot(seq)


def test_append_slot_refuses_to_grow_more_than_one_block():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq("a", 2)
    bm.allocate(seq)
    seq.output_ids.extend([1, 2, 3])
    with pytest.raises(RuntimeError, match="needs 2 more blocks"):
        bm.append_slot(seq)
    with pytest.raises(RuntimeError, match="allocate it first"):
        bm.append_slot(make_seq("b", 1))


def test_free_returns_blocks_and_is_strict():
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_seq("a", 3), make_seq("b", 2)
    bm.allocate(a)
    bm.allocate(b)
    table = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3 and not bm.is_allocated(table[0])
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


def test_slot_maps_positions_through_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", 6)
    seq.block_table = [5, 2]  # set by hand to check the arithmetic
    assert [bm.slot(seq, p) for p in range(6)] == [20, 21, 22, 23, 8, 9]
    assert bm.slot(seq, 7) == 11
    with pytest.raises(IndexError, match="position 8"):
        bm.slot(seq, 8)
    with pytest.raises(IndexError):
        bm.slot(seq, -1)


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=3, block_size=1)
    for i in range(5):
        s = make_seq(f"s{i}", 2)
        bm.allocate(s)
        assert sorted(s.block_table) == [1, 2]
        bm.free(s)
    assert bm.num_free_blocks == 2


def test_shared_blocks_are_counted_and_freed_by_their_last_holder():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq("a", 4)
    bm.allocate(a)
    prefix = list(a.block_table)
    b = make_seq("b", 5)
    bm.share(b, prefix)  # b starts with a's two full blocks
    assert [bm.ref_count(x) for x in prefix] == [2, 2] and bm.num_used_blocks == 2
    assert bm.can_append(b)
    bm.append_slot(b)  # b's fifth token goes to a block of its own
    assert b.block_table[:2] == prefix and bm.ref_count(b.block_table[2]) == 1
    bm.free(a)
    assert [bm.ref_count(x) for x in prefix] == [1, 1] and bm.num_free_blocks == 2  # still held by b
    with pytest.raises(RuntimeError, match="owned by 'b'"):
        a.block_table = prefix
        bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 0 and bm.ref_count(prefix[0]) == 0
    c = make_seq("c", 2)
    with pytest.raises(RuntimeError, match="cannot share block .* it is free"):
        bm.share(c, prefix)
    assert c.block_table == []
