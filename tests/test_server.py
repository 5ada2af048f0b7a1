"""The HTTP server end to end: ``python -m llm_serving serve`` in a subprocess on a free loopback port.

Most tests use stand-in agents (deterministic tokens, no MindSpore): sequence tokens follow
``t[i] = (t[i-1] * 31 + prompt_len + i) % vocab``, so answers are checked without a model. A "slow" server
(stand-in steps of 10 ms, decode batch 4, queue limit 2) makes disconnects, overload and the drain
observable. One test serves the embedded default model (tiny dims, small buckets) through MindSpore.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 1000  # default_model.vocab_size: the stand-in answers modulo the model's vocabulary
EOS = 2
PROMPTS = ["Hello", "The river ran past the old mill and", "Numbers: 1 2 3", "Ünïcödé and emoji 🙂 too",
           "Once upon a time, in a small village by the sea, there lived", "tea?"]


class ServerProcess:
    """``llm-serving serve`` on port 0; the URL comes from its "ready" line."""

    def __init__(self, data_dir: Path, *args: str, timeout: float = 120.0, prefix: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir  # where the embedded (seeded random) model it serves is built
        cmd = [*prefix, sys.executable, "-m", "llm_serving", "serve", "--port", "0",
               "--set", f"default_model.data_dir={data_dir}", "--set", "default_model.weights=random", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            ready = [m for line in list(self.lines) if (m := re.search(r"ready in .* at (http://\S+)", line))]
            if ready:
                self.url = ready[0].group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("server did not become ready:\n" + self.output)
            else:
                time.sleep(0.05)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("server did not exit after the signal:\n" + self.output) from None
        self._reader.join(5)
        return code

    def shm_segments(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"llmserving_{self.proc.pid}_")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-data")


@pytest.fixture(scope="module")
def fast(data_dir):
    server = ServerProcess(data_dir, "--standin-agents")
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def slow(data_dir):
    server = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01",
                           "--decode-batch-size", "4", "--set", "serving_config.max_queue_size=2")
    yield server
    assert server.stop() == 0, server.output


# ---- helpers ---------------------------------------------------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


async def post(url: str, body, headers=None, raw: bytes | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body)
        async with s.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


async def stream_lines(url: str, body, headers=None) -> tuple[int, str, list[str]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        lines = [line.decode().rstrip("\n") async for line in r.content]
        return r.status, r.headers.get("Content-Type", ""), [x for x in lines if x.strip()]


def sse_payloads(lines: list[str]) -> list[str]:
    assert all(x.startswith("data: ") for x in lines), lines[:3]
    return [x[len("data: "):] for x in lines]


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value.replace("+Inf", "inf"))
    return out


def check_standin_tokens(ids: list[int], prompt_len: int, reason: str) -> None:
    """The stand-in's recurrence holds, and the finish reason matches the last token."""
    for i in range(1, len(ids)):
        assert ids[i] == (ids[i - 1] * 31 + prompt_len + i) % VOCAB
    assert EOS not in ids[:-1]
    assert reason == ("eos_token" if ids[-1] == EOS else "length")


def generate_url(server: ServerProcess, stream: bool = False, name: str = "llama2") -> str:
    return f"{server.url}/models/{name}/generate{'_stream' if stream else ''}"


