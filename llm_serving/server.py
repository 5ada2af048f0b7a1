"""The HTTP API (aiohttp) on top of an ``Engine``: llm-serving routes, OpenAI completions, health, metrics.

Routes:
- ``POST /models/<name>/generate`` and ``/models/<name>/generate_stream``: the TGI-style body of MindSpore
  llm-serving (see ``api_schema``). The model answers under ``model_config.model_name`` and every alias.
  Streams are one JSON object per line, or Server-Sent Events when the client sends
  ``Accept: text/event-stream`` or ``"sse": true`` (body, parameters or ``?sse=true``).
- ``POST /v1/completions`` and ``GET /v1/models``: the OpenAI API (streams are SSE ending ``data: [DONE]``).
- ``GET /health``: 200 when ready, 503 while loading, draining or after an engine failure.
- ``GET /metrics``: Prometheus text (``metrics``).

Every error is JSON ``{"error": message, "error_type": tag}`` (the OpenAI routes nest the message as OpenAI
clients expect: ``{"error": {"message", "type", "param", "code"}, "error_type": tag}``). A client that
disconnects aborts its request, which frees its KV blocks at once; that needs the handler to be cancelled
on disconnect, so run the app with ``make_runner`` (``handler_cancellation=True``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llm_serving.api_schema import (
    ApiError,
    CompletionRequest,
    GenerateRequest,
    Limits,
    SamplingOptions,
    parse_completion,
    parse_generate,
    parse_json,
)
from llm_serving.config import ServingConfig
from llm_serving.metrics import CONTENT_TYPE, ServerMetrics
from llm_serving.request_stream import NO_TOKEN, EngineError, QueueFull, RequestStream
from llm_serving.scheduler import RequestRejected
from llm_serving.stop_strings import StopMatcher

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
OFFLOAD_ENCODE_CHARS = 1 << 16  # longer prompts are tokenized off the event loop
STREAM_RETRY_MS = 30000
# finish reasons as each API names them (TGI for the llm-serving body, OpenAI for /v1)
TGI_FINISH = {"eos": "eos_token", "length": "length", "stop": "stop_sequence", "abort": "abort"}
OPENAI_FINISH = {"eos": "stop", "length": "length", "stop": "stop", "abort": "abort"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class TokenInfo:
    id: int
    logprob: float
    text: str  # text this token released (stop strings trimmed): the texts concatenate to the answer
    special: bool

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "logprob": self.logprob, "text": self.text, "special": self.special}


@dataclass
class Piece:
    """One engine event as the client sees it: released text, its token (None for a tokenless end)."""

    text: str
    token: TokenInfo | None
    finish_reason: str | None  # engine naming: eos, length, stop, abort


@dataclass
class Outcome:
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


class ClientGone(Exception):
    """The client closed the connection while its answer was being written."""


class Generation:
    """One admitted request: engine events -> pieces, with stop strings, metrics and abort on early exit."""

    def __init__(self, server: Server, stream: RequestStream, stops: tuple[str, ...], arrival: float) -> None:
        self.server, self.stream = server, stream
        self.matcher = StopMatcher(stops)
        self.arrival = arrival
        self.prompt_len = len(stream.prompt_ids)
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._last_token_time: float | None = None
        self._closed = False
        self.failed = False  # the engine failed while serving it

    async def pieces(self) -> AsyncIterator[Piece]:
        """The request's pieces, in order; the last one has a finish_reason. Iterate once."""
        metrics, tok = self.server.metrics, self.server.engine.tokenizer
        try:
            async for ev in self.stream:
                now = time.monotonic()
                token = None
                if ev.token_id != NO_TOKEN:
                    self.num_tokens += 1
                    metrics.generation_tokens += 1
                    if self._last_token_time is None:
                        metrics.ttft.observe(now - self.arrival)
                    else:
                        metrics.tpot.observe(now - self._last_token_time)
                    self._last_token_time = now
                text = self.matcher.feed(ev.text)
                reason = ev.finish_reason
                if ev.finished:
                    text += self.matcher.flush()
                elif self.matcher.stopped:
                    reason = "stop"
                    self.server.engine.finish(self.stream.request_id, "stop")  # frees its blocks now
                if ev.token_id != NO_TOKEN:
                    token = TokenInfo(ev.token_id, ev.logprob, text, tok.is_special(ev.token_id))
                if reason is not None:
                    self.finish_reason = reason
                yield Piece(text, token, reason)
                if reason is not None:
                    return
        except EngineError:
            self.failed = True
            raise
        finally:
            self.close()

    def close(self, record: bool = True) -> None:
        """End the request's bookkeeping (idempotent); aborts it in the engine if it has not finished.

        ``record=False`` leaves the outcome to the caller (a multi-prompt request refused as a whole).
        """
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.stream.abort()  # the consumer went away (disconnect, error): free the blocks now
        self.server.metrics.in_flight -= 1
        self.server._streams.discard(self.stream)
        if record:
            self._record()

    async def collect(self) -> Outcome:
        out = Outcome()
        parts = []
        async for piece in self.pieces():
            parts.append(piece.text)
            if piece.token is not None:
                out.tokens.append(piece.token)
            out.finish_reason = piece.finish_reason
        out.text = "".join(parts)
        return out

    def _record(self) -> None:
        m = self.server.metrics
        reason = self.finish_reason
        if self.failed:
            m.requests.inc("error")
        elif reason is None or reason == "abort":
            m.requests.inc("aborted")
            m.finish_reasons.inc("abort")
        else:
            m.requests.inc("success")
            m.finish_reasons.inc(reason)
            if self._last_token_time is not None:
                m.e2e.observe(self._last_token_time - self.arrival)


