"""What every section of the reliability suite (``scripts/chaos.py``) shares: the section interface, the
run context, a raw HTTP/1.1 client and readers of the server's ``/metrics`` and ``/health``.

Section interface (how ``chaos_agents.py`` adds ``sigkill``, ``sigstop`` and ``poison``):

    SECTIONS = [Section(name="sigkill", help="...", add_arguments=add_args, run=run_sigkill)]

- ``add_arguments(parser)`` adds the section's own flags to the ``chaos.py`` command line; name them
  ``--<section>-...`` so sections never clash. It may be None.
- ``run(ctx)`` is a coroutine taking a ``Context`` (the server's URL and API key, the parsed arguments,
  ``log``, the raw client ``ctx.exchange`` and ``ctx.metrics()``/``ctx.health()``); it returns the section's
  figures, a flat JSON-able dict (name -> number or short string), printed as one table and written to
  ``--json``. Raise ``SectionError`` when the section cannot run (e.g. it needs ``--server-pid``); other
  exceptions are reported as the section's failure too, and the next section still runs.
- Sections run one after the other, in the order of ``--sections``, against the same live server; leave it
  serving (or say in the figures that it is not).

The client speaks raw bytes over asyncio streams on purpose: hostile requests (bad Content-Length, bare
methods, broken chunking) cannot be sent through a well-behaved HTTP library. Only loopback servers are
targeted (``check_loopback``): this suite floods and corrupts what it talks to.

Pointed at ``llm-serving router`` (router mode, ``Context.target``), the same sections run through the router:
its ``/metrics`` serves each engine's figures with an ``engine`` label, which ``metric_total`` sums, so the KV
blocks left after a run are those of every engine behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

READ_LIMIT = 4 << 20  # bytes of one response kept; the rest is read and dropped


class SectionError(Exception):
    """A section that cannot run as asked (missing flag, server in the wrong state)."""


@dataclass
class RawResponse:
    """One exchange's outcome. ``status`` None: the connection ended without a status line."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names; a repeated name keeps the last
    body: bytes = b""
    elapsed: float = 0.0
    timed_out: bool = False
    error: str | None = None  # connection errors (reset, refused)

    @property
    def status_class(self) -> str:
        if self.timed_out:
            return "hang"
        return "none" if self.status is None else f"{self.status // 100}xx"

    def json(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def is_json_error(self) -> bool:
        """A 4xx/5xx whose body is a JSON object with an ``error`` member, served as application/json."""
        body = self.json()
        return (self.headers.get("content-type", "").startswith("application/json")
                and isinstance(body, dict) and "error" in body)


def check_loopback(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``url`` if every address it resolves to is loopback, else SectionError."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SectionError(f"{url!r}: expected http://HOST:PORT")
    port = parts.port or 80
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SectionError(f"{parts.hostname}: {exc}") from None
    if not all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        raise SectionError(f"{parts.hostname} is not a loopback address: the chaos suite only targets "
                           "servers on this machine (127.0.0.0/8, ::1)")
    return parts.hostname, port


async def exchange(host: str, port: int, request: bytes, timeout: float = 30.0,
                   half_close: bool = False) -> RawResponse:
    """Send ``request`` as is on a new connection and read until the server closes it (send
    ``Connection: close``); ``half_close`` shuts our side after sending, for requests that promise more body
    than they carry."""
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(_exchange(host, port, request, half_close, t0), timeout)
    except TimeoutError:
        return RawResponse(None, elapsed=time.monotonic() - t0, timed_out=True)


async def _exchange(host: str, port: int, request: bytes, half_close: bool, t0: float) -> RawResponse:
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    except OSError as exc:
        return RawResponse(None, elapsed=time.monotonic() - t0, error=f"connect: {exc}")
    data = bytearray()
    error = None
    try:
        try:
            writer.write(request)
            await writer.drain()
            if half_close and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError) as exc:  # the server answered early and closed: read what it sent
            error = f"send: {type(exc).__name__}"
        while True:
            try:
                chunk = await reader.read(1 << 16)
            except (ConnectionError, OSError) as exc:
                error = f"read: {type(exc).__name__}"
                break
            if not chunk:
                break
            if len(data) < READ_LIMIT:
                data += chunk
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    response = parse_response(bytes(data))
    response.elapsed = time.monotonic() - t0
    if response.status is None:
        response.error = error
    return response


def parse_response(data: bytes) -> RawResponse:
    """A status line, headers and body (de-chunked) from the raw bytes of one response."""
    while data.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in data:  # interim answers (100 Continue)
        data = data.partition(b"\r\n\r\n")[2]
    head, sep, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2) if lines else []
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return RawResponse(None)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        rest = _dechunk(rest)
    elif headers.get("content-length", "").isdigit():
        rest = rest[:int(headers["content-length"])]
    return RawResponse(int(parts[1]), headers, rest)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, sep, data = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
        except ValueError:
            break
        if not sep or size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


