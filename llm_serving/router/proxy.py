"""The router's HTTP side: every route but its own ``/health`` and ``/metrics`` is forwarded to the engine the
policy chooses (``affinity``), the body as sent, the answer streamed back as it comes (SSE included), so every API
of ``llm-serving serve`` works through it unchanged.

Engines are watched with ``GET /health`` every ``health_interval_s``: one that does not answer 200 gets no new
requests until it does, and the prefixes it held are forgotten (it may have restarted with an empty cache). A
request whose engine cannot be reached, or does not answer within the first-byte timeout, goes to another engine
while nothing has reached the client; once bytes have, it cannot move: a stream then ends with an error event
(``upstream``). Malformed requests get the engines' own JSON 4xx from the router (``llm_serving.front``: the body
read within its limit and decoded, JSON nesting bounded, the HTTP parser's rejections as JSON); a client that
leaves aborts its request on the engine. With ``--api-key`` every route but ``/health`` needs
``Authorization: Bearer <key>`` (``llm_serving.front.api_key``, the engine's own check), which is passed on to the
engines as sent; the router sends its key on its own calls to them. ``/metrics``: the router's own counters, then
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
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from llm_serving.front.api_key import api_key_middleware
from llm_serving.front.errors import error_response, is_openai_path, json_http_errors
from llm_serving.front.guards import JsonErrorRunner, check_json, read_body, too_deep
from llm_serving.request_errors import ApiError
from llm_serving.router.affinity import AffinityPolicy
from llm_serving.router.disaggregation import (
    DISAGGREGATED_PATHS,
    decode_request,
    prefill_request,
    without_transfer_params,
)
from llm_serving.router.timeouts import Timeouts
from llm_serving.router.upstream import NotAnswered, client_timeout, forwarded_headers, relay

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20


@dataclass
class EngineInfo:
    index: int
    url: str
    healthy: bool = False


def request_json(body: bytes) -> Any:
    """The body as JSON; None when it is not JSON (the engine will judge it); 400 for JSON no engine takes (nested
    too deeply, lone surrogates), which the router itself cannot route."""
    try:
        data = json.loads(body) if body else None
    except RecursionError:
        raise too_deep() from None
    except ValueError:
        return None
    check_json(data)
    return data


def routing_text(data: Any) -> str:
    """The part of a request (its JSON body) that decides its prefix: the prompt (OpenAI completions,
    llm-serving's ``inputs``), the chat messages, or token ids, as text; "" when the body is not such JSON."""
    if not isinstance(data, dict):
        return ""
    for key in ("prompt", "inputs", "messages", "input_ids"):
        value = data.get(key)
        if isinstance(value, str):
            return value
        if value is not None:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return ""


class RouterServer:
    """Forwards requests to ``engine_urls`` by ``policy``; ``app()`` is the aiohttp application."""

    def __init__(self, engine_urls: list[str], policy: AffinityPolicy, health_interval_s: float = 1.0,
                 prefill_urls: tuple[str, ...] = (), prefill_policy: AffinityPolicy | None = None,
                 timeouts: Timeouts | None = None, api_key: str | None = None) -> None:
        urls = [*engine_urls, *prefill_urls]  # prefill engines numbered after the others
        self.engines = [EngineInfo(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.serving = set(range(len(engine_urls)))  # the engines that answer clients (decode engines)
        self.prefilling = set(range(len(engine_urls), len(urls)))
        self.policy, self.health_interval_s, self.timeouts = policy, health_interval_s, timeouts or Timeouts()
        self.api_key = api_key  # asked of clients, and sent to the engines on the router's own calls (/metrics)
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
        self.engine_failures = Counter("llm_serving_router_engine_failures", "Forwarded requests an engine failed, "
                                       "by how: unreachable, timeout or broken before answering (the request "
                                       "moves), or cut and timeout during a stream (it ends with an error event)",
                                       ["engine", "reason"], registry=self.registry)
        self.client_gone = Counter("llm_serving_router_client_disconnects", "Requests whose client left before "
                                   "its answer was written in full (their engine request is closed)",
                                   registry=self.registry)
        self._session: aiohttp.ClientSession | None = None
        self._watcher: asyncio.Task | None = None

    def app(self) -> web.Application:
        key_check = api_key_middleware(self.api_key)  # before forwarding: a request without it never reaches an engine
        middlewares = [json_http_errors] + ([key_check] if key_check else [])
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def make_runner(self, **kwargs: Any) -> web.AppRunner:
        """The runner to serve ``app()`` with, as the engine's: handlers cancelled when their client leaves (which
        closes the engine's request, so the engine aborts it), the HTTP parser's errors as JSON."""
        return JsonErrorRunner(self.app(), handler_cancellation=True, access_log=None, **kwargs)

    # ---- lifetime --------------------------------------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        # no total timeout: a generation may stream for minutes (each request has the router's ``Timeouts``)
        timeout = client_timeout(self.timeouts)
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
        try:
            return await self._forward(request)
        except ApiError as err:
            return error_response(err, is_openai_path(request.path))
        except asyncio.CancelledError:  # the client left (the engine's request closed as this unwinds)
            self.client_gone.inc()
            raise

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request, MAX_BODY_BYTES)
        data = request_json(body)
        text = routing_text(data)
        splittable = request.method == "POST" and request.path in DISAGGREGATED_PATHS
        if splittable and isinstance(data, dict) and "kv_transfer_params" in data:
            data = without_transfer_params(data)  # transfers are the router's to name, never a client's
            body = json.dumps(data).encode()
        if self.prefilling and splittable:
            prefilled = await self._prefill(request, body, data, text)
            if isinstance(prefilled, web.StreamResponse):
                return prefilled  # the prefill engine refused the request: the decode engine would too
            body = prefilled
        tried: set[int] = set()
        timed_out = False
        while True:
            choice = self.policy.choose(text, (self.healthy & self.serving) - tried)
            if choice is None:
                if timed_out:
                    raise ApiError(504, f"no engine answered within {self.timeouts.first_byte_s:g} s (tried "
                                        f"{', '.join(self.engines[e].url for e in sorted(tried))})", "upstream_timeout")
                down = ", ".join(e.url for e in self.engines)
                raise ApiError(503, f"no engine can take the request (engines: {down})", "no_engine")
            engine = self.engines[choice.engine]
            self.routed.labels(str(engine.index), "prefix" if choice.matched_chars else "load").inc()
            try:
                return await self._relay(request, body, engine)
            except NotAnswered as failed:
                log.warning("engine %d (%s) did not answer (%s): trying another", engine.index, engine.url, failed)
                self.engine_failures.labels(str(engine.index), failed.reason).inc()
                if failed.reason == "unreachable":
                    self._set_health(engine, False)
                timed_out = timed_out or failed.reason == "timeout"
            tried.add(engine.index)
            self.failovers.labels(str(engine.index)).inc()

    async def _prefill(self, request: web.Request, body: bytes, data: Any, text: str) -> bytes | web.StreamResponse:
        """Run the prompt on a prefill engine: the body for the decode engine (with the transfer of its KV blocks
        when there is one), or the prefill engine's 4xx answer. ``data``: ``body`` parsed (None if not JSON)."""
        assert self._session is not None
        first = prefill_request(data)
        choice = None if first is None else self.prefill_policy.choose(text, self.healthy & self.prefilling)
        if choice is None:
            return body
        engine = self.engines[choice.engine]
        headers = forwarded_headers(request)
        self.prefill_policy.started(engine.index)
        try:
            async with self._session.post(engine.url + request.path, json=first, headers=headers,
                                          timeout=client_timeout(self.timeouts)) as upstream:
                answer, status = await upstream.read(), upstream.status
                content_type = upstream.headers.get("Content-Type", "application/json")
        except aiohttp.ClientError as exc:  # the read timeouts included
            log.warning("prefill engine %d (%s) failed (%s): the decode engine computes the prompt",
                        engine.index, engine.url, exc or type(exc).__name__)
            if not isinstance(exc, TimeoutError):
                self._set_health(engine, False)
            self.prefills.labels(str(engine.index), "unreachable").inc()
            return body
        finally:
            self.prefill_policy.finished(engine.index)
        if 400 <= status < 500:
            self.prefills.labels(str(engine.index), "refused").inc()
            return web.Response(body=answer, status=status, headers={"Content-Type": content_type})
        decoding = decode_request(data, answer, engine.url) if status == 200 else None
        self.prefills.labels(str(engine.index), "none" if decoding is None else "transfer").inc()
        return body if decoding is None else json.dumps(decoding).encode()

    async def _relay(self, request: web.Request, body: bytes, engine: EngineInfo) -> web.StreamResponse:
        """Send the request to ``engine`` and relay its answer (``upstream.relay``: ``NotAnswered`` when nothing
        reached the client)."""
        assert self._session is not None
        self.policy.started(engine.index)
        self.in_flight.labels(str(engine.index)).inc()
        try:
            relayed = await relay(self._session, request, engine.url + request.path_qs, body, self.timeouts)
        finally:
            self.policy.finished(engine.index)
            self.in_flight.labels(str(engine.index)).dec()
        if relayed.failure is not None:
            log.warning("engine %d (%s) broke off a stream (%s): it ends with an error event", engine.index,
                        engine.url, relayed.failure)
            self.engine_failures.labels(str(engine.index), relayed.failure).inc()
        if relayed.client_gone:
            self.client_gone.inc()
        return relayed.response

    async def metrics(self, _request: web.Request) -> web.Response:
        texts = await asyncio.gather(*(self._engine_metrics(e) for e in self.engines))
        engines = CollectorRegistry()
        engines.register(_Labelled([(str(e.index), t) for e, t in zip(self.engines, texts) if t]))
        return web.Response(body=generate_latest(self.registry) + generate_latest(engines),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _engine_metrics(self, engine: EngineInfo) -> str:
        assert self._session is not None
        try:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            async with self._session.get(engine.url + "/metrics", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError):
            return ""


class _Labelled:
    """A collector of the engines' scraped metrics, each sample with its engine's label added (one family per
    name across engines, as Prometheus wants). The router's ``engine`` replaces a server's own (vLLM's series
    carry ``engine="0"``), so samples of different engines never collide."""

    def __init__(self, scraped: list[tuple[str, str]]) -> None:
        self.scraped = scraped

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for engine, text in self.scraped:
            for family in text_string_to_metric_families(text):
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                            family.unit))
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "engine": engine}, s.value, s.timestamp, s.exemplar)
        return list(merged.values())