class Server:
    """Owns the aiohttp application; ``state`` is "loading", "ready", "draining" or "failed"."""

    def __init__(self, engine: Any, config: ServingConfig, metrics: ServerMetrics | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.limits = Limits.from_config(config)
        self.model_name = config.model_config.model_name
        self.names = config.model_names
        self.max_body_bytes = max_body_bytes
        self.state = "loading"
        self.failure: str | None = None
        self.created = int(time.time())
        self._streams: set[RequestStream] = set()
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
        return self.metrics.in_flight

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.metrics.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def abort_all(self) -> int:
        """Abort every request in flight (their clients get finish_reason "abort"); returns how many."""
        streams = list(self._streams)
        for s in streams:
            s.abort()
        return len(streams)

    def make_runner(self) -> web.AppRunner:
        return web.AppRunner(self.app, handler_cancellation=True, access_log=None)

    # ---- app -----------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._json_errors])
        app.router.add_post("/models/{model_name}/generate", self._guard(self.generate, "llm"))
        app.router.add_post("/models/{model_name}/generate_stream", self._guard(self.generate_stream, "llm"))
        app.router.add_post("/v1/completions", self._guard(self.completions, "openai"))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own errors (unknown route, wrong method, oversized body) as JSON too."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status,
                                                                                               "http_error")
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 405:
                message += f" (allowed: {exc.headers.get('Allow', '')})"
            return _error_response(ApiError(exc.status, message, kind), request.path.startswith("/v1/"))

    def _guard(self, handler: Handler, api: str) -> Handler:
        """Turn ApiErrors into JSON error responses and count refused requests by outcome."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as err:
                outcome = "overloaded" if err.status == 503 else "rejected" if err.status < 500 else "error"
                self.metrics.requests.inc(outcome)
                return _error_response(err, api == "openai")
            except Exception as exc:  # a bug must not take the server down: log it, answer 500
                log.exception("%s %s failed", request.method, request.path)
                self.metrics.requests.inc("error")
                err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
                return _error_response(err, api == "openai")

        return guarded

    # ---- shared steps ----------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_name
        if name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here; served names: {', '.join(self.names)}",
                           "model_not_found", "model")
        return name

    def _check_accepting(self) -> None:
        if self.state == "ready" and self.engine.ready:
            return
        if self.state == "loading":
            raise ApiError(503, "the model is still loading; retry when /health says ready", "not_ready")
        if self.state == "draining":
            raise ApiError(503, "the server is shutting down", "unavailable")
        raise ApiError(503, f"the engine has failed: {self.failure or 'an agent stopped'}", "engine_error")

    async def _read_body(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise _too_large(request.content_length, self.max_body_bytes)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, self.max_body_bytes) from None
        return parse_json(raw)

    async def _prepare(self, prompt: str | tuple[int, ...], requested: int | None) -> tuple[list[int], int]:
        """Tokenize and size one generation: (prompt ids, max_new_tokens); raises ApiError if it cannot run."""
        self._check_accepting()
        tok = self.engine.tokenizer
        if isinstance(prompt, str) and len(prompt) > OFFLOAD_ENCODE_CHARS:
            ids = await asyncio.get_running_loop().run_in_executor(None, tok.encode, prompt)
        elif isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            bad = [t for t in prompt if t >= tok.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                                    f"0..{tok.vocab_size - 1}", "invalid_request", "prompt")
            ids = list(prompt)
        return ids, self.limits.new_token_budget(len(ids), requested)

    def _queue(self, ids: list[int], budget: int, sampling: SamplingOptions, stops: tuple[str, ...],
               arrival: float, ignore_eos: bool = False, request_id: str | None = None) -> Generation:
        """Submit a prepared generation to the engine."""
        rid = request_id or f"gen-{uuid.uuid4().hex[:16]}"
        try:
            stream = self.engine.submit(ids, sampling.to_params(budget, ignore_eos), rid)
        except QueueFull as exc:
            raise ApiError(503, f"the server is overloaded: {exc}", "overloaded") from None
        except RequestRejected as exc:
            raise ApiError(400, str(exc), "invalid_request") from None
        except EngineError as exc:
            raise ApiError(503, str(exc), "engine_error") from None
        self.metrics.in_flight += 1
        self.metrics.prompt_tokens += len(ids)
        self._streams.add(stream)
        return Generation(self, stream, stops, arrival)

    # ---- llm-serving routes ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream_route=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream_route=True)

    async def _generate(self, request: web.Request, stream_route: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        self._check_model(request.match_info["model_name"])
        body = await self._read_body(request)
        req = parse_generate(body, self.limits, stream=True if stream_route else None)
        ids, budget = await self._prepare(req.inputs, req.max_new_tokens)
        gen = self._queue(ids, budget, req.sampling, req.stop, arrival)
        try:
            if req.stream:
                return await self._stream_llm(request, gen, req)
            out = await _engine_errors(gen.collect())
        finally:
            gen.close()
        data: dict[str, Any] = {
            "generated_text": out.text, "finish_reason": TGI_FINISH[out.finish_reason],
            "generated_tokens": len(out.tokens), "prompt_tokens": gen.prompt_len,
            "tokens": [t.to_json() for t in out.tokens],
        }
        if req.details:
            data["details"] = self._details(req, out.finish_reason, len(out.tokens), out.tokens)
        return _json(data)

    async def _stream_llm(self, request: web.Request, gen: Generation, req: GenerateRequest) -> web.StreamResponse:
        sse = req.sse or _wants_sse(request)
        resp = await _open_stream(request, "text/event-stream" if sse else "application/x-ndjson")

        def frame(obj: dict[str, Any]) -> bytes:
            text = json.dumps(obj, ensure_ascii=False)
            return (f"data: {text}\n\n" if sse else f"{text}\n").encode()

        def message(text: str, tokens: Any, details: Any) -> bytes:
            return frame({"event": "message", "retry": STREAM_RETRY_MS,
                          "data": [{"generated_text": text, "tokens": tokens, "details": details}]})

        parts: list[str] = []
        try:
            async for piece in gen.pieces():  # a tokenless piece is a server-side abort: shown too
                parts.append(piece.text)
                details = (self._details(req, piece.finish_reason, gen.num_tokens)
                           if req.details and piece.finish_reason else None)
                tokens = piece.token.to_json() if piece.token else None
                await _write(resp, message(piece.text, tokens, details))
            if req.return_full_text:
                details = self._details(req, gen.finish_reason, gen.num_tokens) if req.details else None
                await _write(resp, message("".join(parts), None, details))
        except EngineError as exc:
            await _write(resp, frame({"error": str(exc), "error_type": "engine_error"}))
        except ClientGone:
            return resp
        await resp.write_eof()
        return resp

    def _details(self, req: GenerateRequest, reason: str | None, n: int,
                 tokens: list[TokenInfo] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"finish_reason": TGI_FINISH.get(reason or "abort"), "generated_tokens": n,
                             "seed": req.sampling.seed}
        if tokens is not None:
            d["tokens"] = [t.to_json() for t in tokens]
        return d

    # ---- OpenAI routes ---------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._read_body(request)
        req = parse_completion(body, self.limits)
        model = self._check_model(req.model)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        prepared = [await self._prepare(p, req.max_tokens) for p in req.prompts]  # refuse before queueing any
        gens: list[Generation] = []
        try:
            for i, (ids, budget) in enumerate(prepared):
                gens.append(self._queue(ids, budget, req.sampling, req.stop, arrival, req.ignore_eos,
                                        f"{cid}-{i}"))
        except ApiError:
            for g in gens:  # all or nothing: the request is counted once, as refused
                g.close(record=False)
            raise
        try:
            meta = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
            echoes = [self._echo_text(req, p) for p in req.prompts]
            if req.stream:
                return await self._stream_openai(request, gens, req, meta, echoes)
            outs = await _engine_errors(asyncio.gather(*(g.collect() for g in gens)))
        finally:
            for g in gens:  # a failed or abandoned choice ends the others too
                g.close()
        choices = []
        for i, (g, out, echo) in enumerate(zip(gens, outs, echoes)):
            lp = _openai_logprobs(self.engine.tokenizer, out.tokens, len(echo), req.logprobs)
            choices.append({"index": i, "text": echo + out.text, "logprobs": lp,
                            "finish_reason": OPENAI_FINISH[out.finish_reason]})
        return _json({**meta, "choices": choices, "usage": _usage(gens)})

    async def _stream_openai(self, request: web.Request, gens: list[Generation], req: CompletionRequest,
                             meta: dict[str, Any], echoes: list[str]) -> web.StreamResponse:
        resp = await _open_stream(request, "text/event-stream")
        tok = self.engine.tokenizer

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return f"data: {json.dumps({**meta, 'choices': choices, **extra}, ensure_ascii=False)}\n\n".encode()

        offsets = [len(e) for e in echoes]
        try:
            for i, echo in enumerate(echoes):
                if echo:
                    await _write(resp, chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]))
            async for i, piece in _merge([g.pieces() for g in gens]):
                tokens = [piece.token] if piece.token else []
                lp = _openai_logprobs(tok, tokens, offsets[i], req.logprobs)
                offsets[i] += len(piece.text)
                reason = OPENAI_FINISH[piece.finish_reason] if piece.finish_reason else None
                await _write(resp, chunk([{"index": i, "text": piece.text, "logprobs": lp, "finish_reason": reason}]))
            if req.include_usage:
                await _write(resp, chunk([], usage=_usage(gens)))
            await _write(resp, b"data: [DONE]\n\n")
        except EngineError as exc:
            err = {"error": {"message": str(exc), "type": "engine_error", "param": None, "code": None}}
            await _write(resp, f"data: {json.dumps(err)}\n\n".encode())
        except ClientGone:
            return resp
        await resp.write_eof()
        return resp

    def _echo_text(self, req: CompletionRequest, prompt: str | tuple[int, ...]) -> str:
        if not req.echo:
            return ""
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "llm-serving",
                 "root": self.model_name, "max_model_len": self.limits.max_model_len} for name in self.names]
        return _json({"object": "list", "data": data})

    # ---- operations ------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        state = self.state
        if state == "ready" and not self.engine.ready:
            state = "failed"
        body: dict[str, Any] = {"status": state, "model": self.model_name}
        if state == "failed":
            body["error"] = self.failure or "the engine stopped (an agent exited); see the server log"
        return _json(body, status=200 if state == "ready" else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        stats = self.engine.stats() if self.state != "loading" else None
        return web.Response(body=self.metrics.render(stats).encode(), headers={"Content-Type": CONTENT_TYPE})


# ---- helpers ---------------------------------------------------------------------------------------------
def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=_dumps)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def _error_response(err: ApiError, openai: bool) -> web.Response:
    if openai:
        body: dict[str, Any] = {"error": {"message": err.message, "type": err.error_type, "param": err.param,
                                          "code": err.status}, "error_type": err.error_type}
    else:
        body = {"error": err.message, "error_type": err.error_type}
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return _json(body, status=err.status, headers=headers)


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(413, f"the request body is too large{got}; the limit is {limit} bytes", "payload_too_large")


def _wants_sse(request: web.Request) -> bool:
    if "text/event-stream" in request.headers.get("Accept", ""):
        return True
    return request.query.get("sse", "").lower() in ("1", "true", "yes")


async def _open_stream(request: web.Request, content_type: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": f"{content_type}; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionResetError, ConnectionError) as exc:
        raise ClientGone(str(exc)) from None


async def _engine_errors(awaitable: Awaitable[Any]) -> Any:
    """An engine failure during a non-streamed request becomes a 503 JSON error."""
    try:
        return await awaitable
    except EngineError as exc:
        raise ApiError(503, f"the engine failed while serving the request: {exc}", "engine_error") from None


async def _merge(iters: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(iters) == 1:
        async for item in iters[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()  # the generator's own cleanup (Generation.close) aborts its request


def _usage(gens: list[Generation]) -> dict[str, int]:
    prompt = sum(g.prompt_len for g in gens)
    completion = sum(g.num_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _openai_logprobs(tok: Any, tokens: list[TokenInfo], offset: int, want: int | None) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object; greedy's top-1 alternative is the chosen token itself."""
    if want is None:
        return None
    names, offsets = [], []
    for t in tokens:
        names.append(tok.token_text(t.id))
        offsets.append(offset)
        offset += len(t.text)
    top = [{n: t.logprob} for n, t in zip(names, tokens)] if want >= 1 else None
    return {"tokens": names, "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top,
            "text_offset": offsets}
