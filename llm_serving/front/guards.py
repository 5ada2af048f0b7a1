"""Guards in front of every route of the engine and the router: the body read within its limit and decoded per
its ``Content-Encoding`` (``read_body``), JSON nesting and lone surrogates refused (``check_json``), and JSON answers
for what aiohttp refuses before any route runs (``JsonErrorRunner``).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from llm_serving.front.errors import error_response, is_openai_path, too_large
from llm_serving.request_errors import ApiError

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32  # containers inside containers; the deepest request body needs about 6


# ---- the body ----------------------------------------------------------------------------------------------
async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The request's body decoded per its ``Content-Encoding``, within ``max_bytes`` decoded (413 past it); 400
    for a body that is not its declared encoding or broken chunking."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(request.content_length, max_bytes)
    try:
        return await request.read()  # decoded per Content-Encoding, the limit applying to the decoded size
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


def too_deep() -> ApiError:
    return ApiError(400, f"the request body nests JSON too deeply (more than {MAX_JSON_DEPTH} levels)",
                    "invalid_json")


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
                raise too_deep()
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
        if not resp.prepared and "Content-Encoding" in request.headers and not request.content.is_eof():
            await _settle_encoded_body(request, resp)
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
            openai = is_openai_path(_path(request))
        resp = error_response(err, openai)
        resp.force_close()
        return resp


async def _settle_encoded_body(request: web.BaseRequest, resp: web.StreamResponse) -> None:
    """A body in a ``Content-Encoding`` that the route answered without reading (a 404, 405, 415): read it now.
    aiohttp would read it after the answer, to keep the connection, and log a body that is not its encoding as an
    unhandled exception with a traceback; such a body (or one past the size limit) closes the connection."""
    try:
        await request.read()
    except (web.RequestPayloadError, web.HTTPRequestEntityTooLarge):
        request.content.feed_eof()
        resp.force_close()


def _json_http_error(request: web.BaseRequest, exc: web.HTTPException) -> web.Response:
    kind = (exc.reason or "http error").lower().replace(" ", "_")
    err = ApiError(exc.status, f"{request.method} {_path(request)}: {exc.text or exc.reason}", kind)
    resp = error_response(err, is_openai_path(_path(request)))
    for name, value in exc.headers.items():  # Allow, WWW-Authenticate, ...
        if name.lower() not in ("content-type", "content-length"):
            resp.headers[name] = value
    return resp


def _path(request: web.BaseRequest) -> str:
    try:
        return request.path
    except Exception:  # noqa: BLE001 - a request the parser could not read has no usable path
        return ""
