"""One timed request over HTTP: the URL and body per endpoint, and reading each kind of response.

Endpoints: ``stream`` posts the contest's body ``{"inputs", "parameters": {"max_new_tokens", "do_sample":
"False", "return_full_text": "True"}, "stream": true}`` to ``/models/<model>/generate_stream``; ``full`` the
same unstreamed to ``/models/<model>/generate``; ``openai`` a streamed ``/v1/completions`` request.

Token counts: the server's own counts replace the client's when it reports them (``generated_tokens``/
``prompt_tokens`` of ``generate``, stream ``details``, OpenAI ``usage``, which is requested with
``stream_options.include_usage``); otherwise a stream counts one token per line (per line with ``tokens``
info when the server sends it) or per OpenAI chunk with text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from llm_serving.bench import BenchError
from llm_serving.bench.results import RequestResult
from loadtest.dataset import BenchRequest

DEFAULT_PORT = 8000
ENDPOINTS = ("stream", "full", "openai")


@dataclass
class BenchConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    endpoint: str = "stream"
    model_name: str = "llama2"
    qps: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    return_full_text: bool = True  # the contest's body; the stream's last line then carries the whole text
    request_timeout: float = 600.0
    metrics_interval: float = 0.5  # seconds between GET /metrics scrapes; 0 disables
    ignore_eos: bool = False  # OpenAI endpoint: vLLM's ignore_eos, so every output has max_new_tokens tokens

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout > 0:
            raise BenchError(f"--request-timeout must be > 0, got {self.request_timeout}")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def url(self) -> str:
        if self.endpoint == "openai":
            return f"{self.base_url}/v1/completions"
        path = "generate_stream" if self.endpoint == "stream" else "generate"
        return f"{self.base_url}/models/{self.model_name}/{path}"

    def body(self, req: BenchRequest) -> dict[str, Any]:
        if self.endpoint == "openai":
            body = {"model": self.model_name, "prompt": req.prompt if req.prompt_ids is None else req.prompt_ids,
                    "max_tokens": req.max_new_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if self.ignore_eos:
                body["ignore_eos"] = True
            return body
        if req.prompt_ids is not None or self.ignore_eos:
            raise BenchError("token-id prompts and ignore_eos need the openai endpoint")
        params = {"max_new_tokens": req.max_new_tokens, "do_sample": "False",
                  "return_full_text": "True" if self.return_full_text else "False"}
        return {"inputs": req.prompt, "parameters": params, "stream": self.endpoint == "stream"}


class _ServerError(Exception):
    """The response said the request failed (an error object inside a 200 stream, or a bad frame)."""


async def _lines(resp: aiohttp.ClientResponse, now: Callable[[], float]):
    """Yield (arrival time, stripped non-empty line) as bytes arrive; no line-length limit."""
    buf = b""
    async for chunk in resp.content.iter_any():
        t = now()
        buf += chunk
        *complete, buf = buf.split(b"\n")
        for line in complete:
            if line.strip():
                yield t, line.strip().decode("utf-8")
    if buf.strip():
        yield now(), buf.strip().decode("utf-8")


def _json_frame(line: str) -> dict[str, Any] | None:
    """Parse one stream line; accepts bare JSON lines and SSE ``data:`` frames, skips other SSE fields."""
    if line.startswith("data:"):
        line = line[5:].strip()
    elif re.match(r"^(event|id|retry):|^:", line):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _ServerError(f"bad stream line {line[:80]!r}: {e}") from None
    if not isinstance(obj, dict):
        raise _ServerError(f"stream line is not an object: {line[:80]!r}")
    if "error" in obj:
        raise _ServerError(f"server error in stream: {obj['error']}")
    return obj


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, cfg: BenchConfig,
                       now: Callable[[], float]) -> None:
    texts: list[str] = []
    has_token: list[bool] = []  # whether the line carried token info (a text-only flush line does not)
    server_count = None
    async for t, line in _lines(resp, now):
        obj = _json_frame(line)
        if obj is None:
            continue
        try:
            item = obj["data"][0]
            texts.append(item["generated_text"])
        except (KeyError, IndexError, TypeError):
            raise _ServerError(f"stream line lacks data[0].generated_text: {line[:80]!r}") from None
        res.chunk_times.append(t)
        has_token.append(bool(item.get("tokens")))
        details = item.get("details")
        if isinstance(details, dict):
            server_count = details.get("generated_tokens", server_count)
            res.finish_reason = details.get("finish_reason", res.finish_reason)
    if not texts:
        raise _ServerError("stream ended without any message line")
    if cfg.return_full_text:
        # The last line should repeat the whole answer; it is not a new token.
        res.full_text_checked = len(texts) >= 2 and "".join(texts[:-1]) == texts[-1]
        if res.full_text_checked:
            texts.pop()
            res.chunk_times.pop()
            has_token.pop()
    res.text = "".join(texts)
    if server_count:
        res.output_tokens = int(server_count)
    else:  # one line per token; count only token lines when the server says which those are
        res.output_tokens = sum(has_token) if any(has_token) else len(res.chunk_times)


async def _read_openai(resp: aiohttp.ClientResponse, res: RequestResult, now: Callable[[], float]) -> None:
    texts: list[str] = []
    usage_tokens = None
    done = False
    async for t, line in _lines(resp, now):
        if not line.startswith("data:"):
            continue  # SSE comments and other fields
        if line[5:].strip() == "[DONE]":
            done = True
            break
        obj = _json_frame(line)
        usage = obj.get("usage") if obj else None
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
            res.prompt_tokens = int(usage.get("prompt_tokens", res.prompt_tokens))
        choices = obj.get("choices") if obj else None
        if not choices:
            continue
        text = choices[0].get("text") or ""
        reason = choices[0].get("finish_reason")
        res.finish_reason = reason or res.finish_reason
        if text or not reason:  # a closing chunk with only a finish_reason carries no token
            texts.append(text)
            res.chunk_times.append(t)
    if not done:
        raise _ServerError("SSE stream ended without 'data: [DONE]'")
    if not texts:
        raise _ServerError("SSE stream carried no completion text")
    res.text = "".join(texts)
    res.output_tokens = usage_tokens if usage_tokens is not None else len(res.chunk_times)


async def _read_full(resp: aiohttp.ClientResponse, res: RequestResult, now: Callable[[], float]) -> None:
    try:
        obj = json.loads(await resp.text())
        res.text = obj["generated_text"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise _ServerError("generate response is not a json object with 'generated_text'") from None
    res.chunk_times.append(now())  # the whole answer arrives at once: TTFT = E2E
    res.finish_reason = obj.get("finish_reason")
    count = obj.get("generated_tokens")
    if isinstance(obj.get("prompt_tokens"), int):  # the server's own count beats our estimate
        res.prompt_tokens = obj["prompt_tokens"]
    if count is None and isinstance(obj.get("tokens"), list):
        count = len(obj["tokens"])
    res.output_tokens = int(count) if count is not None else 1


def _http_error(status: int, body: str) -> str:
    """``HTTP <status> <error_type>: <message>`` from either error shape of the API, else the raw body."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        message, kind = obj["error"], obj.get("error_type")
        if isinstance(message, dict):  # OpenAI shape
            kind = kind or message.get("type")
            message = message.get("message", message)
        return f"HTTP {status} {kind}: {message}" if kind else f"HTTP {status}: {message}"
    return f"HTTP {status}: {body[:200]}".replace("\n", " ")


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig, req: BenchRequest,
                       now: Callable[[], float]) -> RequestResult:
    """Send one request and time it; never raises (failures are recorded in the result)."""
    res = RequestResult(req.index, req.prompt, req.prompt_tokens, req.max_new_tokens,
                        streamed=cfg.endpoint != "full")
    res.send_time = now()
    try:
        async with session.post(cfg.url(), json=cfg.body(req)) as resp:
            if resp.status != 200:
                raise _ServerError(_http_error(resp.status, await resp.text()))
            if cfg.endpoint == "stream":
                await _read_stream(resp, res, cfg, now)
            elif cfg.endpoint == "openai":
                await _read_openai(resp, res, now)
            else:
                await _read_full(resp, res, now)
        res.ttft = res.chunk_times[0] - res.send_time
        res.success = True
    except _ServerError as e:
        res.error = str(e)
    except TimeoutError:
        res.error = f"timeout after {cfg.request_timeout:g}s"
    except (aiohttp.ClientError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:  # e.g. a frame of wrong shape
        res.error = f"malformed response: {type(e).__name__}: {e}"
    res.end_time = res.chunk_times[-1] if res.success and not res.streamed else now()
    return res
