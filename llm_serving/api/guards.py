"""Guards in front of every route: what reaches the JSON parser, who may call, and JSON answers for what
aiohttp refuses before any route runs.

- ``read_json_body``: 415 unless the body is declared JSON (a browser sends ``text/plain``, form and
  multipart bodies to another origin without a CORS preflight, ``application/json`` only after one, so this
  keeps a web page from starting generations on a local server); 400 for a body that is not its
  ``Content-Encoding``; then JSON nested no deeper than any request needs and free of lone UTF-16
  surrogates (which no tokenizer can take).
- ``api_key_middleware``: ``Authorization: Bearer <serving_config.api_key>`` on every route but /health.
- ``JsonErrorRunner``: the HTTP parser's own rejections (bad Content-Length, oversized headers, unknown
  methods, broken chunking, TLS on the plain port) answered as JSON like every other error.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from llm_serving.api.responses import error_response, too_large
from llm_serving.api.schema import parse_json
from llm_serving.request_errors import ApiError

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32  # containers inside containers; the deepest request body needs about 6
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
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(request.content_length, max_bytes)
    try:
        raw = await request.read()  # decoded per Content-Encoding, the limit applying to the decoded size
    except web.HTTPRequestEntityTooLarge:
        raise too_large(None, max_bytes) from None
    except web.RequestPayloadError as exc:  # not gzip/deflate as declared, broken chunking
        # the body's stream is broken: mark it ended, or aiohttp reads it again after the answer (to keep the
        # connection) and logs the error as unhandled; the answer closes the connection instead
        request.content.feed_eof()
        why = " ".join(str(exc).split("message:", 1)[-1].split())  # "400, message:\n  Can not decode ..."
        err = ApiError(400, f"the request body cannot be read: {why}", "invalid_body")
        err.close_connection = True
        raise err from None
    value = parse_json(raw)
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """400 for JSON nested deeper than ``MAX_JSON_DEPTH`` or holding a string (or key) with a lone UTF-16
    surrogate (``"\\ud800"`` parses, but is not text: encoding it fails wherever it goes next)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body nests JSON too deeply (more than {MAX_JSON_DEPTH} "
                                    "levels)", "invalid_json")
            if isinstance(item, dict):
                for key, member in item.items():
                    _check_text(key)
                    stack.append((member, depth + 1))
            else:
                stack.extend((member, depth + 1) for member in item)


def _check_text(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"the request body has a string with a lone UTF-16 surrogate "
                            f"({s[exc.start]!r}), which is not Unicode text", "invalid_json") from None


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


# ---- the HTTP parser's own rejections ----------------------------------------------------------------------
class JsonErrorRunner(web.AppRunner):
    """An ``AppRunner`` whose connections answer the HTTP parser's rejections with JSON.

    aiohttp gives no hook for those: the connection's ``RequestHandler.handle_error`` builds them as
    text/plain before any middleware or request factory could shape them. So the ``web.Server`` that
    ``AppRunner`` makes is rebuilt to create connections of a ``RequestHandler`` subclass; that reads the
    server's stored constructor arguments (``_kwargs``, ``_loop``), and falls back to aiohttp's text answers
    (logged) if a later aiohttp stores them otherwise.
    """

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        kwargs, loop = getattr(made, "_kwargs", None), getattr(made, "_loop", None)
        if not isinstance(kwargs, dict) or loop is None:
            log.warning("aiohttp %s: cannot install JSON answers for HTTP parser errors", aiohttp.__version__)
            return made
        return _JsonErrorServer(made.request_handler, request_factory=made.request_factory,
                                handler_cancellation=made.handler_cancellation, loop=loop, **kwargs)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorHandler(RequestHandler):
    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        """Every response of the connection passes here: an aiohttp ``HTTPException`` raised where no
        middleware runs (the Expect header's handler: 417) is answered as JSON too."""
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and not resp.prepared:
            resp = _json_http_error(request, resp)
        return await super().finish_response(request, resp, start_time)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The error answer of a connection: the parser's 400s (the client's fault: logged at debug only),
        and 500/504 for handlers that raised past the routes' own guards (logged by aiohttp)."""
        if isinstance(exc, HttpProcessingError) and status < 500:
            if request.writer.output_size > 0:  # as aiohttp: a response is under way, the connection is lost
                raise ConnectionError("response already started; cannot send the error")
            log.debug("bad HTTP request: %s", message)
            text = " ".join(line.strip() for line in (message or "").splitlines()
                            if line.strip() and set(line.strip()) != {"^"})
            err = ApiError(status, f"bad HTTP request: {text or 'malformed'}", "bad_http_request")
            openai = False
        else:
            super().handle_error(request, status, exc, message)  # logs it; raises if a response is under way
            kind = "timeout" if status == 504 else "internal_error"
            err = ApiError(status, "the request timed out" if status == 504 else "internal error", kind)
            openai = _path(request).startswith("/v1/")
        resp = error_response(err, openai)
        resp.force_close()
        return resp


def _json_http_error(request: web.BaseRequest, exc: web.HTTPException) -> web.Response:
    kind = (exc.reason or "http error").lower().replace(" ", "_")
    err = ApiError(exc.status, f"{request.method} {_path(request)}: {exc.text or exc.reason}", kind)
    resp = error_response(err, _path(request).startswith("/v1/"))
    for name, value in exc.headers.items():  # Allow, WWW-Authenticate, ...
        if name.lower() not in ("content-type", "content-length"):
            resp.headers[name] = value
    return resp


def _path(request: web.BaseRequest) -> str:
    try:
        return request.path
    except Exception:  # noqa: BLE001 - a request the parser could not read has no usable path
        return ""
