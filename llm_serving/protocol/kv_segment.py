"""The shared memory whole KV blocks cross between the agents' caches and the master (prefill/decode disaggregation).

One segment per agent pool, beside the step segments, allocated at start and never resized: a region per rank, each
room for ``max_blocks`` blocks (``AgentSpec.kv_segment_blocks``) of that rank's block bytes
(``parallel.kv_block_bytes``: every rank of a plan holds as many kv heads). A KV-copy step (``batch.KvCopyStep``) has
every rank copy its shard of the named blocks out of its cache into its region (export) or from its region into its
cache (import); the master reads or writes the regions around that step. A region holds block after block; within a
block the bytes are the rank's own business (its backend's cache layout): the master moves them whole, and the
engine at the other end must serve the same layout (``engine.kv_transfer`` checks it). Kept free of MindSpore: both
sides import it.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

import numpy as np
import numpy.typing as npt

from llm_serving.protocol.shm_channel import NAME_PREFIX, Attached, ChannelError, attach_untracked


class KvSegment:
    """``create`` on the master (owner: ``close`` unlinks), ``attach`` in each local agent."""

    def __init__(self, segment: shared_memory.SharedMemory | Attached, ranks: int, block_bytes: int,
                 max_blocks: int, owner: bool) -> None:
        self.name = segment.name.lstrip("/")
        self.ranks, self.block_bytes, self.max_blocks = ranks, block_bytes, max_blocks
        self._segment: shared_memory.SharedMemory | Attached | None = segment
        self._owner = owner
        self._bytes: npt.NDArray[np.uint8] = np.ndarray((ranks * max_blocks * block_bytes,), np.uint8,
                                                        buffer=segment.buf)

    @staticmethod
    def nbytes(ranks: int, block_bytes: int, max_blocks: int) -> int:
        return max(1, ranks * max_blocks * block_bytes)

    @classmethod
    def create(cls, ranks: int, block_bytes: int, max_blocks: int) -> KvSegment:
        name = f"{NAME_PREFIX}kv_{os.getpid()}_{secrets.token_hex(4)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=cls.nbytes(ranks, block_bytes, max_blocks))
        return cls(segment, ranks, block_bytes, max_blocks, owner=True)

    @classmethod
    def attach(cls, name: str, ranks: int, block_bytes: int, max_blocks: int) -> KvSegment:
        segment = attach_untracked(name)
        need = cls.nbytes(ranks, block_bytes, max_blocks)
        if segment.size < need:
            segment.close()
            raise ChannelError(f"KV segment {name!r} holds {segment.size} bytes; {ranks} ranks x {max_blocks} "
                               f"blocks of {block_bytes} bytes need {need}")
        return cls(segment, ranks, block_bytes, max_blocks, owner=False)

    def region(self, rank: int, num_blocks: int) -> npt.NDArray[np.uint8]:
        """The first ``num_blocks`` blocks of ``rank``'s region: uint8 ``[num_blocks, block_bytes]`` (a view)."""
        if not 0 <= rank < self.ranks or not 0 <= num_blocks <= self.max_blocks:
            raise ValueError(f"rank {rank} / {num_blocks} blocks: the KV segment holds {self.ranks} ranks of "
                             f"{self.max_blocks} blocks")
        start = rank * self.max_blocks * self.block_bytes
        return self._bytes[start: start + num_blocks * self.block_bytes].reshape(num_blocks, self.block_bytes)

    def read(self, num_blocks: int) -> list[bytes]:
        """Master: every rank's ``num_blocks`` exported blocks (copies), by rank."""
        return [self.region(r, num_blocks).tobytes() for r in range(self.ranks)]

    def write(self, shards: list[bytes], num_blocks: int) -> None:
        """Master: each rank's ``num_blocks`` blocks to import, by rank."""
        if len(shards) != self.ranks:
            raise ValueError(f"{len(shards)} KV shards for {self.ranks} ranks")
        for rank, data in enumerate(shards):
            region = self.region(rank, num_blocks)
            if len(data) != region.nbytes:
                raise ValueError(f"rank {rank}'s KV shard has {len(data)} bytes, {num_blocks} blocks are "
                                 f"{region.nbytes}")
            region.reshape(-1)[:] = np.frombuffer(data, np.uint8)

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        self._bytes = np.empty(0, np.uint8)  # drops the view of the mapping, which close() needs gone
        try:
            segment.close()
        except BufferError:
            pass  # a view is still held somewhere; the mapping goes with it
        if self._owner and isinstance(segment, shared_memory.SharedMemory):  # an owner created it
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
