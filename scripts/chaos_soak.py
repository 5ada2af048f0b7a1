"""The ``soak`` section: a bounded mixed load, then what it left behind.

Workers keep requests in flight for ``--soak-seconds`` (or ``--soak-requests``): valid requests on every
generation route (streamed or not, greedy or sampled, some with stop strings), clients that leave a stream
after its first bytes, and hostile requests from the fuzz generator. Each outcome is counted: ok (a complete
answer), a clean refusal (a JSON 4xx, or a JSON 503 with Retry-After when overloaded), an error (5xx, an
incomplete or failed answer, a non-JSON error, no answer), a hang (no answer within the request timeout).
Then it waits for the server to go idle and reads the KV blocks still held from ``/metrics``: a leak shows
there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from chaos_core import Context, RawResponse, Section, http_request, metric_total, sse_events
from chaos_fuzz import fuzz_cases

HOSTILE_KINDS = ("json_value", "json_shape", "raw_body", "encoding", "known")


def _body(route: str, model: str, rng: random.Random, max_tokens: int, stream: bool) -> dict[str, Any]:
    sampled = rng.random() < 0.3
    stop = ["the"] if rng.random() < 0.1 else None
    prompt = rng.choice(("hello world", "The river ran past the old mill and", "Numbers: 1 2 3", "tea?",
                         "Once upon a time, in a small village by the sea, there lived"))
    if route.startswith("tgi"):
        params: dict[str, Any] = {"max_new_tokens": max_tokens, "details": True}
        if sampled:
            params.update(do_sample=True, temperature=0.8, top_p=0.9, top_k=40, seed=rng.randrange(1 << 31))
        if stop:
            params["stop"] = stop
        return {"inputs": prompt, "parameters": params}
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream,
                            "temperature": 0.8 if sampled else 0}
    if sampled:
        body.update(top_p=0.9, seed=rng.randrange(1 << 31))
    if stop:
        body["stop"] = stop
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _complete(route: str, stream: bool, r: RawResponse) -> bool:
    """Whether a 200 carries a whole answer, judged by the protocol, never by the text (a token may read "error"):
    an OpenAI stream is whole SSE events, none an error event, the last ``[DONE]``; an llm-serving stream is JSON
    lines (or SSE events), none an error, the last with its details."""
    text = r.body.decode("utf-8", "replace")
    if not stream:
        body = r.json()
        if route.startswith("tgi"):
            return isinstance(body, dict) and "generated_text" in body and bool(body.get("finish_reason"))
        return isinstance(body, dict) and all(c.get("finish_reason") for c in body.get("choices") or [{}])
    sse = r.headers.get("content-type", "").startswith("text/event-stream")
    if route.startswith("tgi"):
        frames = sse_events(text) if sse else text.split("\n")
        if not sse and frames.pop() != "":
            return False  # the last line was cut
        done = None
    else:
        frames, done = sse_events(text), "[DONE]"
        if not frames or frames.pop() != done:
            return False
    try:
        objects = [json.loads(frame) for frame in frames]
    except ValueError:
        return False
    if not objects or any(not isinstance(o, dict) or "error" in o for o in objects):
        return False
    return done is not None or bool(objects[-1].get("data", [{}])[0].get("details"))


def classify(r: RawResponse, complete: bool = True) -> str:
    if r.timed_out:
        return "hang"
    if r.status is not None and 200 <= r.status < 300:
        return "ok" if complete else "error"
    if r.status == 503 and r.is_json_error and "retry-after" in r.headers:
        return "overloaded"
    if r.status is not None and 400 <= r.status < 500 and r.is_json_error:
        return "refused"
    return "error"


async def _leave_early(ctx: Context, request: bytes, timeout: float) -> str:
    """Send a streamed request, read its first body bytes, hang up."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ctx.host, ctx.port), timeout)
    except (OSError, TimeoutError):
        return "error"
    try:
        writer.write(request)
        await writer.drain()
        data = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in data or data.endswith(b"\r\n\r\n"):
            chunk = await asyncio.wait_for(reader.read(4096), max(deadline - time.monotonic(), 0.01))
            if not chunk:
                break
            data += chunk
        status = data.split(b" ", 2)[1] if data.startswith(b"HTTP/") else b""
        return "disconnect" if status == b"200" else "error"
    except TimeoutError:
        return "hang"
    except (ConnectionError, OSError):
        return "error"
    finally:
        writer.close()


