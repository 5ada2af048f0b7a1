"""The consumer side of one request: a stream of TokenEvents, readable from asyncio or from threads.

The engine thread only appends raw ``(token_id, logprob, finish_reason, time)`` items to a deque and wakes
a waiting consumer; detokenization happens on the consumer side when an event is read. That keeps the
engine's per-step work independent of text handling (vLLM v1 likewise detokenizes outside its engine
core), and a consumer that only wants the final result is woken once, not once per token.

A request with stop strings is the exception: its tokens are decoded and matched as they arrive, on the
engine thread, so ``push_token`` tells the engine at once that a stop string completed and the engine ends
the request there (finish reason "stop", its KV blocks freed) whoever reads the stream and however late.

The engine uses the producer interface (``push_token``, ``push_end``, ``push_error``, with a ``Wakeups``
to wake each asyncio consumer's loop once per step). One consumer per stream: iterate it (``async for`` or
``for``) or call ``result()``/``aresult()``, which drain what is left. Streams are created by
``Engine.submit``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from llm_serving.core.logprobs import PromptLogprob, TopLogprobs
from llm_serving.engine.stop_strings import StopMatcher
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer

NO_TOKEN = -1  # token_id of the last event of an aborted (or externally finished) request: no new token


class EngineError(RuntimeError):
    """The engine cannot serve the request (an agent died, the engine is stopped or failed)."""


@dataclass
class TokenEvent:
    """One step of a request: its new token and the text that token released (may be empty).

    The last event has ``finished=True`` and a ``finish_reason`` (one of ``sequence.FINISH_REASONS``); an
    end from outside (abort, ``Engine.finish``) carries no token (``token_id == NO_TOKEN``), only the held-back
    text. When a stop string ends the request, the last event carries the token that completed it and the
    text before the stop string.
    """

    token_id: int
    logprob: float
    text: str
    finished: bool
    finish_reason: str | None
    top_logprobs: TopLogprobs | None = None  # the most likely tokens of its position, when the request asked


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None  # the prompt text, None when submitted as token ids
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # decode(prompt + tokens) minus the prompt's text: what a completion appends (stop cut)
    finish_reason: str | None = None
    arrival_time: float = 0.0  # time.monotonic() at submit
    first_token_time: float | None = None  # when the engine produced the first token
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when the engine produced each token
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, when the request asked
    # (logprob, alternatives) of every prompt token after the first, when the request scored its prompt
    prompt_logprobs: list[PromptLogprob] | None = None
    # float32 [n, vocab]: the logits of the first n generated positions (row k: the distribution token k was
    # picked from) when the request asked for a logits dump; n = min(asked, generated). None otherwise.
    logits: np.ndarray | None = None


# Item pushed by the engine: (token_id, logprob, finish_reason, monotonic time, text, top logprobs) or an
# EngineError; the text is None when the consumer decodes it (no stop strings).
_Item = tuple[int, float, "str | None", float, "str | None", "TopLogprobs | None"]

_WAIT_NONE, _WAIT_ANY, _WAIT_FINAL = 0, 1, 2


class RequestStream:
    """Token events of one request, in order. See the module docstring for the threading model."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], tokenizer: AnyTokenizer,
                 abort: Callable[[str], object], stop: tuple[str, ...] = (),
                 logits_rows: list[np.ndarray] | None = None, logits_width: int = 0,
                 prompt_scores: list[PromptLogprob] | None = None) -> None:
        """``logits_rows``: the list the engine appends the request's dumped logits rows to (``Sequence.logits``),
        stacked into the result when the request ends; ``prompt_scores``: the list of its prompt tokens' logprobs
        (``Sequence.prompt_scores``), complete in the result when it ends."""
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self._abort = abort
        self._items: deque[_Item | EngineError] = deque()
        self._final_pushed = False  # producer side: nothing is pushed after the final item
        # thread consumers
        self._wake = threading.Event()
        self._thread_wait = _WAIT_NONE
        # asyncio consumer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: asyncio.Future | None = None
        self._async_waiting = False
        # the side that decodes: the producer with stop strings (it matches them), else the consumer
        self._decoder = tokenizer.incremental_decoder(prompt_ids)
        self._stop_matcher = StopMatcher(stop) if stop else None
        # consumer side
        self._texts: list[str] = []  # text of each event read
        self._result = GenerationResult(request_id, prompt, prompt_ids, arrival_time=time.monotonic())
        self._logits_rows, self._logits_width = logits_rows, logits_width
        self._prompt_scores = prompt_scores
        self._done = False
        self._error: EngineError | None = None

    # ---- public -----------------------------------------------------------------------------------------
    @property
    def prompt_logprobs(self) -> list[PromptLogprob] | None:
        """Its prompt tokens' scores once the consumer has read the last event (None: it scored none)."""
        return self._result.prompt_logprobs

    @property
    def finished(self) -> bool:
        """True once the consumer has read the last event (or the error)."""
        return self._done

    @property
    def finish_reason(self) -> str | None:
        return self._result.finish_reason

    def abort(self) -> None:
        """Stop the request: its KV blocks are freed at once; the stream ends with finish_reason "abort"."""
        if not self._final_pushed:
            self._abort(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        """Blocking iteration; raises EngineError if the engine fails. Interrupting it aborts the request."""
        try:
            while True:
                if not self._items:
                    if self._done:
                        return
                    self._wait_thread(_WAIT_ANY)
                    continue
                yield self._consume(self._items.popleft())
        except BaseException:
            if not self._done:
                self.abort()
            raise

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self

    async def __anext__(self) -> TokenEvent:
        """Next event; a cancelled consumer (e.g. a disconnected HTTP client) aborts the request."""
        while not self._items:
            if self._done:
                raise StopAsyncIteration
            loop = asyncio.get_running_loop()
            self._loop = loop
            self._future = loop.create_future()
            self._async_waiting = True
            try:
                if not self._items:  # re-check after announcing the wait: no wake-up can be lost
                    await self._future
            except asyncio.CancelledError:
                self.abort()
                raise
            finally:
                self._async_waiting = False
                self._future = None
        return self._consume(self._items.popleft())

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request ends; the whole generation (events already read included)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            if not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout}s")
                self._wait_thread(_WAIT_FINAL, left)
                if not self._final_pushed:
                    continue
            while self._items:
                self._consume(self._items.popleft())
        return self._finished_result()

    async def aresult(self) -> GenerationResult:
        """``result`` for asyncio code."""
        async for _ in self:
            pass
        return self._finished_result()

    # ---- producer side (engine thread, under the engine lock) ------------------------------------------
    def push_token(self, token_id: int, logprob: float, finish_reason: str | None, now: float,
                   wakeups: Wakeups, top: TopLogprobs | None = None) -> str | None:
        """A new token; returns the reason the request ends with: ``finish_reason``, or "stop" when the text
        completed one of its stop strings (the engine then ends the request), None while it goes on."""
        if self._final_pushed:
            return None
        text, matcher = None, self._stop_matcher
        if matcher is not None:
            text, stopped = self._match_stops(matcher, self._decoder.push(token_id), finish_reason is not None)
            finish_reason = "stop" if stopped else finish_reason
        self._append((token_id, logprob, finish_reason, now, text, top), wakeups)
        return finish_reason

    def push_end(self, reason: str, now: float, wakeups: Wakeups) -> None:
        """The end of the request from outside (abort, ``Engine.finish``): no new token."""
        if self._final_pushed:
            return
        text, matcher = None, self._stop_matcher
        if matcher is not None:
            text, stopped = self._match_stops(matcher, "", True)
            reason = "stop" if stopped else reason
        self._append((NO_TOKEN, 0.0, reason, now, text, None), wakeups)

    def push_error(self, error: EngineError, wakeups: Wakeups) -> None:
        """The engine cannot serve the request; the consumer gets ``error`` raised."""
        if not self._final_pushed:
            self._append(error, wakeups)

    def _match_stops(self, matcher: StopMatcher, text: str, final: bool) -> tuple[str, bool]:
        """(text to release, whether a stop string completed) after the stop strings have seen ``text``; ``final``:
        the request ends here, so the text held back for a partial match is released too."""
        if final:
            text += self._decoder.flush()
        released = matcher.feed(text)
        if matcher.stopped:
            return released, True
        if final:
            released += matcher.flush()
        return released, False

    def _append(self, item: _Item | EngineError, wakeups: Wakeups) -> None:
        """Append one item; wake a waiting thread now, note a waiting asyncio consumer in ``wakeups``."""
        final = isinstance(item, EngineError) or item[2] is not None
        self._final_pushed = final
        self._items.append(item)
        wait = self._thread_wait
        if wait == _WAIT_ANY or (wait == _WAIT_FINAL and final):
            self._wake.set()
        if self._async_waiting and self._loop is not None:  # __anext__ sets the loop before it waits
            wakeups.add(self._loop, self)

    def _wake_async(self) -> None:
        """Runs on the consumer's event loop (``Wakeups.send``)."""
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ---- consumer side ----------------------------------------------------------------------------------
    def _wait_thread(self, mode: int, timeout: float | None = None) -> None:
        self._wake.clear()
        self._thread_wait = mode
        try:
            ready = self._final_pushed if mode == _WAIT_FINAL else bool(self._items)
            if not ready:  # re-check after announcing the wait: no wake-up can be lost
                self._wake.wait(timeout if timeout is not None else 1.0)
        finally:
            self._thread_wait = _WAIT_NONE

    def _consume(self, item: _Item | EngineError) -> TokenEvent:
        res = self._result
        if isinstance(item, EngineError):
            self._done = True
            self._error = item
            raise item
        token, logprob, reason, t, text, top = item
        if token != NO_TOKEN:
            res.token_ids.append(token)
            res.logprobs.append(logprob)
            if top is not None:
                res.top_logprobs.append(top)
            res.token_times.append(t)
            if res.first_token_time is None:
                res.first_token_time = t
        if text is None:  # no stop strings: decoded here, off the engine thread
            text = self._decoder.push(token) if token != NO_TOKEN else ""
            if reason is not None:
                text += self._decoder.flush()
        self._texts.append(text)
        if reason is not None:
            res.finish_reason = reason
            res.finish_time = t
            res.text = "".join(self._texts)
            if self._prompt_scores is not None:  # complete: scored before the first token or the end
                res.prompt_logprobs = list(self._prompt_scores)
            if self._logits_rows is not None:  # complete: the engine appends rows before it pushes their token
                rows = self._logits_rows
                res.logits = np.stack(rows) if rows else np.zeros((0, self._logits_width), np.float32)
            self._done = True
        return TokenEvent(token, logprob, text, reason is not None, reason, top)

    def _finished_result(self) -> GenerationResult:
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        return f"RequestStream({self.request_id!r}, prompt={len(self.prompt_ids)} tokens, done={self._done})"


class Wakeups:
    """The asyncio consumers to wake after a batch of pushes: one ``call_soon_threadsafe`` per event loop."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, stream: RequestStream) -> None:
        self._by_loop.setdefault(loop, []).append(stream)

    def send(self) -> None:
        """Wake every noted consumer (call once, after the pushes)."""
        for loop, streams in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_streams, streams)
            except RuntimeError:  # the consumer's event loop is closed: nobody is left to wake
                pass
        self._by_loop.clear()


def _wake_streams(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream._wake_async()
