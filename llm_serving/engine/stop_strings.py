"""Stop strings over streamed text: trim at the first completed stop string, never stream a part of one.

A stop string may be split across tokens ("\\n\\nUser" as "\\n", "\\nUs", "er"), so text that could be the
start of a stop string is held back until the next piece shows whether it is one. Released text therefore
never contains a stop string or a prefix of one that later completes, and the concatenation of what is
released equals the generated text cut before the stop string that is completed first (the earliest end;
on a tie, the longest), whatever the pieces were.

Every route gets stop strings through ``SamplingParams.stop``; a ``RequestStream`` with stop strings matches
them as its tokens arrive, so the engine ends the request at the token that completes one.
"""

from __future__ import annotations


class StopMatcher:
    """Per-request filter: ``feed`` each new piece of text, ``flush`` at the end of the generation."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.stopped = False  # True once a stop string was found; later text is dropped
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that can be released now (possibly empty)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # (end, -length) of each stop string's first occurrence: the one completed first wins, as if the
        # text had arrived one character at a time (so the result does not depend on how it was split).
        hits = [(i + len(s), -len(s)) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            end, neg_len = min(hits)
            self.stopped = True
            self._held = ""
            return buf[: end + neg_len]
        keep = max(_prefix_overlap(buf, s) for s in self.stops)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail when generation ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _prefix_overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` cut before the stop string it completes first, as a StopMatcher fed it would release."""
    matcher = StopMatcher(stops)
    released = matcher.feed(text)
    return released if matcher.stopped else released + matcher.flush()
