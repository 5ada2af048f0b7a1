"""One forwarded request: sent to an engine within the router's timeouts, its answer relayed to the client.

Three timeouts bound an engine (``timeouts.Timeouts``): connecting, the first byte of its answer (for a request
that is not streamed that is the whole generation, so it is long) and the wait between two chunks of an answer.
Before any byte has reached the client an engine's failure raises ``NotAnswered`` (the caller may try another
engine); after it, a streamed answer (SSE or JSON lines) ends with an error event in the engine's own format
(``front.errors``), the partial event the engine was cut in dropped first, and the stream is closed properly. A
whole body (one with a Content-Length: every answer that is not a stream) is read in full before the client gets
any of it, so an engine that breaks off there is still ``NotAnswered``. When the client leaves, the handler is
cancelled (the router runs with handler cancellation) and leaving the upstream request closes its connection:
the engine sees its client gone and aborts the request, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from llm_serving.front.errors import is_openai_path, stream_error_event
from llm_serving.request_errors import ApiError
from llm_serving.router.timeouts import Timeouts

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
                        "trailer", "proxy-authorization", "proxy-authenticate"})
# of the client's headers, also not forwarded: the router has decoded the body and answered any Expect itself
DECODED = frozenset({"content-encoding", "expect"})
STREAM_SEPARATORS = {"text/event-stream": b"\n\n", "application/x-ndjson": b"\n"}  # where an event ends


def client_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts for a forwarded request: ``sock_read`` bounds the wait for the answer's head (and each
    read after it, which ``idle_s`` bounds more tightly when it is shorter)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.first_byte_s)


class NotAnswered(Exception):
    """The engine failed before the client got any byte; ``reason``: "unreachable" (connecting failed: the
    engine is down), "timeout" (no answer within the first-byte timeout) or "broken" (it broke off its answer)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Relayed:
    """A relayed answer; ``failure`` says how the engine broke off an answer under way ("cut" or "timeout");
    ``client_gone``: the client left while it was being written."""

    response: web.StreamResponse
    failure: str | None = None
    client_gone: bool = False


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The client's headers an engine gets (not the hop-by-hop ones, which describe this connection, nor those
    describing the body as the client encoded it)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | DECODED}


def _answer_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def relay(session: aiohttp.ClientSession, request: web.Request, url: str, body: bytes,
                timeouts: Timeouts) -> Relayed:
    """Send ``request`` (its ``body`` already read and decoded) to ``url`` and relay the answer (see the module
    docstring); ``NotAnswered`` when nothing reached the client."""
    try:
        async with session.request(request.method, url, data=body, headers=forwarded_headers(request),
                                   timeout=client_timeout(timeouts)) as upstream:
            if upstream.content_length is not None or upstream.content_type not in STREAM_SEPARATORS:
                whole = await _read_whole(upstream, timeouts.idle_s)
                return Relayed(web.Response(body=whole, status=upstream.status, reason=upstream.reason,
                                            headers=_answer_headers(upstream)))
            return await _relay_stream(request, upstream, timeouts.idle_s)
    except NotAnswered:
        raise
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:  # refused, no route, timeout
        raise NotAnswered("unreachable", str(exc) or type(exc).__name__) from None
    except TimeoutError as exc:  # aiohttp's socket read timeout: no answer's head in time
        raise NotAnswered("timeout", f"no answer within {timeouts.first_byte_s:g} s ({exc})") from None
    except aiohttp.ClientError as exc:  # the connection broke before the head of an answer
        raise NotAnswered("broken", str(exc) or type(exc).__name__) from None


async def _read_whole(upstream: aiohttp.ClientResponse, idle_s: float) -> bytes:
    parts = []
    try:
        while chunk := await _next_chunk(upstream, idle_s):
            parts.append(chunk)
    except TimeoutError:
        raise NotAnswered("timeout", f"the answer's body stopped for {idle_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise NotAnswered("broken", f"the answer's body broke off: {exc or type(exc).__name__}") from None
    return b"".join(parts)


async def _next_chunk(upstream: aiohttp.ClientResponse, idle_s: float) -> bytes:
    return await asyncio.wait_for(upstream.content.readany(), idle_s)


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse, idle_s: float) -> Relayed:
    """Relay a stream event by event: the bytes up to the last whole event go on at once; a cut leaves no half
    event before the error event."""
    separator = STREAM_SEPARATORS[upstream.content_type]
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=_answer_headers(upstream))
    pending = b""
    try:
        await response.prepare(request)
        while True:
            try:
                chunk = await _next_chunk(upstream, idle_s)
            except TimeoutError:
                err = ApiError(504, f"the engine sent nothing for {idle_s:g} s: the stream is cut",
                               "upstream_timeout")
                return await _end(Relayed(response, "timeout"), _error_event(request, upstream, err))
            except aiohttp.ClientError as exc:
                err = ApiError(502, f"the engine broke off the stream: {exc or type(exc).__name__}",
                               "upstream_error")
                return await _end(Relayed(response, "cut"), _error_event(request, upstream, err))
            if not chunk:
                return await _end(Relayed(response), pending)  # the engine ended it: nothing is pending
            whole, cut, pending = (pending + chunk).rpartition(separator)
            if cut:
                await response.write(whole + cut)
    except ConnectionError as exc:
        log.debug("client left during its stream: %s", exc)
        return Relayed(response, client_gone=True)


def _error_event(request: web.Request, upstream: aiohttp.ClientResponse, err: ApiError) -> bytes:
    return stream_error_event(err, is_openai_path(request.path), sse=upstream.content_type == "text/event-stream")


async def _end(relayed: Relayed, last: bytes) -> Relayed:
    """Write ``last`` and end the stream; a client that left meanwhile is a disconnect, not an error."""
    try:
        if last:
            await relayed.response.write(last)
        await relayed.response.write_eof()
    except ConnectionError as exc:
        log.debug("client left at the end of its stream: %s", exc)
        relayed.client_gone = True
    return relayed
