"""The llm-serving (TGI-style) routes: ``POST /models/<name>/generate`` and ``/models/<name>/generate_stream``.

The body is MindSpore llm-serving's (see ``schema``); the model answers under
``model_config.model_name`` and every alias. ``generate`` answers one JSON object; streams are one JSON
object per line, or Server-Sent Events when the client sends ``Accept: text/event-stream`` or ``"sse": true``
(body, parameters or ``?sse=true``). Each stream line is ``{"event": "message", "retry": ms, "data": [...]}``
as the contest's client reads it.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.generation import Generation, TokenInfo
from llm_serving.api.responses import (
    ClientGone,
    end_stream,
    engine_errors,
    engine_failure,
    open_stream,
    write,
)
from llm_serving.api.schema import GenerateRequest, parse_generate
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.errors import json_response

if TYPE_CHECKING:
    from llm_serving.api.route_context import RouteContext

STREAM_RETRY_MS = 30000
# finish reasons as this API names them (TGI's), for each of sequence.FINISH_REASONS
TGI_FINISH = {"eos": "eos_token", "length": "length", "stop": "stop_sequence", "abort": "abort"}


class TgiRoutes:
    """The handlers; ``server`` admits the requests."""

    def __init__(self, server: RouteContext) -> None:
        self.server = server

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream_route=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream_route=True)

    async def _generate(self, request: web.Request, stream_route: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        server = self.server
        model = server.check_model(request.match_info["model_name"])
        req = parse_generate(await server.read_body(request), stream=True if stream_route else None)
        max_new = req.max_new_tokens if req.max_new_tokens is not None else server.default_max_new_tokens
        params = req.sampling.to_params(max_new, stop=req.stop, field_names=req.FIELD_NAMES)
        ids = await server.tokenize(req.inputs)
        gen = server.start_generation(ids, params, arrival, req.FIELD_NAMES, model=model)
        try:
            if req.stream:
                return await self._stream(request, gen, req)
            answer = await engine_errors(gen.collect())
        finally:
            gen.close()
        data: dict[str, Any] = {
            "generated_text": answer.text, "finish_reason": TGI_FINISH[answer.finish_reason],
            "generated_tokens": len(answer.tokens), "prompt_tokens": gen.prompt_len,
            "tokens": [t.to_json() for t in answer.tokens],
        }
        if req.details:
            data["details"] = _details(req, answer.finish_reason, len(answer.tokens), answer.tokens)
        return json_response(data)

    async def _stream(self, request: web.Request, gen: Generation, req: GenerateRequest) -> web.StreamResponse:
        sse = req.sse or _wants_sse(request)
        resp = await open_stream(request, "text/event-stream" if sse else "application/x-ndjson")

        def frame(obj: dict[str, Any]) -> bytes:
            text = json.dumps(obj, ensure_ascii=False)
            return (f"data: {text}\n\n" if sse else f"{text}\n").encode()

        def message(text: str, tokens: Any, details: Any) -> bytes:
            return frame({"event": "message", "retry": STREAM_RETRY_MS,
                          "data": [{"generated_text": text, "tokens": tokens, "details": details}]})

        parts: list[str] = []
        try:
            async for delta in gen.deltas():  # a tokenless delta is a server-side abort: shown too
                parts.append(delta.text)
                details = (_details(req, delta.finish_reason, gen.num_tokens)
                           if req.details and delta.finish_reason else None)
                tokens = delta.token.to_json() if delta.token else None
                await write(resp, message(delta.text, tokens, details))
            if req.return_full_text:
                details = _details(req, gen.finish_reason, gen.num_tokens) if req.details else None
                await write(resp, message("".join(parts), None, details))
        except EngineError as exc:
            err = engine_failure(exc)
            return await end_stream(resp, frame({"error": err.message, "error_type": err.error_type}))
        except ClientGone:
            return resp
        return await end_stream(resp)


def _details(req: GenerateRequest, reason: str | None, n: int,
             tokens: list[TokenInfo] | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"finish_reason": TGI_FINISH.get(reason or "abort"), "generated_tokens": n,
                         "seed": req.sampling.seed}
    if tokens is not None:
        d["tokens"] = [t.to_json() for t in tokens]
    return d


def _wants_sse(request: web.Request) -> bool:
    if "text/event-stream" in request.headers.get("Accept", ""):
        return True
    return request.query.get("sse", "").lower() in ("1", "true", "yes")
