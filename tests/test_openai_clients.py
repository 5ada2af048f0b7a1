"""The OpenAI API as benchmark and evaluation clients use it (issue 30's first part): ``stream_options`` as OpenAI
(``"usage": null`` in every chunk but the last) and vLLM (``continuous_usage_stats``, which guidellm always sends)
send them; an explicit ``max_tokens`` past the context refused with 400 and the numbers, as vLLM does, while an
absent one is clipped; unsupported parameters a 400 (``openai.BadRequestError``) with OpenAI's error object (a
string ``code``); vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in the shapes lm-evaluation-harness'
remote tokenizer reads. One server with stand-in agents (the real tokenizer and chat template)."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from test_server import post, run, sse_payloads

from llm_serving.config.serving_config import ServingConfig
from llm_serving.models.default_model import default_model_dir
from llm_serving.tokenization.tokenizer import Tokenizer
from tests.tiny_engine import openai_client


@pytest.fixture(scope="module")
def server(standin_server):
    return standin_server


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    cfg = ServingConfig().with_values({"default_model.data_dir": str(server.data_dir),
                                       "default_model.weights": "random"})
    return Tokenizer(default_model_dir(cfg.default_model, cfg.max_model_len) / "tokenizer.model")



async def stream_chunks(url: str, body: dict) -> list[dict]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        lines = [x for x in (await r.text()).split("\n") if x]
    payloads = sse_payloads(lines)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}),
])
def test_stream_usage_null_then_the_total_and_continuous_usage(server, path, body):
    body = {**body, "temperature": 0, "stream": True}
    plain = run(stream_chunks(server.url + path, body))
    assert all("usage" not in c for c in plain)
    chunks = run(stream_chunks(server.url + path, {**body, "stream_options": {"include_usage": True}}))
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    total = chunks[-1]["usage"]
    assert total["completion_tokens"] == 6 and total["total_tokens"] == total["prompt_tokens"] + 6
    # guidellm's request: every content chunk carries the usage so far, the last one the total
    counted = run(stream_chunks(server.url + path, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}))
    so_far = [c["usage"]["completion_tokens"] for c in counted[:-1]]
    assert so_far == sorted(so_far) and so_far[-1] == 6 and counted[-1]["usage"] == total
    assert all(c["usage"]["prompt_tokens"] == total["prompt_tokens"] for c in counted)


def test_an_explicit_max_tokens_past_the_context_is_a_400_an_absent_one_is_clipped(server, tokenizer):
    client = openai_client(server)
    prompt = "word " * 150  # about 300 tokens of the 512 the default config serves
    n = len(tokenizer.encode(prompt))
    with pytest.raises(openai.BadRequestError, match=rf"prompt \({n} tokens\) \+ max_tokens \(300\) = {n + 300} "
                                                     "exceeds max_model_len 512") as err:
        client.completions.create(model="llama2", prompt=prompt, max_tokens=300, temperature=0)
    assert err.value.body["code"] == "invalid_request" and err.value.body["param"] == "max_tokens"
    messages = [{"role": "user", "content": prompt}]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="llama2", messages=messages, max_tokens=300, temperature=0)
    answer = client.chat.completions.create(model="llama2", messages=messages, temperature=0)  # no max_tokens
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= 512


def test_unsupported_parameters_are_bad_requests_with_openais_error_object(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama2", prompt="hi", max_tokens=2, suffix="!", temperature=0)
    assert err.value.status_code == 400
    assert err.value.body == {"message": err.value.body["message"], "type": "invalid_request_error",
                              "param": "suffix", "code": "unsupported"}
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and isinstance(err.value.body["code"], str)


def test_tokenize_detokenize_and_tokenizer_info_in_vllms_shapes(server, tokenizer):
    """What lm-evaluation-harness' RemoteTokenizer asks: tokenizer_info's special tokens and chat template, then
    /tokenize without special tokens and /detokenize."""
    url = server.url
    _, info, _ = run(get_json(f"{url}/tokenizer_info"))
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>") and "[INST]" in info["chat_template"]
    assert info["model_max_length"] == 512 and info["vocab_size"] == tokenizer.vocab_size
    text = "Hello world, naïve café"
    status, res, _ = run(post(f"{url}/tokenize", {"prompt": text, "add_special_tokens": False}))
    assert status == 200 and res["tokens"] == tokenizer.encode(text, add_bos=False), res
    assert res["count"] == len(res["tokens"]) and res["max_model_len"] == 512 and res["token_strs"] is None
    _, with_bos, _ = run(post(f"{url}/tokenize", {"model": "llama2", "prompt": text, "return_token_strs": True}))
    assert with_bos["tokens"] == tokenizer.encode(text) and with_bos["token_strs"][0] == "<s>"
    messages = [{"role": "user", "content": "Hello"}]
    _, chat, _ = run(post(f"{url}/tokenize", {"messages": messages}))
    completion = openai_client(server).chat.completions.create(model="llama2", messages=messages, max_tokens=1)
    assert chat["count"] == completion.usage.prompt_tokens
    status, res, _ = run(post(f"{url}/detokenize", {"tokens": tokenizer.encode(text, add_bos=False)}))
    assert status == 200 and res == {"prompt": text}
    for path, body, phrase in [("/tokenize", {}, "either 'prompt'"), ("/tokenize", {"prompt": "x", "bogus": 1},
                                                                        "unknown key"),
                               ("/detokenize", {"tokens": [10**7]}, "outside the vocabulary"),
                               ("/detokenize", {"tokens": "1 2"}, "list of token ids")]:
        status, res, _ = run(post(url + path, body))
        assert status == 400 and phrase in res["error"]["message"], (path, res)
    status, res, _ = run(post(f"{url}/tokenize", {"model": "gpt-4", "prompt": "x"}))
    assert status == 404 and res["error"]["code"] == "model_not_found"


async def get_json(url: str) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(), dict(r.headers)


def test_a_priority_is_refused_unless_the_policy_is_priority(server):
    """vLLM's rule and words: a nonzero priority needs scheduler.policy "priority" (this server runs fcfs); 0 is
    the default and always accepted."""
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="Got priority 3 but Priority scheduling is not enabled") as err:
        client.completions.create(model="llama2", prompt="hi", max_tokens=2, temperature=0, extra_body={"priority": 3})
    assert err.value.body["param"] == "priority"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="Got priority -1"):
        client.chat.completions.create(model="llama2", messages=messages, max_tokens=2, extra_body={"priority": -1})
    answer = client.chat.completions.create(model="llama2", messages=messages, max_tokens=2,
                                            extra_body={"priority": 0, "ignore_eos": True})
    assert answer.usage.completion_tokens == 2
