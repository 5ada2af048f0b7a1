"""``POST /v1/chat/completions`` end to end (``llm-serving serve`` in a subprocess, as in test_server), and chat
prompt files offline (``llm-serving generate``, ``LLM.chat``).

The reference for every answer is the completions route (or ``generate``) given the prompt ids that the chat
template renders (test_chat_template checks those ids against transformers). Stand-in agents answer
deterministically from the prompt; one test serves the tiny real model through MindSpore.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from test_server import ROOT, ServerProcess, metrics, post, run, sse_payloads, wait_metric

from llm_serving.config.serving_config import ServingConfig
from llm_serving.models.default_model import default_model_dir, ensure_default_model
from llm_serving.tokenization.chat_template import (
    LLAMA2_CHAT_TEMPLATE,
    ChatTemplate,
    check_messages,
    load_chat_template,
)
from llm_serving.tokenization.tokenizer import Tokenizer
from tests.tiny_engine import TINY_SERVED

SYSTEM = {"role": "system", "content": "Answer in one short sentence."}
CHATS = [
    [{"role": "user", "content": "Hello"}],
    [SYSTEM, {"role": "user", "content": "Why does the river run past the old mill?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Ünïcödé and emoji 🙂, please."}],
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chat-serve-data")


@pytest.fixture(scope="module")
def fast(data_dir):
    server = ServerProcess(data_dir, "--standin-agents")
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def slow(data_dir):
    server = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01", "--decode-batch-size", "4")
    yield server
    assert server.stop() == 0, server.output


def served_model_dir(data_dir: Path, sets: dict | None = None) -> Path:
    """The embedded model a server started with ``--set k=v`` for ``sets`` serves."""
    cfg = ServingConfig().with_values({"default_model.data_dir": str(data_dir), "default_model.weights": "random",
                                       **(sets or {})})
    return default_model_dir(cfg.default_model, cfg.max_model_len)


def default_template(data_dir: Path, sets: dict | None = None) -> ChatTemplate:
    tok = Tokenizer(served_model_dir(data_dir, sets) / "tokenizer.model")
    return ChatTemplate(LLAMA2_CHAT_TEMPLATE, "default", tok)


def client_for(server: ServerProcess, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout)


# ---- the OpenAI client ----------------------------------------------------------------------------------------
def test_chat_equals_completions_on_the_rendered_prompt(fast, data_dir):
    client, template = client_for(fast), default_template(data_dir)
    assert "chat template: the Llama-2 chat format (default)" in fast.output
    for chat in CHATS:
        ids = template.prompt_ids(check_messages(chat))
        ref = client.completions.create(model="llama2", prompt=ids, max_tokens=12, temperature=0, logprobs=1)
        done = client.chat.completions.create(model="llama2", messages=chat, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=1)
        assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
        choice = done.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", ref.choices[0].text)
        assert choice.finish_reason == ref.choices[0].finish_reason
        assert done.usage.model_dump() == ref.usage.model_dump() and done.usage.prompt_tokens == len(ids)
        content = choice.logprobs.content
        assert [c.logprob for c in content] == ref.choices[0].logprobs.token_logprobs
        assert [c.token for c in content] == ref.choices[0].logprobs.tokens
        assert all(c.top_logprobs[0].token == c.token and bytes(c.bytes).decode("utf-8", "replace") for c in content)

        chunks = list(client.chat.completions.create(model="llama2", messages=chat, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == done.usage.model_dump()
        assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1


def test_chat_sampling_limits_and_stop(fast, data_dir):
    client, template = client_for(fast), default_template(data_dir)
    chat = CHATS[1]
    five = client.chat.completions.create(model="llama2", messages=chat, max_completion_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert (five.usage.completion_tokens, five.choices[0].finish_reason) == (5, "length")
    assert client.chat.completions.create(model="llama2", messages=chat, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content == \
        five.choices[0].message.content
    full = client.chat.completions.create(model="llama2", messages=chat, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[5:8]
    for stream in (False, True):
        res = client.chat.completions.create(model="llama2", messages=chat, max_tokens=30, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            parts = [c.choices[0] for c in res]
            text, reason = "".join(p.delta.content or "" for p in parts), parts[-1].finish_reason
        else:
            text, reason = res.choices[0].message.content, res.choices[0].finish_reason
        assert (text, reason) == (full[: full.index(stop)], "stop")
    drawn = [client.chat.completions.create(model="llama2", messages=chat, max_tokens=8, seed=3, top_p=0.9)
             for _ in range(2)]  # OpenAI's default temperature 1: sampled, reproducible with a seed
    assert drawn[0].choices[0].message.content == drawn[1].choices[0].message.content
    without = client.chat.completions.create(model="llama2", messages=chat, temperature=0)  # no max_tokens
    assert without.usage.prompt_tokens == len(template.prompt_ids(check_messages(chat)))
    assert without.usage.completion_tokens >= 1


def test_raw_stream_frames(fast):
    async def go():
        body = {"messages": CHATS[0], "max_tokens": 4, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(f"{fast.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            lines = [x.decode().strip() async for x in r.content if x.strip()]
        payloads = sse_payloads(lines)
        assert payloads[-1] == "[DONE]"
        frames = [json.loads(p) for p in payloads[:-1]]
        assert frames[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}
        assert all("usage" not in f for f in frames)
        assert frames[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    run(go())


# ---- bad requests ----------------------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
BAD_CHATS = [  # (body, status, error_type, text the message must contain)
    ({}, 400, "invalid_request", "missing 'messages'"),
    ({"messages": []}, 400, "invalid_request", "non-empty list"),
    ({"messages": "hi"}, 400, "invalid_request", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request", "messages[0].content must be"),
    ({"messages": [{"role": "user"}]}, 400, "invalid_request", "content is missing"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "invalid_request",
     "the chat template refused the messages: Llama-2 chat: after an optional first system message"),
    ({"messages": [SYSTEM]}, 400, "invalid_request", "needs a user message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "unsupported", "only text parts"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": "a"}]}, 400, "invalid_request",
     "the chat template refused the messages"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "invalid_request",
     "tools[0].function.name must be"),
    ({"messages": USER, "response_format": {"type": "grammar"}}, 400, "unsupported", "response_format type"),
    ({"messages": USER, "n": 200}, 400, "invalid_request", "n must be <= 128"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request", "top_logprobs must be <= 20"),
    ({"messages": USER, "top_logprobs": 0}, 400, "invalid_request", "top_logprobs needs logprobs=true"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, 400, "invalid_request", "disagree"),
    ({"messages": USER, "max_completion_tokens": 10**6}, 400, "invalid_request", "max_completion_tokens 1000000"),
    ({"messages": USER, "max_tokens": 0}, 400, "invalid_request", "max_tokens must be >= 1"),
    ({"messages": USER, "temperature": 3}, 400, "invalid_request", "temperature must be <= 2"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, 400, "invalid_request", "only allowed with"),
    ({"messages": USER, "prompt": "x"}, 400, "invalid_request", "unknown key(s) 'prompt'"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "prompt_too_long", "messages has"),
    ({"messages": USER, "model": "gpt-4"}, 404, "model_not_found", "not served here"),
]


def test_bad_chat_requests_get_json_4xx_and_leave_the_server_serving(fast):
    async def go():
        before = await metrics(fast.url)
        for body, status, kind, text in BAD_CHATS:
            got, res, _ = await post(f"{fast.url}/v1/chat/completions", body)
            assert (got, res.get("error_type")) == (status, kind), (body, res)
            assert text in res["error"]["message"] and res["error"]["code"] == kind, (text, res)
            assert res["error"]["type"] == "invalid_request_error", res
        after = await metrics(fast.url)
        key = 'llm_serving_requests_total{outcome="rejected"}'
        assert after[key] - before[key] == len(BAD_CHATS)
    run(go())
    client = client_for(fast)
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):
        client.chat.completions.create(model="llama2", messages=[SYSTEM, *USER, *USER], temperature=0)
    with pytest.raises(openai.BadRequestError, match="tool_choice must be none, auto, required"):
        client.chat.completions.create(model="llama2", messages=USER, tool_choice={"type": "function"}, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert client.chat.completions.create(model="llama2", messages=USER, max_tokens=2).usage.completion_tokens >= 1


# ---- disconnects and metrics (slow stand-in steps) ------------------------------------------------------------------
def test_disconnect_frees_the_sequence_and_metrics_count(slow):
    aborted, success = 'llm_serving_requests_total{outcome="aborted"}', 'llm_serving_requests_total{outcome="success"}'
    body = {"messages": CHATS[1], "max_tokens": 300, "temperature": 0, "ignore_eos": True}

    async def go():
        base = await metrics(slow.url)
        async with aiohttp.ClientSession() as s, \
                s.post(f"{slow.url}/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # the role chunk, written before the request's first step: wait for it
            m = await wait_metric(slow.url, "llm_serving_running_batch_size", lambda v: v == 1)
            assert m["llm_serving_running_batch_size"] == 1 and m["llm_serving_kv_blocks_used"] > 0
        t0 = time.monotonic()
        m = await wait_metric(slow.url, "llm_serving_kv_blocks_used", lambda v: v == 0)
        assert m["llm_serving_kv_blocks_used"] == 0 and time.monotonic() - t0 < 2.0  # generating takes 3 s
        assert m[aborted] == base[aborted] + 1

        with pytest.raises(asyncio.TimeoutError):  # non-streamed: the client gives up waiting
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4)) as s:
                await s.post(f"{slow.url}/v1/chat/completions", json=body)
        m = await wait_metric(slow.url, aborted, lambda v: v == base[aborted] + 2)
        assert m[aborted] == base[aborted] + 2 and m["llm_serving_kv_blocks_used"] == 0

        status, res, _ = await post(f"{slow.url}/v1/chat/completions", {**body, "max_tokens": 3})
        assert status == 200 and res["usage"]["completion_tokens"] == 3
        m = await metrics(slow.url)
        assert m[success] == base[success] + 1
        assert m["llm_serving_prompt_tokens_total"] - base["llm_serving_prompt_tokens_total"] == \
            3 * res["usage"]["prompt_tokens"]
        assert m['llm_serving_request_finish_total{reason="length"}'] >= 1
    run(go())


# ---- templates from the model directory and the YAML ------------------------------------------------------------
MODEL_DIR_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def test_served_template_comes_from_the_model_directory_or_the_yaml(data_dir, fast, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(served_model_dir(data_dir), model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": MODEL_DIR_TEMPLATE, "legacy": False}))
    own = tmp_path / "own.jinja"
    own.write_text("{{ bos_token }}{{ messages[-1]['content'] }} =>")
    tok = Tokenizer(model / "tokenizer.model")
    for extra, origin in (((), str(model / "tokenizer_config.json")),
                          (("--set", f"tokenizer.chat_template={own}"), f"{own} (tokenizer.chat_template)")):
        server = ServerProcess(data_dir, "--standin-agents", "--model", str(model), *extra)
        try:
            assert f"chat template: {origin}" in server.output
            cfg = ServingConfig.from_dict({"tokenizer": {"chat_template": str(own)}} if extra else {})
            ids = load_chat_template(cfg, model, tok).prompt_ids(check_messages(CHATS[2]))
            client = client_for(server)
            done = client.chat.completions.create(model="llama2", messages=CHATS[2], max_tokens=6, temperature=0)
            ref = client.completions.create(model="llama2", prompt=ids, max_tokens=6, temperature=0)
            assert done.usage.prompt_tokens == len(ids) and done.choices[0].message.content == ref.choices[0].text
        finally:
            assert server.stop() == 0, server.output

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    res = subprocess.run([sys.executable, "-m", "llm_serving", "serve", "--port", "0", "--standin-agents",
                          "--set", f"default_model.data_dir={data_dir}", "--set", f"tokenizer.chat_template={bad}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1 and "start-up failed" in res.stderr and "is not valid Jinja" in res.stderr, res


# ---- the real (tiny) model ---------------------------------------------------------------------------------------
def test_tiny_model_greedy_chat_equals_completions(tiny_server):
    client, template = client_for(tiny_server, timeout=60), default_template(tiny_server.data_dir, TINY_SERVED)
    for chat in CHATS:
        ids = template.prompt_ids(check_messages(chat))
        ref = client.completions.create(model="llama2", prompt=ids, max_tokens=10, temperature=0)
        done = client.chat.completions.create(model="llama2", messages=chat, max_tokens=10, temperature=0)
        assert done.choices[0].message.content == ref.choices[0].text
        assert done.usage.model_dump() == ref.usage.model_dump()
        streamed = client.chat.completions.create(model="llama2", messages=chat, max_tokens=10, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == ref.choices[0].text


# ---- offline: llm-serving generate and LLM.chat -------------------------------------------------------------------
def test_generate_reads_chat_prompt_files(tmp_path):
    sections = {"default_model": {"data_dir": str(tmp_path / "models"), "weights": "random"},
                "model_config": {"seq_length": [128], "prefill_batch_size": [2], "decode_batch_size": [4]}}
    config = tmp_path / "chat.yaml"
    config.write_text(yaml.safe_dump(sections))
    cfg = ServingConfig.from_yaml(config)
    template = ChatTemplate(LLAMA2_CHAT_TEMPLATE, "default",
                            Tokenizer(ensure_default_model(cfg.default_model, cfg.max_model_len) / "tokenizer.model"))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([CHATS[0], {"messages": CHATS[1]}, "plain text"]))

    def cli(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llm_serving", "generate", "--config", str(config),
                               "--prompts", str(path), "--max-new-tokens", "4", "--standin-agents"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)

    res = cli(prompts)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.strip()]
    assert [x.get("messages") for x in lines] == [CHATS[0], CHATS[1], None]
    assert [x["prompt_ids"] for x in lines[:2]] == [template.prompt_ids(check_messages(c)) for c in CHATS[:2]]
    assert lines[2]["prompt"] == "plain text"

    prompts.write_text(json.dumps([[{"role": "robot", "content": "hi"}]]))
    res = cli(prompts)
    assert res.returncode == 2 and "item 0 of" in res.stderr and "messages[0].role must be one of" in res.stderr
    prompts.write_text(json.dumps(["fine", [{"role": "assistant", "content": "hi"}]]))
    res = cli(prompts)
    assert res.returncode == 2 and "item 1 of" in res.stderr and "the chat template refused it" in res.stderr

    from llm_serving.engine.llm import LLM

    with LLM(cfg, standin_agents=True, progress=None) as llm:
        chats = llm.chat(CHATS, max_new_tokens=4)
        plain = llm.generate([template.prompt_ids(check_messages(c)) for c in CHATS], max_new_tokens=4)
        assert [r.token_ids for r in chats] == [r.token_ids for r in plain]
        assert [r.prompt_ids for r in chats] == [r.prompt_ids for r in plain]
