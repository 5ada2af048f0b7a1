"""The serve process: a validated config -> engine + HTTP server, with a graceful drain (``llm-serving serve``).

Threads: the main thread starts the engine (model build, agent start-up and warm-up can take minutes) while
the HTTP server already runs on its own event-loop thread, so ``/health`` answers "loading" meanwhile.
A signal during start-up raises KeyboardInterrupt in the main thread; the agent pool cleans up on it.

SIGINT/SIGTERM once serving: stop accepting (listening socket closed, new requests on open connections get
503), let requests in flight finish for up to ``serving_config.drain_timeout_s``, abort what is left, stop
the agents (their shared memory is unlinked) and exit 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.server import Server
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.step_shape import step_rows
from llm_serving.front.api_key import exposure_warning
from llm_serving.protocol.wire import AgentSpec

if TYPE_CHECKING:
    from llm_serving.engine.loop import Engine  # imported when serving: it pulls in the agent pool

ABORT_GRACE_S = 5.0  # after aborting, how long handlers get to write their last frame
SHUTDOWN_TIMEOUT_S = 5.0  # aiohttp's wait for handlers when the runner is cleaned up


def log(message: str) -> None:
    print(f"[llm-serving {time.strftime('%H:%M:%S')}] {message}", flush=True)


class _HttpThread:
    """An asyncio loop on its own thread running the aiohttp app; ``call`` runs a coroutine there."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="llm-serving-http", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _listen(self, host: str, port: int) -> list[tuple[str, int]]:
        self.runner = self.server.make_runner(shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        try:
            await site.start()
        except OSError:
            await self.runner.cleanup()
            self.runner = None
            raise
        return [a[:2] for a in self.runner.addresses]

    def listen(self, host: str, port: int) -> list[tuple[str, int]]:
        return self.call(self._listen(host, port))

    async def _stop_listening(self) -> None:
        for site in list(self.runner.sites if self.runner else ()):
            await site.stop()

    async def _drain(self, timeout: float, force: threading.Event) -> bool:
        self.server.start_draining()
        await self._stop_listening()
        deadline = time.monotonic() + timeout
        while self.server.num_in_flight and time.monotonic() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
        return self.server.num_in_flight == 0

    def drain(self, timeout: float, force: threading.Event) -> bool:
        """Stop accepting and wait for requests in flight; False if some are still running."""
        return self.call(self._drain(timeout, force))

    def abort_all(self) -> int:
        async def abort() -> int:
            n = self.server.abort_all()
            await self.server.wait_idle(ABORT_GRACE_S)
            return n

        return self.call(abort())

    def close(self) -> None:
        if self.runner is not None:
            self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def _standin_pool_factory(step_delay_s: float) -> Any:
    """Stand-in agents that take ``step_delay_s`` per step (tests of disconnects, overload and drains)."""

    def factory(spec: AgentSpec) -> Any:
        from llm_serving.executor.agent_pool import AgentPool

        return AgentPool(dataclasses.replace(spec, step_delay_s=step_delay_s))

    return factory


def _write_steps(path: str, engine: Engine, config: ServingConfig) -> None:
    """The served steps as a step profile (the simulator's ``costs.load_profile`` reads it)."""
    stats, steps = engine.stats(), step_rows(engine.step_trace or [])
    body = {"model": str(engine.model.model_path), "config": config.source, "served": True,
            "num_blocks": int(stats["kv_blocks_total"]) + 1, "tensor_parallel": config.num_agents,
            "decode_buckets": list(config.model_config.decode_batch_size), "steps": steps}
    Path(path).write_text(json.dumps(body) + "\n")
    log(f"{len(steps)} steps recorded in {path}")


def serve(config: ServingConfig, standin_agents: bool = False, standin_step_delay: float = 0.0,
          record_steps: str | None = None) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status (0 after a clean drain, 1 when start-up fails).
    ``record_steps``: a file to write every step's shape and time to when stopping (a step profile for the
    simulator, ``llm-serving profile``)."""
    from llm_serving.engine.loop import Engine  # the engine pulls in the agent pool only when serving

    if standin_agents and standin_step_delay > 0:
        engine = Engine(config, standin_agents=True, pool_factory=_standin_pool_factory(standin_step_delay))
    else:
        engine = Engine.from_config(config, standin_agents=standin_agents)
    server = Server(engine, config)
    sc = config.serving_config
    http = _HttpThread(server)
    try:
        addresses = http.listen(sc.server_ip, sc.server_port)
    except OSError as exc:
        http.close()
        print(f"error: cannot listen on {sc.server_ip}:{sc.server_port}: {exc}", file=sys.stderr, flush=True)
        return 1
    host, port = addresses[0]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    log(f"listening on {url} (config {config.source}); /health says ready once the model is up")
    if warning := exposure_warning(sc.server_ip, sc.api_key):
        log(warning)

    stop, force = threading.Event(), threading.Event()
    starting = True

    def on_signal(signum: int, _frame: Any) -> None:
        if starting:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        if stop.is_set():
            force.set()
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            t0 = time.monotonic()
            engine.start(progress=log)
            log(f"chat template: {server.chat_template().origin}")  # a bad one fails start-up here
            starting = False
        except KeyboardInterrupt as exc:
            starting = False
            log(f"{exc or 'interrupted'} during start-up: stopping")
            server.mark_failed("interrupted during start-up")
            engine.shutdown()
            return 0
        except Exception as exc:  # noqa: BLE001 - any start-up failure ends the command with its message
            starting = False
            server.mark_failed(str(exc))
            engine.shutdown()
            print(f"error: start-up failed: {exc}", file=sys.stderr, flush=True)
            return 1
        gc.collect()
        gc.freeze()  # start-up's objects out of the cyclic GC's walks between steps, as in the agents
        if record_steps:
            engine.step_trace = []
        server.mark_ready()
        names = ", ".join(server.names)
        log(f"ready in {time.monotonic() - t0:.1f}s: model {config.model_config.model_name} at {url} "
            f"(names: {names}); POST /models/<name>/generate[_stream], POST /v1/completions, "
            f"POST /v1/chat/completions, GET /v1/models, /health, /metrics")
        while not stop.wait(0.5):
            if engine.state == "failed":  # the agents could not be replaced: a process supervisor takes over
                server.mark_failed(str(engine.error))
                print(f"error: the engine failed: {engine.error}; exiting with status 1", file=sys.stderr,
                      flush=True)
                engine.shutdown()
                return 1
        log(f"signal received: draining {server.num_in_flight} request(s) for up to {sc.drain_timeout_s:g}s "
            "(signal again to abort them now)")
        if not http.drain(sc.drain_timeout_s, force):
            log(f"aborting {http.abort_all()} request(s) still running")
        engine.shutdown()
        if record_steps:
            _write_steps(record_steps, engine, config)
        log("stopped")
        return 0
    finally:
        if starting:
            engine.shutdown()
        http.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
