"""Issue 51, parts 2 and 5: the router as hard as the engine. Against a stand-in engine (an aiohttp server that
fails on purpose: never answers, stalls, dies mid-stream, records what it got) the router's own behaviour: JSON
errors for bodies no engine takes, gzip bodies forwarded decoded, a 504 or another engine when an engine does not
answer, an error event when a stream is cut, the engine's request closed when the client leaves. Against real
engines (stand-in agents): a non-streamed request whose client left is aborted on the engine, and the fuzz of the
reliability suite through the router (fuzz and soak) gives no 5xx, no error that is not JSON, no KV block left.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llm_serving.api.responses import end_stream
from llm_serving.request_errors import ApiError
from llm_serving.router.affinity import AffinityPolicy
from llm_serving.router.proxy import RouterServer, request_json
from llm_serving.router.timeouts import Timeouts
from tests.test_router import RouterProcess
from tests.test_server import ServerProcess, long_completion, metrics, wait_metric

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import chaos
import chaos_fuzz
import chaos_soak
from chaos_core import Context

SHORT = Timeouts(connect_s=5, first_byte_s=0.5, idle_s=0.5)  # short: the stand-in fails on purpose
FIRST_EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'


# ---- the router's own checks -------------------------------------------------------------------------------
def test_bodies_no_engine_takes_are_400s_before_routing():
    nested: list = [1]
    for _ in range(32):
        nested = [nested]
    for body in (b"[" * 5000 + b"]" * 5000, json.dumps({"prompt": nested}).encode(), b'{"prompt": "\\ud800"}'):
        with pytest.raises(ApiError) as info:
            request_json(body)
        assert info.value.status == 400 and info.value.error_type == "invalid_json"
    assert request_json(b"not json") is None and request_json(b'{"prompt": "x"}') == {"prompt": "x"}


def test_the_router_command_takes_its_timeouts_and_refuses_nonpositive_ones(capsys):
    from llm_serving.cli.main import main

    for flag in ("--connect-timeout", "--first-byte-timeout", "--idle-timeout"):
        assert main(["router", "--engine", "http://127.0.0.1:9", flag, "0"]) == 2
        assert f"{flag} must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--help"])
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--connect-timeout", "--first-byte-timeout", "--idle-timeout"))


# ---- a stand-in engine -------------------------------------------------------------------------------------
class StandIn:
    """An engine's stand-in: ``/health`` answers, each other path fails (or answers) in its own way; it records
    what it received and which handlers were cancelled (their client, the router, closed the connection)."""

    def __init__(self, hang: bool = True) -> None:
        self.hang_completions = hang
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()
        self.cancelled = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self.health)
        for path, handler in (("/v1/completions", self.hang), ("/v1/echo", self.echo), ("/v1/cut", self.cut),
                              ("/models/m/generate_stream", self.cut), ("/v1/stall", self.stall),
                              ("/v1/fine", self.fine)):
            app.router.add_post(path, handler)
        self.runner = web.AppRunner(app, handler_cancellation=True)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _arrive(self, request: web.Request) -> bytes:
        body = await request.read()
        self.received.append((dict(request.headers), body))
        self.arrived.set()
        return body

    async def _wait_forever(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def hang(self, request: web.Request) -> web.StreamResponse:
        """A stopped engine: the request is taken, no answer ever comes."""
        if not self.hang_completions:
            return await self.fine(request)
        await self._arrive(request)
        await self._wait_forever()
        raise AssertionError("unreachable")

    async def echo(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"length": len(await self._arrive(request))})

    async def fine(self, request: web.Request) -> web.StreamResponse:
        await self._arrive(request)
        return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        await self._arrive(request)
        sse = request.path.startswith("/v1/")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(FIRST_EVENT if sse else b'{"token": "a"}\n')
        return resp

    async def cut(self, request: web.Request) -> web.StreamResponse:
        """An engine that dies in the middle of an event."""
        resp = await self._start_stream(request)
        await resp.write(b'data: {"choi' if request.path.startswith("/v1/") else b'{"tok')
        assert request.transport is not None
        request.transport.abort()
        await self._wait_forever()
        return resp

    async def stall(self, request: web.Request) -> web.StreamResponse:
        """An engine stopped in the middle of a stream."""
        await self._start_stream(request)
        await self._wait_forever()
        raise AssertionError("unreachable")

    async def start(self) -> str:
        await self.runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def routed(hangs: tuple[bool, ...] = (True,),
                 timeouts: Timeouts = SHORT) -> AsyncIterator[tuple[str, list[StandIn], RouterServer]]:
    """The router (in this process, as ``llm-serving router`` runs it) in front of stand-ins, one per ``hangs``
    (whether its completions route never answers)."""
    engines = len(hangs)
    stand_ins = [StandIn(hang) for hang in hangs]
    urls = [await s.start() for s in stand_ins]
    server = RouterServer(urls, AffinityPolicy(engines, use_prefix=False), health_interval_s=600,
                          timeouts=timeouts)
    runner = server.make_runner()
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", stand_ins, server
    finally:
        await runner.cleanup()
        for s in stand_ins:
            await s.runner.cleanup()


def run(make: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(make(), 60))  # a bound on a hang, not a timed assertion


def counter(server: RouterServer, name: str, **labels: str) -> float:
    value = server.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def read_stream(url: str, path: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()  # raises if the stream did not end properly (chunked terminator)


# ---- the stand-in engine's failures --------------------------------------------------------------------------
def test_an_engine_that_never_answers_is_a_json_504_and_another_engine_takes_the_next():
    async def go() -> None:
        async with routed((True,)) as (url, _, server):
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 504 and r.content_type == "application/json"
                assert (await r.json())["error"]["code"] == "upstream_timeout"
            assert counter(server, "llm_serving_router_engine_failures_total", engine="0", reason="timeout") == 1
        async with routed((True, False)) as (url, stand_ins, server):  # engine 0 never answers, engine 1 does
            for _ in range(3):  # idle engines take requests in turn: engine 0 gets some first
                async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={}) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
            assert counter(server, "llm_serving_router_failovers_total", engine="0") >= 1
            assert stand_ins[0].received and len(stand_ins[1].received) == 3
    run(go)


def test_a_stream_cut_by_the_engine_ends_with_an_error_event_in_the_engines_format():
    async def go() -> None:
        async with routed() as (url, _, server):
            status, body = await read_stream(url, "/v1/cut", {"prompt": "x", "stream": True})
            assert status == 200
            events = body.decode().split("\n\n")
            assert events[0].encode() + b"\n\n" == FIRST_EVENT and events[2:] == [""], body  # no half event
            error = json.loads(events[1].removeprefix("data: "))["error"]
            assert error["code"] == "upstream_error" and error["type"] == "server_error"
            status, body = await read_stream(url, "/models/m/generate_stream", {"inputs": "x"})
            lines = body.decode().splitlines()
            assert status == 200 and lines[0] == '{"token": "a"}' and len(lines) == 2, body
            assert json.loads(lines[1])["error_type"] == "upstream_error"
            status, body = await read_stream(url, "/v1/stall", {"prompt": "x", "stream": True})
            error = json.loads(body.decode().split("\n\n")[1].removeprefix("data: "))["error"]
            assert status == 200 and error["code"] == "upstream_timeout", body
            assert counter(server, "llm_serving_router_engine_failures_total", engine="0", reason="cut") == 2
    run(go)


def test_a_client_that_leaves_closes_the_engines_request():
    async def go() -> None:
        for stream in (False, True):
            async with routed(timeouts=Timeouts(first_byte_s=60, idle_s=60)) as (url, stand_ins, server):
                path = "/v1/stall" if stream else "/v1/completions"
                async with aiohttp.ClientSession() as s:
                    task = asyncio.ensure_future(s.post(url + path, json={"prompt": "x", "stream": stream}))
                    await stand_ins[0].arrived.wait()
                    if stream:
                        resp = await task
                        assert await resp.content.readuntil(b"\n\n") == FIRST_EVENT
                        resp.close()
                    else:
                        task.cancel()
                await stand_ins[0].cancelled.wait()  # the router closed its connection to the engine
                for _ in range(100):
                    if counter(server, "llm_serving_router_client_disconnects_total"):
                        break
                    await asyncio.sleep(0.05)
                assert counter(server, "llm_serving_router_client_disconnects_total") == 1
    run(go)


def test_a_gzip_body_is_forwarded_decoded_and_one_that_is_not_gzip_is_a_json_400():
    async def go() -> None:
        async with routed() as (url, stand_ins, _):
            body = json.dumps({"prompt": "hello " * 100}).encode()
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/echo", data=gzip.compress(body), headers=headers) as r:
                    assert r.status == 200 and (await r.json())["length"] == len(body)
                got_headers, got = stand_ins[0].received[-1]
                assert got == body and "Content-Encoding" not in got_headers
                assert got_headers["Content-Length"] == str(len(body))
                async with s.post(url + "/v1/echo", data=body, headers=headers) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_body"
                deep = b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
                async with s.post(url + "/models/m/generate", data=deep, headers={"Content-Type": "x"}) as r:
                    assert r.status == 400 and (await r.json())["error_type"] == "invalid_json"
            assert len(stand_ins[0].received) == 1  # neither refused body reached the engine
    run(go)


def test_a_body_that_is_not_its_encoding_on_a_route_that_never_reads_it_logs_no_traceback(caplog):
    """aiohttp reads an unread body after the answer (to keep the connection) and logged one that is not its
    Content-Encoding as an unhandled exception; the shared connection handler (engine and router) reads it first."""
    async def go() -> None:
        async with routed() as (url, _, _server):
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            async with aiohttp.ClientSession() as s:
                for method, path, status in (("POST", "/health", 400), ("GET", "/health", 200),
                                             ("GET", "/metrics", 200)):
                    async with s.request(method, url + path, data=b"not gzip " * 100, headers=headers) as r:
                        assert r.status == status
                        if status >= 400:
                            assert (await r.json())["error_type"] == "invalid_body"  # forwarded: read first
    with caplog.at_level("DEBUG", logger="aiohttp"):
        run(go)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_client_leaving_after_the_last_event_is_not_an_error():
    """``end_stream`` (the engine's streams end with it) on a connection its client closed: no exception."""
    async def go() -> None:
        ended: asyncio.Future[web.StreamResponse] = asyncio.get_running_loop().create_future()

        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: [DONE]\n\n")
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)  # until the client has left
            try:
                ended.set_result(await end_stream(resp, b"data: late\n\n"))
            except Exception as exc:  # noqa: BLE001 - what the test is about
                ended.set_exception(exc)
            return resp

        app = web.Application()
        app.router.add_post("/s", handler)
        runner = web.AppRunner(app)  # no handler cancellation: the handler sees the closed connection
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.post(f"http://127.0.0.1:{sock.getsockname()[1]}/s")
                assert await r.content.readuntil(b"\n\n") == b"data: [DONE]\n\n"
                r.close()
            assert (await ended).prepared
        finally:
            await runner.cleanup()
    run(go)


