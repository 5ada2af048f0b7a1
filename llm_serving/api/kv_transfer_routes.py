"""Prefill/decode disaggregation over HTTP (``serving_config.kv_transfer``), with vLLM's ``kv_transfer_params``.

The prefill engine answers a request sent with ``{"do_remote_decode": true}`` as usual (the router asks for one
token), then copies the prompt's KV blocks out of its agents (``Engine.export_prompt_kv``) and holds them, bytes in
its memory, under a new ``transfer_id`` that its answer names in ``kv_transfer_params``. The decode engine, sent the
same request with ``{"transfer_id", "remote_url"}``, fetches them (``GET /v1/kv_transfer/{id}`` of the prefill
engine: TCP, so the engines may run on different hosts) and imports them into its prefix cache
(``Engine.import_prompt_kv``) before it admits the request, which then computes only the prompt's last partial
block. Held blocks are handed out once and forgotten after ``hold_s`` or beyond ``hold_bytes`` (oldest first).

Losing blocks on the way costs time, not tokens: a fetch that fails (expired, unreachable engine, damaged payload) is
logged and the decode engine computes the prompt itself. A payload of another layout (model, tensor-parallel size,
dtype, block size, kernels) is refused with a 400: that is a deployment error, not a lost transfer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

import aiohttp
from aiohttp import web

from llm_serving.api.responses import error_response
from llm_serving.api.schema import ApiError, KvTransferParams
from llm_serving.engine.kv_transfer import KvPayload
from llm_serving.engine.request_stream import EngineError

log = logging.getLogger(__name__)

HOLD_S = 60.0  # exported blocks not fetched by then are dropped
HOLD_BYTES = 4 << 30  # at most this many bytes of blocks held at once (the oldest dropped first)
FETCH_TIMEOUT_S = 60.0


class KvTransferRoutes:
    """Export after, import before a request; ``fetch`` is the route decode engines download from."""

    def __init__(self, engine: Any, enabled: bool, api_key: str | None = None, hold_s: float = HOLD_S,
                 hold_bytes: int = HOLD_BYTES) -> None:
        self.engine, self.enabled = engine, enabled
        # sent when fetching: the engines of one deployment share their key (serving_config.api_key)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.hold_s, self.hold_bytes = hold_s, hold_bytes
        self._held: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> (deadline, payload bytes)
        self._held_total = 0
        self._session: aiohttp.ClientSession | None = None
        self.fetch_failures = 0

    def check(self, params: KvTransferParams | None) -> None:
        """A 400 for ``kv_transfer_params`` sent to an engine started without KV transfer."""
        if params is not None and not self.enabled:
            raise ApiError(400, "this engine serves no KV transfer: kv_transfer_params needs serving_config.kv_transfer "
                                "true", "invalid_request", "kv_transfer_params")

    # ---- prefill side ----------------------------------------------------------------------------------------
    async def export(self, params: KvTransferParams | None, prompt_ids: list[int]) -> dict[str, Any]:
        """The answer's ``kv_transfer_params`` entry ({} unless asked; null when no blocks were kept: the prompt
        fills no whole block, or the copy failed; the decode engine then computes the prompt itself)."""
        if params is None or not params.do_remote_decode:
            return {}
        try:
            payload = await asyncio.wrap_future(self.engine.export_prompt_kv(prompt_ids))
        except EngineError as exc:
            log.warning("exporting a prompt's KV blocks failed: %s", exc)
            return {"kv_transfer_params": None}
        if not payload.num_blocks:
            return {"kv_transfer_params": None}
        transfer_id = f"kv-{uuid.uuid4().hex}"
        self._hold(transfer_id, payload.to_bytes())
        return {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                       "num_blocks": payload.num_blocks}}

    def _hold(self, transfer_id: str, data: bytes) -> None:
        self._expire()
        self._held[transfer_id] = (time.monotonic() + self.hold_s, data)
        self._held_total += len(data)
        while self._held_total > self.hold_bytes and self._held:
            dropped, (_, old) = self._held.popitem(last=False)
            self._held_total -= len(old)
            log.warning("KV blocks %s dropped unfetched: more than %d bytes held", dropped, self.hold_bytes)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held and next(iter(self._held.values()))[0] <= now:
            _, (_, data) = self._held.popitem(last=False)
            self._held_total -= len(data)

    @property
    def num_held(self) -> int:
        self._expire()
        return len(self._held)

    async def fetch(self, request: web.Request) -> web.Response:
        """``GET /v1/kv_transfer/{transfer_id}``: the held blocks (once), or a 404."""
        self._expire()
        transfer_id = request.match_info["transfer_id"]
        entry = self._held.pop(transfer_id, None)
        if entry is None:
            return error_response(ApiError(404, f"no KV blocks are held under {transfer_id[:80]!r}: fetched already, "
                                                f"dropped after {self.hold_s:g} s, or never kept", "not_found"), True)
        self._held_total -= len(entry[1])
        return web.Response(body=entry[1], content_type="application/octet-stream")

    # ---- decode side -----------------------------------------------------------------------------------------
    async def import_blocks(self, params: KvTransferParams | None) -> int:
        """Fetch and import the blocks ``params`` names; the number imported (0 when none were, the prompt then
        computed here). A 400 when they are of another layout."""
        if params is None or params.transfer_id is None:
            return 0
        data = await self._download(params)
        if data is None:
            return 0
        try:
            payload = KvPayload.from_bytes(data)
        except ValueError as exc:
            self.fetch_failures += 1
            log.warning("KV blocks %s from %s are unreadable (%s): computing the prompt here", params.transfer_id,
                        params.remote_url, exc)
            return 0
        try:
            return await asyncio.wrap_future(self.engine.import_prompt_kv(payload))
        except ValueError as exc:
            raise ApiError(400, f"kv_transfer_params: {exc}", "invalid_request", "kv_transfer_params") from None
        except EngineError as exc:
            log.warning("importing KV blocks %s failed (%s): computing the prompt here", params.transfer_id, exc)
            return 0

    async def _download(self, params: KvTransferParams) -> bytes | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S))
        url = f"{params.remote_url.rstrip('/')}/v1/kv_transfer/{params.transfer_id}"
        try:
            async with self._session.get(url, headers=self._headers) as resp:
                if resp.status == 200:
                    return await resp.read()
                reason = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.fetch_failures += 1
        log.warning("fetching KV blocks from %s failed (%s): computing the prompt here", url, reason)
        return None

    async def close(self, _app: web.Application | None = None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
