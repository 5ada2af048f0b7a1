"""JSON bodies and JSON errors, as every route of the engine and the router answers them.

Errors are JSON ``{"error": message, "error_type": tag}``; the OpenAI routes nest the message as OpenAI
clients expect: ``{"error": {"message", "type", "param", "code"}, "error_type": tag}``, ``type`` OpenAI's class
(``invalid_request_error`` for a 4xx, ``server_error`` for a 5xx) and ``code`` our tag, a string as OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llm_serving.request_errors import ApiError

MAX_ERROR_CHARS = 2000  # of an error message: many quote the request, which may be a megabyte

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=_dumps)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def is_openai_path(path: str) -> bool:
    """Whether a path's errors take OpenAI's shape."""
    return path.startswith("/v1/")


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


def stream_error_event(err: ApiError, openai: bool, sse: bool = True) -> bytes:
    """The last event of a stream that failed after it began: OpenAI's error object in an SSE ``data:`` event
    (no ``[DONE]`` after it), or for the llm-serving routes the JSON error as an SSE event or JSON line."""
    body = {"error": openai_error(err)} if openai else {"error": err.message, "error_type": err.error_type}
    text = json.dumps(body, ensure_ascii=False)
    return (f"data: {text}\n\n" if sse else f"{text}\n").encode()


def too_large(size: int | None, limit: int) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body is too large{got}; the limit is {limit} bytes", "payload_too_large")


@web.middleware
async def json_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method, oversized body) as JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status,
                                                                                           "http_error")
        message = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 405:
            message += f" (allowed: {exc.headers.get('Allow', '')})"
        return error_response(ApiError(exc.status, message, kind), is_openai_path(request.path))
