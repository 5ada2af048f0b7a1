"""vLLM's runtime adapter routes: ``POST /v1/load_lora_adapter {lora_name, lora_path}`` and
``POST /v1/unload_lora_adapter {lora_name}``, served only with ``lora.allow_runtime_updates`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loading reads any directory the server can see. Refused otherwise with a 404,
as vLLM, whose routes do not exist then, answers.

Unloading an adapter that requests still use is deferred, not refused: the name stops being served at once (new
requests for it are a 404, ``/v1/models`` drops it) and the requests that chose it finish with it; its slot is
reused once none holds it (``core.adapters``). Refusing would make a client wait for traffic it does not control
to stop, and failing those requests is never an option.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.front.errors import json_response
from llm_serving.protocol.lora import AdapterError
from llm_serving.request_errors import ApiError, ModelNotFound

if TYPE_CHECKING:
    from llm_serving.engine.loop import Engine


class LoraRoutes:
    """The two handlers over ``engine``'s adapters; ``allowed``: ``lora.allow_runtime_updates``."""

    def __init__(self, engine: Engine, allowed: bool, read_body: Any, check_accepting: Any) -> None:
        self.engine = engine
        self.allowed = allowed
        self._read_body = read_body
        self._check_accepting = check_accepting

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        try:
            adapter = self.engine.load_adapter(name, path)
        except AdapterError as exc:
            raise ApiError(400, f"LoRA adapter {name!r} cannot be served: {exc}", "invalid_request",
                           "lora_path") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_request", "lora_name") from None
        return json_response({"status": "ok", "message": f"LoRA adapter {name!r} added",
                              "lora_name": name, "lora_path": adapter.path, "rank": adapter.config.max_rank})

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name",))
        name = body["lora_name"]
        try:
            still = self.engine.unload_adapter(name)
        except ModelNotFound as exc:
            raise ApiError(404, str(exc), "not_found", "lora_name") from None
        return json_response({"status": "ok", "message": f"LoRA adapter {name!r} removed",
                              "lora_name": name, "requests_finishing": still})

    async def _body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, str]:
        if not self.allowed or self.engine.adapters is None:
            raise ApiError(404, "runtime LoRA adapter loading is off: serve with lora.enable and "
                                "lora.allow_runtime_updates (--enable-lora --allow-runtime-lora-updating)",
                           "not_found")
        self._check_accepting()
        body = await self._read_body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_request")
        for key in body:
            if key not in fields and key != "load_inplace":
                raise ApiError(400, f"unknown field {key!r}; expected {', '.join(fields)}", "invalid_request", key)
        if body.get("load_inplace"):
            raise ApiError(400, "load_inplace is not served: unload the adapter, then load it", "invalid_request",
                           "load_inplace")
        for key in fields:
            value = body.get(key)
            if not isinstance(value, str) or not value.strip():
                raise ApiError(400, f"{key} must be a non-empty string, got {value!r}", "invalid_request", key)
        return {key: body[key].strip() for key in fields}