# ---- llm-serving API --------------------------------------------------------------------------------------------
def test_health_models_and_metrics(fast):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{fast.url}/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ready"
            async with s.get(f"{fast.url}/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
                assert ids == ["llama2"]
        m = await metrics(fast.url)
        for name in ("llm_serving_running_batch_size", "llm_serving_queue_length", "llm_serving_kv_blocks_used",
                     "llm_serving_kv_blocks_free", "llm_serving_time_to_first_token_seconds_count",
                     "llm_serving_time_per_output_token_seconds_count", 'llm_serving_requests_total{outcome="success"}',
                     "llm_serving_generation_tokens_total"):
            assert name in m
    run(go())


def test_vllm_metric_names_scraped_from_a_served_run(fast):
    """vLLM's names, types, ``model_name`` label and buckets beside ours, counting what this run did."""
    from llm_serving.api.vllm_metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

    lab = '{engine="0",model_name="llama2"}'

    def hist(m: dict[str, float], name: str, what: str) -> float:
        return m.get(f"vllm:{name}_{what}{lab}", 0.0)

    async def go():
        before = await metrics(fast.url)
        for i in range(3):
            status, res, _ = await post(fast.url + "/v1/completions", {"prompt": f"count {i} then", "max_tokens": 4,
                                                                       "temperature": 0, "ignore_eos": True})
            assert status == 200, res
        m = await metrics(fast.url)
        for name in ("num_requests_running", "num_requests_waiting"):
            assert m[f"vllm:{name}{lab}"] >= 0
        assert 0 <= m[f"vllm:kv_cache_usage_perc{lab}"] <= 1
        assert m[f"vllm:num_preemptions_total{lab}"] >= 0
        queried = m[f"vllm:prefix_cache_queries_total{lab}"] - before.get(f"vllm:prefix_cache_queries_total{lab}", 0)
        assert queried >= 3 * 3  # every started prompt is looked up, a few tokens each
        assert 0 <= m[f"vllm:prefix_cache_hits_total{lab}"] <= m[f"vllm:prefix_cache_queries_total{lab}"]
        assert m[f"vllm:prefix_cache_queries_total{lab}"] == m["llm_serving_engine_prefix_cache_queried_tokens"]
        for name, per_request in (("time_to_first_token_seconds", 1), ("inter_token_latency_seconds", 3),
                                  ("e2e_request_latency_seconds", 1)):
            assert hist(m, name, "count") - hist(before, name, "count") == 3 * per_request, name
            assert hist(m, name, "sum") > hist(before, name, "sum")
        assert m["vllm:time_to_first_token_seconds_count" + lab] == m["llm_serving_time_to_first_token_seconds_count"]
        async with aiohttp.ClientSession() as s, s.get(f"{fast.url}/metrics") as r:
            text = await r.text()
        for name, buckets in (("time_to_first_token_seconds", TTFT_BUCKETS), ("inter_token_latency_seconds",
                              ITL_BUCKETS), ("e2e_request_latency_seconds", E2E_BUCKETS)):
            les = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
                   if line.startswith(f"vllm:{name}_bucket")]
            assert les == [str(float(b)) for b in buckets] + ["+Inf"], name
            assert f"# TYPE vllm:{name} histogram" in text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f"# TYPE vllm:{name} gauge" in text
        for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
            assert f"# TYPE vllm:{name}_total counter" in text  # (prometheus_client names the family so)
    run(go())


def test_served_model_names_max_model_len_and_one_models_card(data_dir):
    """``--served-model-name`` (the first is the main name; ids may hold slashes), ``--max-model-len`` and
    ``GET /v1/models/{id}`` (404 with OpenAI's error body for a name not served)."""
    server = ServerProcess(data_dir, "--standin-agents", "--served-model-name", "org/llama-3", "short",
                           "--max-model-len", "256")
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{server.url}/v1/models") as r:
                    cards = (await r.json())["data"]
                assert [c["id"] for c in cards] == ["org/llama-3", "short"]
                assert {c["max_model_len"] for c in cards} == {256} and {c["root"] for c in cards} == {"org/llama-3"}
                async with s.get(f"{server.url}/v1/models/org/llama-3") as r:
                    assert r.status == 200 and (await r.json())["id"] == "org/llama-3"
                async with s.get(f"{server.url}/v1/models/llama2") as r:
                    body = await r.json()
                    assert r.status == 404 and body["error"]["code"] == "model_not_found", body
                    assert body["error"]["type"] == "invalid_request_error"
            status, res, _ = await post(generate_url(server, name="short"), {"inputs": "hi",
                                                                            "parameters": {"max_new_tokens": 2}})
            assert status == 200, res
        run(go())
    finally:
        assert server.stop() == 0, server.output


def test_max_model_len_from_the_model_is_capped_by_the_kv_cache(data_dir, capsys):
    from llm_serving.cli.commands.serve import build_parser, load_config
    from llm_serving.config.serving_config import ConfigError
    from llm_serving.engine.wiring import resolve_model

    base = ["--set", f"default_model.data_dir={data_dir}", "--set", "default_model.weights=random"]
    cfg = load_config(build_parser().parse_args([*base, "--max-model-len", "model"]))
    positions = resolve_model(load_config(build_parser().parse_args(base)), None, tokenizer=False
                              ).llama_config.max_position_embeddings
    assert cfg.max_model_len == min(positions, (cfg.pa_config.num_blocks - 1) * cfg.pa_config.block_size)
    assert "max model length" in capsys.readouterr().err
    blocks = positions // 16  # one block short of the model's positions (block 0 is the padding block)
    small = load_config(build_parser().parse_args([*base, "--set", f"pa_config.num_blocks={blocks}",
                                                   "--max-model-len", "model"]))
    assert small.max_model_len == (blocks - 1) * 16 < positions
    assert "below the model's max_position_embeddings" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--max-model-len: expected a number of tokens or 'model'"):
        load_config(build_parser().parse_args([*base, "--max-model-len", "lots"]))


