"""The KV cache manager's API as the scheduler and KV transfer use it: starting, growing, trimming and freeing a
sequence's blocks, the block-table mirror a step gathers, the prefix cache's counts, and transfer holds."""

from __future__ import annotations

import numpy as np

from llm_serving.core.kv_cache_manager import KVCacheManager
from llm_serving.core.sequence import Sequence


def manager(num_blocks: int = 9, caching: bool = True, max_num_seqs: int = 3) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, max_num_seqs=max_num_seqs, max_model_len=32,
                          prefix_caching=caching)


def started(kv: KVCacheManager, rid: str, tokens: list[int], num_tokens: int | None = None) -> Sequence:
    seq = Sequence(rid, tokens)
    kv.start(seq, kv.computed_prefix(seq), len(tokens) if num_tokens is None else num_tokens)
    return seq


def test_allocate_slots_grows_and_mirrors_or_changes_nothing():
    kv = manager()  # 8 usable blocks
    a, b = started(kv, "a", list(range(5))), started(kv, "b", list(range(3)))
    assert (len(a.block_table), len(b.block_table), kv.num_free_blocks) == (2, 1, 5)
    assert kv.allocate_slots(a, 8)  # within its blocks: nothing to take
    assert kv.allocate_slots(a, 9) and len(a.block_table) == 3 and kv.num_free_blocks == 4
    assert kv.block_tables([a, b]).tolist() == [a.block_table, b.block_table + [0, 0]]
    tables, before = kv.block_tables([b, a]), (list(b.block_table), kv.num_free_blocks)
    assert not kv.allocate_slots(b, 4 * 6)  # 5 more blocks: only 4 free
    assert (b.block_table, kv.num_free_blocks) == before
    assert kv.block_tables([b, a]).tolist() == tables.tolist()
    assert kv.missing_blocks(b, 4 * 6) == 5 and kv.missing_blocks(a, 1) == 0


def test_block_tables_are_a_copy_and_trim_resets_the_mirror():
    kv = manager()
    a, b = started(kv, "a", list(range(5))), started(kv, "b", list(range(9)))
    tables = kv.block_tables([a])
    assert kv.allocate_slots(a, 17)  # blocks for proposals
    assert tables.tolist() == [a.block_table[:2]] and kv.block_tables([a]).tolist() == [a.block_table]
    kv.trim(a, 6)
    assert len(a.block_table) == 2 and kv.num_used_blocks == 5
    assert kv.block_tables([a, b]).tolist() == [a.block_table + [0], b.block_table]
    kv.trim(a, 6)  # nothing past them: nothing to do
    assert len(a.block_table) == 2


def test_a_freed_row_is_reused_without_its_old_blocks():
    kv = manager(max_num_seqs=1)
    a = started(kv, "a", list(range(12)))
    kv.free(a)
    b = started(kv, "b", [1])  # a's row, its table reset
    assert kv.block_tables([b]).tolist() == [b.block_table] and kv.num_used_blocks == 1
    assert kv.allocate_slots(b, 9)
    assert kv.block_tables([b]).tolist() == [b.block_table] and len(b.block_table) == 3


def test_start_counts_the_prefix_caches_tokens_and_free_caches_the_computed_blocks():
    kv = manager()
    a = started(kv, "a", list(range(10)))
    a.num_computed_tokens = 10
    kv.free(a)  # its 2 full blocks cached, idle
    assert kv.accounting() == {"free": 6, "idle_cached": 2, "held": 0, "cached": 2}
    b = Sequence("b", list(range(9)))
    hit = kv.computed_prefix(b)  # the last token is left to compute: 2 blocks
    assert len(hit) == 2 and kv.blocks_to_start(hit, 10) == 3  # the 2 idle ones revived and 1 new
    kv.start(b, hit, 10)
    assert b.num_cached_blocks == 2 and b.block_table[:2] == hit
    assert kv.prefix_cache_stats() == {"kv_blocks_cached": 0, "prefix_cache_queried_tokens": 10 + 9,
                                       "prefix_cache_hit_tokens": 8, "prefix_cache_evictions": 0}
    plain = manager(caching=False)
    c = started(plain, "c", list(range(10)))
    c.num_computed_tokens = 10
    assert plain.computed_prefix(Sequence("d", list(range(10)))) == []
    plain.free(c)
    assert plain.prefix_cache_stats() == dict.fromkeys(kv.prefix_cache_stats(), 0)


def test_evictions_are_still_counted_after_the_cache_is_reset():
    kv = manager(num_blocks=3)  # 2 usable
    a = started(kv, "a", list(range(8)))
    a.num_computed_tokens = 8
    kv.free(a)
    b = started(kv, "b", [50, 51, 52, 53, 54])  # takes both idle cached blocks
    assert kv.prefix_cache_stats()["prefix_cache_evictions"] == 2
    kv.free(b)
    kv.reset_prefix_cache()
    assert kv.prefix_cache_stats()["prefix_cache_evictions"] == 2


def test_transfer_holds_get_no_row_even_under_a_running_requests_id():
    kv = manager()
    a = started(kv, "a", list(range(9)))
    a.num_computed_tokens = 9
    kv.cache_computed(a)  # 2 full blocks cached while a runs on
    export = Sequence("a", list(range(9)))  # a client may name a request as a transfer is named
    assert kv.hold_cached_prefix(export) and export.block_table == a.block_table[:2]
    assert not kv.hold_cached_prefix(Sequence("x", [7, 7, 7, 7, 7]))  # nothing cached
    imported = Sequence("a", list(range(100, 116)))
    assert kv.hold_for_import(imported, 4) and len(imported.block_table) == 4
    kv.free(export)
    kv.free(imported)  # never computed: the blocks are free again
    assert kv.block_tables([a]).tolist() == [a.block_table] and kv.num_used_blocks == 3
    assert kv.allocate_slots(a, 17) and kv.block_tables([a]).tolist() == [a.block_table]
    assert not kv.hold_for_import(Sequence("y", list(range(8))), 2)  # a's blocks: cached already
    assert not kv.hold_for_import(Sequence("z", list(range(200, 240))), 10)  # more than are free
    assert not kv.hold_for_import(Sequence("w", list(range(300, 308))), 0)
    assert not manager(caching=False).hold_for_import(Sequence("v", list(range(8))), 2)
    assert np.array_equal(kv.block_tables([a])[0], a.block_table)
