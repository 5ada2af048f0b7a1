"""The agent process's start-up housekeeping (agents/agent_main.py)."""

from __future__ import annotations

import gc

from agents.agent_main import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: tracked by the cyclic GC


def test_objects_alive_after_warm_up_leave_the_cyclic_gc_and_new_ones_do_not() -> None:
    before = _Node()
    try:
        freeze_startup_objects()
        after = _Node()
        tracked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert id(before) not in tracked  # in the permanent generation: never walked again
        assert id(after) in tracked  # made while serving: collected as usual
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
