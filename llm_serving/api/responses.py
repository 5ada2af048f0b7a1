"""The HTTP responses the engine's routes share beyond JSON bodies and errors (``llm_serving.front.errors``, shared
with the router): streamed responses and what an engine failure answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from llm_serving.engine.live_requests import SequenceError
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.errors import stream_error_event
from llm_serving.request_errors import ApiError

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection while its answer was being written."""


async def open_stream(request: web.Request, content_type: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": f"{content_type}; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # no length: aiohttp chunks it for HTTP/1.1 and ends it at close for HTTP/1.0 (forcing chunked
    # encoding would fail those requests with a RuntimeError)
    await resp.prepare(request)
    return resp


async def write(resp: web.StreamResponse, data: bytes) -> None:
    """Write one chunk; a closed connection raises ClientGone."""
    try:
        await resp.write(data)
    except (ConnectionResetError, ConnectionError) as exc:
        raise ClientGone(str(exc)) from None


async def end_stream(resp: web.StreamResponse, last: bytes = b"") -> web.StreamResponse:
    """Write ``last`` (an error event, or nothing) and end the stream. A client that left meanwhile (after the
    last event, before the end) is a client disconnect like any other, not the server's failure."""
    try:
        if last:
            await resp.write(last)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError) as exc:
        log.debug("client left before the end of its stream: %s", exc)
    return resp


def engine_failure(exc: EngineError) -> ApiError:
    """What an engine failure means to the client: a ``SequenceError`` is this request's own failure (500: the
    same request would fail again), any other the engine could not serve it now (agents down or recovering: 503,
    retry)."""
    if isinstance(exc, SequenceError):
        return ApiError(500, f"generating this request failed: {exc}", "generation_failed")
    return ApiError(503, f"the engine failed while serving the request: {exc}", "engine_error")


def openai_stream_error(exc: EngineError) -> bytes:
    """The server-sent event that ends an OpenAI stream the engine failed."""
    return stream_error_event(engine_failure(exc), openai=True)


async def engine_errors(awaitable: Awaitable[Any]) -> Any:
    """An engine failure during a non-streamed request becomes its JSON error (``engine_failure``)."""
    try:
        return await awaitable
    except EngineError as exc:
        raise engine_failure(exc) from None
