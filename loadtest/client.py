"""Async load-test client: the contest's ``test_serving_performance.py`` flags, vLLM ``bench serve`` metrics.

Compatible with the contest script: ``-X/--qps``, ``-P/--port``, ``-O/--out_dir``, ``-T/--test_time`` and an
alpaca json read from ``./alpaca_5010.json`` by default; it sends ``int(test_time * qps)`` requests cycling
through the dataset in order, each ``{"inputs": instruction[":" + input], "parameters": {"max_new_tokens":
<tokens of the reference output>, "do_sample": "False", "return_full_text": "True"}, "stream": true}`` to
``/models/<model>/generate_stream``, and writes ``result_<qps>_x.json`` with the contest's per-request fields.

Beyond the contest script it offers real arrival processes, a concurrency cap, the ``full`` and OpenAI
endpoints, a time-bounded run (per-request timeout), metrics and plots (see ``loadtest.report``).

Token counts: with ``--tokenizer`` the served sentencepiece model counts prompt tokens (with ``<s>``) and
``max_new_tokens`` (reference output, without ``<s>``, like the contest's ``tokenizer.tokenize``). Without it
both are estimated as ``ceil(words * --tokens-per-word)`` over whitespace-separated words, +1 for ``<s>`` on
prompts (1.3 suits English with a Llama-2 vocabulary). The server's own counts replace these when it reports them
(``generated_tokens``/``prompt_tokens`` of ``generate``, stream ``details``, OpenAI ``usage``, which is
requested with ``stream_options.include_usage``); otherwise a stream counts one token per line (per line
with ``tokens`` info when the server sends it) or per OpenAI chunk with text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtest import report as bench_report

DEFAULT_DATASET = "./alpaca_5010.json"
DEFAULT_PORT = 8000
ENDPOINTS = ("stream", "full", "openai")
ARRIVALS = ("poisson", "gamma", "constant")
RUNNING_BATCH_GAUGE = "llm_serving_running_batch_size"
PROG = "test_serving_performance"


class BenchError(ValueError):
    """Bad flags, dataset or target: the run cannot start."""


# ------------------------------------------------------------------------------------------ requests
@dataclass
class BenchRequest:
    index: int
    prompt: str
    max_new_tokens: int
    prompt_tokens: int


@dataclass
class RequestResult:
    """What one request did; times are seconds on the benchmark clock (0 = first request sent)."""

    index: int
    prompt: str
    prompt_tokens: int
    max_new_tokens: int
    streamed: bool = True
    success: bool = False
    error: str = ""
    text: str = ""
    output_tokens: int = 0
    finish_reason: str | None = None
    send_time: float = 0.0
    end_time: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each output chunk
    full_text_checked: bool | None = None  # stream + return_full_text: the last line equalled the chunks

    @property
    def latency(self) -> float | None:
        return self.end_time - self.send_time if self.success else None

    @property
    def itl(self) -> list[float]:
        if not self.streamed:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not (self.success and self.streamed and self.ttft is not None and self.output_tokens > 1):
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The contest's fields (input, resp_text, res_time, first_token_time) followed by ours."""
        return {
            "input": self.prompt, "resp_text": self.text, "res_time": self.latency,
            "first_token_time": self.ttft, "index": self.index, "success": self.success, "error": self.error,
            "prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
            "output_tokens": self.output_tokens, "finish_reason": self.finish_reason,
            "send_time": self.send_time, "end_time": self.end_time, "tpot": self.tpot, "itl": self.itl,
            "full_text_checked": self.full_text_checked,
        }


