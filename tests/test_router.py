"""Issue 35, data parallelism: ``llm-serving router`` in front of two ``llm-serving serve`` engines (stand-in agents:
the routing is under test, not the model) and an address where nothing listens. Answers through the router equal
the engines' own, streams included; requests spread by load, a shared prefix stays on one engine, metrics come
labelled per engine, a stopped engine's requests go to the other, and no engine at all is a JSON 503; the small
real model answers the same through the router. The policy and the routing text are checked on their own first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llm_serving.executor.collective_launch import free_port
from llm_serving.router.affinity import CHUNK_CHARS, AffinityPolicy, PrefixIndex, prefix_keys
from llm_serving.router.proxy import request_json, routing_text
from tests.test_server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful assistant who answers questions about the Python standard library. " * 4


# ---- the policy --------------------------------------------------------------------------------------------
def test_prefix_keys_name_whole_prefixes():
    a, b = prefix_keys("x" * 200), prefix_keys("x" * 130 + "y" * 70)
    assert len(a) == 200 // CHUNK_CHARS and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys("short") == [] and prefix_keys("ab" * 64)[0] != prefix_keys("ba" * 64)[0]


def test_the_index_forgets_the_oldest_prefixes_and_a_whole_engine():
    index = PrefixIndex(capacity=4)
    first, second = prefix_keys("a" * 192), prefix_keys("b" * 128)
    index.remember(first, 0)
    index.remember(second, 1)  # 5 keys: the oldest ("a" * 64) is dropped
    assert len(index) == 4 and index.longest(first, {0, 1}) == (0, 3)
    assert index.longest(first[:1], {0, 1}) == (None, 0)
    assert index.longest(second, {0}) == (None, 0)  # its engine is not among those asked about
    index.forget_engine(1)
    assert index.longest(second, {0, 1}) == (None, 0) and len(index) == 2


def test_affinity_holds_within_the_imbalance_and_yields_beyond_it():
    policy = AffinityPolicy(3, min_match=0.5, max_imbalance=2)
    healthy = {0, 1, 2}
    firsts = [policy.choose(f"{i}", healthy).engine for i in range(3)]
    assert sorted(firsts) == [0, 1, 2]  # idle engines in turn
    prompt = SYSTEM + "What does itertools.chain do?"
    home = policy.choose(prompt, healthy)
    assert home.matched_chars == 0
    again = policy.choose(SYSTEM + "And functools.reduce?", healthy)  # most of it is the shared prefix
    assert again.engine == home.engine and again.matched_chars >= len(SYSTEM) - CHUNK_CHARS
    assert policy.choose("short " + SYSTEM[:70], healthy).matched_chars == 0  # a prefix must start the text
    for _ in range(3):
        policy.started(home.engine)  # 3 in flight there, 0 elsewhere: beyond max_imbalance 2
    moved = policy.choose(SYSTEM + "And heapq?", healthy)
    assert moved.engine != home.engine and moved.matched_chars == 0
    policy.finished(home.engine)
    assert policy.choose(SYSTEM + "And bisect?", healthy - {home.engine}).engine != home.engine
    assert policy.choose(SYSTEM, set()) is None
    by_load = AffinityPolicy(2, use_prefix=False)
    assert [by_load.choose(SYSTEM, {0, 1}).engine for _ in range(4)] == [0, 1, 0, 1]


def test_the_routing_text_is_the_prompt_of_each_api():
    def text(body: bytes) -> str:
        return routing_text(request_json(body))

    assert text(b'{"prompt": "Hello", "max_tokens": 3}') == "Hello"
    assert text(b'{"inputs": "Hi", "parameters": {}}') == "Hi"
    chat = text(b'{"messages": [{"role": "user", "content": "Hey"}]}')
    assert chat.startswith('[{"role":"user","content":"Hey"') and text(b'{"prompt": [1, 2]}') == "[1,2]"
    assert text(b"not json") == text(b"[1]") == text(b"") == text(b"\xff\xfe") == ""


# ---- the router in front of real servers -----------------------------------------------------------------
class RouterProcess:
    def __init__(self, *engines: str, health_interval_s: float = 0.2, prefill: tuple[str, ...] = (),
                 extra: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "llm_serving", "router", "--port", "0", "--health-interval",
                str(health_interval_s), *extra]
        for url in engines:
            argv += ["--engine", url]
        for url in prefill:
            argv += ["--prefill", url]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 60
        self.url = None
        while self.url is None:
            found = [m.group(1) for line in list(self.lines) if (m := re.search(r"ready at (http://\S+)", line))]
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.lines)
            self.url = found[0] if found else None
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(20)


def post(url: str, body: dict | bytes, timeout: float = 60, headers: dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def routed(metrics: str) -> dict[tuple[str, str], float]:
    pattern = r'llm_serving_router_requests_total\{by="(\w+)",engine="(\d)"\} (\S+)'
    return {(engine, by): float(v) for by, engine, v in re.findall(pattern, metrics)}


def completion(prompt: str, stream: bool = False) -> dict:
    return {"model": "llama2", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data = tmp_path_factory.mktemp("router")
    engines = [ServerProcess(data, "--standin-agents") for _ in range(2)]
    nowhere = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess(*(e.url for e in engines), nowhere)
    yield router, engines, nowhere
    router.stop()
    for engine in engines:
        engine.stop()


def test_answers_through_the_router_are_the_engines_own(cluster):
    router, engines, _ = cluster
    status, health = get(router.url + "/health")
    assert status == 200 and list(json.loads(health)["engines"].values()) == [True, True, False]
    for stream in (False, True):
        direct = post(engines[0].url + "/v1/completions", completion("Tell me a story", stream))
        via = post(router.url + "/v1/completions", completion("Tell me a story", stream))
        assert via[0] == direct[0] == 200
        if stream:  # the same events, ids and times aside
            texts = [[json.loads(line[6:])["choices"][0]["text"] for line in body.decode().splitlines()
                      if line.startswith("data: {")] for body in (direct[1], via[1])]
            assert texts[0] == texts[1] and via[1].decode().rstrip().endswith("data: [DONE]")
        else:
            assert json.loads(via[1])["choices"] == json.loads(direct[1])["choices"]
    status, body = post(router.url + "/v1/completions", b"{not json")
    assert status == 400 and "error" in json.loads(body)  # the engine's own answer, passed through


def test_requests_spread_by_load_and_a_shared_prefix_stays_on_one_engine(cluster):
    router, _, _ = cluster
    before = routed(get(router.url + "/metrics")[1])
    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(post(router.url + "/v1/completions",
                                                                       completion(f"question {i}"))[0]))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 8
    for i in range(4):  # one after another: the first by load, the rest where the prefix went
        assert post(router.url + "/v1/completions", completion(SYSTEM + f"Question {i}?"))[0] == 200
    metrics = get(router.url + "/metrics")[1]
    after = routed(metrics)
    spread = {e: after.get((e, "load"), 0) - before.get((e, "load"), 0) for e in ("0", "1")}
    assert spread["0"] >= 2 and spread["1"] >= 2, spread
    by_prefix = {e: after.get((e, "prefix"), 0) - before.get((e, "prefix"), 0) for e in ("0", "1")}
    assert sorted(by_prefix.values()) == [0, 3], by_prefix
    for engine in ("0", "1"):  # each engine's own metrics, labelled
        assert re.search(rf'llm_serving_running_batch_size\{{engine="{engine}"', metrics)
        assert re.search(rf'vllm:num_requests_running\{{engine="{engine}",model_name=', metrics)  # the router's
    assert 'llm_serving_router_engine_up{engine="2"' in metrics


def test_a_stopped_engine_loses_its_requests_to_the_other_and_none_left_is_a_503(tmp_path):
    engines = [ServerProcess(tmp_path, "--standin-agents") for _ in range(2)]
    router = RouterProcess(*(e.url for e in engines), health_interval_s=600)  # no health check meanwhile
    try:
        assert engines[1].stop() == 0
        answers = [post(router.url + "/v1/completions", completion(f"after {i}"))[0] for i in range(4)]
        assert answers == [200] * 4  # engine 1 unreachable before answering: its request moved to engine 0
        metrics = get(router.url + "/metrics")[1]
        assert re.search(r'llm_serving_router_failovers_total\{engine="1"\} 1\.0', metrics), metrics
        assert 'llm_serving_router_engine_up{engine="1",url=' in metrics and get(router.url + "/health")[0] == 200
        assert engines[0].stop() == 0
        status, body = post(router.url + "/v1/completions", completion("anyone?"))
        assert status == 503 and json.loads(body)["error"]["code"] == "no_engine"
        assert get(router.url + "/health")[0] == 503
    finally:
        assert router.stop() == 0, router.lines
        for engine in engines:
            engine.stop()


def test_the_router_asks_for_its_api_key_and_sends_it_on_its_own_calls(tmp_path):
    """``--api-key``: a request without the key is refused by the router itself (never forwarded), one with it
    reaches the engine (which needs the same key), and /metrics carries the engine's metrics, fetched with it."""
    engine = ServerProcess(tmp_path, "--standin-agents", "--api-key", "s3cret")
    router = RouterProcess(engine.url, extra=("--api-key", "s3cret"))
    key = {"Authorization": "Bearer s3cret"}
    try:
        for headers in (None, {"Authorization": "Bearer wrong"}):
            status, body = post(router.url + "/v1/completions", completion("hello"), headers=headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        assert get(router.url + "/metrics")[0] == 401 and get(router.url + "/health")[0] == 200
        assert routed(get(router.url + "/metrics", key)[1]) == {}  # the refused requests went nowhere
        assert post(router.url + "/v1/completions", completion("hello"), headers=key)[0] == 200
        metrics = get(router.url + "/metrics", key)[1]
        assert routed(metrics) == {("0", "load"): 1.0}
        assert re.search(r'llm_serving_running_batch_size\{engine="0"', metrics)  # scraped with the key
    finally:
        assert router.stop() == 0, router.lines
        engine.stop()


def test_a_real_model_answers_the_same_through_the_router(tiny_server):
    """The small real model: greedy completions with logprobs and echo (as lm-evaluation-harness asks) and a
    streamed chat, through the router and straight from the engine."""
    router = RouterProcess(tiny_server.url)
    try:
        for prompt in ("The quick brown fox", "Once upon a time there was"):
            body = {"model": "llama2", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                    "echo": True}
            direct, via = (post(url + "/v1/completions", body) for url in (tiny_server.url, router.url))
            assert direct[0] == via[0] == 200
            assert json.loads(via[1])["choices"] == json.loads(direct[1])["choices"]
        chat = {"model": "llama2", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6,
                "temperature": 0, "stream": True}
        streams = [post(url + "/v1/chat/completions", chat)[1].decode() for url in (tiny_server.url, router.url)]
        deltas = [[json.loads(line[6:])["choices"][0]["delta"].get("content") for line in s.splitlines()
                   if line.startswith("data: {")] for s in streams]
        assert deltas[0] == deltas[1] and any(deltas[0])
    finally:
        assert router.stop() == 0, router.lines
