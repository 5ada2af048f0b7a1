"""Each step's batch from rank 0 to the other tensor-parallel ranks through MindSpore's broadcast collective, for
pools with ranks on other hosts (``AgentSpec.has_remote_ranks``): only rank 0 reads the master's shared memory,
as vLLM's driver worker broadcasts its inputs to the other workers.

One broadcast per step carries a fixed header of ``HEADER_WORDS`` int32 words: the step number, the payload's
length and the payload's first bytes; a batch larger than that (a prefill, a wide block table) takes a second
broadcast of the rest, its length rounded up to a power of two so the ranks see few distinct shapes. int32
because the CPU broadcast kernel takes only int32 and float32 (MindSpore 2.10: "Select CPU operator[Broadcast]
fail! Unsupported data type!" for uint8); the bytes are only copied, never computed on.

The payload is the step (``protocol.batch.Step``) pickled: every rank runs the same build (the pool's join handshake
checks the protocol), and the collective's peers are the pool's own ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np

from llm_serving.protocol.batch import Step

HEADER_WORDS = 4096  # 16 KiB: a decode batch of up to ~100 sequences goes in one broadcast
STOP = -1  # header step: rank 0 leaves the serve loop (the master closed its command pipe)
_META = 2  # header words before the payload: step, payload bytes


class StepBroadcast:
    """Rank 0 ``send``s each step (a batch, or None when it could not read one); the other ranks ``receive`` it."""

    def __init__(self, collective: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """``collective``: broadcast int32 words from rank 0, returning rank 0's words on every rank (default:
        MindSpore's ``broadcast`` over the world group)."""
        self._collective = collective or _mindspore_broadcast()

    def send(self, step: int, batch: Step | None) -> None:
        """(Rank 0.) ``step`` and its batch; ``batch`` None: the followers answer the step with an error."""
        payload = b"" if batch is None else pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        header = np.zeros(HEADER_WORDS, np.int32)
        header[0], header[1] = step, len(payload)
        head = payload[: (HEADER_WORDS - _META) * 4]
        header[_META:].view(np.uint8)[: len(head)] = np.frombuffer(head, np.uint8)
        self._collective(header)
        rest = payload[len(head):]
        if rest:
            words = np.zeros(_rest_words(len(rest)), np.int32)
            words.view(np.uint8)[: len(rest)] = np.frombuffer(rest, np.uint8)
            self._collective(words)

    def stop(self) -> None:
        """(Rank 0.) Tell the followers to leave their serve loop."""
        self.send(STOP, None)

    def receive(self) -> tuple[int, Step | None]:
        """(Other ranks.) The next step number (``STOP``: leave) and its batch (None: rank 0 could not read it)."""
        header = self._collective(np.zeros(HEADER_WORDS, np.int32))
        step, size = int(header[0]), int(header[1])
        payload = header[_META:].view(np.uint8)[:size].tobytes()
        if size > len(payload):
            rest = size - len(payload)
            payload += self._collective(np.zeros(_rest_words(rest), np.int32)).view(np.uint8)[:rest].tobytes()
        return step, (pickle.loads(payload) if size else None)  # rank 0 of this pool, the same build


def _mindspore_broadcast() -> Callable[[np.ndarray], np.ndarray]:
    import mindspore as ms
    from mindspore.communication import GlobalComm
    from mindspore.ops.communication import broadcast

    def from_rank0(words: np.ndarray) -> np.ndarray:
        tensor = ms.Tensor(words)
        broadcast(tensor, 0, GlobalComm.WORLD_COMM_GROUP)  # in place: rank 0's words on every rank
        return tensor.asnumpy()

    return from_rank0


def _rest_words(nbytes: int) -> int:
    """int32 words for ``nbytes``, rounded up to a power of two (at least 1024)."""
    words = max(1024, -(-nbytes // 4))
    return 1 << (words - 1).bit_length()