def test_generate_and_stream_agree(fast):
    async def one(prompt: str, n: int):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": "False",
                                                 "return_full_text": "True", "details": "True"}, "stream": "True"}
        status, res, _ = await post(generate_url(fast), {**body, "stream": False})
        assert status == 200, res
        ids = [t["id"] for t in res["tokens"]]
        assert res["generated_tokens"] == len(ids) and 1 <= len(ids) <= n
        check_standin_tokens(ids, res["prompt_tokens"], res["finish_reason"])
        assert "".join(t["text"] for t in res["tokens"]) == res["generated_text"]

        status, ctype, lines = await stream_lines(generate_url(fast, stream=True), body)
        assert status == 200 and "ndjson" in ctype
        items = [json.loads(x)["data"][0] for x in lines]  # what the contest's client does
        *token_items, last = items
        assert "".join(i["generated_text"] for i in token_items) == res["generated_text"]
        assert last["generated_text"] == res["generated_text"] and last["tokens"] is None  # return_full_text
        assert [i["tokens"]["id"] for i in token_items] == ids
        assert last["details"]["finish_reason"] == res["finish_reason"]
        assert all(json.loads(x)["event"] == "message" and json.loads(x)["retry"] == 30000 for x in lines)

        for url, headers in ((generate_url(fast, True), {"Accept": "text/event-stream"}),
                             (generate_url(fast, True) + "?sse=true", None)):
            status, ctype, lines = await stream_lines(url, {**body, "parameters": {"max_new_tokens": n}}, headers)
            assert status == 200 and ctype.startswith("text/event-stream")
            texts = [json.loads(p)["data"][0]["generated_text"] for p in sse_payloads(lines)]
            assert "".join(texts) == res["generated_text"] and len(texts) == len(ids)  # no full-text line
        return res

    async def go():
        results = [await one(p, n) for p, n in zip(PROMPTS, (1, 5, 17, 40, 9, 64))]
        assert len({r["generated_text"] for r in results}) == len(results)
    run(go())


def test_concurrent_streams(fast):
    """Dozens of simultaneous streams each get exactly their own tokens."""
    n_streams = 48

    async def one(s: aiohttp.ClientSession, i: int):
        body = {"inputs": f"{PROMPTS[i % len(PROMPTS)]} #{i}", "parameters": {"max_new_tokens": 20 + i % 13}}
        async with s.post(generate_url(fast, stream=True), json=body) as r:
            assert r.status == 200
            items = [json.loads(x)["data"][0] async for x in r.content if x.strip()]
        async with s.post(generate_url(fast), json=body) as r:
            ref = await r.json()
        assert "".join(x["generated_text"] for x in items) == ref["generated_text"]
        assert [x["tokens"]["id"] for x in items] == [t["id"] for t in ref["tokens"]]

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*(one(s, i) for i in range(n_streams)))
        m = await metrics(fast.url)
        assert m["llm_serving_kv_blocks_used"] == 0 and m["llm_serving_requests_in_flight"] == 0
        assert m["llm_serving_engine_steps_total"] > 0
    run(go())


def test_stop_strings(fast):
    async def go():
        body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 30}}
        _, full, _ = await post(generate_url(fast), body)
        texts = [t["text"] for t in full["tokens"]]
        k = next(i for i in range(3, len(texts)) if texts[i] and texts[i + 1])  # a stop across two tokens
        start = sum(len(t) for t in texts[:k]) + len(texts[k]) - 1
        stop = full["generated_text"][start:start + 2]
        expected = full["generated_text"][: full["generated_text"].index(stop)]
        with_stop = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 30, "stop": [stop, "never seen"]}}
        status, res, _ = await post(generate_url(fast), with_stop)
        assert status == 200 and res["generated_text"] == expected and res["finish_reason"] == "stop_sequence"
        assert len(res["tokens"]) == k + 2 and "".join(t["text"] for t in res["tokens"]) == expected
        _, _, lines = await stream_lines(generate_url(fast, True), with_stop)
        assert "".join(json.loads(x)["data"][0]["generated_text"] for x in lines) == expected
        streamed = {**with_stop, "parameters": {**with_stop["parameters"], "details": True}}
        _, _, lines = await stream_lines(generate_url(fast, True), streamed)
        assert json.loads(lines[-1])["data"][0]["details"]["finish_reason"] == "stop_sequence"
        m = await metrics(fast.url)
        assert m['llm_serving_request_finish_total{reason="stop"}'] >= 2 and m["llm_serving_kv_blocks_used"] == 0
    run(go())


