"""The ``fuzz`` section: generated hostile requests across every route, sent as raw bytes.

Each case is one request on its own connection: JSON values swapped for hostile ones (huge or tiny numbers,
integers past Python's digit limit, NaN, lone surrogates, deep nesting, long lists and strings), bodies of the
wrong shape or not JSON at all, wrong or missing Content-Type, bodies that are not their Content-Encoding,
broken Content-Length and chunking, oversized headers and request lines, unknown methods, and bytes that are
not HTTP. The cases come from a seeded generator, so a run is reproducible; the requests of issue 18 are
always among them. What counts: no 5xx, every 4xx a JSON error, no hang, an answer whenever the request was
complete, and afterwards the server still healthy with no KV block held. Pointed at a router, the requests go
through it to its engines (``target``: "router"), and the KV blocks held are summed over them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import json
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

from chaos_core import Context, RawResponse, Section, metric_total

HOLE = "\u0000chaos-hole\u0000"  # placeholder swapped for raw JSON text after json.dumps
_HOLE_JSON = json.dumps(HOLE)


@dataclass(frozen=True)
class Case:
    """One hostile request; ``expect_no_response``: the server may rightly close without an answer (the
    request was never complete), so that is not counted against it."""

    kind: str
    route: str
    name: str
    data: bytes
    method: str = "POST"
    half_close: bool = False
    expect_no_response: bool = False


# ---- the routes and their valid bodies ---------------------------------------------------------------------
def _routes(model: str) -> dict[str, tuple[str, dict[str, Any], list[tuple[Any, ...]]]]:
    """route -> (path, a valid body, the paths of the fields to swap)."""
    tgi = {"inputs": "hello world", "parameters": {"max_new_tokens": 4, "do_sample": False}}
    tgi_fields = [("inputs",), ("parameters",), ("stream",), ("sse",)] + [("parameters", k) for k in (
        "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop",
        "return_full_text", "details", "sse", "truncate", "best_of", "typical_p", "watermark")]
    completion = {"model": model, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    completion_fields = [(k,) for k in (
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
        "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "user",
        "seed", "suffix", "repetition_penalty", "ignore_eos")]
    chat = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0}
    chat_fields = [(k,) for k in (
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream", "stop",
        "n", "seed", "logprobs", "top_logprobs", "presence_penalty", "user", "tools", "response_format")]
    chat_fields += [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content")]
    return {
        "tgi": (f"/models/{model}/generate", tgi, tgi_fields),
        "tgi_stream": (f"/models/{model}/generate_stream", tgi, tgi_fields),
        "completions": ("/v1/completions", completion, completion_fields),
        "chat": ("/v1/chat/completions", chat, chat_fields),
    }


GET_ROUTES = {"health": "/health", "metrics": "/metrics", "models": "/v1/models"}


# ---- hostile JSON values (raw text: some cannot come from json.dumps) --------------------------------------
_SCALARS = [
    "null", "true", "false", '""', '" "', '"x"', "0", "-0", "-1", "1", "3", "0.5", "-0.5", "2.5", "100000",
    "2147483647", "2147483648", "-2147483649", "9223372036854775807", "9223372036854775808",
    "-9223372036854775809", "18446744073709551616", "1e308", "1e999", "-1e999", "NaN", "Infinity",
    "-Infinity", "5e-324", "1e-300", "1e-45", "1e-39", "3.5e38", "-0.0", "1E2", '"0.5"', '"True"', '"false"',
    '"yes"', '"nan"', '"inf"', '"-inf"', '"1e999"', '"0x10"', '" 7 "', '"\\u0000"', '"\\ud800"', '"\\udfff"',
    '"a\\ud83d"', '"\\ud83d\\ude00"', '"\\uffff"', '"\\"', "01", "1.", ".5", "+1", "tru", "'x'", '"\\x41"',
]


def hostile_value(rng: random.Random) -> str:
    """Raw JSON text (sometimes not valid JSON) for one field."""
    pick = rng.random()
    if pick < 0.45:
        return rng.choice(_SCALARS)
    if pick < 0.6:  # numbers of many digits: past float's range, past int()'s 4,300-digit limit
        digits = rng.choice((20, 310, 400, 4300, 4301, 6000))
        text = rng.choice("123456789") + "9" * (digits - 1)
        return rng.choice((text, "-" + text, f'"{text}"', f"{text}.5", f"{text}e5"))
    if pick < 0.72:  # long strings
        n = rng.choice((300, 5000, 100_000, 400_000))
        unit = rng.choice(("a", "word ", "\U0001f642", "\\n", "\\u00e9", "<s>", "\\ud800"))
        return '"' + unit * (n // len(unit) or 1) + '"'
    if pick < 0.88:  # lists
        return rng.choice((
            "[]", "[null]", "[1,2,3]", "[-1]", "[1e999]", '["a"]', '[""]', '["\\ud800"]', "[[1,2],[3]]",
            "[[]]", "[[[]]]", '[{"a":1}]', "[" + ",".join(["1"] * rng.choice((300, 5000, 100_000))) + "]",
            "[" + ",".join(['"hi"'] * rng.choice((17, 300, 2000))) + "]",
            "[" + ",".join(["[1]"] * 2000) + "]", "[" + ",".join([str(10**30)] * 5) + "]",
        ))
    if pick < 0.94:  # nesting
        depth = rng.choice((33, 200, 2000, 100_000))
        return rng.choice(("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth))
    return rng.choice(("{}", '{"a":1}', '{"":null}', '{"\\ud800":1}',
                       "{" + ",".join(f'"k{i}":{i}' for i in range(rng.choice((50, 10_000)))) + "}"))


def _render(body: Any, raw: str) -> bytes:
    """``body`` as JSON with the HOLE placeholder replaced by ``raw``."""
    return json.dumps(body).replace(_HOLE_JSON, raw, 1).encode("utf-8", "surrogatepass")


def _swap(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``body`` with the member at ``path`` set to ``value`` (parents made as needed)."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
    last = path[-1]
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(last, int) and last < len(node)):
        node[last] = value
    return body


def _delete(body: Any, key: str) -> Any:
    body = json.loads(json.dumps(body))
    body.pop(key, None)
    return body


@functools.cache
def _gzip_bomb() -> bytes:
    """20 MiB of JSON in about 20 KiB: the body limit must apply to the decoded size."""
    return gzip.compress(b'{"inputs": "' + b" " * (20 << 20) + b'"}', compresslevel=9, mtime=0)


# ---- request bytes -----------------------------------------------------------------------------------------
def _request(method: str, path: str, body: bytes | None, headers: list[tuple[str, str]] | None = None,
             auth: dict[str, str] | None = None, content_type: str | None = "application/json",
             length: str | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if body is not None and content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    for name, value in (auth or {}).items():
        lines.append(f"{name}: {value}")
    for name, value in headers or []:
        lines.append(f"{name}: {value}")
    if body is not None and length != "omit":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


class _Generator:
    def __init__(self, seed: int, model: str, api_key: str | None) -> None:
        self.rng = random.Random(seed)
        self.routes = _routes(model)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.api_key = api_key

    def post_route(self) -> tuple[str, str, dict[str, Any], list[tuple[Any, ...]]]:
        name = self.rng.choice(list(self.routes))
        path, body, fields = self.routes[name]
        return name, path, body, fields

    def valid(self) -> tuple[str, str, bytes]:
        name, path, body, _ = self.post_route()
        return name, path, json.dumps(body).encode()

    # each returns one Case
    def json_value(self) -> Case:
        route, path, body, fields = self.post_route()
        field = self.rng.choice(fields)
        raw = hostile_value(self.rng)
        name = f"{'.'.join(map(str, field))}={raw[:40]}"
        if self.rng.random() < 0.25:  # a second hostile field in the same body
            field2 = self.rng.choice(fields)
            body = _swap(body, field2, json.loads(self.rng.choice(_SCALARS[:40])))
            name += f" +{'.'.join(map(str, field2))}"
        return Case("json_value", route, name, _request("POST", path, _render(_swap(body, field, HOLE), raw),
                                                         auth=self.auth))

    def json_shape(self) -> Case:
        route, path, body, fields = self.post_route()
        r = self.rng.random()
        if r < 0.25:
            key = self.rng.choice(list(body))
            data, name = json.dumps(_delete(body, key)).encode(), f"without {key}"
        elif r < 0.5:
            key = self.rng.choice(("max_new_token", "", "__proto__", "\\ud800", "k" * 5000, "Inputs",
                                   "stream "))
            raw = hostile_value(self.rng)
            text = json.dumps(body)
            data = (text[:-1] + f', "{key}": {raw}}}').encode("utf-8", "surrogatepass")
            name = f"unknown key {key[:20]!r}"
        elif r < 0.7:
            raw = hostile_value(self.rng)
            data, name = raw.encode("utf-8", "surrogatepass"), f"top level {raw[:40]}"
        elif r < 0.85:
            first = json.dumps(body)[1:-1]
            key = fields[0][0]
            data, name = ("{" + first + f', "{key}": 5, "{key}": "again"' + "}").encode(), f"duplicate {key}"
        else:
            data, name = json.dumps([body, body]).encode(), "list of bodies"
        return Case("json_shape", route, name, _request("POST", path, data, auth=self.auth))

    def raw_body(self) -> Case:
        route, path, body = self.valid()
        r = self.rng.random()
        if r < 0.3:
            cut = self.rng.randrange(0, len(body))
            data, name = body[:cut], f"truncated at {cut}"
        else:
            data, name = self.rng.choice((
                (b"", "empty"), (b"   \n\t ", "whitespace"),
                (bytes(self.rng.randrange(256) for _ in range(64)), "random bytes"),
                (b"\xff\xfe" + body, "invalid utf-8"), (b"\xef\xbb\xbf" + body, "utf-8 bom"),
                (body.decode().encode("utf-16"), "utf-16"), (body.decode().encode("utf-32-le"), "utf-32"),
                (body + b" trailing", "trailing garbage"), (body + body, "two documents"),
                (body.replace(b'"', b"'"), "single quotes"), (b"\x00" * 100, "nul bytes"),
                (b'{"inputs": "' + b"x" * ((1 << 20) + 10) + b'"}', "over the body limit"),
            ))
        return Case("raw_body", route, name, _request("POST", path, data, auth=self.auth))

    def headers(self) -> Case:
        route, path, body = self.valid()
        r = self.rng.random()
        half_close = expect_none = False
        if r < 0.35:
            ctype = self.rng.choice((
                None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x", "application/json; charset=utf-16", "application/jsonp",
                "APPLICATION/JSON", "application/ld+json", "\x01\x02", ";;;", "application/json" + "x" * 9000,
                "*/*", "application/"))
            data = _request("POST", path, body, auth=self.auth, content_type=ctype)
            name = f"Content-Type {str(ctype)[:30]!r}"
        elif r < 0.7:
            length = self.rng.choice(("abc", "-1", "1e3", " 5", "99999999999999999999", "0", "3", "0x10",
                                      "omit", str(len(body) + 50), "5, 5", ""))
            if length == str(len(body) + 50):
                half_close = expect_none = True  # promised more than sent: the server waits, then sees EOF
            data = _request("POST", path, body, auth=self.auth, length=length)
            name = f"Content-Length {length!r}"
        else:
            extra, name = self.rng.choice((
                ([("Transfer-Encoding", "chunked")], "chunked with a plain body"),
                ([("Transfer-Encoding", "gzip")], "Transfer-Encoding gzip"),
                ([("Transfer-Encoding", "chunked, chunked")], "chunked twice"),
                ([("Expect", "100-continue")], "Expect 100-continue"), ([("Expect", "tea")], "Expect tea"),
                ([("X-Big", "a" * 9000)], "header over 8 KiB"),
                ([(f"X-H{i}", "v") for i in range(150)], "150 headers"),
                ([("X-Bad", "a\x00b")], "NUL in a header"), ([("Bad Name", "v")], "space in a header name"),
                ([("X-Fold", "a\r\n folded")], "obs-fold"), ([("Accept", "text/event-stream")], "Accept SSE"),
                ([("Upgrade", "websocket"), ("Connection", "Upgrade")], "websocket upgrade"),
                ([("Upgrade", "h2c")], "h2c upgrade"), ([("Host", "a"), ("Host", "b")], "two Host headers"),
                ([("Content-Length", "5")], "two Content-Lengths"),
            ))
            data = _request("POST", path, body, extra, auth=self.auth)
        return Case("headers", route, name, data, half_close=half_close, expect_no_response=expect_none)

    def chunked(self) -> Case:
        route, path, body = self.valid()
        good = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        data, name = self.rng.choice((
            (good, "valid chunks"), (b"zz\r\n" + body + b"\r\n0\r\n\r\n", "bad chunk size"),
            (b"ffffffffffffffffff\r\n" + body, "huge chunk size"), (good[:-5], "no last chunk"),
            (b"5\r\n" + body, "chunk longer than said")))
        half_close = name in ("no last chunk", "huge chunk size", "chunk longer than said")
        headers = [("Transfer-Encoding", "chunked"), ("Content-Type", "application/json")]
        request = _request("POST", path, None, headers, auth=self.auth) + data
        return Case("headers", route, name, request, half_close=half_close, expect_no_response=half_close)

    def encoding(self) -> Case:
        route, path, body = self.valid()
        bomb = _gzip_bomb()
        coding, data, name = self.rng.choice((
            ("gzip", body, "gzip that is not"), ("deflate", body, "deflate that is not"), ("br", body, "br"),
            ("zstd", body, "zstd"), ("gzip, deflate", gzip.compress(body, mtime=0), "two codings"),
            ("x-unknown", body, "unknown coding"), ("identity", body, "identity"),
            ("gzip", gzip.compress(body, mtime=0), "valid gzip"), ("deflate", zlib.compress(body), "valid deflate"),
            ("gzip", gzip.compress(body, mtime=0)[:-8], "truncated gzip"), ("gzip", bomb, "gzip bomb (20 MiB)"),
            ("gzip", gzip.compress(b"{not json", mtime=0), "gzip of bad json"),
        ))
        return Case("encoding", route, name, _request("POST", path, data, [("Content-Encoding", coding)],
                                                       auth=self.auth))

    def request_line(self) -> Case:
        route, path, body = self.valid()
        target, version = path, "HTTP/1.1"
        r = self.rng.random()
        if r < 0.6:
            target = self.rng.choice((
                "/models/%ff/generate", "/models/%00/generate", "/models/../v1/completions",
                "//v1/completions",
                "/v1/completions?x=%zz&sse=true", "/v1/completions#frag", "*", "http://127.0.0.1/v1/completions",
                "/" + "a" * 9000, "/models/\u00e9\u00e9/generate", path + "?sse=1", "/v1/completions/",
                "/V1/COMPLETIONS", "/models/" + "m" * 5000 + "/generate", "/models//generate",
                "/models/llama2%2Fx/generate", "",
            ))
            name = f"target {target[:40]!r}"
        else:
            version = self.rng.choice(("HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", "http/1.1", "HTTP/9.9", "HTTP/1",
                                       ""))
            name = f"version {version!r}"
        head = f"POST {target} {version}".rstrip() + "\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in self.auth.items())
        return Case("request_line", route, name, (head + "\r\n").encode("utf-8", "surrogateescape") + body)

    def method(self) -> Case:
        if self.rng.random() < 0.5:
            route, path, body = self.valid()
            method = self.rng.choice(("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO",
                                      "post", "POST\x00", "M" * 100, "PROPFIND", "CONNECT"))
        else:
            route = self.rng.choice(list(GET_ROUTES))
            path, body = GET_ROUTES[route], b'{"inputs": "x"}'
            method = self.rng.choice(("POST", "PUT", "DELETE", "FOO", "HEAD", "OPTIONS"))
        return Case("method", route, f"{method[:10]!r} {path}", _request(method, path, body, auth=self.auth),
                    method=method)

    def not_http(self) -> Case:
        data, name, expect_none = self.rng.choice((
            (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32)), "TLS client hello", False),
            (bytes(self.rng.randrange(256) for _ in range(200)) + b"\r\n\r\n", "random bytes", False),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/2 preface", False),
            (b"SSH-2.0-OpenSSH_9.0\r\n\r\n", "SSH banner", False),
            (b"GET /health\r\n\r\n", "HTTP/0.9", False),
            (b"\r\n\r\n", "blank lines", True), (b"GET", "cut request line", True),
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", "cut headers", True),
        ))
        # only a request cut short is half-closed: aiohttp drops a connection at EOF, answered or not
        return Case("not_http", "other", name, data, half_close=expect_none, expect_no_response=expect_none)

    def auth_case(self) -> Case:
        route, path, body = self.valid()
        value = self.rng.choice(("", "Bearer", "Bearer ", "Bearer " + "x" * 5000, "Basic Zm9vOmJhcg==",
                                 "Bearer wrong-key", "bearer\tx", "Bearer \udcff\udcfe", None))
        auth = {} if value is None else {"Authorization": value}
        return Case("auth", route, f"Authorization {str(value)[:20]!r}",
                    _request("POST", path, body, auth=auth))

    def get_route(self) -> Case:
        route = self.rng.choice(list(GET_ROUTES))
        query = self.rng.choice(("", "?x=1", "?" + "a" * 3000, "?%zz", "?a=1&a=2"))
        return Case("get", route, f"GET {route}{query[:10]}",
                    _request("GET", GET_ROUTES[route] + query, None, auth=self.auth))


KINDS = (("json_value", 34), ("json_shape", 12), ("raw_body", 9), ("headers", 10), ("chunked", 4),
         ("encoding", 8), ("request_line", 7), ("method", 7), ("not_http", 3), ("auth", 3), ("get_route", 3))


def known_cases(model: str) -> list[Case]:
    """The requests of issue 18's findings, always sent."""
    gen = f"/models/{model}/generate"
    bodies = [
        ("tgi", gen, (b'{"inputs":"hello world","parameters":{"max_new_tokens":4,"do_sample":true,'
                      b'"top_p":1e-300}}')),
        ("tgi", gen, (b'{"inputs":"hello world","parameters":{"max_new_tokens":4,"do_sample":true,"top_k":1,'
                      b'"top_p":5e-324}}')),
        ("tgi", gen, b'{"inputs":"hi","parameters":{"seed":' + b"9" * 4400 + b"}}"),
        ("tgi", gen, b'{"inputs":"\\ud800"}'),
        ("completions", "/v1/completions", json.dumps({"prompt": ["hi"] * 2000, "max_tokens": 1}).encode()),
    ]
    for key in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        bodies.append(("completions", "/v1/completions",
                       b'{"prompt":"hi","max_tokens":2,"%s":' % key.encode() + b"9" * 400 + b"}"))
    return [Case("known", route, f"issue 18: {body[:50]!r}", _request("POST", path, body))
            for route, path, body in bodies]