class TokenCounter:
    """Counts tokens with the served tokenizer when given, else estimates from whitespace-separated words."""

    def __init__(self, tokenizer_path: str | Path | None = None, tokens_per_word: float = 1.3):
        if tokens_per_word <= 0:
            raise BenchError(f"--tokens-per-word must be > 0, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word
        self._sp = None
        self.path: Path | None = None
        if tokenizer_path is not None:
            # sentencepiece itself rather than llm_serving.tokenizer, so this package needs nothing from the
            # server it measures; imported here because only --tokenizer uses it.
            import sentencepiece as spm

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.model"
            if not path.is_file():
                raise BenchError(f"--tokenizer: tokenizer model not found: {path}")
            sp = spm.SentencePieceProcessor()
            try:
                sp.Load(str(path))
            except (OSError, RuntimeError) as e:
                raise BenchError(f"--tokenizer: cannot load sentencepiece model {path}: {e}") from e
            self._sp, self.path = sp, path

    @property
    def method(self) -> str:
        if self._sp is not None:
            return f"tokenizer {self.path}"
        return f"estimate: ceil(words x {self.tokens_per_word})"

    def count(self, text: str, add_bos: bool) -> int:
        if self._sp is not None:  # Llama's <s> is one id in front of the pieces
            return len(self._sp.encode(text)) + int(add_bos)
        return math.ceil(len(text.split()) * self.tokens_per_word) + int(add_bos)


def load_dataset(path: str | Path) -> list[dict[str, str]]:
    """Read an alpaca json list of ``{"instruction", "input", "output"}`` (strings), checking every record."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"dataset {path} not found (make one with scripts/make_workload.py)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read dataset {path}: {e}") from e
    if not isinstance(data, list) or not data:
        raise BenchError(f"dataset {path} must be a non-empty json list of alpaca records")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise BenchError(f"dataset {path} record {i} is {type(rec).__name__}, expected an object")
        for key in ("instruction", "input", "output"):
            if not isinstance(rec.get(key), str):
                raise BenchError(f"dataset {path} record {i}: key {key!r} missing or not a string")
    return data


def contest_prompt(record: dict[str, str]) -> str:
    return record["instruction"] + ":" + record["input"] if record["input"] else record["instruction"]


def build_requests(records: Sequence[dict[str, str]], num_prompts: int, counter: TokenCounter,
                   shuffle: bool = False, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests cycling through the records in order (or a seeded shuffle of them)."""
    order = np.arange(len(records))
    if shuffle:
        np.random.default_rng(seed).shuffle(order)
    out = []
    for i in range(num_prompts):
        rec = records[int(order[i % len(records)])]
        prompt = contest_prompt(rec)
        out.append(BenchRequest(i, prompt, max(counter.count(rec["output"], add_bos=False), 1),
                                counter.count(prompt, add_bos=True)))
    return out


def arrival_offsets(n: int, qps: float, process: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Send times in seconds after the first request (which goes at 0).

    poisson: exponential gaps of mean 1/qps; gamma: gaps of mean 1/qps with shape ``burstiness`` (< 1 is
    burstier, 1 is Poisson); constant: exactly 1/qps apart; qps = inf sends everything at once.
    """
    if process not in ARRIVALS:
        raise BenchError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    if not qps > 0:
        raise BenchError(f"-X/--qps must be > 0, got {qps}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if n <= 1 or math.isinf(qps):
        return np.zeros(max(n, 0))
    rng = np.random.default_rng(seed)
    mean = 1.0 / qps
    if process == "poisson":
        gaps = rng.exponential(mean, n - 1)
    elif process == "gamma":
        gaps = rng.gamma(burstiness, mean / burstiness, n - 1)
    else:
        gaps = np.full(n - 1, mean)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# -------------------------------------------------------------------------------------------- protocol
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
            return {"model": self.model_name, "prompt": req.prompt, "max_tokens": req.max_new_tokens,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
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
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:  # e.g. a frame of the wrong shape
        res.error = f"malformed response: {type(e).__name__}: {e}"
    res.end_time = res.chunk_times[-1] if res.success and not res.streamed else now()
    return res


def parse_gauge(text: str, name: str) -> float | None:
    """Sum of a Prometheus gauge's samples over its label sets, or None when absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", re.MULTILINE)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None


async def _scrape(cfg: BenchConfig, now: Callable[[], float], samples: list[tuple[float, float]],
                  stop: asyncio.Event) -> None:
    """Poll the server's running-batch gauge until ``stop``; give up quietly if it is not served.

    Its own session, so a full connection pool of streaming requests never delays a scrape.
    """
    url = f"{cfg.base_url}/metrics"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            try:
                async with session.get(url) as resp:
                    value = parse_gauge(await resp.text(), RUNNING_BATCH_GAUGE) if resp.status == 200 else None
            except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
                value = None
            if value is None and not samples:
                return  # no gauge on this server
            if value is not None:
                samples.append((now(), value))
            try:
                await asyncio.wait_for(stop.wait(), cfg.metrics_interval)
            except TimeoutError:
                pass


# ----------------------------------------------------------------------------------------------- the run
class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.tty = self.enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = 0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        t = time.perf_counter()
        decile = self.done * 10 // self.total
        if self.tty and (t - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = t
            self.stream.write("\r" + self._line(t))
        elif not self.tty and decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line(t) + "\n")
        self.stream.flush()

    def _line(self, t: float) -> str:
        filled = 30 * self.done // self.total
        return (f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                f"failed {self.failed} {t - self.start:7.1f}s")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class BenchRun:
    config: BenchConfig
    results: list[RequestResult]
    duration: float  # first request sent -> last response done: the contest's total time
    server_batch: list[tuple[float, float]]
    metrics: dict[str, Any]


async def benchmark(requests: Sequence[BenchRequest], cfg: BenchConfig, progress: bool = True) -> BenchRun:
    """Send ``requests`` on the configured arrival schedule and collect results and metrics."""
    offsets = arrival_offsets(len(requests), cfg.qps, cfg.arrival, cfg.burstiness, cfg.seed)
    bar = ProgressBar(len(requests), progress)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # aiohttp would silently cap concurrency at 100
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    samples: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        async def one(req: BenchRequest) -> RequestResult:
            if gate is None:
                res = await send_request(session, cfg, req, now)
            else:
                async with gate:
                    res = await send_request(session, cfg, req, now)
            bar.update(res.success)
            return res

        stop = asyncio.Event()
        scraper = asyncio.create_task(_scrape(cfg, now, samples, stop)) if cfg.metrics_interval else None
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = offset - now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = now()
        stop.set()
        if scraper is not None:
            await scraper
    bar.close()
    metrics = bench_report.compute_metrics(results, duration, samples)
    return BenchRun(cfg, results, duration, samples, metrics)


async def wait_ready(cfg: BenchConfig, seconds: float) -> None:
    """Poll ``GET /health`` until it answers 200, or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{cfg.base_url}/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.2)
    raise BenchError(f"server at {cfg.base_url} not ready after {seconds:g}s ({last})")


def save_run(run: BenchRun, out_dir: str | Path, settings: dict[str, Any], plots: bool = True) -> dict[str, Path]:
    """Write result_<qps>_x.json (per request), summary json, markdown report and PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"{float(run.config.qps)}_x"  # the contest names its file result_{x}_x.json with x a float
    paths = {"results": out / f"result_{suffix}.json", "summary": out / f"summary_{suffix}.json",
             "report": out / f"report_{suffix}.md"}
    paths["results"].write_text(json.dumps([r.to_json() for r in run.results], ensure_ascii=False))
    summary = {"settings": settings, "metrics": run.metrics, "server_running_batch": run.server_batch}
    paths["summary"].write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    pngs = bench_report.write_plots(run.results, run.duration, out, suffix, run.server_batch) if plots else []
    paths.update({p.stem: p for p in pngs})
    paths["report"].write_text(bench_report.markdown_report(run.metrics, settings, [p.name for p in pngs]))
    return paths


# ---------------------------------------------------------------------------------------------------- CLI
DESCRIPTION = ("Load-test an llm-serving (or OpenAI-compatible) server the way the contest's "
               "test_serving_performance.py does, with vLLM-style metrics.")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tool's flags, for its own parser or an ``llm-serving bench`` subparser."""
    p.add_argument("-X", "--qps", type=float, default=1.0, help="mean request rate in req/s; inf = all at once")
    p.add_argument("-P", "--port", type=int, default=DEFAULT_PORT, help="server port (%(default)s)")
    p.add_argument("-O", "--out_dir", "--out-dir", dest="out_dir", default="bench_results",
                   help="directory for results, report and plots (%(default)s)")
    p.add_argument("-T", "--test_time", "--test-time", dest="test_time", type=float, default=3600.0,
                   help="seconds of arrivals: sends int(test_time * qps) requests unless --num-prompts")
    p.add_argument("--dataset_path", "--dataset-path", "--dataset", dest="dataset_path", default=DEFAULT_DATASET,
                   help="alpaca json [{instruction, input, output}] (%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="server host (%(default)s)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="stream",
                   help="stream: /models/<m>/generate_stream; full: /models/<m>/generate; "
                        "openai: /v1/completions with SSE (%(default)s)")
    p.add_argument("--model-name", default="llama2", help="model name in the URL / OpenAI body (%(default)s)")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="arrival process (%(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: <1 burstier, 1 = poisson (%(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="number of requests (overrides -T)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed for arrivals and --shuffle (%(default)s)")
    p.add_argument("--shuffle", action="store_true", help="sample the dataset in a seeded random order")
    p.add_argument("--tokenizer", default=None, help="sentencepiece tokenizer.model (or its dir) for counting")
    p.add_argument("--tokens-per-word", type=float, default=1.3,
                   help="token estimate per whitespace word without --tokenizer (%(default)s)")
    p.add_argument("--return-full-text", action=argparse.BooleanOptionalAction, default=True,
                   help="send return_full_text like the contest (stream's last line = whole text)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request limit in s (%(default)s)")
    p.add_argument("--metrics-interval", type=float, default=0.5,
                   help=f"s between GET /metrics scrapes of {RUNNING_BATCH_GAUGE}; 0 = off (%(default)s)")
    p.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many s for GET /health")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _num_prompts(args: argparse.Namespace) -> int:
    if args.num_prompts is not None:
        n = args.num_prompts
    elif math.isinf(args.qps):
        raise BenchError("-X/--qps inf sends everything at once: give --num-prompts")
    else:
        n = int(args.test_time * args.qps)  # the contest's count
    if n < 1:
        raise BenchError(f"nothing to send: {n} requests (check -T/--test_time, -X/--qps, --num-prompts)")
    return n


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the load test; exit 0 if every request succeeded, 1 if some failed, 2 if it could not run."""
    return run_args(build_parser(prog).parse_args(argv), prog)


def run_args(args: argparse.Namespace, prog: str = PROG) -> int:
    """``main`` after parsing: the entry point for a subcommand that registered ``add_arguments``."""
    try:
        cfg = BenchConfig(host=args.host, port=args.port, endpoint=args.endpoint, model_name=args.model_name,
                          qps=args.qps, arrival=args.arrival, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, seed=args.seed,
                          return_full_text=args.return_full_text, request_timeout=args.request_timeout,
                          metrics_interval=max(args.metrics_interval, 0.0))
        arrival_offsets(2, cfg.qps, cfg.arrival, cfg.burstiness)  # validate before loading anything
        n = _num_prompts(args)
        counter = TokenCounter(args.tokenizer, args.tokens_per_word)
        requests = build_requests(load_dataset(args.dataset_path), n, counter, args.shuffle, args.seed)
        if args.wait_ready > 0:
            asyncio.run(wait_ready(cfg, args.wait_ready))
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"{prog}: {n} requests to {cfg.url()} at {cfg.qps:g} req/s ({cfg.arrival}), "
          f"token counts by {counter.method}", file=sys.stderr)
    run = asyncio.run(benchmark(requests, cfg, progress=not args.no_progress))
    settings = {**asdict(cfg), "url": cfg.url(), "dataset": str(args.dataset_path), "num_prompts": n,
                "token_counting": counter.method}
    paths = save_run(run, args.out_dir, settings, plots=not args.no_plots)
    print(bench_report.format_console(run.metrics))
    unchecked = sum(1 for r in run.results if r.success and r.full_text_checked is False)
    if unchecked:
        print(f"warning: {unchecked} streams' last line did not equal the concatenated chunks "
              "(return_full_text line missing or different)", file=sys.stderr)
    print(f"results: {paths['results']}  report: {paths['report']}")
    return 0 if run.metrics["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