def test_stop_string_over_several_tokens_openai_both_modes(fast):
    client = openai.OpenAI(base_url=f"{fast.url}/v1", api_key="unused", max_retries=0, timeout=30)
    prompt = PROMPTS[2]
    full = client.completions.create(model="llama2", prompt=prompt, max_tokens=30, temperature=0, logprobs=0)
    text, offsets = full.choices[0].text, full.choices[0].logprobs.text_offset + [len(full.choices[0].text)]
    k = next(i for i in range(2, len(offsets) - 3) if all(offsets[j] < offsets[j + 1] for j in (i, i + 1, i + 2)))
    stop = text[offsets[k + 1] - 1: offsets[k + 2] + 1]  # last char of token k .. first char of token k + 2
    expected = text[: text.index(stop)]
    done = client.completions.create(model="llama2", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, "stop")
    chunks = [c.choices[0] for c in client.completions.create(model="llama2", prompt=prompt, max_tokens=30,
                                                              temperature=0, stop=stop, stream=True)]
    assert "".join(c.text for c in chunks) == expected and chunks[-1].finish_reason == "stop"
    assert all(stop not in c.text for c in chunks)


# ---- OpenAI API -------------------------------------------------------------------------------------------------
def test_openai_client(fast):
    client = openai.OpenAI(base_url=f"{fast.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["llama2"]
    for prompt in PROMPTS[:3]:
        _, ref, _ = run(post(generate_url(fast), {"inputs": prompt, "parameters": {"max_new_tokens": 12}}))
        done = client.completions.create(model="llama2", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        choice = done.choices[0]
        assert choice.text == ref["generated_text"]
        assert choice.finish_reason == ("stop" if ref["finish_reason"] == "eos_token" else "length")
        assert done.usage.prompt_tokens == ref["prompt_tokens"]
        assert done.usage.completion_tokens == ref["generated_tokens"]
        assert choice.logprobs.token_logprobs == [t["logprob"] for t in ref["tokens"]]
        chunks = list(client.completions.create(model="llama2", prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["generated_text"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert chunks[-1].usage.completion_tokens == ref["generated_tokens"]

    two = client.completions.create(model="llama2", prompt=PROMPTS[:2], max_tokens=5, temperature=0, echo=True)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text[: len(p)] for c, p in zip(two.choices, PROMPTS[:2])] == PROMPTS[:2]
    streamed = ["", ""]
    for c in client.completions.create(model="llama2", prompt=PROMPTS[:2], max_tokens=5, temperature=0, echo=True,
                                       stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in two.choices]

    sampled = client.completions.create(model="llama2", prompt="hi", max_tokens=4, seed=3)  # temperature 1
    assert sampled.choices[0].finish_reason in ("stop", "length") and sampled.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="top_p must be <= 1"):
        client.completions.create(model="llama2", prompt="hi", max_tokens=4, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="logprobs must be <= 5"):
        client.completions.create(model="llama2", prompt="hi", max_tokens=4, logprobs=6)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="llama2", prompt="hi", max_tokens=-3, temperature=0)


# ---- bad input -------------------------------------------------------------------------------------------------
BAD_REQUESTS = [  # (path, body or raw bytes, status, error_type)
    ("/models/llama2/generate", b"{not json", 400, "invalid_json"),
    ("/models/llama2/generate", b"", 400, "invalid_json"),
    ("/models/llama2/generate", b"[" * 100000, 400, "invalid_json"),
    ("/models/llama2/generate", [1, 2], 400, "invalid_request"),
    ("/models/llama2/generate", {"parameters": {"max_new_tokens": 5}}, 400, "invalid_request"),
    ("/models/llama2/generate", {"inputs": 42}, 400, "invalid_request"),
    ("/models/llama2/generate_stream", {"inputs": ""}, 400, "invalid_request"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"max_new_tokens": -5}}, 400, "invalid_request"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10**12}}, 400, "invalid_request"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"max_new_tokens": "ten"}}, 400, "invalid_request"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"top_p": 3}}, 400, "invalid_request"),
    ("/models/llama2/generate_stream", {"inputs": "word " * 2000}, 400, "prompt_too_long"),
    ("/models/llama2/generate", {"inputs": "x" * (2 << 20)}, 413, "payload_too_large"),
    ("/models/llama_7b/generate", {"inputs": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "invalid_request"),  # OpenAI's range is 0..5
    ("/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": "5"}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": [10**6], "temperature": 0}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "x", "temperature": 0, "model": "nope"}, 404, "model_not_found"),
    ("/v2/nothing", {}, 404, "not_found"),
]
NAMED_FIELD_BAD = [  # (path, body, the field the 400 message must name): sampling values, engine limits
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"do_sample": "True", "temperature": -1}},
     "temperature"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"do_sample": True, "top_p": 1.5}}, "top_p"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"top_k": -1}}, "top_k"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10**6}}, "max_new_tokens"),
    ("/models/llama2/generate_stream", {"inputs": "x", "parameters": {"stop": ["a", ""]}}, "stop"),
    ("/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, -1], "temperature": 0}, "prompt"),
]
BAD_REQUESTS += [(path, body, 400, "invalid_request") for path, body, _ in NAMED_FIELD_BAD]


