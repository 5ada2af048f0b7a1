"""The HTTP server (aiohttp) on top of an ``Engine``: the app, its state, and what every route shares.

Routes (each group in its own module):
- ``POST /models/<name>/generate`` and ``/models/<name>/generate_stream``: the llm-serving body
  (``tgi_routes``).
- ``POST /v1/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}``: the OpenAI API (``openai_routes``).
- ``POST /v1/chat/completions``: OpenAI chat, messages rendered by the model's chat template (``chat_routes``).
- ``GET /health``: 200 when ready, 503 while loading, recovering (agents being replaced), draining or after
  an engine failure; the agents' process ids with it.
- ``GET /metrics``: Prometheus text (``metrics``).
- ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters at run time (``lora_routes``).

A request's model (the OpenAI body's ``model``, the llm-serving route's name) is the base model under any of its
names, or a LoRA adapter the engine serves (``lora``), which then computes it (``check_model``, ``start_generation``).

The server admits requests for the routes: it refuses them unless ready, reads the body within its size
limit (declared JSON, readable, no deeper than any request needs: ``guards``, which also checks the API
key when one is configured), tokenizes (long prompts off the event loop) and submits to the engine, whose
admission check (``engine.admission``) is the one check of the request's limits; every refusal becomes a JSON error
naming the field as the route's API calls it, counted by outcome in the metrics. A client that disconnects
aborts its request, which frees its KV blocks at once; that needs the handler to be cancelled on disconnect,
so run the app with ``make_runner`` (``handler_cancellation=True``, and the HTTP parser's errors as JSON).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.chat_routes import ChatRoutes
from llm_serving.api.generation import Generation
from llm_serving.api.guards import read_json_body
from llm_serving.api.kv_transfer_routes import KvTransferRoutes
from llm_serving.api.lora_routes import LoraRoutes
from llm_serving.api.metrics import CONTENT_TYPE, ServerMetrics
from llm_serving.api.openai_routes import OpenAIRoutes
from llm_serving.api.route_context import OFFLOAD_ENCODE_CHARS
from llm_serving.api.schema import parameter_error
from llm_serving.api.tgi_routes import TgiRoutes
from llm_serving.api.tokenizer_routes import TokenizerRoutes
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.api_key import api_key_middleware
from llm_serving.front.errors import error_response, json_http_errors, json_response
from llm_serving.front.guards import JsonErrorRunner
from llm_serving.request_errors import ApiError, InvalidParameter, ModelNotFound, QueueFull, RequestRejected
from llm_serving.tokenization.chat_template import ChatTemplate
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer

if TYPE_CHECKING:
    from llm_serving.engine.loop import Engine  # imported by the caller: it pulls in the agent pool

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Server:
    """Owns the aiohttp application; ``state`` is "loading", "ready", "draining" or "failed". The routes see it
    as a ``route_context.RouteContext``."""

    def __init__(self, engine: Engine, config: ServingConfig, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_config.model_name
        self.names = config.model_names
        self.default_max_new_tokens = config.model_config.max_generate_length  # when a body names none
        self.max_body_bytes = max_body_bytes
        self.state = "loading"
        self.failure: str | None = None
        self.created = int(time.time())
        self._live: set[Generation] = set()  # generations in flight
        self.metrics = ServerMetrics(self._engine_stats, lambda: len(self._live), self.model_name)
        self.app = self._build_app()

    # ---- lifecycle (used by serve) -------------------------------------------------------------------
    def mark_ready(self) -> None:
        self.state = "ready"

    def mark_failed(self, message: str) -> None:
        self.state, self.failure = "failed", message

    def start_draining(self) -> None:
        """Refuse new requests from now on; requests in flight go on."""
        if self.state != "failed":
            self.state = "draining"

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._live:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def abort_all(self) -> int:
        """Abort every request in flight (their clients get finish_reason "abort"); returns how many."""
        generations = list(self._live)
        for g in generations:
            g.abort()
        return len(generations)

    def make_runner(self, **kwargs: Any) -> web.AppRunner:
        """The runner to serve ``app`` with: handlers cancelled on disconnect, parser errors as JSON."""
        return JsonErrorRunner(self.app, handler_cancellation=True, access_log=None, **kwargs)

    # ---- app -----------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        tgi, openai = TgiRoutes(self), OpenAIRoutes(self)
        sc = self.config.serving_config
        self.kv_transfer = KvTransferRoutes(self.engine, sc.kv_transfer, self.metrics.kv_fetches, sc.api_key,
                                            peers=sc.kv_transfer_peers)
        guards = [m for m in (api_key_middleware(self.config.serving_config.api_key),) if m is not None]
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[json_http_errors, *guards])
        app.router.add_post("/models/{model_name}/generate", self._guard(tgi.generate, "llm"))
        app.router.add_post("/models/{model_name}/generate_stream", self._guard(tgi.generate_stream, "llm"))
        app.router.add_post("/v1/completions", self._guard(openai.completions, "openai"))
        self.chat = ChatRoutes(self)
        app.router.add_post("/v1/chat/completions", self._guard(self.chat.chat_completions, "openai"))
        tokenizer = TokenizerRoutes(self)
        app.router.add_post("/tokenize", tokenizer.tokenize)
        app.router.add_post("/detokenize", tokenizer.detokenize)
        app.router.add_get("/tokenizer_info", tokenizer.tokenizer_info)
        app.router.add_get("/v1/models", openai.models)
        app.router.add_get("/v1/models/{model_id:.+}", openai.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        lora = LoraRoutes(self.engine, self.config.lora.allow_runtime_updates, self.read_body, self.check_accepting)
        app.router.add_post("/v1/load_lora_adapter", self._guard(lora.load, "openai"))
        app.router.add_post("/v1/unload_lora_adapter", self._guard(lora.unload, "openai"))
        app.router.add_get("/v1/kv_transfer/{transfer_id}", self.kv_transfer.fetch)
        app.router.add_delete("/v1/kv_transfer/{transfer_id}", self.kv_transfer.release)
        app.on_cleanup.append(self.kv_transfer.close)
        return app

    def _guard(self, handler: Handler, api: str) -> Handler:
        """Turn ApiErrors into JSON error responses and count refused requests by outcome."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as err:
                outcome = ("overloaded" if err.error_type == "overloaded" else "rejected" if err.status < 500
                           else "error")
                self.metrics.requests.labels(outcome).inc()
                return error_response(err, api == "openai")
            except Exception as exc:  # a bug must not take the server down: log it, answer 500
                log.exception("%s %s failed", request.method, request.path)
                self.metrics.requests.labels("error").inc()
                internal = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
                return error_response(internal, api == "openai")

        return guarded

    # ---- the served model and admitting requests (the routes' RouteContext) -------------------------------
    @property
    def tokenizer(self) -> AnyTokenizer:
        return self.engine.tokenizer

    @property
    def model_path(self) -> Path:
        """The served model's directory or checkpoint (known once the engine has started)."""
        return self.engine.model.model_path

    def chat_template(self) -> ChatTemplate:
        """The served model's chat template: the engine's, loaded on first use after it started (ConfigError)."""
        return self.engine.chat_template.get()

    def check_model(self, name: str | None) -> str:
        """The served name a request asks for (the main one when it names none): the base model's or a LoRA
        adapter's (``adapters``); 404 if not served here."""
        if name is None:
            return self.model_name
        if name not in self.names and name not in self.adapters:
            raise ApiError(404, f"model {name!r} is not served here; served names: "
                                f"{', '.join((*self.names, *self.adapters))}", "model_not_found", "model")
        return name

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served now: name -> directory (none without ``lora.enable``)."""
        registry = self.engine.adapters
        return {} if registry is None else {a.name: a.path for a in registry.adapters}

    async def read_body(self, request: web.Request) -> Any:
        """The request's JSON body within ``max_body_bytes`` (declared JSON, readable: ``guards``)."""
        return await read_json_body(request, self.max_body_bytes)

    async def tokenize(self, prompt: str | tuple[int, ...]) -> list[int]:
        """The prompt's token ids (ids as sent; their range is the engine's to check); 503 unless serving."""
        self.check_accepting()
        if not isinstance(prompt, str):
            return list(prompt)
        tok = self.tokenizer
        if len(prompt) > OFFLOAD_ENCODE_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, tok.encode, prompt)
        return tok.encode(prompt)

    def start_generation(self, ids: list[int], params: SamplingParams, arrival: float,
                         field_names: Mapping[str, str], request_id: str | None = None,
                         clip: bool = True, follows: str | None = None, model: str | None = None) -> Generation:
        """Submit a tokenized request; the engine's refusals become ApiErrors, fields named as
        ``field_names`` (the route's API) calls them. With ``clip``, a max_new_tokens beyond the context left after
        the prompt is clipped to it, the answer then ending with finish reason "length" (as the config documents
        for the llm-serving route, and for an OpenAI request that sent no max_tokens); without, it is a 400 with
        the numbers, as vLLM answers an explicit one. ``follows``: the request id of another choice of the same
        prompt (OpenAI's ``n``), whose prompt KV blocks this one shares (``Scheduler.add``). ``model``: the name
        ``check_model`` gave; an adapter's computes the request with it.
        """
        rid = request_id or f"gen-{uuid.uuid4().hex[:16]}"
        try:
            adapter = model if model is not None and model not in self.names else None
            stream = self.engine.submit(ids, params, rid, clip_to_context=clip, follows=follows, adapter=adapter)
        except InvalidParameter as exc:  # the admission check: a limit of the configuration
            raise parameter_error(exc, field_names) from None
        except ModelNotFound as exc:  # unloaded since check_model
            raise ApiError(404, str(exc), "model_not_found", "model") from None
        except QueueFull as exc:
            err = ApiError(503, f"the server is overloaded: {exc}", "overloaded")
            err.retry_after = exc.retry_after
            raise err from None
        except RequestRejected as exc:
            raise ApiError(400, str(exc), "invalid_request") from None
        except EngineError as exc:
            raise ApiError(503, str(exc), "engine_error") from None
        self.metrics.prompt_tokens.inc(len(ids))
        return Generation(stream, self.tokenizer, self.metrics, arrival, self._live)

    def check_accepting(self) -> None:
        """503 unless ready to serve (loading, recovering, draining, failed)."""
        if self.state == "ready" and self.engine.ready:
            return
        if self.state == "loading":
            raise ApiError(503, "the model is still loading; retry when /health says ready", "not_ready")
        if self.state == "draining":
            raise ApiError(503, "the server is shutting down", "unavailable")
        if self.engine.state == "recovering":
            raise ApiError(503, f"the agents are being restarted after a failure ({self.engine.last_failure}); "
                                "retry shortly", "recovering")
        raise ApiError(503, f"the engine has failed: {self.failure or 'an agent stopped'}", "engine_error")

    # ---- operations ------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        state = self.state
        if state == "ready" and not self.engine.ready:
            state = "recovering" if self.engine.state == "recovering" else "failed"
        body: dict[str, Any] = {"status": state, "model": self.model_name,
                                "agent_pids": self.engine.agent_pids}
        standby = self.engine.standby
        if standby is not None:
            body["standby"] = standby
        if state == "failed":
            body["error"] = self.failure or "the engine stopped (an agent exited); see the server log"
        elif state == "recovering":
            body["error"] = f"restarting the agents after: {self.engine.last_failure}"
        return json_response(body, status=200 if state == "ready" else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _engine_stats(self) -> Mapping[str, Any] | None:
        return self.engine.stats() if self.state != "loading" else None
