"""OpenAI's ``n`` and ``best_of`` on the real engine and through the routes: the choices of a prompt share its KV
blocks (the first computes the prompt, the others start on its cached blocks), each draws from its own seed
stream (``seed + j``), so choice j is exactly the separate request with that seed; streams interleave the choices
by ``index``; ``best_of`` returns the n of highest total logprob; usage counts the prompt once."""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import openai
import pytest
from test_server import run, sse_payloads

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from tests.tiny_engine import openai_client, tiny_engine_config

PROMPT = [1] + [17 + (i * 37) % 900 for i in range(37)]  # 38 tokens: 4 full blocks of 8 and 6 more


def test_choices_share_the_prompt_blocks_and_equal_separate_seeded_requests(tmp_path):
    cfg = tiny_engine_config(tmp_path, model_config={"seq_length": [64]},
                             pa_config={"num_blocks": 40, "decode_seq_length": 96})
    sampled = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8)
    with Engine(cfg) as engine:
        engine.start(progress=None)
        streams = [engine.submit(PROMPT, _with_seed(sampled, 11 + j), f"n-{j}", follows="n-0" if j else None)
                   for j in range(4)]
        together = [s.result(timeout=120) for s in streams]
        shared = engine.stats()["prefix_cache_hit_tokens"]
    assert shared == 3 * 32  # three choices started on the first one's four full prompt blocks
    assert len({tuple(r.token_ids) for r in together}) > 1
    unshared = ServingConfig.from_dict({**cfg.to_dict(), "scheduler": {**cfg.to_dict()["scheduler"],
                                                                       "enable_prefix_caching": False}})
    with Engine(unshared) as fresh:  # every request computes its whole prompt
        fresh.start(progress=None)
        separate = [fresh.submit(PROMPT, _with_seed(sampled, 11 + j)).result(timeout=120) for j in range(4)]
    assert [r.token_ids for r in together] == [r.token_ids for r in separate]
    for a, b in zip(together, separate):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def test_the_routes_answer_n_and_best_of(standin_server):
    client = openai_client(standin_server)
    done = client.completions.create(model="llama2", prompt=["hello", "world wide"], max_tokens=3, n=3, seed=4)
    assert [c.index for c in done.choices] == list(range(6))
    one = client.completions.create(model="llama2", prompt="hello", max_tokens=3, seed=4)
    assert done.usage.prompt_tokens == one.usage.prompt_tokens + client.completions.create(
        model="llama2", prompt="world wide", max_tokens=3).usage.prompt_tokens  # each prompt counted once
    assert done.usage.completion_tokens == 6 * 3
    best = client.completions.create(model="llama2", prompt="hello", max_tokens=3, n=2, best_of=4, logprobs=0)
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 4 * 3
    totals = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert totals == sorted(totals, reverse=True)
    chat = client.chat.completions.create(model="llama2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="best_of .* must be >= n"):
        client.completions.create(model="llama2", prompt="x", max_tokens=2, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(model="llama2", prompt="x", max_tokens=2, n=1, best_of=2, stream=True)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 3, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}),
])
def test_a_stream_interleaves_the_choices_by_index(standin_server, path, body):
    async def go() -> list[dict]:
        async with aiohttp.ClientSession() as s, s.post(standin_server.url + path, json={**body, "stream": True}) as r:
            assert r.status == 200
            lines = [x for x in (await r.text()).split("\n") if x]
        return [json.loads(p) for p in sse_payloads(lines)[:-1]]

    chunks = run(go())
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        for choice in c["choices"]:
            by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1]
    for choices in by_index.values():
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in choices) == 1
