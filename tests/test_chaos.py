"""Issue 18 against live servers with stand-in agents: every finding of the HTTP layer reproduced over the
wire, then the fast part of the reliability suite (``scripts/chaos.py``): a few hundred fuzz cases and a
short soak, and the section interface that ``scripts/chaos_agents.py`` plugs into."""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_server import ServerProcess

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import chaos
import chaos_fuzz
import chaos_soak
from chaos_core import Context, RawResponse, SectionError, exchange, http_request

GEN = "/models/llama2/generate"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-data")


@pytest.fixture(scope="module")
def server(data_dir):
    s = ServerProcess(data_dir, "--standin-agents")
    yield s
    assert s.stop() == 0, s.output


def ctx_for(server: ServerProcess, *argv: str) -> Context:
    """A section's context with the command line's defaults and ``argv``."""
    return Context(server.url, chaos.parse_args(["--url", server.url, *argv]), log=lambda _m: None)


def send(server: ServerProcess, request: bytes, half_close: bool = False) -> RawResponse:
    ctx = ctx_for(server)
    return asyncio.run(exchange(ctx.host, ctx.port, request, timeout=20, half_close=half_close))


def post(server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None) -> RawResponse:
    return send(server, http_request("POST", path, body, JSON if headers is None else headers))


def assert_json_4xx(r: RawResponse, status: int | None = None) -> dict:
    assert r.status is not None and 400 <= r.status < 500, (r.status, r.body[:300])
    assert status is None or r.status == status, (r.status, r.body[:300])
    assert r.is_json_error, (r.headers, r.body[:300])
    return r.json()


# ---- finding 1: sampling values the agents hold as float32 -------------------------------------------------
def test_top_p_that_is_zero_in_float32_is_a_400(server):
    for params in ({"max_new_tokens": 4, "do_sample": True, "top_p": 1e-300},
                   {"max_new_tokens": 4, "do_sample": True, "top_k": 1, "top_p": 5e-324}):
        r = post(server, GEN, json.dumps({"inputs": "hello world", "parameters": params}).encode())
        body = assert_json_4xx(r, 400)
        assert "top_p" in body["error"] and "float32" in body["error"]
    r = post(server, "/v1/completions", b'{"prompt": "hello world", "max_tokens": 4, "top_p": 1e-300}')
    assert assert_json_4xx(r, 400)["error"]["param"] == "top_p"


# ---- finding 2: no 5xx on bad input; the HTTP parser's own rejections as JSON ------------------------------
@pytest.mark.parametrize("body", [
    b'{"inputs": "hi", "parameters": {"seed": ' + b"9" * 5000 + b"}}",  # int() digit limit
    b'{"inputs": "hi", "unknown": [' + b"1" * 4400 + b"]}",
    b'{"inputs": "hi", "parameters": {"temperature": ' + b"9" * 400 + b"}}",  # OverflowError in float()
    b'{"inputs": "hi", "parameters": {"repetition_penalty": ' + b"9" * 400 + b"}}",
    b'{"inputs": "\\ud800"}',  # lone surrogate: sentencepiece cannot take it
    b'{"inputs": "ok", "parameters": {"stop": ["\\udfff"]}}',
])
def test_hostile_json_values_are_json_400s(server, body):
    assert_json_4xx(post(server, GEN, body), 400)


