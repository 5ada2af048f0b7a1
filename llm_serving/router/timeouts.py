"""How long the router waits on an engine (``llm-serving router --connect-timeout`` etc.; applied in ``upstream``).
Without them an engine that stops (SIGSTOP, a hung host) held its requests for as long as it was stopped, forever
if it never resumed. A module of its own, free of aiohttp, so the command line reads the defaults cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """Seconds the router waits on an engine."""

    connect_s: float = 5.0
    first_byte_s: float = 300.0  # a request that is not streamed answers only when its generation is done
    idle_s: float = 60.0  # between two chunks of an answer
