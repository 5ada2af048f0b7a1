"""LoRA adapters over HTTP with stand-in agents (``llm-serving serve --standin-agents``): a row computed with an
adapter of rank r answers the stand-in's token + 1 + r, so every answer shows which adapter computed it:
``t[i] = (t[i-1] * 31 + prompt_len + i + shift) % vocab``, shift 0 for the base model."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.adapter_dirs import adapter_dir
from tests.test_server import VOCAB, ServerProcess, metrics, post, run

RANKS = {"sql": 4, "poet": 8, "chat": 16}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-serve-data")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: adapter_dir(root, name, rank) for name, rank in RANKS.items()}
    dirs["late"] = adapter_dir(root, "late", 2)
    dirs["big"] = adapter_dir(root, "big", 64)
    dirs["dora"] = adapter_dir(root, "dora", 4, use_dora=True)
    dirs["head"] = adapter_dir(root, "head", 4, target_modules=["q_proj", "lm_head"])
    dirs["nowhere"] = adapter_dir(root, "nowhere", 4, target_modules=["nonexistent_proj"])
    dirs["sql2"] = adapter_dir(root, "sql2", 12)
    return dirs


@pytest.fixture(scope="module")
def served(data_dir, adapters):
    """Two slots for three adapters at start (sql, poet, chat), runtime loading on, steps of 10 ms."""
    modules = [f"{name}={adapters[name]}" for name in RANKS]
    server = ServerProcess(data_dir, "--standin-agents", "--standin-step-delay", "0.01", "--lora-modules", *modules,
                           "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating")
    yield server
    assert server.stop() == 0, server.output


def check_tokens(ids: list[int], prompt_len: int, shift: int) -> None:
    assert len(ids) >= 3, ids
    for i in range(1, len(ids)):
        assert ids[i] == (ids[i - 1] * 31 + prompt_len + i + shift) % VOCAB, (i, shift)


async def generate(url: str, model: str, prompt: str, n: int = 12) -> dict:
    status, res, _ = await post(f"{url}/models/{model}/generate",
                                {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
    assert status == 200, res
    return res


def shift_of(model: str) -> int:
    return 1 + RANKS[model] if model in RANKS else 0


def test_models_lists_each_adapter_with_its_parent(served, adapters):
    async def go():
        async with aiohttp.ClientSession() as s, s.get(f"{served.url}/v1/models") as r:
            cards = {c["id"]: c for c in (await r.json())["data"]}
        assert set(RANKS) <= set(cards) and cards["llama2"]["parent"] is None
        for name in RANKS:
            assert cards[name]["parent"] == cards["llama2"]["root"] and cards[name]["root"] == str(adapters[name])
        async with aiohttp.ClientSession() as s, s.get(f"{served.url}/v1/models/poet") as r:
            assert r.status == 200 and (await r.json())["parent"] == cards["llama2"]["root"]
    run(go())


def test_three_adapters_and_the_base_mixed_answer_each_their_own_on_every_route(served):
    prompts = ["The river ran past the old mill and", "Numbers: 1 2 3", "Once upon a time"]
    models = ["llama2", *RANKS, "llama2", "sql", "chat", "poet"]

    async def one(model: str, prompt: str) -> tuple[str, str]:
        res = await generate(served.url, model, prompt)
        check_tokens([t["id"] for t in res["tokens"]], res["prompt_tokens"], shift_of(model))
        return model, res["generated_text"]

    async def openai_text(model: str, prompt: str, chat: bool) -> str:
        route = "chat/completions" if chat else "completions"
        body = {"model": model, "max_tokens": 12, "temperature": 0}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        status, res, _ = await post(f"{served.url}/v1/{route}", body)
        assert status == 200 and res["model"] == model, res
        choice = res["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    async def go():
        for prompt in prompts:  # all at once: the steps mix them, the two slots shared among three adapters
            answers = await asyncio.gather(*(one(m, prompt) for m in models))
            texts = {m: t for m, t in answers}
            assert len(set(texts.values())) == 4  # each adapter and the base answer differently
            completions = await asyncio.gather(*(openai_text(m, prompt, False) for m in models))
            assert [texts[m] for m in models] == list(completions)  # the same model gives the same greedy text
            chats = await asyncio.gather(*(openai_text(m, prompt, True) for m in models))
            assert len({c for m, c in zip(models, chats)}) == 4
            assert all(c == chats[models.index(m)] for m, c in zip(models, chats))
        m = await metrics(served.url)
        assert m["llm_serving_kv_blocks_used"] == 0 and m["llm_serving_engine_lora_slot_loads"] >= 3
        assert m['llm_serving_lora_requests_total{adapter="chat"}'] >= 9
        assert any(k.startswith("vllm:lora_requests_info{") and 'max_lora="2"' in k for k in m)
    run(go())


def test_unknown_models_and_bad_loads_are_json_errors_naming_the_key(served, adapters):
    async def go():
        status, res, _ = await post(f"{served.url}/v1/completions", {"model": "nope", "prompt": "hi"})
        assert status == 404 and res["error"]["code"] == "model_not_found" or res["error"]["type"]
        status, res, _ = await post(f"{served.url}/models/nope/generate", {"inputs": "hi"})
        assert status == 404
        load = f"{served.url}/v1/load_lora_adapter"
        for name, key in (("big", "max_lora_rank"), ("dora", "use_dora"), ("head", "lm_head"),
                          ("nowhere", "target_modules")):
            status, res, _ = await post(load, {"lora_name": name, "lora_path": str(adapters[name])})
            assert status == 400 and key in json.dumps(res), res
        for body, field in (({"lora_name": "x"}, "lora_path"), ({"lora_path": "/tmp"}, "lora_name"),
                            ({"lora_name": "x", "lora_path": "/no/such"}, "adapter_config.json"),
                            ({"lora_name": "llama2", "lora_path": str(adapters["late"])}, "base model"),
                            ({"lora_name": "sql", "lora_path": str(adapters["late"])}, "already loaded"),
                            ({"lora_name": "a b", "lora_path": str(adapters["late"])}, "letters")):
            status, res, _ = await post(load, body)
            assert status == 400 and field in json.dumps(res), (body, res)
        status, res, _ = await post(f"{served.url}/v1/unload_lora_adapter", {"lora_name": "never"})
        assert status == 404 and "never" in json.dumps(res)
        status, res, _ = await post(f"{served.url}/models/big/generate", {"inputs": "hi"})
        assert status == 404  # refused loads serve nothing
        assert (await generate(served.url, "sql", "still serving"))["generated_tokens"] >= 1
    run(go())


def test_load_and_unload_while_eight_streams_run_loses_no_request(served, adapters):
    async def stream(s: aiohttp.ClientSession, model: str, prompt: str, shift: int) -> list[int]:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 40, "details": True}}
        async with s.post(f"{served.url}/models/{model}/generate_stream", json=body) as r:
            assert r.status == 200, await r.text()
            items = [json.loads(x)["data"][0] async for x in r.content if x.strip()]
        ids = [i["tokens"]["id"] for i in items if i.get("tokens")]
        assert items[-1]["details"]["finish_reason"] in ("length", "eos_token")
        return ids

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            plan = [("sql", 0), ("poet", 1), ("llama2", 2), ("chat", 3), ("sql", 4), ("poet", 5), ("chat", 6),
                    ("llama2", 7)]
            prompt_len = len((await post(f"{served.url}/tokenize", {"prompt": "stream 0"}))[1]["tokens"])
            tasks = [asyncio.create_task(stream(s, m, f"stream {i}", shift_of(m))) for m, i in plan]
            while True:  # until the server holds all eight (each needs 40 steps of 10 ms or more to finish)
                m = await metrics(served.url)
                if m["llm_serving_queue_length"] + m["llm_serving_running_batch_size"] == len(plan):
                    break
                await asyncio.sleep(0.01)
            status, res, _ = await post(f"{served.url}/v1/load_lora_adapter",
                                        {"lora_name": "late", "lora_path": str(adapters["late"])})
            assert status == 200 and res["rank"] == 2, res
            status, res, _ = await post(f"{served.url}/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert status == 200 and res["requests_finishing"] == 2, res  # deferred: they finish with it
            late = asyncio.create_task(stream(s, "late", "stream 8", 3))
            status, _, _ = await post(f"{served.url}/models/sql/generate", {"inputs": "gone"})
            assert status == 404  # unloaded for new requests at once
            results = await asyncio.gather(*tasks, late)
        for (model, _), ids in zip(plan, results):  # sql's two streams finished with sql (a deferred unload)
            check_tokens(ids, prompt_len, shift_of(model))
        check_tokens(results[-1], prompt_len, 3)
        # sql again under the same name, another adapter (rank 12): its answers, not the old sql's cached ones
        status, res, _ = await post(f"{served.url}/v1/load_lora_adapter",
                                    {"lora_name": "sql", "lora_path": str(adapters["sql2"])})
        assert status == 200, res
        res = await generate(served.url, "sql", "stream 0")
        check_tokens([t["id"] for t in res["tokens"]], res["prompt_tokens"], 13)
        m = await metrics(served.url)
        assert m["llm_serving_kv_blocks_used"] == 0 and m["llm_serving_requests_in_flight"] == 0
        assert m["llm_serving_engine_requests_failed"] == 0
    run(go())


def test_adapter_routes_are_off_by_default(data_dir, adapters):
    server = ServerProcess(data_dir, "--standin-agents")
    try:
        async def go():
            status, res, _ = await post(f"{server.url}/v1/load_lora_adapter",
                                        {"lora_name": "sql", "lora_path": str(adapters["sql"])})
            assert status == 404 and "allow_runtime_updates" in res["error"]["message"]
            status, res, _ = await post(f"{server.url}/v1/completions", {"model": "sql", "prompt": "hi"})
            assert status == 404
            async with aiohttp.ClientSession() as s, s.get(f"{server.url}/v1/models") as r:
                assert all(c["parent"] is None for c in (await r.json())["data"])
        run(go())
    finally:
        assert server.stop() == 0, server.output
