"""A base for tests' in-process agent pools: the ``StepPool`` members such a pool does not model."""

from __future__ import annotations

from collections.abc import Callable


class StandInPool:
    """No processes, nothing stopped, no warm-up costs or KV block count reported (the engine then keeps its
    configured step timeout), no KV transfers; ``start`` does nothing and ``close`` ends it."""

    step_timeout_s: float | None = None
    alive: bool = True
    pids: list[int] = []  # noqa: RUF012 - read only
    kv_blocks: int | None = None
    slowest_warmup_step_s: float | None = None

    def stopped_pids(self) -> list[int]:
        return []

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        pass

    def close(self, graceful: bool = True) -> None:
        self.alive = False

    def export_kv(self, block_ids: list[int]) -> list[bytes]:
        raise RuntimeError("this stand-in pool has no KV segment")

    def import_kv(self, block_ids: list[int], shards: list[bytes]) -> None:
        raise RuntimeError("this stand-in pool has no KV segment")
