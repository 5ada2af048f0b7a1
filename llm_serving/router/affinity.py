"""Which engine a request goes to: prefix affinity bounded by load (the cache-aware policy of SGLang's router and
vLLM's production-stack router, on the request's text instead of tokens: the router does not tokenize).

The text is cut into ``CHUNK_CHARS`` pieces; piece i's key hashes pieces 0..i, as the engines' prefix cache
hashes token blocks, so a key names a whole prefix. ``PrefixIndex`` remembers, for the most recent keys, the
engine a request with that prefix went to. A request goes to the engine holding its longest remembered prefix
when that covers at least ``min_match`` of its text and that engine has at most ``max_imbalance`` more requests
in flight than the least busy healthy engine; otherwise to the least busy one (ties in turn). Either way its
keys then point at the chosen engine, which is about to cache that prefix.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

CHUNK_CHARS = 64  # shorter than a prompt template's fixed head, so shared system prompts match


def prefix_keys(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """One key per whole ``chunk`` of ``text``, each naming the text up to the end of that chunk."""
    keys, digest = [], b""
    for start in range(0, len(text) - chunk + 1, chunk):
        digest = hashlib.blake2b(digest + text[start:start + chunk].encode(), digest_size=12).digest()
        keys.append(digest)
    return keys


class PrefixIndex:
    """The engine each remembered prefix went to, for the ``capacity`` most recently used prefixes."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest(self, keys: list[bytes], engines: set[int]) -> tuple[int | None, int]:
        """(The engine among ``engines`` holding the longest prefix, how many chunks of it), or (None, 0)."""
        for depth in range(len(keys), 0, -1):
            owner = self._owner.get(keys[depth - 1])
            if owner is not None and owner in engines:
                return owner, depth
        return None, 0

    def remember(self, keys: list[bytes], engine: int) -> None:
        for key in keys:
            self._owner[key] = engine
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget_engine(self, engine: int) -> None:
        """An engine restarted or left: its cache is gone."""
        for key in [k for k, owner in self._owner.items() if owner == engine]:
            del self._owner[key]


@dataclass
class Choice:
    engine: int
    matched_chars: int  # of the prompt's text, found on the chosen engine (0: chosen by load)


class AffinityPolicy:
    """Chooses an engine for each request; the caller reports requests in flight (``started`` / ``finished``)."""

    def __init__(self, num_engines: int, min_match: float = 0.5, max_imbalance: int = 4,
                 use_prefix: bool = True) -> None:
        self.in_flight = [0] * num_engines
        self.index = PrefixIndex()
        self.min_match, self.max_imbalance, self.use_prefix = min_match, max_imbalance, use_prefix
        self._turn = itertools.count()

    def choose(self, text: str, healthy: set[int]) -> Choice | None:
        """The engine for a request whose prompt reads ``text``; None when no engine is healthy."""
        if not healthy:
            return None
        least = min(self.in_flight[e] for e in healthy)
        idle = sorted(e for e in healthy if self.in_flight[e] == least)
        keys = prefix_keys(text) if self.use_prefix else []
        owner, depth = self.index.longest(keys, healthy)
        matched = depth * CHUNK_CHARS
        if owner is not None and matched >= self.min_match * len(text) \
                and self.in_flight[owner] - least <= self.max_imbalance:
            choice = Choice(owner, matched)
        else:
            choice = Choice(idle[next(self._turn) % len(idle)], 0)
        self.index.remember(keys, choice.engine)
        return choice

    def started(self, engine: int) -> None:
        self.in_flight[engine] += 1

    def finished(self, engine: int) -> None:
        self.in_flight[engine] -= 1