# ---- real engines behind the router ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router-failures")


def test_a_non_streamed_request_whose_client_left_is_aborted_on_the_engine(data_dir):
    engine = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01")
    router = RouterProcess(engine.url)
    aborted = 'llm_serving_requests_total{outcome="aborted"}'
    try:
        async def go() -> None:
            before = (await metrics(engine.url)).get(aborted, 0.0)
            async with aiohttp.ClientSession() as s:
                task = asyncio.ensure_future(s.post(router.url + "/v1/completions",
                                                    json=long_completion(300, stream=False)))
                await wait_metric(engine.url, "llm_serving_running_batch_size", lambda v: v == 1, timeout=30)
                assert (await metrics(engine.url))["llm_serving_kv_blocks_used"] > 0
                task.cancel()
            m = await wait_metric(engine.url, aborted, lambda v: v == before + 1, timeout=30)
            assert m[aborted] == before + 1 and m["llm_serving_kv_blocks_used"] == 0
            assert m["llm_serving_running_batch_size"] == 0
        asyncio.run(go())
    finally:
        assert router.stop() == 0, router.lines
        assert engine.stop() == 0, engine.output
    assert "Traceback" not in "\n".join(router.lines) + engine.output


def test_fuzz_and_soak_through_the_router_give_no_5xx_and_only_json_errors(data_dir):
    """The reliability suite's router mode, short: hostile requests, then a soak whose clients partly leave
    mid-stream (their engine requests aborted: no KV block left on the engine)."""
    engine = ServerProcess(data_dir, "--standin-agents")
    router = RouterProcess(engine.url)
    try:
        ctx = Context(router.url, chaos.parse_args([
            "--url", router.url, "--fuzz-count", "200", "--fuzz-seed", "11", "--fuzz-concurrency", "4",
            "--fuzz-timeout", "120", "--fuzz-request-timeout", "30", "--soak-seconds", "3",
            "--soak-concurrency", "4", "--soak-request-timeout", "30", "--soak-seed", "2"]), log=lambda _m: None)
        figures = asyncio.run(chaos_fuzz.run(ctx))
        soak = asyncio.run(chaos_soak.run(ctx))
    finally:
        assert router.stop() == 0, router.lines
        assert engine.stop() == 0, engine.output
    assert figures["target"] == "router" and figures["sent"] == 200, figures
    assert figures["5xx"] == 0 and figures["non_json_errors"] == 0 and figures["hangs"] == 0, figures
    assert figures["unexpected_no_response"] == 0 and figures["4xx"] > 100 and figures["2xx"] > 0, figures
    assert figures["healthy_after"] == 1 and figures["kv_blocks_used_after"] == 0, figures
    assert soak["ok"] > 0 and soak["disconnects"] > 0 and soak["errors"] == soak["hangs"] == 0, soak
    assert soak["kv_blocks_used_after"] == 0 and soak["requests_in_flight_after"] == 0, soak
    assert "Traceback" not in "\n".join(router.lines) + engine.output