def test_bad_inputs_get_json_4xx_and_leave_the_server_serving(fast):
    async def go():
        before = await metrics(fast.url)
        for path, body, status, kind in BAD_REQUESTS:
            raw = body if isinstance(body, bytes) else None
            got, res, _ = await post(fast.url + path, body, raw=raw)
            assert (got, res.get("error_type")) == (status, kind), (path, str(body)[:80], res)
            message = res["error"]["message"] if path.startswith("/v1/") else res["error"]
            assert isinstance(message, str) and message
        for path, body, field in NAMED_FIELD_BAD:
            _, res, _ = await post(fast.url + path, body)
            assert field in (res["error"]["message"] if path.startswith("/v1/") else res["error"]), res
        async with aiohttp.ClientSession() as s, s.get(generate_url(fast)) as r:
            assert r.status == 405 and (await r.json())["error_type"] == "method_not_allowed"
        after = await metrics(fast.url)
        refused = sum(1 for p, *_ in BAD_REQUESTS if p != "/v2/nothing") + len(NAMED_FIELD_BAD)  # posted twice
        assert after['llm_serving_requests_total{outcome="rejected"}'] - before[
            'llm_serving_requests_total{outcome="rejected"}'] == refused
        status, res, _ = await post(generate_url(fast), {"inputs": "still fine", "parameters": {"max_new_tokens": 3}})
        assert status == 200 and res["generated_tokens"] >= 1
    run(go())


# ---- disconnects, overload, drain (slow stand-in steps) ---------------------------------------------------------
def long_completion(n: int = 300, stream: bool = True) -> dict:
    return {"prompt": "a long story", "max_tokens": n, "temperature": 0, "stream": stream, "ignore_eos": True}


async def wait_metric(url: str, name: str, predicate, timeout: float = 3.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(url)
        if predicate(m[name]) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.02)


def test_client_disconnect_aborts_and_frees_blocks(slow):
    aborted = 'llm_serving_requests_total{outcome="aborted"}'

    async def go():
        base = (await metrics(slow.url))[aborted]
        # stream: leave after the first chunk
        async with aiohttp.ClientSession() as s, s.post(f"{slow.url}/v1/completions", json=long_completion()) as r:
            assert r.status == 200
            await r.content.readline()
            m = await metrics(slow.url)
            assert m["llm_serving_running_batch_size"] == 1 and m["llm_serving_kv_blocks_used"] > 0
        t0 = time.monotonic()
        m = await wait_metric(slow.url, "llm_serving_kv_blocks_used", lambda v: v == 0)
        assert m["llm_serving_kv_blocks_used"] == 0 and time.monotonic() - t0 < 2.0  # generating would take 3 s
        assert m[aborted] == base + 1 and m["llm_serving_running_batch_size"] == 0

        with pytest.raises(asyncio.TimeoutError):  # non-streamed: the client gives up waiting
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4)) as s:
                await s.post(f"{slow.url}/v1/completions", json=long_completion(stream=False))
        m = await wait_metric(slow.url, aborted, lambda v: v == base + 2)
        assert m[aborted] == base + 2 and m["llm_serving_kv_blocks_used"] == 0
    run(go())


