"""The HTTP responses every route shares: JSON bodies, JSON errors, and streamed responses.

Errors are JSON ``{"error": message, "error_type": tag}``; the OpenAI routes nest the message as OpenAI
clients expect: ``{"error": {"message", "type", "param", "code"}, "error_type": tag}``, ``type`` OpenAI's class
(``invalid_request_error`` for a 4xx, ``server_error`` for a 5xx) and ``code`` our tag, a string as OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from llm_serving.engine.live_requests import SequenceError
from llm_serving.engine.request_stream import EngineError
from llm_serving.request_errors import ApiError

MAX_ERROR_CHARS = 2000  # of an error message: many quote the request, which may be a megabyte


class ClientGone(Exception):
    """The client closed the connection while its answer was being written."""


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=_dumps)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def error_response(err: ApiError, openai: bool) -> web.Response:
    message = err.message
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS - 3] + "..."
    if openai:
        body: dict[str, Any] = {"error": openai_error(err, message), "error_type": err.error_type}
    else:
        body = {"error": message, "error_type": err.error_type}
    headers = {"Retry-After": str(err.retry_after)} if err.status == 503 else None
    resp = json_response(body, status=err.status, headers=headers)
    if err.close_connection:
        resp.force_close()
    return resp


def openai_error(err: ApiError, message: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``err``."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return {"message": err.message if message is None else message, "type": kind, "param": err.param,
            "code": err.error_type}


def too_large(size: int | None, limit: int) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body is too large{got}; the limit is {limit} bytes", "payload_too_large")


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


def engine_failure(exc: EngineError) -> ApiError:
    """What an engine failure means to the client: a ``SequenceError`` is this request's own failure (500: the
    same request would fail again), any other the engine could not serve it now (agents down or recovering: 503,
    retry)."""
    if isinstance(exc, SequenceError):
        return ApiError(500, f"generating this request failed: {exc}", "generation_failed")
    return ApiError(503, f"the engine failed while serving the request: {exc}", "engine_error")


def openai_stream_error(exc: EngineError) -> bytes:
    """The server-sent event that ends an OpenAI stream the engine failed."""
    body = {"error": openai_error(engine_failure(exc))}
    return f"data: {json.dumps(body)}\n\n".encode()


async def engine_errors(awaitable: Awaitable[Any]) -> Any:
    """An engine failure during a non-streamed request becomes its JSON error (``engine_failure``)."""
    try:
        return await awaitable
    except EngineError as exc:
        raise engine_failure(exc) from None
