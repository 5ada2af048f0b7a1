"""KV-copy steps on an agent: whole blocks between this rank's KV cache and its region of the KV segment.

Prefill/decode disaggregation (``llm_serving.engine.kv_transfer``) moves a prompt's blocks from a prefill engine's
agents to a decode engine's. Here that is a host copy: the backends hand out their caches as host arrays that are the
caches themselves (``Attention.cache_blocks``; on CPU the device memory is the host's), blocks on the first axis. The
region holds the named blocks one after another, each block's bytes cache by cache in layer order: the same engine
build on the other side reads them back the same way, in as many copies as its segment needs. A backend whose caches
live in device memory (Ascend) has no such view and refuses at start-up: there a copy needs gather/scatter graphs, not
written yet.
"""

from __future__ import annotations

import numpy as np

from llm_serving.protocol.batch import KvCopyStep
from llm_serving.protocol.kv_segment import KvSegment


class KvBlockCopier:
    """Copies blocks of ``caches`` (block-major host views, ``Attention.cache_blocks``) to and from ``rank``'s
    region of ``segment``; refuses at construction when their bytes per block differ from the segment's."""

    def __init__(self, caches: list[np.ndarray], segment: KvSegment, rank: int) -> None:
        self.caches, self.segment, self.rank = caches, segment, rank
        self.block_bytes = [int(c[0].nbytes) for c in caches]
        self.num_blocks = int(caches[0].shape[0]) if caches else 0
        if sum(self.block_bytes) != segment.block_bytes:
            raise ValueError(f"this rank's KV cache holds {sum(self.block_bytes)} bytes per block, the KV segment "
                             f"expects {segment.block_bytes} (parallel.kv_block_bytes)")

    @classmethod
    def of_runner(cls, runner, segment: KvSegment, rank: int) -> KvBlockCopier:
        """The copier of a ``ModelRunner``'s caches, every layer's in order."""
        block_size = runner.rc.block_size
        caches = [c for layer in runner.model.layers for c in layer.attention.cache_blocks(block_size)]
        return cls(caches, segment, rank)

    def run(self, copy: KvCopyStep) -> None:
        ids = np.asarray(copy.block_ids, np.int64)
        if ids.size and not 0 < int(ids.min()) <= int(ids.max()) < self.num_blocks:
            raise ValueError(f"KV copy of blocks {ids.min()}..{ids.max()}: "
                             f"the cache has blocks 1..{self.num_blocks - 1}")
        region = self.segment.region(self.rank, ids.size)
        offset = 0
        for cache, size in zip(self.caches, self.block_bytes):
            part = region[:, offset: offset + size]
            if copy.direction == "export":
                part[:] = np.ascontiguousarray(cache[ids]).reshape(ids.size, -1).view(np.uint8)
            else:
                cache[ids] = np.ascontiguousarray(part).view(cache.dtype).reshape((ids.size, *cache.shape[1:]))
            offset += size