def test_overload_gives_503(slow):
    async def go():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(f"{slow.url}/v1/completions", json=long_completion(60, stream=False)) as r:
                    return r.status, await r.json(), r.headers
            results = await asyncio.gather(*(one() for _ in range(12)))
        statuses = [st for st, _, _ in results]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2  # at least max_queue_size get in
        for status, body, headers in results:
            if status == 503:
                assert body["error_type"] == "overloaded" and "max_queue_size" in body["error"]["message"]
                assert headers["Retry-After"]
            else:
                assert body["usage"]["completion_tokens"] == 60
        m = await metrics(slow.url)
        assert m['llm_serving_requests_total{outcome="overloaded"}'] == statuses.count(503)
    run(go())


def test_a_flood_past_the_wait_bound_gets_503_with_retry_after(data_dir):
    """serving_config.max_queue_wait_s (here any wait at all, once the drain rate is measured): a flood gets JSON 503
    "overloaded" with Retry-After for the requests that would queue behind others, and the admitted ones complete."""
    server = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01", "--decode-batch-size", "4",
                           "--set", "serving_config.max_queue_wait_s=0.000001")

    async def go():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(f"{server.url}/v1/completions", json=long_completion(16, stream=False)) as r:
                    return r.status, await r.json(), r.headers
            results = []
            for _ in range(5):  # the first flood measures the drain rate (nothing refused before); a later one meets it
                results += await asyncio.gather(*(one() for _ in range(12)))
                if any(st == 503 for st, _, _ in results):
                    break
        statuses = [st for st, _, _ in results]
        assert set(statuses) == {200, 503}  # at most four running and one queued before the first one ends
        for status, body, headers in results:
            if status == 503:
                assert body["error_type"] == "overloaded" and "max_queue_wait_s" in body["error"]["message"]
                assert int(headers["Retry-After"]) >= 1
            else:
                assert body["usage"]["completion_tokens"] == 16
        m = await wait_metric(server.url, "llm_serving_kv_blocks_used", lambda v: v == 0)
        assert m['llm_serving_requests_total{outcome="overloaded"}'] == statuses.count(503)
        assert m["llm_serving_kv_blocks_used"] == 0 and m["llm_serving_queue_length"] == 0
    try:
        run(go())
    finally:
        assert server.stop() == 0, server.output


def test_sigterm_drains_and_frees_shared_memory(data_dir):
    server = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01",
                           "--set", "serving_config.drain_timeout_s=1.0")
    try:
        assert server.shm_segments()

        async def go():
            async with aiohttp.ClientSession() as s:
                long = await s.post(f"{server.url}/v1/completions", json=long_completion(500))
                short = await s.post(f"{server.url}/v1/completions", json=long_completion(40))
                await long.content.readline()
                await short.content.readline()
                server.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                await asyncio.sleep(0.2)
                with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting connections
                    async with aiohttp.ClientSession() as fresh:
                        await fresh.get(f"{server.url}/health")
                short_frames = sse_payloads([x.decode().strip() async for x in short.content if x.strip()])
                long_frames = sse_payloads([x.decode().strip() async for x in long.content if x.strip()])
                waited = time.monotonic() - t0
            assert (short_frames[-1] == "[DONE]"
                    and json.loads(short_frames[-2])["choices"][0]["finish_reason"] == "length")
            assert long_frames[-1] == "[DONE]" and json.loads(long_frames[-2])["choices"][0]["finish_reason"] == "abort"
            assert 0.8 < waited < 3.0  # drain_timeout_s, then aborted (generating all would take 5 s)
        run(go())
        assert server.stop(timeout=15) == 0, server.output
        assert "draining 2 request(s)" in server.output and "aborting 1 request(s)" in server.output
        assert server.shm_segments() == []
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


