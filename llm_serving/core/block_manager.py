"""Paged KV-cache bookkeeping on the master: which fixed-size blocks of the agents' KV cache each sequence owns.
The allocator under ``llm_serving.core.kv_cache_manager.KVCacheManager``, the only one that calls it.

The agents hold the cache tensors; the master only hands out block ids (a step turns a position into the flat slot
``block_id * block_size + offset``). Block 0 is a reserved dummy block: padded tokens write into
it and unused block-table entries point at it, so it is never given to a sequence.

Blocks are reference-counted by their holders (sequences, by identity: a KV transfer's may bear a request's id):
``share`` adds a holder to blocks another sequence already filled, and a block returns to the free list when its
last holder frees it. Accounting is strict
so that a scheduler bug surfaces as an exception instead of two sequences silently overwriting each other's KV: a
sequence frees only blocks it holds, once.

With prefix caching (``llm_serving.core.prefix_cache``) a full block whose K/V is computed is also registered under
its content's key: ``cached_prefix`` finds the blocks of a new sequence's longest cached prefix for ``share``, and
a cached block its last holder frees stays cached, idle, until a fresh block is needed and none is free (then
the least recently used idle one is evicted). Idle cached blocks count as free (``num_free_blocks``): taking one
costs a fresh allocation nothing. Every usable block is exactly one of free, idle cached, or held
(``accounting``).
"""

from __future__ import annotations

from collections import deque

from llm_serving.core.prefix_cache import PrefixCache, extend_block_hashes
from llm_serving.core.sequence import Sequence
from llm_serving.protocol.model_config import blocks_needed

DUMMY_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved dummy block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(DUMMY_BLOCK + 1, num_blocks))
        self._holders: dict[int, set[Sequence]] = {}  # block id -> the sequences holding it
        self.prefix_cache = PrefixCache() if prefix_caching else None

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the dummy block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given now: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + self.num_idle_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences."""
        return len(self._holders)

    @property
    def num_idle_cached_blocks(self) -> int:
        """Cached blocks no sequence holds (kept for later hits, evicted least recently used first)."""
        return self.prefix_cache.num_idle if self.prefix_cache is not None else 0

    def accounting(self) -> dict[str, int]:
        """Block counts by state; raises RuntimeError unless every usable block is in exactly one state."""
        cache = self.prefix_cache
        idle = {b for b in range(self.num_blocks) if cache is not None and cache.is_idle(b)}
        free, held = set(self._free), set(self._holders)
        counts = {"free": len(free), "idle_cached": len(idle), "held": len(held),
                  "cached": len(cache) if cache is not None else 0}
        if (len(free) != len(self._free) or free & idle or free & held or idle & held
                or len(free | idle | held) != self.num_usable_blocks or DUMMY_BLOCK in free | idle | held):
            raise RuntimeError(f"KV block accounting is broken: {counts} of {self.num_usable_blocks} usable")
        return counts

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return blocks_needed(num_tokens, self.block_size)

    # ---- allocation -----------------------------------------------------------------------------------
    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start ``seq``'s table with ``blocks`` that other sequences hold or the prefix cache keeps, all filled (a
        shared prefix); each gains ``seq`` as a holder. Only whole blocks can be shared: the next token goes to a
        new one."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id!r} already holds blocks {seq.block_table}")
        cache = self.prefix_cache
        for block in blocks:
            if block not in self._holders and (cache is None or not cache.is_idle(block)):
                raise RuntimeError(f"sequence {seq.request_id!r} cannot share block {block}: it is free")
        for block in blocks:
            if block not in self._holders:
                assert cache is not None  # an unheld block to share is an idle cached one (checked above)
                cache.revive(block)
                self._holders[block] = set()
            self._holders[block].add(seq)
        seq.block_table = list(blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` the blocks to hold its first ``num_tokens`` tokens (a prompt chunk, a decode token)."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"cannot grow sequence {seq.request_id!r} by {missing} blocks: only "
                               f"{self.num_free_blocks} free")
        seq.block_table.extend(self._take(seq) for _ in range(missing))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    # ---- prefix caching -------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The cached blocks of the longest cached prefix of ``seq``'s first ``num_blocks`` (full) blocks; [] without
        prefix caching."""
        if self.prefix_cache is None:
            return []
        self._hash_blocks(seq, num_blocks)
        return self.prefix_cache.lookup(seq.block_hashes[:num_blocks])

    def num_idle(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are idle cached ones (sharing them takes them out of ``num_free_blocks``)."""
        cache = self.prefix_cache
        return sum(cache.is_idle(b) for b in blocks) if cache is not None else 0

    def cache_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose every token's K/V is computed (``num_computed_tokens``)."""
        full = seq.num_computed_tokens // self.block_size
        if self.prefix_cache is None or full <= seq.num_cached_blocks:
            return
        self._hash_blocks(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.prefix_cache.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_cached_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the agents that held their K/V are gone); idle ones become free."""
        if self.prefix_cache is not None:
            self._free.extend(self.prefix_cache.clear())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on all its blocks; a block nobody else holds is free again. Raises on blocks it
        does not hold (double free, foreign block)."""
        table = seq.block_table
        if not table:
            raise RuntimeError(f"sequence {seq.request_id!r} holds no blocks to free (double free?)")
        if len(set(table)) != len(table):
            raise RuntimeError(f"sequence {seq.request_id!r} lists a block twice: {table}")
        for block in table:
            holders = self._holders.get(block)
            if holders is None or seq not in holders:
                what = ("a free block" if holders is None
                        else f"a block owned by {', '.join(repr(h.request_id) for h in holders)}")
                raise RuntimeError(f"sequence {seq.request_id!r} frees block {block}, which is {what}")
        cache = self.prefix_cache
        for block in reversed(table):  # a prefix's tail blocks are evicted before its head: they hit less often
            holders = self._holders[block]
            holders.discard(seq)
            if not holders:
                del self._holders[block]
                if cache is None or not cache.release(block):
                    self._free.append(block)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Drop ``seq``'s hold on its blocks past the first ``keep`` (grown for tokens it did not keep)."""
        tail = seq.block_table[keep:]
        for block in reversed(tail):
            holders = self._holders.get(block)
            if holders is None or seq not in holders:
                raise RuntimeError(f"sequence {seq.request_id!r} truncates block {block}, which it does not hold")
            holders.discard(seq)
            if not holders:
                del self._holders[block]
                if self.prefix_cache is None or not self.prefix_cache.release(block):
                    self._free.append(block)
        del seq.block_table[keep:]

    # ---- internals ------------------------------------------------------------------------------------
    def _hash_blocks(self, seq: Sequence, full: int) -> None:
        """Make sure ``seq.block_hashes`` has the keys of its first ``full`` blocks."""
        if len(seq.block_hashes) < full:
            extend_block_hashes(seq.block_hashes, seq.token_ids(0, full * self.block_size), self.block_size, full,
                                seq.adapter.cache_salt if seq.adapter is not None else b"")

    def _take(self, seq: Sequence) -> int:
        if self._free:
            block = self._free.popleft()
        elif self.prefix_cache is not None:  # callers take a block only when one is free or idle cached
            block = self.prefix_cache.evict()
        else:
            raise RuntimeError("no free KV block to take")
        self._holders[block] = {seq}
        return block
