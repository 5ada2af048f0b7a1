"""The consumer side of one request: a stream of TokenEvents, readable from asyncio or from threads.

The engine thread only appends raw ``(token_id, logprob, finish_reason, time)`` items to a deque and wakes
a waiting consumer; detokenization happens on the consumer side when an event is read. That keeps the
engine's per-step work independent of text handling (vLLM v1 likewise detokenizes outside its engine
core), and a consumer that only wants the final result is woken once, not once per token.

One consumer per stream: iterate it (``async for`` or ``for``) or call ``result()``/``aresult()``, which
drain what is left. Streams are created by ``Engine.submit``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from llm_serving.tokenizer import IncrementalDecoder, Tokenizer

NO_TOKEN = -1  # token_id of the last event of an aborted (or externally finished) request: no new token


class EngineError(RuntimeError):
    """The engine cannot serve the request (an agent died, the engine is stopped or failed)."""


class QueueFull(RuntimeError):
    """More requests are waiting than ``serving_config.max_queue_size``; retry later (HTTP 503)."""


@dataclass
class TokenEvent:
    """One step of a request: its new token and the text that token released (may be empty).

    The last event has ``finished=True`` and a ``finish_reason`` ("eos", "length", "abort", "stop"); for
    "abort"/"stop" from outside it carries no token (``token_id == NO_TOKEN``), only the held-back text.
    """

    token_id: int
    logprob: float
    text: str
    finished: bool
    finish_reason: str | None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None  # the prompt text, None when submitted as token ids
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # decode(prompt + tokens) minus the prompt's text: what a completion appends
    finish_reason: str | None = None
    arrival_time: float = 0.0  # time.monotonic() at submit
    first_token_time: float | None = None  # when the engine produced the first token
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when the engine produced each token


# Raw item pushed by the engine: (token_id, logprob, finish_reason, monotonic time) or an EngineError.
_Item = tuple[int, float, "str | None", float]

_WAIT_NONE, _WAIT_ANY, _WAIT_FINAL = 0, 1, 2


class RequestStream:
    """Token events of one request, in order. See the module docstring for the threading model."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], tokenizer: Tokenizer,
                 abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self._abort = abort
        self._seq: object = None  # the engine's Sequence of this request (tells a reused id apart)
        self._items: deque[_Item | EngineError] = deque()
        self._final_pushed = False  # producer side: nothing is pushed after the final item
        # thread consumers
        self._wake = threading.Event()
        self._thread_wait = _WAIT_NONE
        # asyncio consumer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: asyncio.Future | None = None
        self._async_waiting = False
        # consumer side
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._result = GenerationResult(request_id, prompt, prompt_ids, arrival_time=time.monotonic())
        self._done = False
        self._error: EngineError | None = None

    # ---- public -----------------------------------------------------------------------------------------
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
    def _push(self, item: _Item | EngineError) -> asyncio.AbstractEventLoop | None:
        """Append one item; wake a waiting thread now, return the loop of a waiting asyncio consumer."""
        if self._final_pushed:
            return None
        final = isinstance(item, EngineError) or item[2] is not None
        self._final_pushed = final
        self._items.append(item)
        wait = self._thread_wait
        if wait == _WAIT_ANY or (wait == _WAIT_FINAL and final):
            self._wake.set()
        if self._async_waiting:
            return self._loop
        return None

    def _wake_async(self) -> None:
        """Runs on the consumer's event loop."""
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
        token, logprob, reason, t = item
        text = ""
        if token != NO_TOKEN:
            res.token_ids.append(token)
            res.logprobs.append(logprob)
            res.token_times.append(t)
            if res.first_token_time is None:
                res.first_token_time = t
            text = self._decoder.push(token)
        if reason is not None:
            text += self._decoder.flush()
            res.finish_reason = reason
            res.finish_time = t
            res.text = self._decoder.text
            self._done = True
        return TokenEvent(token, logprob, text, reason is not None, reason)

    def _finished_result(self) -> GenerationResult:
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        return f"RequestStream({self.request_id!r}, prompt={len(self.prompt_ids)} tokens, done={self._done})"
