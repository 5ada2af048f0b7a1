"""Who may call the engine or the router: ``Authorization: Bearer <key>`` on every route but /health (the engine's
``serving_config.api_key``, the router's ``--api-key``), and the start-up warning for a server open to anyone
beyond this machine. One copy, so both answer a missing key with the same JSON 401.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from aiohttp import web

from llm_serving.front.errors import error_response
from llm_serving.request_errors import ApiError

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key: probes and load balancers


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


ENGINE_KEY = "serving_config.api_key (or --api-key, or $LLM_SERVING_API_KEY)"


def exposure_warning(host: str, api_key: str | None, how_to_set: str = ENGINE_KEY) -> str | None:
    """The start-up warning for a server reachable beyond this machine that anyone may use; None if not.
    ``how_to_set``: where this server takes its key."""
    if api_key or is_loopback(host):
        return None
    return (f"warning: listening on {host} without an API key: anyone who reaches this port can run "
            f"generations; set {how_to_set}, or bind 127.0.0.1")
