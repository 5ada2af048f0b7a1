"""The KV cache as the scheduler sees it (in the shape of vLLM v1's KVCacheManager): which blocks each sequence
holds, the longest cached prefix a waiting one can start on, and the block tables of a step.

The scheduler decides which sequences run, and whom to preempt when blocks run out; this decides where their K/V
lives. It owns the block allocator (``core.block_manager``: holders, free and idle cached blocks), the prefix
cache's hit counts, and a mirror of the running sequences' block tables in one array (a row each, changed a block
at a time), so that a step's tables are one gather instead of converting every Python list on every step. Every
change of a running sequence's blocks goes through here, so the mirror cannot drift from the tables.

KV transfer (``engine.kv_transfer``) holds blocks through sequences of its own, never running: they get no row.
"""

from __future__ import annotations

import numpy as np

from llm_serving.core.block_manager import DUMMY_BLOCK, BlockManager
from llm_serving.core.sequence import Sequence
from llm_serving.protocol.arrays import Int32s
from llm_serving.protocol.model_config import blocks_needed


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 prefix_caching: bool = False) -> None:
        self._blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._tables = np.zeros((max_num_seqs, blocks_needed(max_model_len, block_size)), np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._row: dict[Sequence, int] = {}  # by identity: a transfer's sequence may reuse a request's id
        self.queried_tokens = 0  # tokens of the sequences started with prefix caching, and how many were cached
        self.hit_tokens = 0

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self._blocks.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given now (idle cached ones included: they are evicted on demand)."""
        return self._blocks.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._blocks.num_used_blocks

    @property
    def usage(self) -> float:
        return self._blocks.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return self._blocks.blocks_needed(num_tokens)

    def missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def accounting(self) -> dict[str, int]:
        """Block counts by state; raises RuntimeError unless every usable block is in exactly one state."""
        return self._blocks.accounting()

    def prefix_cache_stats(self) -> dict[str, int]:
        """Idle cached blocks, tokens of started sequences looked up and how many hit, evictions (all 0 without
        prefix caching)."""
        cache = self._blocks.prefix_cache  # (an empty one is falsy: it has a length)
        idle, evictions = (cache.num_idle, cache.evictions) if cache is not None else (0, 0)
        return {"kv_blocks_cached": idle, "prefix_cache_queried_tokens": self.queried_tokens,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_evictions": evictions}

    # ---- a sequence's blocks --------------------------------------------------------------------------
    def computed_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of waiting ``seq``'s longest cached prefix, leaving at least its last token to compute
        (a step must produce its next token, and a shared block is never written); [] without prefix caching."""
        return self._blocks.cached_prefix(seq, (seq.num_tokens - 1) // self.block_size)

    def blocks_to_start(self, hit: list[int], num_tokens: int) -> int:
        """Free blocks that ``start`` takes for a sequence on ``hit`` holding ``num_tokens`` tokens: its new ones,
        and the idle cached ones of ``hit`` it revives."""
        return self.blocks_needed(num_tokens) - len(hit) + self._blocks.num_idle(hit)

    def start(self, seq: Sequence, hit: list[int], num_tokens: int) -> None:
        """Give waiting ``seq`` the cached blocks ``hit`` (``computed_prefix``) and new ones up to ``num_tokens``
        tokens, and a table row; counts the prefix cache's queried and hit tokens. The blocks must be free
        (``blocks_to_start``)."""
        self._blocks.share(seq, hit)
        seq.num_cached_blocks = len(hit)
        self._blocks.grow(seq, num_tokens)
        if self.prefix_caching:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += len(hit) * self.block_size
        row = self._row[seq] = self._free_rows.pop()
        self._tables[row] = DUMMY_BLOCK
        self._tables[row, : len(seq.block_table)] = seq.block_table

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s blocks to hold its first ``num_tokens`` tokens (a chunk, a decode token, the positions
        after it); False, changing nothing, when too few are free (the caller decides whom to preempt)."""
        held = len(seq.block_table)
        if not self._blocks.can_grow(seq, num_tokens):
            return False
        self._blocks.grow(seq, num_tokens)
        row = self._row.get(seq)
        if row is not None:
            self._tables[row, held:len(seq.block_table)] = seq.block_table[held:]
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past its first ``num_tokens`` tokens (grown for proposals it rejected)."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_table) > keep:
            self._blocks.truncate(seq, keep)
            row = self._row.get(seq)
            if row is not None:
                self._tables[row, keep:] = DUMMY_BLOCK

    def cache_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose every token's K/V is computed (``num_computed_tokens``) in the
        prefix cache."""
        self._blocks.cache_computed(seq)

    def free(self, seq: Sequence) -> None:
        """Give back all of ``seq``'s blocks and its row; its computed blocks stay cached (a recompute or a
        follow-up hits them). Raises on a double free."""
        self._blocks.cache_computed(seq)
        self._blocks.free(seq)
        row = self._row.pop(seq, None)
        if row is not None:
            self._free_rows.append(row)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the agents that held their K/V are gone); idle ones become free."""
        self._blocks.reset_prefix_cache()

    # ---- steps ----------------------------------------------------------------------------------------
    def block_tables(self, seqs: list[Sequence]) -> Int32s:
        """The block tables of running ``seqs``, a row each as wide as the longest, padded with the dummy block:
        a copy, so later steps do not change a batch built from it."""
        width = max(len(seq.block_table) for seq in seqs)
        rows = np.fromiter((self._row[seq] for seq in seqs), np.intp, len(seqs))
        return self._tables[rows, :width]

    # ---- KV transfer (engine.kv_transfer) -------------------------------------------------------------
    def hold_cached_prefix(self, seq: Sequence) -> bool:
        """Hold the blocks of ``seq``'s longest cached prefix (``computed_prefix``), so that no step hands them
        out while they are copied out, until ``free``; False, holding nothing, when none is cached."""
        blocks = self.computed_prefix(seq)
        if blocks:
            self._blocks.share(seq, blocks)
        return bool(blocks)

    def hold_for_import(self, seq: Sequence, num_blocks: int) -> bool:
        """Fresh blocks for ``seq``'s first ``num_blocks`` full blocks, to copy another engine's K/V of them into
        (then ``cache_computed`` registers them, idle once freed); False, holding nothing, without prefix caching,
        when they are all cached already, or when too few are free."""
        num_tokens = num_blocks * self.block_size
        if (not self.prefix_caching or len(self._blocks.cached_prefix(seq, num_blocks)) == num_blocks
                or not self._blocks.can_grow(seq, num_tokens)):
            return False
        self._blocks.grow(seq, num_tokens)
        return True
