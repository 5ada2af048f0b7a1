"""Prefix caching: full KV blocks found again by their content, so that a request sharing a prefix with an earlier
one (a system prompt, a conversation's history, a preempted sequence's own tokens) skips recomputing it.

A block's key is a digest of its parent block's key and its own token ids, so equal keys mean equal whole prefixes
up to the block's end. The digest is blake2b (128 bits), not Python's ``hash``: token ids come from clients, and
tuples of small ints are easy to collide on purpose, which would hand one request another's KV.

Only blocks whose every token's K/V has been computed are registered (the scheduler does it when a step's results
come back), so a request that hits a block never reads a slot still being written. A cached block may be held by
any number of sequences (the block manager's holder counts); one held by none stays cached, *idle*, in
least-recently-used order, and is evicted (forgotten, handed out as a fresh block) only when the block manager runs
out of free ones. The agents' KV cache is lost when they are replaced, and the whole cache with it (``clear``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int,
                        salt: bytes = b"") -> None:
    """Append the keys of the full blocks ``len(hashes) .. num_blocks - 1`` of ``token_ids`` to ``hashes``;
    ``salt`` seeds the first block's key (a LoRA adapter's, ``core.adapters.Adapter.cache_salt``: its K/V are not
    the base model's), so keys of different salts never meet."""
    for i in range(len(hashes), num_blocks):
        tokens = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashes[-1] if hashes else hashlib.blake2b(salt, digest_size=16).digest() if salt else b""
        hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())


class PrefixCache:
    """Key <-> block of the registered blocks, and the idle ones (held by no sequence) in LRU order."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of ``keys`` that is cached."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """Cache a held block whose K/V is computed under ``key``; a key cached already keeps its block (this one
        then stays uncached and is freed as usual)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def release(self, block: int) -> bool:
        """Its last holder let ``block`` go: True if it is cached (it stays, idle), False if it is to be freed."""
        if block not in self._key_of:
            return False
        self._idle[block] = None
        return True

    def revive(self, block: int) -> None:
        """An idle block gains a holder (a prefix hit): it is no longer evictable."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and return it, to be handed out as a fresh block."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1
        return block

    def clear(self) -> list[int]:
        """Forget every key (the agents' KV cache is gone); returns the idle blocks, which are free now."""
        idle = list(self._idle)
        self._block_of.clear()
        self._key_of.clear()
        self._idle.clear()
        return idle