def fuzz_cases(count: int, seed: int, model: str = "llama2", api_key: str | None = None) -> list[Case]:
    """``count`` cases: the known ones first, then seeded draws over ``KINDS``."""
    g = _Generator(seed, model, api_key)
    cases = known_cases(model)
    if api_key:
        auth = f"Authorization: Bearer {api_key}\r\n".encode()
        cases = [Case(c.kind, c.route, c.name, c.data.replace(b"\r\n", b"\r\n" + auth, 1)) for c in cases]
    names, weights = zip(*KINDS)
    make = {"auth": g.auth_case}
    while len(cases) < count:
        kind = g.rng.choices(names, weights)[0]
        cases.append(make.get(kind, getattr(g, kind))())
    return cases[:count]


# ---- running and counting ----------------------------------------------------------------------------------
async def send_all(ctx: Context, cases: list[Case], concurrency: int, request_timeout: float,
                   deadline: float) -> list[tuple[Case, RawResponse | None]]:
    """Every case, ``concurrency`` at a time; cases not started by ``deadline`` get None."""
    results: list[tuple[Case, RawResponse | None]] = [(c, None) for c in cases]
    queue = list(enumerate(cases))[::-1]

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            i, case = queue.pop()
            response = await ctx.exchange(case.data, request_timeout, case.half_close)
            results[i] = (case, response)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def tally(results: list[tuple[Case, RawResponse | None]]) -> dict[str, Any]:
    """The figures of a fuzz run (without the after-run checks)."""
    sent = [(c, r) for c, r in results if r is not None]
    classes = Counter(r.status_class for _, r in sent)
    statuses = Counter(r.status for _, r in sent if r.status is not None)
    fives = [f"{c.kind}/{c.route} {c.name} -> {r.status}" for c, r in sent if r.status and r.status >= 500]
    non_json = [f"{c.kind}/{c.route} {c.name} -> {r.status}" for c, r in sent
                if r.status and r.status >= 400 and c.method != "HEAD" and not r.is_json_error]
    unexpected_none = [f"{c.kind}/{c.route} {c.name}" for c, r in sent
                       if r.status is None and not r.timed_out and not c.expect_no_response]
    return {
        "sent": len(sent), "not_sent": len(results) - len(sent), "routes": len({c.route for c, _ in sent}),
        "2xx": classes["2xx"], "3xx": classes["3xx"], "4xx": classes["4xx"], "5xx": classes["5xx"],
        "503": statuses[503], "no_response": classes["none"], "unexpected_no_response": len(unexpected_none),
        "hangs": classes["hang"], "non_json_errors": len(non_json),
        "by_status": " ".join(f"{s}:{n}" for s, n in sorted(statuses.items())),
        "by_kind": " ".join(f"{k}:{n}" for k, n in sorted(Counter(c.kind for c, _ in sent).items())),
        "first_5xx": "; ".join(fives[:5]), "first_non_json": "; ".join(non_json[:5]),
        "first_unexpected_no_response": "; ".join(unexpected_none[:5]),
    }


