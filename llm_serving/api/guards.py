"""The engine's guards in front of every route: what reaches the JSON parser and who may call (the guards it
shares with the router, and JSON answers for what aiohttp refuses before any route runs: ``llm_serving.front``).

- ``read_json_body``: 415 unless the body is declared JSON (a browser sends ``text/plain``, form and
  multipart bodies to another origin without a CORS preflight, ``application/json`` only after one, so this
  keeps a web page from starting generations on a local server); 400 for a body that is not its
  ``Content-Encoding``; then JSON nested no deeper than any request needs and free of lone UTF-16
  surrogates (which no tokenizer can take).
- ``api_key_middleware`` (``front.api_key``, shared with the router): ``Authorization: Bearer <key>`` on every
  route but /health.
- ``JsonErrorRunner`` (``front.guards``): the HTTP parser's own rejections (bad Content-Length, oversized
  headers, unknown methods, broken chunking, TLS on the plain port) answered as JSON like every other error.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llm_serving.api.schema import parse_json
from llm_serving.front.guards import check_json, read_body
from llm_serving.request_errors import ApiError


# ---- the body ----------------------------------------------------------------------------------------------
def check_content_type(request: web.BaseRequest) -> None:
    """415 unless the body is declared ``application/json`` (or a ``+json`` type); charset is not checked:
    the JSON parser detects UTF-8/16/32."""
    mime = request.content_type  # application/octet-stream when the header is missing
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    sent = request.headers.get("Content-Type")
    shown = "no Content-Type" if sent is None else f"Content-Type {sent[:100]!r}"
    raise ApiError(415, f"the request body must be JSON, sent with Content-Type: application/json; got "
                        f"{shown}", "unsupported_media_type")


async def read_json_body(request: web.Request, max_bytes: int) -> Any:
    """The request's JSON body, checked (see the module docstring), within ``max_bytes`` (413 past it)."""
    check_content_type(request)
    value = parse_json(await read_body(request, max_bytes))
    check_json(value)
    return value


def check_prompt_count(n: int, max_queue_size: int) -> None:
    """400 for a multi-prompt request that could never be admitted: its prompts are admitted all at once,
    and more than ``max_queue_size`` never fit in the queue (so "503, retry" would be a lie)."""
    if n > max_queue_size:
        raise ApiError(400, f"'prompt' has {n} prompts, more than can ever wait at once "
                            f"(serving_config.max_queue_size {max_queue_size}); send fewer per request",
                       "invalid_request", "prompt")