# ---- the real (tiny) model ---------------------------------------------------------------------------------------
def test_tiny_default_model_end_to_end(data_dir):
    server = ServerProcess(
        data_dir, "--set", "default_model.weights=random", "--set", "default_model.hidden_size=64",
        "--set", "default_model.intermediate_size=128",
        "--set", "default_model.num_layers=2", "--set", "model_config.seq_length=[32]",
        "--set", "model_config.prefill_batch_size=[2]", "--set", "model_config.decode_batch_size=[4]",
        "--set", "pa_config.num_blocks=40", "--set", "pa_config.decode_seq_length=96",
        "--set", "model_config.max_generate_length=64", "--set", "model_config.model_name=llama_tiny")
    try:
        assert "warmed decode" in server.output

        async def go():
            results = []
            for prompt in PROMPTS[:4]:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "return_full_text": "True"},
                        "stream": True}
                status, res, _ = await post(generate_url(server, name="llama_tiny"), {**body, "stream": False})
                assert status == 200 and 1 <= res["generated_tokens"] <= 12, res
                assert all(t["logprob"] <= 0 for t in res["tokens"])
                _, _, lines = await stream_lines(generate_url(server, True, name="llama2"), body)  # the alias
                items = [json.loads(x)["data"][0] for x in lines]
                assert "".join(i["generated_text"] for i in items[:-1]) == items[-1]["generated_text"]
                assert items[-1]["generated_text"] == res["generated_text"]
                results.append(res)
            return results

        results = run(go())
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model="llama_tiny", prompt=PROMPTS[:4], max_tokens=12, temperature=0)
        assert [c.text for c in done.choices] == [r["generated_text"] for r in results]  # batched == alone

        async def sampled(seed: int) -> list[str]:  # do_sample without a temperature: HF's default 1.0
            texts = []
            for prompt in PROMPTS[:4]:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": "True", "seed": seed,
                                                         "details": True}}
                status, res, _ = await post(generate_url(server, name="llama_tiny"), body)
                assert status == 200 and res["details"]["seed"] == seed, res
                _, _, lines = await stream_lines(generate_url(server, True, name="llama_tiny"), body)
                assert "".join(json.loads(x)["data"][0]["generated_text"] for x in lines) == res["generated_text"]
                texts.append(res["generated_text"])
            return texts

        drawn = run(sampled(5))
        assert sum(d != r["generated_text"] for d, r in zip(drawn, results)) >= 2  # sampled, not greedy

        async def at_temperature_0() -> list[str]:  # do_sample with temperature 0 is greedy, as on every route
            texts = []
            for prompt in PROMPTS[:4]:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": "True", "temperature": 0,
                                                         "seed": 5}}
                status, res, _ = await post(generate_url(server, name="llama_tiny"), body)
                assert status == 200, res
                texts.append(res["generated_text"])
            return texts

        assert run(at_temperature_0()) == [r["generated_text"] for r in results]
        assert run(sampled(6)) != drawn
        # OpenAI's default temperature 1 with the same seed, four prompts in one batch: the same draws
        done = client.completions.create(model="llama_tiny", prompt=PROMPTS[:4], max_tokens=12, seed=5)
        assert [c.text for c in done.choices] == drawn
        assert server.stop() == 0, server.output
        assert server.shm_segments() == []
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_model_directory_is_served_at_its_own_length_unless_a_config_sets_one(tmp_path, capsys):
    """As vLLM: ``--model DIR`` with no length chosen serves the model's max_position_embeddings (capped by the KV
    cache); the prefill buckets longer than that are dropped; a YAML or ``--set`` length is kept."""
    from llm_serving.cli.commands.serve import build_parser, load_config
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig

    model = build_random_model(tmp_path / "m", LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                           num_hidden_layers=1, num_attention_heads=2,
                                                           num_key_value_heads=1, max_position_embeddings=200))
    cfg = load_config(build_parser().parse_args(["--model", str(model)]))
    assert cfg.max_model_len == 200 and cfg.model_config.seq_length == (64, 200)
    err = capsys.readouterr().err
    assert "max model length 200: the model's max_position_embeddings" in err and "-> [64, 200]" in err
    assert load_config(build_parser().parse_args(["--model", str(model), "--set", "pa_config.decode_seq_length=300"])
                       ).max_model_len == 300
    (tmp_path / "c.yaml").write_text("pa_config:\n  decode_seq_length: 96\nmodel_config:\n  seq_length: [64]\n")
    assert load_config(build_parser().parse_args(["--model", str(model), "--config", str(tmp_path / "c.yaml")])
                       ).max_model_len == 96