async def run(ctx: Context) -> dict[str, Any]:
    a = ctx.args
    model = await ctx.model_name()
    cases = fuzz_cases(a.fuzz_count, a.fuzz_seed, model, ctx.api_key)
    ctx.log(f"fuzz: {len(cases)} cases (seed {a.fuzz_seed}), {a.fuzz_concurrency} at a time")
    t0 = time.monotonic()
    results = await send_all(ctx, cases, a.fuzz_concurrency, a.fuzz_request_timeout, t0 + a.fuzz_timeout)
    seconds = time.monotonic() - t0
    figures = tally(results)
    after = await ctx.wait_idle(30.0)
    status, _ = await ctx.health()
    kv_used = metric_total(after, "llm_serving_kv_blocks_used")
    figures.update(seconds=round(seconds, 1), healthy_after=int(status == 200), target=await ctx.target(),
                   kv_blocks_used_after=-1 if kv_used is None else int(kv_used))
    figures["passed"] = (figures["5xx"] == 0 and figures["non_json_errors"] == 0 and figures["hangs"] == 0
                         and figures["unexpected_no_response"] == 0 and figures["healthy_after"] == 1
                         and figures["kv_blocks_used_after"] == 0 and figures["not_sent"] == 0)
    return figures


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fuzz")
    g.add_argument("--fuzz-count", type=int, default=1200, help="hostile requests to send (default 1200)")
    g.add_argument("--fuzz-seed", type=int, default=0, help="generator seed (default 0)")
    g.add_argument("--fuzz-concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    g.add_argument("--fuzz-timeout", type=float, default=600.0,
                   help="seconds for the whole fuzz; cases not started by then are reported as not sent")
    g.add_argument("--fuzz-request-timeout", type=float, default=60.0,
                   help="seconds one request may take before it counts as a hang (default 60)")


SECTION = Section("fuzz", "generated hostile requests on every route: status classes, 5xx, non-JSON errors",
                  run, add_arguments)
