"""Issue 51, KV transfers that cannot lie: a decode engine fetches only from its configured prefill engines
(``serving_config.kv_transfer_peers``) and imports a payload only when every block's digest holds and its tokens
are the request's own prompt prefix; the router drops a client's own ``kv_transfer_params``.

The pieces here, with a loopback HTTP server standing for a prefill engine (an honest one or a liar) that records
what was asked of it; real engines through the router in ``tests/test_disaggregation.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from llm_serving.api.kv_hold import HeldPayloads, read_local
from llm_serving.api.kv_transfer_routes import KvTransferRoutes
from llm_serving.api.schema import KvTransferParams
from llm_serving.config.sections import http_origin
from llm_serving.config.serving_config import ConfigError
from llm_serving.engine.kv_transfer import KvPayload, digest_key, verified
from llm_serving.router.disaggregation import decode_request, prefill_request, without_transfer_params
from tests.tiny_engine import tiny_engine_config

LAYOUT = {"block_size": 4, "block_bytes": 8, "tensor_parallel_size": 2, "dtype": "float32"}
PROMPT = list(range(100, 111))  # 11 tokens: 2 whole blocks
KEY = digest_key("deployment secret")


def payload(tokens: list[int] = PROMPT[:8]) -> KvPayload:
    n = len(tokens) // LAYOUT["block_size"]
    return KvPayload(LAYOUT, tokens, [bytes(range(8 * n)), bytes([7] * 8 * n)])


# ---- the payload -------------------------------------------------------------------------------------------
def test_a_payload_is_taken_only_with_every_digest_holding_for_the_prompt_it_was_made_for():
    data = payload().to_bytes(KEY)
    assert verified(data, PROMPT, KEY).shards == payload().shards
    assert verified(data, PROMPT[:8], KEY).num_blocks == 2  # the prompt may end where its blocks do
    header_end = len(data) - 2 * 16
    for where, block, rank in ((header_end, 0, 0), (header_end + 15, 1, 0), (len(data) - 1, 1, 1)):
        damaged = bytearray(data)
        damaged[where] ^= 1
        with pytest.raises(ValueError, match=f"block {block} of rank {rank} does not match its digest"):
            verified(bytes(damaged), PROMPT, KEY)
    zeroed = data[:header_end] + bytes(32)
    with pytest.raises(ValueError, match="block 0 of rank 0 does not match"):
        verified(zeroed, PROMPT, KEY)
    with pytest.raises(ValueError, match="serving_config.api_key"):  # another deployment's (or no) key
        verified(data, PROMPT, digest_key("another"))
    assert verified(payload().to_bytes(), PROMPT, digest_key(None)).num_blocks == 2  # no key: digests still hold
    for other, why in ((PROMPT[:7], "not a prefix of the request's 7-token"),
                       ([1, *PROMPT[1:]], "not a prefix"), (list(range(11)), "not a prefix")):
        with pytest.raises(ValueError, match=why):
            verified(data, other, KEY)


def test_a_relabelled_payload_fails_its_digests():
    """Another prompt's token ids written over an honest payload's header (what a forger without the key could
    do to make a decode engine file real blocks under a victim's prompt)."""
    data = payload().to_bytes(KEY)
    victim = list(range(500, 508))
    relabelled = data.replace(json.dumps(PROMPT[:8]).encode(), json.dumps(victim).encode())
    assert relabelled != data
    with pytest.raises(ValueError, match="block 0 of rank 0 does not match"):
        verified(relabelled, victim, KEY)
    header = json.loads(data[12: len(data) - 32])  # after the magic and the header's length; before the shards
    header["digests"][1] = header["digests"][1][:1]  # digests for too few blocks
    body = json.dumps(header).encode()
    with pytest.raises(ValueError, match="rank 1 do not cover its 2 blocks"):
        KvPayload.from_bytes(data[:8] + len(body).to_bytes(4, "little") + body + data[-32:], KEY)


# ---- trusted peers -----------------------------------------------------------------------------------------
def test_peers_are_compared_by_scheme_host_port_and_path():
    assert http_origin("http://LocalHost:8001/") == http_origin("http://localhost:8001") == "http://localhost:8001"
    assert http_origin("http://10.0.0.1") == "http://10.0.0.1:80" and http_origin("https://h/") == "https://h:443"
    assert http_origin("http://[::1]:9/x/") == "http://[::1]:9/x"
    for bad in ("ftp://h", "http://", "10.0.0.1:8001", "http://u@evil:1", "http://h:99999", "http://h/?a=1"):
        assert http_origin(bad) is None, bad
    assert http_origin("http://10.0.0.1:8001") != http_origin("http://10.0.0.1:8002")


def test_the_peers_config_key_is_checked(tmp_path):
    cfg = tiny_engine_config(tmp_path, serving_config={"kv_transfer": True,
                                                        "kv_transfer_peers": ["http://10.0.0.1:8001"]})
    assert cfg.serving_config.kv_transfer_peers == ("http://10.0.0.1:8001",)
    assert tiny_engine_config(tmp_path, serving_config={"kv_transfer": True}).serving_config.kv_transfer_peers == ()
    for serving, why in (({"kv_transfer": True, "kv_transfer_peers": ["10.0.0.1:8001"]}, r"http\(s\) URLs"),
                         ({"kv_transfer_peers": ["http://10.0.0.1:8001"]}, "kv_transfer true")):
        with pytest.raises(ConfigError, match=why) as err:
            tiny_engine_config(tmp_path, serving_config=serving)
        assert err.value.key == "serving_config.kv_transfer_peers"


class Liar:
    """A loopback HTTP server answering every request with ``body``; ``asked`` lists the paths it was asked."""

    def __init__(self, body: bytes) -> None:
        self.asked: list[str] = []
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                liar.asked.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_DELETE = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def liar(body: bytes) -> Iterator[Liar]:
    server = Liar(body)
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def attempt(routes: KvTransferRoutes, url: str, prompt: list[int]) -> int:
    """A decode engine's import for a request naming ``url`` (no engine: every case here stops before one)."""
    params = KvTransferParams(transfer_id="llmserving_kvx_1_ab", remote_url=url)

    async def run() -> int:
        try:
            return await routes.import_blocks(params, prompt)
        finally:
            await routes.close()

    return asyncio.run(run())


def counts(fetches: Counter) -> dict[str, float]:
    return {s.labels["via"]: s.value for m in fetches.collect() for s in m.samples if s.name.endswith("_total")}


def test_a_decode_engine_fetches_only_from_its_peers_and_takes_only_honest_payloads():
    for peers in ((), ("http://127.0.0.1:1",)):  # none configured (the default), or others
        fetches = Counter("fetches", "", ["via"], registry=CollectorRegistry())
        with liar(payload().to_bytes(KEY)) as server:
            routes = KvTransferRoutes(None, True, fetches, api_key="deployment secret", peers=peers)
            assert attempt(routes, server.url, PROMPT) == 0
        assert server.asked == [] and counts(fetches) == {"refused": 1}  # nothing fetched, counted
    for body, prompt in ((payload().to_bytes(KEY)[:-1] + b"\0", PROMPT),  # a damaged block
                         (payload().to_bytes(KEY), list(range(11))),  # another prompt's blocks
                         (payload().to_bytes(), PROMPT),  # digests without the deployment's key
                         (b"not a payload", PROMPT)):
        fetches = Counter("fetches", "", ["via"], registry=CollectorRegistry())
        with liar(body) as server:
            routes = KvTransferRoutes(None, True, fetches, api_key="deployment secret", peers=(server.url + "/",))
            assert attempt(routes, server.url, prompt) == 0  # refused before any engine call (there is none)
        assert server.asked == ["/v1/kv_transfer/llmserving_kvx_1_ab"] and counts(fetches) == {"refused": 1}


@pytest.mark.skipif(os.geteuid() != 0, reason="hands a segment to another user (needs root)")
def test_a_segment_another_user_made_is_not_read():
    held = HeldPayloads(60.0, 1 << 20)
    try:
        name = held.put(b"blocks")
        assert read_local(name) == b"blocks"
        os.chown(Path("/dev/shm", name), 65534, -1)  # nobody's: a planted segment under a held transfer's name
        assert read_local(name) is None
    finally:
        held.close()


# ---- the router --------------------------------------------------------------------------------------------
def test_the_router_never_forwards_a_clients_transfer_params():
    client = {"model": "m", "prompt": "victim", "max_tokens": 5,
              "kv_transfer_params": {"transfer_id": "llmserving_kvx_1_ab", "remote_url": "http://evil:1"}}
    stripped = without_transfer_params(client)
    assert stripped == {k: v for k, v in client.items() if k != "kv_transfer_params"}
    first = prefill_request(client)  # split as any request, the transfer parameters the router's own
    assert first is not None and first["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode_request(stripped, b'{"kv_transfer_params": null}', "http://prefill:1") is None
    answer = json.dumps({"kv_transfer_params": {"transfer_id": "llmserving_kvx_2_cd", "num_blocks": 1}}).encode()
    decode = decode_request(stripped, answer, "http://prefill:1")
    assert decode is not None and decode["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": "llmserving_kvx_2_cd", "remote_url": "http://prefill:1"}