def http_request(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> bytes:
    """A well-formed HTTP/1.1 request with ``Connection: close`` (and Content-Length when there is a body)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


@dataclass
class Context:
    """What a section gets: the server, the parsed arguments, a logger and HTTP helpers."""

    url: str
    args: argparse.Namespace
    api_key: str | None = None
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.host, self.port = check_loopback(self.url)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def exchange(self, request: bytes, timeout: float = 30.0, half_close: bool = False) -> RawResponse:
        return await exchange(self.host, self.port, request, timeout, half_close)

    async def get(self, path: str, timeout: float = 10.0) -> RawResponse:
        return await self.exchange(http_request("GET", path, headers=self.auth_headers()), timeout)

    async def post_json(self, path: str, body: Any, timeout: float = 60.0) -> RawResponse:
        headers = {"Content-Type": "application/json", **self.auth_headers()}
        return await self.exchange(http_request("POST", path, json.dumps(body).encode(), headers), timeout)

    async def health(self) -> tuple[int | None, Any]:
        r = await self.get("/health")
        return r.status, r.json()

    async def target(self) -> str:
        """"router" when the URL is ``llm-serving router`` (its /health lists its engines), else "engine"."""
        _, body = await self.health()
        return "router" if isinstance(body, dict) and isinstance(body.get("engines"), dict) else "engine"

    async def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name{labels}: value}``; empty when it cannot be read."""
        r = await self.get("/metrics")
        return parse_metrics(r.body.decode("utf-8", "replace")) if r.status == 200 else {}

    async def model_name(self) -> str:
        r = await self.get("/v1/models")
        body = r.json()
        try:
            return str(body["data"][0]["id"])
        except (TypeError, KeyError, IndexError):
            return "llama2"

    async def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request is in flight or running and no KV block is held; returns the
        last read."""
        deadline = time.monotonic() + timeout
        while True:
            m = await self.metrics()
            idle = all((metric_total(m, f"llm_serving_{name}") or 0) == 0
                       for name in ("requests_in_flight", "running_batch_size", "kv_blocks_used"))
            if idle or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.2)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def metric_total(m: dict[str, float], name: str) -> float | None:
    """``name``'s value in ``parse_metrics`` output, summed over its labelled samples (a router serves each
    engine's with an ``engine`` label); None when there is none."""
    values = [v for key, v in m.items() if key == name or key.startswith(name + "{")]
    return sum(values) if values else None


def sse_events(text: str) -> list[str]:
    """The data of each whole server-sent event in ``text``, as the SSE format defines them: ``data:`` lines
    (one leading space dropped) joined by newlines, an event ending at a blank line; an event the stream was cut
    in (no blank line after it) is not one."""
    events: list[str] = []
    data: list[str] | None = None
    for line in re.split(r"\r\n|\r|\n", text):
        if not line:
            if data is not None:
                events.append("\n".join(data))
            data = None
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data = [*(data or []), value.removeprefix(" ")]
    return events


SectionRun = Callable[[Context], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Section:
    """One part of the suite: ``run(ctx)`` returns its figures (see the module docstring)."""

    name: str
    help: str
    run: SectionRun
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