@pytest.mark.parametrize("key", ["temperature", "top_p", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty"])
def test_huge_integer_in_openai_float_fields_is_a_400(server, key):
    body = b'{"prompt": "hi", "max_tokens": 2, "%s": ' % key.encode() + b"7" * 400 + b"}"
    assert assert_json_4xx(post(server, "/v1/completions", body), 400)["error"]["param"] == key


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_body_that_is_not_its_content_encoding_is_a_json_400(server, encoding):
    r = post(server, GEN, b'{"inputs": "hi"}', {**JSON, "Content-Encoding": encoding})
    assert_json_4xx(r, 400)


def test_gzip_body_that_is_gzip_is_served(server):
    body = gzip.compress(b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}')
    r = post(server, GEN, body, {**JSON, "Content-Encoding": "gzip"})
    assert r.status == 200 and r.json()["generated_tokens"] == 2


@pytest.mark.parametrize("request_bytes", [
    b"POST /models/llama2/generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",  # bad length
    b"POST /models/llama2/generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",  # oversized header
    b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n",  # unknown method
    b"POST /models/llama2/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # oversized request line
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # TLS on the plain port
])
def test_http_parser_rejections_are_json(server, request_bytes):
    body = assert_json_4xx(send(server, request_bytes), 400)
    assert body["error_type"] == "bad_http_request"


def test_unknown_expect_is_a_json_417(server):
    """aiohttp's Expect handler runs before any middleware; its 417 is JSON too."""
    assert_json_4xx(post(server, GEN, b'{"inputs": "hi"}', {**JSON, "Expect": "tea"}), 417)


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/2.0"])
def test_stream_to_a_client_that_is_not_http_1_1_is_served(server, version):
    """Found by the fuzz: streams forced chunked encoding, a RuntimeError (500) for any other version."""
    body = b'{"inputs": "hi", "parameters": {"max_new_tokens": 3}}'
    request = http_request("POST", "/models/llama2/generate_stream", body, JSON)
    r = send(server, request.replace(b"HTTP/1.1", version.encode(), 1))
    assert r.status == 200 and len(r.body.decode().splitlines()) == 3, (r.status, r.body[:300])


# ---- finding 3: a request that can never succeed is a 4xx, not "503 try again" -----------------------------
def test_prompt_list_past_the_cap_is_a_400_not_a_503(server):
    r = post(server, "/v1/completions", json.dumps({"prompt": ["hi"] * 2000, "max_tokens": 1}).encode())
    body = assert_json_4xx(r, 400)
    assert body["error"]["param"] == "prompt" and "Retry-After".lower() not in r.headers


def test_more_prompts_than_the_queue_holds_is_a_400(data_dir):
    s = ServerProcess(data_dir, "--standin-agents", "--set", "serving_config.max_queue_size=4")
    try:
        r = post(s, "/v1/completions", json.dumps({"prompt": ["hi"] * 5, "max_tokens": 1}).encode())
        assert "max_queue_size" in assert_json_4xx(r, 400)["error"]["message"]
        r = post(s, "/v1/completions", json.dumps({"prompt": ["hi"] * 4, "max_tokens": 1}).encode())
        assert r.status == 200 and len(r.json()["choices"]) == 4
    finally:
        assert s.stop() == 0, s.output


# ---- finding 6: Content-Type and the API key ---------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_body_that_is_not_declared_json_is_a_415(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = post(server, GEN, b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}', headers)
    assert assert_json_4xx(r, 415)["error_type"] == "unsupported_media_type"
    r = post(server, GEN, b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}',
             {"Content-Type": "application/json; charset=utf-8"})
    assert r.status == 200


def test_api_key_guards_every_route_but_health(data_dir):
    s = ServerProcess(data_dir, "--standin-agents", "--api-key", "k3y-of-test")
    try:
        assert send(s, http_request("GET", "/health")).status == 200
        tgi = b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}'
        routes = [("GET", "/metrics", None), ("GET", "/v1/models", None), ("POST", GEN, tgi),
                  ("POST", "/models/llama2/generate_stream", tgi),
                  ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')]
        for method, path, body in routes:
            for auth in (None, "Bearer wrong", "k3y-of-test", "Basic k3y-of-test"):
                headers = {**JSON, **({"Authorization": auth} if auth else {})}
                r = send(s, http_request(method, path, body, headers))
                assert r.status == 401 and r.is_json_error, (path, auth, r.status, r.body[:200])
                assert r.headers.get("www-authenticate", "").startswith("Bearer")
            r = send(s, http_request(method, path, body, {**JSON, "Authorization": "Bearer k3y-of-test"}))
            assert r.status == 200, (path, r.body[:200])
        assert "k3y-of-test" not in s.output
    finally:
        assert s.stop() == 0, s.output


# ---- the suite's fast part ---------------------------------------------------------------------------------
def test_fuzz_a_few_hundred_hostile_requests_gives_no_5xx(server):
    ctx = ctx_for(server, "--fuzz-count", "300", "--fuzz-seed", "7", "--fuzz-concurrency", "4",
                  "--fuzz-timeout", "120", "--fuzz-request-timeout", "20")
    figures = asyncio.run(chaos_fuzz.run(ctx))
    assert figures["sent"] == 300 and figures["routes"] >= 6, figures
    assert figures["5xx"] == 0 and figures["non_json_errors"] == 0 and figures["hangs"] == 0, figures
    assert figures["unexpected_no_response"] == 0, figures
    assert figures["4xx"] > 200 and figures["2xx"] > 0, figures
    assert figures["healthy_after"] == 1 and figures["kv_blocks_used_after"] == 0, figures
    assert "Traceback" not in server.output, server.output[-3000:]  # nothing left to aiohttp's error log


def test_fuzz_cases_cover_every_kind_and_are_reproducible():
    cases = chaos_fuzz.fuzz_cases(count=1000, seed=3, model="llama2")
    again = chaos_fuzz.fuzz_cases(count=1000, seed=3, model="llama2")
    assert [c.data for c in cases] == [c.data for c in again]
    kinds = {c.kind for c in cases}
    assert kinds >= {"json_value", "json_shape", "raw_body", "headers", "encoding", "request_line", "method",
                     "not_http"}, kinds
    assert len({c.route for c in cases}) >= 6


def test_soak_short_run_is_clean(server):
    ctx = ctx_for(server, "--soak-seconds", "4", "--soak-concurrency", "6", "--soak-request-timeout", "20",
                  "--soak-seed", "1")
    figures = asyncio.run(chaos_soak.run(ctx))
    assert figures["sent"] > 20 and figures["ok"] > 0 and figures["clean_refusals"] > 0, figures
    assert figures["errors"] == 0 and figures["hangs"] == 0, figures
    assert figures["kv_blocks_used_after"] == 0 and figures["disconnects"] > 0, figures


def test_sections_interface_and_optional_agents_module(tmp_path, monkeypatch):
    names = [s.name for s in chaos.load_sections()]
    assert names[:2] == ["fuzz", "soak"]
    (tmp_path / "chaos_agents.py").write_text(textwrap.dedent("""
        from chaos_core import Section

        async def _run(ctx):
            return {"answer": 42}

        SECTIONS = [Section("sigkill", "kill an agent", _run)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "chaos_agents", raising=False)
    assert [s.name for s in chaos.load_sections()][-1] == "sigkill"
    monkeypatch.delitem(sys.modules, "chaos_agents", raising=False)


def test_cli_targets_loopback_only_and_runs_a_section(server, tmp_path):
    for url in ("http://192.0.2.1:80", "https://127.0.0.1:1", "127.0.0.1:80"):
        with pytest.raises(SectionError):
            Context(url, chaos.parse_args(["--url", url]))
    out = tmp_path / "figures.json"
    code = chaos.main(["--url", server.url, "--sections", "fuzz", "--fuzz-count", "40", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert code == 0 and figures["fuzz"]["sent"] == 40 and figures["fuzz"]["5xx"] == 0, figures


def test_soak_judges_completion_by_the_protocol_not_the_text():
    """A token may read "error": only an error event (or a missing ``[DONE]``, a cut event) makes a stream
    incomplete."""
    sse = {"content-type": "text/event-stream; charset=utf-8"}

    def event(obj: object) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    token = event({"choices": [{"index": 0, "text": "error", "finish_reason": None,  # logprobs quote it
                                "logprobs": {"tokens": ["error"], "top_logprobs": [{"error": -0.1}]}}]})
    failed = event({"error": {"message": "the engine failed", "type": "server_error", "code": "engine_error"}})
    for body, whole in ((token + "data: [DONE]\n\n", True), (token + failed, False), (token, False),
                        (token + "data: [DONE]", False), (failed + "data: [DONE]\n\n", False),
                        (token.replace("\n\n", "\r\n\r\n") + "data: [DONE]\r\n\r\n", True)):
        assert chaos_soak._complete("chat", True, RawResponse(200, sse, body.encode())) is whole, body
    frame = {"event": "message", "data": [{"generated_text": "error", "details": None}]}
    last = {"event": "message", "data": [{"generated_text": "", "details": {"finish_reason": "length"}}]}
    lines = f"{json.dumps(frame)}\n{json.dumps(last)}\n"
    ndjson = {"content-type": "application/x-ndjson"}
    assert chaos_soak._complete("tgi_stream", True, RawResponse(200, ndjson, lines.encode()))
    cut = f"{json.dumps(frame)}\n" + json.dumps({"error": "engine died", "error_type": "upstream_error"}) + "\n"
    assert not chaos_soak._complete("tgi_stream", True, RawResponse(200, ndjson, cut.encode()))
    assert not chaos_soak._complete("tgi_stream", True, RawResponse(200, ndjson, lines.encode()[:-5]))
    assert chaos_soak._complete("tgi_stream", True, RawResponse(200, sse, "".join(
        f"data: {json.dumps(f)}\n\n" for f in (frame, last)).encode()))
