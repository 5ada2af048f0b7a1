"""Exported KV payloads held for decode engines, each in a POSIX shared-memory segment of its own.

The segment's name is the transfer's id, so a decode engine on the same host reads the payload straight from
``/dev/shm`` (``read_local``) and only a decode engine elsewhere needs the HTTP fetch, which reads the same segment.
A segment holds an 8-byte length, then the payload. The holder unlinks a segment when it is taken or released,
after ``hold_s`` seconds, or when more than ``hold_bytes`` are held (oldest first); a holder that crashes leaves
them to Python's resource tracker, which unlinks what its process created.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
import time
from collections import OrderedDict
from multiprocessing import shared_memory

from llm_serving.protocol.shm_channel import NAME_PREFIX, Attached, ChannelError, attach_untracked

PREFIX = f"{NAME_PREFIX}kvx_"
_NAME = re.compile(rf"{PREFIX}[0-9]+_[0-9a-f]+")
_LENGTH = struct.Struct("<Q")


def is_transfer_id(value: str) -> bool:
    return _NAME.fullmatch(value) is not None


class HeldPayloads:
    """Payloads by transfer id (their segment's name), oldest first."""

    def __init__(self, hold_s: float, hold_bytes: int) -> None:
        self.hold_s, self.hold_bytes = hold_s, hold_bytes
        self._held: OrderedDict[str, tuple[float, shared_memory.SharedMemory]] = OrderedDict()
        self._total = 0

    def put(self, data: bytes) -> str:
        """Hold ``data``; its transfer id."""
        self._expire()
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=_LENGTH.size + len(data))
        buf = _buffer(segment)
        _LENGTH.pack_into(buf, 0, len(data))
        buf[_LENGTH.size: _LENGTH.size + len(data)] = data
        self._held[name] = (time.monotonic() + self.hold_s, segment)
        self._total += len(data)
        while self._total > self.hold_bytes and len(self._held) > 1:
            self._unlink(next(iter(self._held)))
        return name

    def take(self, transfer_id: str) -> bytes | None:
        """The payload (once), or None when it is not held."""
        self._expire()
        entry = self._held.get(transfer_id)
        if entry is None:
            return None
        data = _payload(_buffer(entry[1]))
        self._unlink(transfer_id)
        return data

    def release(self, transfer_id: str) -> bool:
        """Forget a payload a decode engine on this host read itself."""
        self._expire()
        if transfer_id not in self._held:
            return False
        self._unlink(transfer_id)
        return True

    def close(self) -> None:
        for name in list(self._held):
            self._unlink(name)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held and next(iter(self._held.values()))[0] <= now:
            self._unlink(next(iter(self._held)))

    def _unlink(self, name: str) -> None:
        _, segment = self._held.pop(name)
        self._total -= _LENGTH.unpack_from(_buffer(segment), 0)[0]
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


def read_local(transfer_id: str) -> bytes | None:
    """A payload held by an engine on this host, read from its segment (not unlinked: its holder does that); None
    when ``transfer_id`` names no such segment here (held elsewhere, taken, dropped), or one another user made (the
    caller then asks the engine itself, which serves only what it holds)."""
    if not is_transfer_id(transfer_id):
        return None
    try:
        if os.stat(os.path.join("/dev/shm", transfer_id)).st_uid != os.geteuid():
            return None
        segment = attach_untracked(transfer_id)
    except (FileNotFoundError, ChannelError):
        return None
    try:
        return _payload(_buffer(segment))
    finally:
        segment.close()


def _buffer(segment: shared_memory.SharedMemory | Attached) -> memoryview:
    """An open segment's bytes (``buf`` is None only once the segment is closed, which no caller here reads)."""
    if segment.buf is None:
        raise ValueError(f"shared-memory segment {segment.name} is closed")
    return segment.buf


def _payload(buf: memoryview) -> bytes:
    (length,) = _LENGTH.unpack_from(buf, 0)
    return bytes(buf[_LENGTH.size: _LENGTH.size + length])
