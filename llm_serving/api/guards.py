"""The engine's guards in front of every route: what reaches the JSON parser and who may call (the guards it
shares with the router, and JSON answers for what aiohttp refuses before any route runs: ``llm_serving.front``).

- ``read_json_body``: 415 unless the body is declared JSON (a browser sends ``text/plain``, form and
  multipart bodies to another origin without a CORS preflight, ``application/json`` only after one, so this
  keeps a web page from starting generations on a local server); 400 for a body that is not its
  ``Content-Encoding``; then JSON nested no deeper than any request needs and free of lone UTF-16
  surrogates (which no tokenizer can take).
- ``api_key_middleware``: ``Authorization: Bearer <serving_config.api_key>`` on every route but /health.
- ``JsonErrorRunner`` (``front.guards``): the HTTP parser's own rejections (bad Content-Length, oversized
  headers, unknown methods, broken chunking, TLS on the plain port) answered as JSON like every other error.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from aiohttp import web

from llm_serving.api.schema import parse_json
from llm_serving.front.errors import error_response
from llm_serving.front.guards import check_json, read_body
from llm_serving.request_errors import ApiError

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key: probes and load balancers


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


# ---- the API key -------------------------------------------------------------------------------------------
def bearer_matches(header: str | None, api_key: str) -> bool:
    """Whether ``header`` (an Authorization value) is ``Bearer <api_key>``; constant-time in the key."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"), api_key.encode("utf-8"))


def api_key_middleware(api_key: str | None) -> Any:
    """A middleware refusing (401, JSON) requests without the key, except to ``OPEN_PATHS``; None without a
    key."""
    if not api_key:
        return None

    @web.middleware
    async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in OPEN_PATHS or bearer_matches(request.headers.get("Authorization"), api_key):
            return await handler(request)
        err = ApiError(401, "this server needs an API key: send the header Authorization: Bearer <key>",
                       "unauthorized")
        resp = error_response(err, request.path.startswith("/v1/"))
        resp.headers["WWW-Authenticate"] = 'Bearer realm="llm-serving"'
        return resp

    return require_api_key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server reachable beyond this machine that anyone may use; None if not."""
    if api_key or is_loopback(host):
        return None
    return (f"warning: listening on {host} without an API key: anyone who reaches this port can run "
            "generations; set serving_config.api_key (or --api-key, or $LLM_SERVING_API_KEY), or bind "
            "127.0.0.1")
