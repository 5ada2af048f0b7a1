"""The router's HTTP side: every route but its own ``/health`` and ``/metrics`` is forwarded to the engine the
policy chooses (``affinity``), the body as sent, the answer streamed back as it comes (SSE included), so every API
of ``llm-serving serve`` works through it unchanged.

Engines are watched with ``GET /health`` every ``health_interval_s``: one that does not answer 200 gets no new
requests until it does, and the prefixes it held are forgotten (it may have restarted with an empty cache). A
request whose engine cannot be reached before any answer has started goes to another engine; once bytes have
reached the client it cannot move, and the connection is closed. ``/metrics``: the router's own counters, then
each engine's metrics with an ``engine`` label (their URL's position on the command line), fetched at scrape time.
With prefill engines (``--prefill``, numbered after the others) a completion or chat request first runs its prompt
on one of them (``disaggregation``); the others then decode.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from llm_serving.router.affinity import AffinityPolicy
from llm_serving.router.disaggregation import (
    DISAGGREGATED_PATHS,
    decode_request,
    prefill_request,
    without_transfer_params,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
              "trailer", "proxy-authorization", "proxy-authenticate"}


@dataclass
class EngineInfo:
    index: int
    url: str
    healthy: bool = False


def routing_text(body: bytes) -> str:
    """The part of a request that decides its prefix: the prompt (OpenAI completions, llm-serving's ``inputs``),
    the chat messages, or token ids, as text; "" when the body is not such JSON (the engine will judge it)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    for key in ("prompt", "inputs", "messages", "input_ids"):
        value = data.get(key)
        if isinstance(value, str):
            return value
        if value is not None:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return ""


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The client's headers an engine gets (not the hop-by-hop ones, which describe this connection)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def error_body(status: int, message: str, error_type: str) -> web.Response:
    """An OpenAI-shaped error, as the engines answer theirs."""
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": error_type}, "error_type": error_type}
    return web.json_response(body, status=status, headers={"Retry-After": "1"} if status == 503 else None)


class RouterServer:
    """Forwards requests to ``engine_urls`` by ``policy``; ``app()`` is the aiohttp application."""

    def __init__(self, engine_urls: list[str], policy: AffinityPolicy, health_interval_s: float = 1.0,
                 prefill_urls: tuple[str, ...] = (), prefill_policy: AffinityPolicy | None = None) -> None:
        urls = [*engine_urls, *prefill_urls]  # prefill engines numbered after the others
        self.engines = [EngineInfo(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.serving = set(range(len(engine_urls)))  # the engines that answer clients (decode engines)
        self.prefilling = set(range(len(engine_urls), len(urls)))
        self.policy, self.health_interval_s = policy, health_interval_s
        self.prefill_policy = prefill_policy or AffinityPolicy(len(urls))
        self.registry = CollectorRegistry()
        self.routed = Counter("llm_serving_router_requests", "Requests sent to each engine, by how it was chosen",
                              ["engine", "by"], registry=self.registry)
        self.failovers = Counter("llm_serving_router_failovers", "Requests moved to another engine because "
                                 "theirs could not be reached", ["engine"], registry=self.registry)
        self.up = Gauge("llm_serving_router_engine_up", "1 while the engine answers /health with 200",
                        ["engine", "url"], registry=self.registry)
        self.prefills = Counter("llm_serving_router_prefills", "Requests sent to a prefill engine first, by what "
                                "the decode engine got (transfer: KV blocks to fetch; none: the prompt to compute)",
                                ["engine", "outcome"], registry=self.registry)
        self.in_flight = Gauge("llm_serving_router_in_flight", "Requests forwarded and not yet answered in full",
                               ["engine"], registry=self.registry)
        self._session: aiohttp.ClientSession | None = None
        self._watcher: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ---- lifetime --------------------------------------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        # no total timeout: a generation may stream for minutes; connecting must be quick
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        # no cap on connections: aiohttp's default of 100 would queue every request beyond the 100th in flight
        # (measured: 128 streams at once through the router ran at 0.78x of the engine alone)
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector)
        await self.check_health()
        self._watcher = asyncio.create_task(self._watch())

    async def _stop(self, _app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._session is not None:
            await self._session.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        results = await asyncio.gather(*(self._probe(e) for e in self.engines))
        for engine, healthy in zip(self.engines, results):
            self._set_health(engine, healthy)

    async def _probe(self, engine: EngineInfo) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def _set_health(self, engine: EngineInfo, healthy: bool) -> None:
        if engine.healthy and not healthy:
            log.warning("engine %d (%s) stopped answering /health: no new requests go to it", engine.index,
                        engine.url)
            self.policy.index.forget_engine(engine.index)
        elif healthy and not engine.healthy:
            log.info("engine %d (%s) serves", engine.index, engine.url)
        engine.healthy = healthy
        self.up.labels(str(engine.index), engine.url).set(1 if healthy else 0)

    @property
    def healthy(self) -> set[int]:
        return {e.index for e in self.engines if e.healthy}

    # ---- routes ----------------------------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        serving = sorted(self.healthy & self.serving)
        status = 200 if serving else 503
        return web.json_response({"status": "ok" if serving else "no engine serving",
                                  "engines": {e.url: e.healthy for e in self.engines}}, status=status)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        text = routing_text(body)
        if request.method == "POST" and request.path in DISAGGREGATED_PATHS:
            body = without_transfer_params(body)  # transfers are the router's to name, never a client's
        if self.prefilling and request.method == "POST" and request.path in DISAGGREGATED_PATHS:
            prefilled = await self._prefill(request, body, text)
            if isinstance(prefilled, web.StreamResponse):
                return prefilled  # the prefill engine refused the request: the decode engine would too
            body = prefilled
        tried: set[int] = set()
        while True:
            choice = self.policy.choose(text, (self.healthy & self.serving) - tried)
            if choice is None:
                down = ", ".join(e.url for e in self.engines)
                return error_body(503, f"no engine can take the request (engines: {down})", "no_engine")
            engine = self.engines[choice.engine]
            self.routed.labels(str(engine.index), "prefix" if choice.matched_chars else "load").inc()
            answer = await self._relay(request, body, engine)
            if answer is not None:
                return answer
            tried.add(engine.index)
            self.failovers.labels(str(engine.index)).inc()

    async def _prefill(self, request: web.Request, body: bytes, text: str) -> bytes | web.StreamResponse:
        """Run the prompt on a prefill engine: the body for the decode engine (with the transfer of its KV blocks
        when there is one), or the prefill engine's 4xx answer."""
        assert self._session is not None
        data = prefill_request(body)
        choice = None if data is None else self.prefill_policy.choose(text, self.healthy & self.prefilling)
        if choice is None:
            return body
        engine = self.engines[choice.engine]
        headers = forwarded_headers(request)
        self.prefill_policy.started(engine.index)
        try:
            async with self._session.post(engine.url + request.path, json=data, headers=headers) as upstream:
                answer, status = await upstream.read(), upstream.status
                content_type = upstream.headers.get("Content-Type", "application/json")
        except aiohttp.ClientError as exc:
            log.warning("prefill engine %d (%s) unreachable (%s): the decode engine computes the prompt",
                        engine.index, engine.url, exc)
            self._set_health(engine, False)
            self.prefills.labels(str(engine.index), "unreachable").inc()
            return body
        finally:
            self.prefill_policy.finished(engine.index)
        if 400 <= status < 500:
            self.prefills.labels(str(engine.index), "refused").inc()
            return web.Response(body=answer, status=status, headers={"Content-Type": content_type})
        decode_body, transferred = decode_request(body, answer, engine.url) if status == 200 else (body, False)
        self.prefills.labels(str(engine.index), "transfer" if transferred else "none").inc()
        return decode_body

    async def _relay(self, request: web.Request, body: bytes, engine: EngineInfo) -> web.StreamResponse | None:
        """Send the request to ``engine`` and stream its answer back; None when the engine could not be reached
        before anything was answered (the caller tries another)."""
        assert self._session is not None
        headers = forwarded_headers(request)
        self.policy.started(engine.index)
        self.in_flight.labels(str(engine.index)).inc()
        response: web.StreamResponse | None = None
        try:
            async with self._session.request(request.method, engine.url + request.path_qs, data=body,
                                             headers=headers) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            if response is None:  # nothing answered yet: another engine may take it
                log.warning("engine %d (%s) unreachable (%s): trying another", engine.index, engine.url, exc)
                self._set_health(engine, False)
                return None
            log.warning("engine %d (%s) broke off an answer: %s", engine.index, engine.url, exc)
            response.force_close()
            return response
        finally:
            self.policy.finished(engine.index)
            self.in_flight.labels(str(engine.index)).dec()

    async def metrics(self, _request: web.Request) -> web.Response:
        texts = await asyncio.gather(*(self._engine_metrics(e) for e in self.engines))
        engines = CollectorRegistry()
        engines.register(_Labelled([(str(e.index), t) for e, t in zip(self.engines, texts) if t]))
        return web.Response(body=generate_latest(self.registry) + generate_latest(engines),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _engine_metrics(self, engine: EngineInfo) -> str:
        assert self._session is not None
        try:
            async with self._session.get(engine.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError):
            return ""


class _Labelled:
    """A collector of the engines' scraped metrics, each sample with its engine's label added (one family per
    name across engines, as Prometheus wants)."""

    def __init__(self, scraped: list[tuple[str, str]]) -> None:
        self.scraped = scraped

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for engine, text in self.scraped:
            for family in text_string_to_metric_families(text):
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                            family.unit))
                for s in family.samples:
                    out.add_sample(s.name, {"engine": engine, **s.labels}, s.value, s.timestamp, s.exemplar)
        return list(merged.values())
