"""Prefill/decode disaggregation over HTTP (``serving_config.kv_transfer``), with vLLM's ``kv_transfer_params``.

The prefill engine answers a request sent with ``{"do_remote_decode": true}`` as usual (the router asks for one
token), then copies the prompt's KV blocks out of its agents (``Engine.export_prompt_kv``) and holds them in a
shared-memory segment under a new ``transfer_id`` that its answer names in ``kv_transfer_params`` (``kv_hold``). The
decode engine, sent the same request with ``{"transfer_id", "remote_url"}``, reads them from that segment when it
runs on the same host, else fetches them (``GET /v1/kv_transfer/{id}`` of the prefill engine: TCP), and imports
them into its prefix cache (``Engine.import_prompt_kv``) before it admits the request, which then computes only the
prompt's last partial block. Held blocks are handed out once (a decode engine that read them itself releases them:
``DELETE /v1/kv_transfer/{id}``) and dropped after ``hold_s`` or beyond ``hold_bytes`` (oldest first).

Losing blocks on the way costs time, not tokens: a fetch that fails (expired, unreachable engine) is logged and the
decode engine computes the prompt itself. A payload of another layout (model, tensor-parallel size, dtype, block
size, kernels) is refused with a 400: that is a deployment error, not a lost transfer.

Transfers cannot poison the prefix cache: the decode engine fetches (or reads from shared memory) only from the
prefill engines its ``serving_config.kv_transfer_peers`` names (none by default) and imports a payload only when
every block's digest holds and its tokens are the request's own prompt prefix (``kv_transfer.verified``, run
before any block is taken). Anything else is refused whole: nothing fetched or imported, counted
(``via="refused"``), the prompt computed here. The router never forwards a client's own ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from llm_serving.api.kv_hold import HeldPayloads, read_local
from llm_serving.api.schema import KvTransferParams
from llm_serving.config.sections import http_origin
from llm_serving.engine.kv_transfer import digest_key, verified
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.errors import error_response
from llm_serving.request_errors import ApiError

log = logging.getLogger(__name__)

HOLD_S = 60.0  # exported blocks not fetched by then are dropped
HOLD_BYTES = 4 << 30  # at most this many bytes of blocks held at once (the oldest dropped first)
FETCH_TIMEOUT_S = 60.0


class KvTransferRoutes:
    """Export after, import before a request; ``fetch`` is the route decode engines download from."""

    def __init__(self, engine: Any, enabled: bool, fetches: Counter, api_key: str | None = None,
                 hold_s: float = HOLD_S, hold_bytes: int = HOLD_BYTES, peers: tuple[str, ...] = ()) -> None:
        self.engine, self.enabled = engine, enabled
        self.fetches = fetches  # by "via": shm, http (imported), failed (not had), refused (not taken)
        self.peers = {http_origin(url) for url in peers} - {None}  # serving_config.kv_transfer_peers
        # the engines of one deployment share their key (serving_config.api_key): sent when fetching, and the
        # payloads' digests are keyed with it
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._digest_key = digest_key(api_key)
        self.held = HeldPayloads(hold_s, hold_bytes)
        self._session: aiohttp.ClientSession | None = None
        self._releasing: set[asyncio.Task] = set()  # DELETEs in flight (kept referenced until done)

    def check(self, params: KvTransferParams | None) -> None:
        """A 400 for ``kv_transfer_params`` sent to an engine started without KV transfer."""
        if params is not None and not self.enabled:
            raise ApiError(400, "this engine serves no KV transfer: kv_transfer_params needs "
                                "serving_config.kv_transfer true", "invalid_request", "kv_transfer_params")

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
        # serialized off the event loop (a long prompt's blocks are many MiB); held on it, where every other use of
        # the held payloads runs (HeldPayloads is not thread-safe)
        data = await asyncio.get_running_loop().run_in_executor(None, payload.to_bytes, self._digest_key)
        transfer_id = self.held.put(data)
        return {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                       "num_blocks": payload.num_blocks}}

    async def fetch(self, request: web.Request) -> web.Response:
        """``GET /v1/kv_transfer/{transfer_id}``: the held blocks (once), or a 404."""
        transfer_id = request.match_info["transfer_id"]
        data = self.held.take(transfer_id)
        if data is None:
            return self._not_held(transfer_id)
        return web.Response(body=data, content_type="application/octet-stream")

    async def release(self, request: web.Request) -> web.Response:
        """``DELETE /v1/kv_transfer/{transfer_id}``: a decode engine on this host read the blocks itself."""
        transfer_id = request.match_info["transfer_id"]
        return web.Response(status=204) if self.held.release(transfer_id) else self._not_held(transfer_id)

    def _not_held(self, transfer_id: str) -> web.Response:
        return error_response(ApiError(404, f"no KV blocks are held under {transfer_id[:80]!r}: fetched already, "
                                            f"dropped after {self.held.hold_s:g} s, or never kept", "not_found"), True)

    # ---- decode side -----------------------------------------------------------------------------------------
    async def import_blocks(self, params: KvTransferParams | None, prompt_ids: list[int]) -> int:
        """Fetch and import the blocks ``params`` names for the prompt ``prompt_ids``; the number imported (0 when
        none were, the prompt then computed here). A 400 when they are of another layout."""
        if params is None or params.transfer_id is None or params.remote_url is None:
            return 0
        if http_origin(params.remote_url) not in self.peers:
            return self._refuse(params, "it is not one of serving_config.kv_transfer_peers: nothing fetched")
        fetched = await self._download(params.transfer_id, params.remote_url)
        if fetched is None:
            return 0
        data, via = fetched
        try:  # checked off the event loop (digests of many MiB), before a block is taken for it
            payload = await asyncio.get_running_loop().run_in_executor(None, verified, data, prompt_ids,
                                                                       self._digest_key)
        except ValueError as exc:
            return self._refuse(params, str(exc))
        self.fetches.labels(via).inc()
        try:
            return await asyncio.wrap_future(self.engine.import_prompt_kv(payload))
        except ValueError as exc:
            raise ApiError(400, f"kv_transfer_params: {exc}", "invalid_request", "kv_transfer_params") from None
        except EngineError as exc:
            log.warning("importing KV blocks %s failed (%s): computing the prompt here", params.transfer_id, exc)
            return 0

    def _refuse(self, params: KvTransferParams, why: str) -> int:
        self.fetches.labels("refused").inc()
        log.warning("KV blocks %s from %s refused (%s): computing the prompt here", params.transfer_id,
                    (params.remote_url or "")[:200], why)
        return 0

    async def _download(self, transfer_id: str, remote_url: str) -> tuple[bytes, str] | None:
        """The payload and how it came: from its segment when the prefill engine (a trusted peer) runs on this host
        (then released there), else over HTTP; None when it cannot be had."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S))
        url = f"{remote_url.rstrip('/')}/v1/kv_transfer/{transfer_id}"
        data = await asyncio.get_running_loop().run_in_executor(None, read_local, transfer_id)
        if data is not None:
            self._releasing.add(asyncio.create_task(self._release(url)))
            return data, "shm"
        try:
            async with self._session.get(url, headers=self._headers) as resp:
                if resp.status == 200:
                    return await resp.read(), "http"
                reason = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.fetches.labels("failed").inc()
        log.warning("fetching KV blocks from %s failed (%s): computing the prompt here", url, reason)
        return None

    async def _release(self, url: str) -> None:
        try:
            if self._session is None:  # closed meanwhile: the holder drops the blocks after hold_s
                return
            async with self._session.delete(url, headers=self._headers) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:  # it drops them after hold_s anyway
            log.warning("releasing KV blocks at %s failed: %s", url, exc)
        finally:
            self._releasing.discard(asyncio.current_task())

    async def close(self, _app: web.Application | None = None) -> None:
        self.held.close()
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