async def run(ctx: Context) -> dict[str, Any]:
    a = ctx.args
    rng = random.Random(a.soak_seed)
    model = await ctx.model_name()
    probe = await ctx.post_json("/v1/chat/completions", {})
    routes = ["tgi", "tgi_stream", "completions"] + (["chat"] if probe.status != 404 else [])
    paths = {"tgi": f"/models/{model}/generate", "tgi_stream": f"/models/{model}/generate_stream",
             "completions": "/v1/completions", "chat": "/v1/chat/completions"}
    hostile = [c for c in fuzz_cases(1500, a.soak_seed, model, ctx.api_key)
               if c.kind in HOSTILE_KINDS and not c.expect_no_response]
    headers = {"Content-Type": "application/json", **ctx.auth_headers()}
    counts: Counter[str] = Counter()
    errors: list[str] = []
    t0 = time.monotonic()
    deadline = t0 + a.soak_seconds
    sent = 0

    async def one() -> None:
        pick = rng.random()
        route = rng.choice(routes)
        stream = route == "tgi_stream" or (route in ("completions", "chat") and rng.random() < 0.5)
        if pick < 0.15:  # a client that leaves mid-stream
            leave = "tgi_stream" if route.startswith("tgi") else route
            body = _body(leave, model, rng, 200, True)
            if leave == "completions":
                body["ignore_eos"] = True
            request = http_request("POST", paths[leave], json.dumps(body).encode(), headers)
            outcome, what = await _leave_early(ctx, request, a.soak_request_timeout), f"leave {route}"
        elif pick < 0.35:
            case = rng.choice(hostile)
            r = await ctx.exchange(case.data, a.soak_request_timeout, case.half_close)
            outcome, what = classify(r), f"hostile {case.kind}/{case.route} {case.name} -> {r.status}"
        else:
            body = _body(route, model, rng, rng.randint(1, a.soak_max_tokens), stream)
            request = http_request("POST", paths[route], json.dumps(body).encode(), headers)
            r = await ctx.exchange(request, a.soak_request_timeout)
            outcome = classify(r, r.status != 200 or _complete(route, stream, r))
            what = f"{route} stream={stream} -> {r.status} {r.body[:120]!r}"
        counts[outcome] += 1
        if outcome in ("error", "hang") and len(errors) < 5:
            errors.append(f"{outcome}: {what}")

    async def worker() -> None:
        nonlocal sent
        while time.monotonic() < deadline and sent < a.soak_requests:
            sent += 1
            await one()

    ctx.log(f"soak: {a.soak_seconds:g} s, {a.soak_concurrency} clients, routes {', '.join(routes)}")
    await asyncio.gather(*(worker() for _ in range(a.soak_concurrency)))
    seconds = time.monotonic() - t0
    after = await ctx.wait_idle(a.soak_idle_timeout)
    status, _ = await ctx.health()
    figures: dict[str, Any] = {
        "seconds": round(seconds, 1), "sent": sent, "ok": counts["ok"],
        "clean_refusals": counts["refused"] + counts["overloaded"], "overloaded_503": counts["overloaded"],
        "disconnects": counts["disconnect"], "errors": counts["error"], "hangs": counts["hang"],
        "ok_per_s": round(counts["ok"] / seconds, 1) if seconds else 0.0,
        "kv_blocks_used_after": _figure(metric_total(after, "llm_serving_kv_blocks_used")),
        "requests_in_flight_after": _figure(metric_total(after, "llm_serving_requests_in_flight")),
        "healthy_after": int(status == 200), "first_errors": " | ".join(errors),
    }
    figures["passed"] = (figures["errors"] == 0 and figures["hangs"] == 0
                         and figures["kv_blocks_used_after"] == 0 and figures["healthy_after"] == 1)
    return figures


def _figure(value: float | None) -> int:
    return -1 if value is None else int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("soak")
    g.add_argument("--soak-seconds", type=float, default=60.0, help="seconds of load (default 60)")
    g.add_argument("--soak-requests", type=int, default=100_000, help="stop after this many requests")
    g.add_argument("--soak-concurrency", type=int, default=16, help="clients at once (default 16)")
    g.add_argument("--soak-max-tokens", type=int, default=32, help="largest max_new_tokens (default 32)")
    g.add_argument("--soak-request-timeout", type=float, default=120.0,
                   help="seconds one request may take before it counts as a hang (default 120)")
    g.add_argument("--soak-idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the server to go idle before reading the KV blocks in use")
    g.add_argument("--soak-seed", type=int, default=0)


SECTION = Section("soak", "bounded mixed load: ok, clean refusals, errors, hangs, KV blocks in use after",
                  run, add_arguments)
