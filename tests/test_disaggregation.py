"""Issue 35, prefill/decode disaggregation: a prompt's KV blocks exported by the engine that computed it and imported
by another, which then decodes the same tokens as an engine that did both.

Pieces first (the KV-copy step through shared memory, the KV segment, the payload format, the engine's pinning and
release of blocks around copies, the router's request rewriting, config and request errors), then two real engines
(the small random Llama, native CPU kernels and the portable graph ops): exported blocks imported into the other
engine's prefix cache give ids and logprobs equal to the colocated answer, the decode engine computes only the last
partial block, corrupted blocks change the answer (so the imported bytes are what it reads), an import lands between
the steps of requests already decoding, tensor parallelism 2 on both sides; and over HTTP, a router with a prefill
engine and a decode engine answers as one engine does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from llm_serving.api.schema import parse_completion
from llm_serving.config.serving_config import ConfigError
from llm_serving.core.kv_cache_manager import KVCacheManager
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.engine.kv_transfer import KvPayload, KvTransfers
from llm_serving.engine.loop import Engine
from llm_serving.executor.agent_pool import AgentDiedError, AgentPool, AgentStepError
from llm_serving.executor.collective_launch import free_port
from llm_serving.protocol.batch import KvCopyStep, StepBatch
from llm_serving.protocol.kv_segment import KvSegment
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from llm_serving.request_errors import ApiError
from llm_serving.router.disaggregation import decode_request, prefill_request
from tests.test_kv_transfer_trust import liar
from tests.test_router import RouterProcess, get, post
from tests.test_server import ServerProcess
from tests.tiny_engine import TINY_SERVED, set_args, tiny_engine_config

BLOCK = 8
LAYOUT = {"block_size": BLOCK, "block_bytes": 16, "tensor_parallel_size": 2, "dtype": "float32"}


# ---- the pieces ----------------------------------------------------------------------------------------------
def test_a_kv_copy_step_crosses_the_step_segment():
    channel = StepChannel.create(ChannelLayout(max_tokens=16, max_batch=4, max_blocks_per_seq=6))
    try:
        channel.write_step(7, KvCopyStep("import", [5, 3, 9]))
        step, copy = channel.read_step()
        assert step == 7 and isinstance(copy, KvCopyStep) and copy.batch_size == 0 and copy.direction == "import"
        assert copy.block_ids.tolist() == [5, 3, 9]
        ones = np.ones(1, np.int32)
        channel.write_step(8, StepBatch(ones, ones - 1, ones, ones, ones, np.zeros((1, 1), np.int32)))
        assert isinstance(channel.read_step()[1], StepBatch)  # a model step after it is a model step
        with pytest.raises(ValueError, match="one sequence's blocks"):
            channel.check_fits(KvCopyStep("export", list(range(1, 8))))
    finally:
        channel.close()
    with pytest.raises(ValueError, match="direction"):
        KvCopyStep("sideways", [1])


def test_the_kv_segment_holds_a_region_per_rank():
    owner = KvSegment.create(ranks=2, block_bytes=12, max_blocks=3)
    try:
        agent = KvSegment.attach(owner.name, 2, 12, 3)
        agent.region(1, 2)[:] = np.arange(24, dtype=np.uint8).reshape(2, 12)
        agent.region(0, 2)[:] = 7
        assert owner.read(2) == [bytes([7] * 24), bytes(range(24))]
        owner.write([bytes(12), bytes([1] * 12)], 1)
        assert agent.region(1, 1).tolist() == [[1] * 12] and agent.region(0, 1).sum() == 0
        with pytest.raises(ValueError, match="12 bytes, 2 blocks are 24"):
            owner.write([bytes(12), bytes(12)], 2)
        with pytest.raises(ValueError, match="3 blocks"):
            owner.region(0, 4)
        agent.close()
        with pytest.raises(Exception, match="need"):
            KvSegment.attach(owner.name, 2, 12, 4)
    finally:
        owner.close()


def test_a_payload_round_trips_and_a_damaged_one_is_refused():
    payload = KvPayload(LAYOUT, list(range(16)), [bytes(range(32)), bytes([9] * 32)])
    assert payload.num_blocks == 2
    back = KvPayload.from_bytes(payload.to_bytes())
    assert (back.layout, back.token_ids, back.shards) == (LAYOUT, payload.token_ids, payload.shards)
    data = payload.to_bytes()
    for damaged, why in ((data[:-1], "describes"), (b"GARBAGE" + data, "not a KV payload"),
                         (KvPayload(LAYOUT, list(range(15)), payload.shards).to_bytes(), "whole blocks")):
        with pytest.raises(ValueError, match=why):
            KvPayload.from_bytes(damaged)


class FakePool:
    """Stands for the agents: KV bytes per block id, per rank (``export_kv`` / ``import_kv``'s contract)."""

    def __init__(self, fail: type[Exception] | None = None) -> None:
        self.cache: dict[int, bytes] = {}
        self.fail = fail
        self.seen: list[tuple[str, list[int]]] = []

    def export_kv(self, blocks):
        self.seen.append(("export", list(blocks)))
        if self.fail:
            raise self.fail("boom") if self.fail is AgentDiedError else self.fail("boom", 0)
        return [b"".join(self.cache.get(b, bytes(8)) for b in blocks) for _ in range(2)]

    def import_kv(self, blocks, shards):
        self.seen.append(("import", list(blocks)))
        for i, b in enumerate(blocks):
            self.cache[b] = shards[0][i * 8:(i + 1) * 8]


def kv_cache() -> KVCacheManager:
    return KVCacheManager(12, BLOCK, max_num_seqs=2, max_model_len=64, prefix_caching=True)


def test_exports_pin_the_prompts_cached_blocks_and_imports_register_them_idle():
    layout = {**LAYOUT, "block_bytes": 8}
    lock = threading.Lock()
    prefill, decode = kv_cache(), kv_cache()
    prompt = list(range(100, 121))  # 21 tokens: 2 whole blocks usable elsewhere
    seq = Sequence("a", prompt)
    prefill.start(seq, [], len(prompt))
    seq.num_computed_tokens = len(prompt)
    prefill.free(seq)  # finished: its 2 full blocks stay cached, idle
    transfers, pool = KvTransfers(layout, lock), FakePool()
    for b in range(1, 12):
        pool.cache[b] = bytes([b]) * 8
    with lock:
        future = transfers.queue_export(prefill, prompt)
    assert prefill.accounting()["held"] == 2 and prefill.accounting()["idle_cached"] == 0  # pinned: no step takes them
    transfers.run(pool, prefill)
    payload = future.result(0)
    assert payload.num_blocks == 2 and payload.token_ids == prompt[:16] and pool.seen[0][0] == "export"
    assert prefill.accounting() == {"free": 9, "idle_cached": 2, "held": 0, "cached": 2}
    assert transfers.queue_export(prefill, list(range(5))).result(0).num_blocks == 0  # nothing cached

    theirs = KvTransfers(layout, lock)
    with lock:
        imported = theirs.queue_import(decode, payload)
    theirs.run(pool, decode)
    assert imported.result(0) == 2 and decode.accounting() == {"free": 9, "idle_cached": 2, "held": 0, "cached": 2}
    assert len(decode.computed_prefix(Sequence("b", prompt))) == 2  # the request's prompt hits both
    assert theirs.queue_import(decode, payload).result(0) == 0  # cached already: nothing to copy
    with pytest.raises(ValueError, match="another layout"):
        theirs.queue_import(decode, KvPayload({**layout, "dtype": "float16"}, payload.token_ids, payload.shards))


def test_a_failed_copy_frees_its_blocks_and_a_dead_pool_fails_every_queued_copy():
    layout = {**LAYOUT, "block_bytes": 8}
    lock = threading.Lock()
    bm = kv_cache()
    payload = KvPayload(layout, list(range(24)), [bytes(24), bytes(24)])
    transfers = KvTransfers(layout, lock)
    first = transfers.queue_import(bm, payload)
    transfers.run(FakePool(fail=AgentStepError), bm)  # raises on export only: this import succeeds
    assert first.result(0) == 3
    bm.reset_prefix_cache()
    failing = KvTransfers(layout, lock)
    nothing: Future = failing.queue_export(bm, list(range(30)))  # nothing cached any more
    assert nothing.result(0).num_blocks == 0
    seq = Sequence("s", list(range(40)))
    bm.start(seq, [], 40)
    seq.num_computed_tokens = 40
    bm.free(seq)
    exports = [failing.queue_export(bm, list(range(40))) for _ in range(2)]
    failing.run(FakePool(fail=AgentStepError), bm)  # the agents serve on: each copy fails alone
    assert all(isinstance(f.exception(0), AgentStepError) for f in exports)
    assert bm.accounting()["held"] == 0
    exports = [failing.queue_export(bm, list(range(40))) for _ in range(2)]
    with pytest.raises(AgentDiedError):
        failing.run(FakePool(fail=AgentDiedError), bm)
    assert all(isinstance(f.exception(0), AgentDiedError) for f in exports) and bm.accounting()["held"] == 0
    assert not failing.pending


def test_the_router_splits_a_request_into_a_prefill_and_a_decode():
    client = {"model": "m", "prompt": "Hi there", "max_tokens": 50, "stream": True, "min_tokens": 3,
              "stream_options": {"include_usage": True}, "temperature": 0}
    first = prefill_request(client)
    assert first == {"model": "m", "prompt": "Hi there", "max_tokens": 1, "temperature": 0,
                     "kv_transfer_params": {"do_remote_decode": True}}
    chat = prefill_request({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and "max_tokens" not in chat
    for unsplit in (None, [1], {"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}):
        assert prefill_request(unsplit) is None
    assert prefill_request({"prompt": [1, 2, 3]}) is not None  # token ids are one prompt
    answer = json.dumps({"choices": [], "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "kv-1",
                                                                 "num_blocks": 3}}).encode()
    assert decode_request(client, answer, "http://10.0.0.1:8001") == {**client, "kv_transfer_params": {
        "do_remote_prefill": True, "transfer_id": "kv-1", "remote_url": "http://10.0.0.1:8001"}}
    for none in (b'{"kv_transfer_params": null}', b"{}", b"oops", b"[1]"):
        assert decode_request(client, none, "http://x") is None


def test_kv_transfer_params_are_checked_and_the_config_names_what_it_needs(tmp_path):
    req = parse_completion({"prompt": "a", "kv_transfer_params": {"do_remote_decode": True}})
    assert req.kv_transfer.do_remote_decode
    for body, why in (({"prompt": "a", "stream": True, "kv_transfer_params": {"do_remote_decode": True}},
                       "one unstreamed choice"),
                      ({"prompt": "a", "kv_transfer_params": {"transfer_id": "x"}}, "both transfer_id and remote_url"),
                      ({"prompt": "a", "kv_transfer_params": {"transfer_id": "x", "remote_url": "file:///etc"}},
                       "http"),
                      ({"prompt": "a", "kv_transfer_params": {"transfer_id": "../../v1/x", "remote_url": "http://h"}},
                       "the id a prefill engine answered"),
                      ({"prompt": "a", "kv_transfer_params": {"surprise": 1}}, "unknown key"),
                      ({"prompt": "a", "kv_transfer_params": []}, "JSON object")):
        with pytest.raises(ApiError, match=why):
            parse_completion(body)
    assert tiny_engine_config(tmp_path, serving_config={"kv_transfer": True}).serving_config.kv_transfer
    for sections, key in (({"scheduler": {"enable_prefix_caching": False}}, "serving_config.kv_transfer"),
                          ({"speculative": {"method": "ngram"}}, "serving_config.kv_transfer"),
                          ({"serving_config": {"kv_transfer": True, "num_agents": 2, "local_agents": 1,
                                               "join_address": "10.0.0.1:9000"}}, "serving_config.kv_transfer")):
        merged = {**sections, "serving_config": {"kv_transfer": True, **sections.get("serving_config", {})}}
        with pytest.raises(ConfigError) as err:
            tiny_engine_config(tmp_path, **merged)
        assert err.value.key == key


# ---- two real engines ----------------------------------------------------------------------------------------
PROMPTS = [list(range(40, 49)), [7 + (3 * i) % 500 for i in range(30)], list(range(300, 340)),
           [11 + (7 * i) % 900 for i in range(52)], list(range(600, 605))]  # 9, 30, 40 (whole), 52, 5 tokens


def kv_config(tmp_path: Path, **sections):
    # the compile cache: the second engine of a configuration loads the first one's graphs
    base = {"serving_config": {"kv_transfer": True, "compile_cache": True}, "model_config": {"seq_length": [64]},
            "pa_config": {"num_blocks": 64, "block_size": BLOCK, "decode_seq_length": 96}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_engine_config(tmp_path, **base)


def chunked_pool(blocks: int):
    """Agent pools whose KV segment holds ``blocks`` blocks: a longer prompt's blocks move in several copies."""
    return lambda spec: AgentPool(dataclasses.replace(spec, kv_segment_bytes=blocks * spec.tensor_parallel_size
                                                      * spec.kv_block_bytes))


def transfer(prefill: Engine, decode: Engine, ids: list[int], corrupt: bool = False) -> int:
    """The prefill half (one token), then the blocks into ``decode`` (through the wire format): blocks imported."""
    prefill.submit(ids, SamplingParams(max_new_tokens=1)).result(60)
    payload = KvPayload.from_bytes(prefill.export_prompt_kv(ids).result(60).to_bytes())
    if corrupt:
        payload.shards = [bytes(len(s)) for s in payload.shards]
    return decode.import_prompt_kv(payload).result(60)


@pytest.mark.parametrize("kernels", ["native", "portable"])
def test_imported_blocks_decode_what_one_engine_answers_alone(tmp_path, kernels):
    cfg = kv_config(tmp_path, model_config={"kernels": kernels})
    with Engine(cfg) as prefill, Engine(cfg, pool_factory=chunked_pool(3)) as decode:  # imports 3 blocks a copy
        prefill.start(progress=None)
        decode.start(progress=None)
        greedy, seeded = SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, temperature=0.8, seed=5)
        for i, ids in enumerate(PROMPTS):
            params = seeded if i == 1 else greedy
            alone = prefill.submit(ids, params).result(60)  # the colocated answer (prefill computes the prompt)
            hits_before = decode.stats()["prefix_cache_hit_tokens"]
            imported = transfer(prefill, decode, ids)
            assert imported == (len(ids) - 1) // BLOCK
            split = decode.submit(ids, params).result(60)
            assert split.token_ids == alone.token_ids, (i, kernels)
            np.testing.assert_allclose(split.logprobs, alone.logprobs, rtol=1e-5, atol=1e-5)
            assert decode.stats()["prefix_cache_hit_tokens"] - hits_before == imported * BLOCK  # only the rest computed
        stats = decode.stats()
        assert stats["kv_imports"] == 4 and stats["kv_imported_blocks"] == sum((len(p) - 1) // BLOCK for p in PROMPTS)
        ids = [13 + (5 * i) % 700 for i in range(33)]
        alone = prefill.submit(ids, greedy).result(60)
        assert transfer(prefill, decode, ids, corrupt=True) == 4
        assert decode.submit(ids, greedy).result(60).token_ids != alone.token_ids  # the imported bytes are read
        for engine in (prefill, decode):
            assert engine.stats()["kv_blocks_used"] == 0
            engine._scheduler.kv_cache.accounting()  # raises unless every block is free, idle or held once


def test_an_import_lands_between_the_steps_of_requests_already_decoding(tmp_path):
    cfg = kv_config(tmp_path)
    with Engine(cfg) as prefill, Engine(cfg) as decode:
        prefill.start(progress=None)
        decode.start(progress=None)
        long = SamplingParams(max_new_tokens=80, ignore_eos=True)
        busy = [[900 - 9 * i - j for j in range(12)] for i in range(3)]
        alone = [prefill.submit(ids, long).result(60) for ids in busy]
        ids = PROMPTS[3]
        want = prefill.submit(ids, SamplingParams(max_new_tokens=8)).result(60)
        prefill.submit(ids, SamplingParams(max_new_tokens=1)).result(60)
        payload = prefill.export_prompt_kv(ids).result(60)
        streams = [decode.submit(p, long) for p in busy]
        while decode.stats()["tokens_generated"] < 3:  # every one decoding
            time.sleep(0.001)
        assert decode.import_prompt_kv(payload).result(60) == (len(ids) - 1) // BLOCK
        assert decode.stats()["tokens_generated"] < 3 * 80  # the copy ran between their steps, not after them
        assert decode.submit(ids, SamplingParams(max_new_tokens=8)).result(60).token_ids == want.token_ids
        assert [s.result(60).token_ids for s in streams] == [a.token_ids for a in alone]
        assert decode.stats()["steps_sent_ahead"] > 0  # asynchronous scheduling was on around the copy


def test_tensor_parallel_engines_move_each_ranks_shard(tmp_path):
    cfg = kv_config(tmp_path, serving_config={"num_agents": 2})
    with Engine(cfg, pool_factory=chunked_pool(2)) as prefill, Engine(cfg) as decode:  # exports 2 blocks a copy
        prefill.start(progress=None)
        decode.start(progress=None)
        for ids in PROMPTS[1:4]:
            alone = prefill.submit(ids, SamplingParams(max_new_tokens=8)).result(60)
            assert transfer(prefill, decode, ids) == (len(ids) - 1) // BLOCK
            assert decode.submit(ids, SamplingParams(max_new_tokens=8)).result(60).token_ids == alone.token_ids
        payload = prefill.export_prompt_kv(PROMPTS[2]).result(60)
        assert len(payload.shards) == 2 and len(payload.shards[0]) == len(payload.shards[1]) > 0
        one_rank = KvPayload({**payload.layout, "tensor_parallel_size": 1}, payload.token_ids, payload.shards[:1])
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            decode.import_prompt_kv(one_rank)


# ---- over HTTP, through the router ---------------------------------------------------------------------------
# the decode engine as if on another host: a /dev/shm of its own (a mount namespace), so the prefill engine's
# segments are not there and it fetches the blocks over HTTP; without root both share /dev/shm
PRIVATE_SHM = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh")
CAN_UNSHARE = os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture(scope="module")
def split_cluster(tmp_path_factory):
    data = tmp_path_factory.mktemp("disaggregation")
    args = set_args({**TINY_SERVED, "serving_config.kv_transfer": True})
    port = free_port()  # the prefill engine trusts itself: it decodes its own transfers in a test below
    prefill_url = f"http://127.0.0.1:{port}"
    prefill = ServerProcess(data, *args, *set_args({"serving_config.kv_transfer_peers": [prefill_url]}),
                            "--port", str(port))
    assert prefill.url == prefill_url
    decode = ServerProcess(data, *args, *set_args({"serving_config.kv_transfer_peers": [prefill.url]}),
                           prefix=PRIVATE_SHM if CAN_UNSHARE else ())
    router = RouterProcess(decode.url, prefill=(prefill.url,))
    yield router, prefill, decode
    router.stop()
    for server in (prefill, decode):
        assert server.stop() == 0, server.output


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_router_with_a_prefill_engine_answers_as_one_engine(split_cluster):
    router, prefill, decode = split_cluster
    prompt = "The quick brown fox jumps over the lazy dog while the cat watches. " * 3
    body = {"model": "llama2", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    status, alone = post(prefill.url + "/v1/completions", body)  # colocated: the prefill engine does it all
    assert status == 200
    status, split = post(router.url + "/v1/completions", body)
    assert status == 200, split
    assert json.loads(split)["choices"] == json.loads(alone)["choices"]
    metrics = get(decode.url + "/metrics")[1]
    imported = metric(metrics, "llm_serving_kv_transfer_imported_blocks_total")
    via = "http" if CAN_UNSHARE else "shm"
    assert imported >= 1 and metric(metrics, f'llm_serving_kv_transfer_fetches_total{{via="{via}"}}') == 1
    assert 'outcome="transfer"' in get(router.url + "/metrics")[1]
    poisoned = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "llmserving_kvx_9_ab",
                                               "remote_url": prefill.url}}
    status, answer = post(router.url + "/v1/completions", poisoned)  # the client's transfer dropped by the router
    assert status == 200 and json.loads(answer)["choices"] == json.loads(alone)["choices"]
    metrics = get(decode.url + "/metrics")[1]
    assert metric(metrics, f'llm_serving_kv_transfer_fetches_total{{via="{via}"}}') == 2
    assert 'via="refused"' not in metrics

    chat = {"model": "llama2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    status, direct = post(prefill.url + "/v1/chat/completions", chat)
    status2, via_router = post(router.url + "/v1/chat/completions", chat)
    assert status == status2 == 200

    def text(raw: bytes) -> str:
        return "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                       for line in raw.decode().splitlines() if line.startswith("data: {") and '"choices": [{' in line)

    assert text(via_router) == text(direct) and via_router.decode().rstrip().endswith("data: [DONE]")
    assert metric(get(decode.url + "/metrics")[1], "llm_serving_kv_transfer_imported_blocks_total") > imported
    assert not list(Path("/dev/shm").glob(f"llmserving_kvx_{prefill.proc.pid}_*"))  # every one fetched, unlinked


def test_held_blocks_are_fetched_once_and_wrong_use_is_a_clear_error(split_cluster, tiny_server):
    _, prefill, decode = split_cluster
    body = {"prompt": "one two three four five six seven eight nine ten eleven twelve " * 3, "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}

    def held() -> dict:
        status, answer = post(prefill.url + "/v1/completions", body)
        assert status == 200
        return json.loads(answer)["kv_transfer_params"]

    params = held()
    assert params["num_blocks"] >= 1 and Path("/dev/shm", params["transfer_id"]).exists()
    status, blob = get_bytes(f"{prefill.url}/v1/kv_transfer/{params['transfer_id']}")
    assert status == 200 and KvPayload.from_bytes(blob).num_blocks == params["num_blocks"]
    status, again = get_bytes(f"{prefill.url}/v1/kv_transfer/{params['transfer_id']}")
    assert status == 404 and "fetched already" in json.loads(again)["error"]["message"]
    assert not Path("/dev/shm", params["transfer_id"]).exists()
    # a transfer that is gone: the decode engine computes the prompt itself (same answer as alone)
    lost = {**body, "max_tokens": 6, "kv_transfer_params": {"transfer_id": params["transfer_id"],
                                                           "remote_url": prefill.url}}
    plain = {k: v for k, v in lost.items() if k != "kv_transfer_params"}
    status, recomputed = post(decode.url + "/v1/completions", lost)
    assert status == 200 and json.loads(recomputed)["choices"] == json.loads(post(prefill.url + "/v1/completions",
                                                                                   plain)[1])["choices"]
    assert metric(get(decode.url + "/metrics")[1], 'llm_serving_kv_transfer_fetches_total{via="failed"}') == 1
    # an engine on the same host reads the segment itself and releases it (here the prefill engine decodes too)
    params = held()
    same_host = {**lost, "kv_transfer_params": {"transfer_id": params["transfer_id"], "remote_url": prefill.url}}
    status, answer = post(prefill.url + "/v1/completions", same_host)
    assert status == 200 and json.loads(answer)["choices"] == json.loads(recomputed)["choices"]
    assert metric(get(prefill.url + "/metrics")[1], 'llm_serving_kv_transfer_fetches_total{via="shm"}') == 1
    deadline = time.monotonic() + 10
    while Path("/dev/shm", params["transfer_id"]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # released by the DELETE the reader sends after the answer's admission
    assert get_bytes(f"{prefill.url}/v1/kv_transfer/{params['transfer_id']}")[0] == 404
    status, refused = post(tiny_server.url + "/v1/completions", body)  # an engine without KV transfer
    assert status == 400 and "serving_config.kv_transfer" in json.loads(refused)["error"]["message"]


def get_bytes(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_a_prefill_engine_that_is_down_leaves_the_prompt_to_the_decode_engine(split_cluster):
    _, prefill, decode = split_cluster
    nowhere = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess(decode.url, prefill=(nowhere,), health_interval_s=600)  # no health check meanwhile
    try:
        router_up = get(router.url + "/health")
        assert router_up[0] == 200 and json.loads(router_up[1])["engines"][nowhere] is False
        body = {"prompt": "a prefill engine that is down " * 4, "max_tokens": 5, "temperature": 0}
        status, answer = post(router.url + "/v1/completions", body)
        assert status == 200 and json.loads(answer)["choices"] == json.loads(
            post(prefill.url + "/v1/completions", body)[1])["choices"]
    finally:
        router.stop()
    bad = subprocess.run([sys.executable, "-m", "llm_serving", "router", "--engine", decode.url, "--prefill", "nope"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--prefill 'nope': expected a URL" in bad.stderr


# ---- transfers that cannot lie (issue 51) --------------------------------------------------------------------
def counts(engine) -> dict[str, float]:
    text = get(engine.url + "/metrics")[1]
    return {**{via: metric(text, f'llm_serving_kv_transfer_fetches_total{{via="{via}"}}')
               for via in ("shm", "http", "failed", "refused")},
            "imported": metric(text, "llm_serving_kv_transfer_imported_blocks_total")}


def choices(url: str, body: dict) -> list:
    status, answer = post(url + "/v1/completions", body)
    assert status == 200, answer
    return json.loads(answer)["choices"]


def hold(prefill, prompt: list[int]) -> dict:
    """The prefill half: the transfer the prefill engine holds for ``prompt``."""
    status, answer = post(prefill.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    params = json.loads(answer)["kv_transfer_params"]
    assert params["num_blocks"] >= 2
    return params


def test_a_client_cannot_make_a_decode_engine_fetch_from_its_server(split_cluster):
    """The operator's report: a request naming a fake server with blocks for a victim's prompt made every later
    request for it answer other text. Now the decode engine fetches only from its peers and the router drops
    client parameters: the fake server is never asked, nothing is imported, the answers are right."""
    router, prefill, decode = split_cluster
    victim = [17 + (11 * i) % 800 for i in range(40)]
    plain = {"prompt": victim, "max_tokens": 6, "temperature": 0}
    right = choices(prefill.url, plain)
    honest = KvPayload.from_bytes(get_bytes(f"{prefill.url}/v1/kv_transfer/{hold(prefill, victim)['transfer_id']}")[1])
    poison = KvPayload(honest.layout, honest.token_ids, [bytes(len(s)) for s in honest.shards])  # digests valid
    with liar(poison.to_bytes()) as server:
        attack = {**plain, "max_tokens": 1,
                  "kv_transfer_params": {"transfer_id": f"llmserving_kvx_{os.getpid()}_ab", "remote_url": server.url}}
        before = counts(decode)
        assert right[0]["text"].startswith(choices(decode.url, attack)[0]["text"])
        after = counts(decode)
        assert after == {**before, "refused": before["refused"] + 1}  # nothing fetched, nothing imported
        assert choices(decode.url, plain) == right  # the prefix cache holds the decode engine's own blocks only
        assert choices(router.url, {**attack, "max_tokens": 6}) == right  # dropped by the router: a transfer of its own
        assert server.asked == []
    assert counts(decode)["refused"] == after["refused"]


def test_damaged_blocks_are_refused_and_the_prompt_computed(split_cluster):
    """Zeroed KV bytes in the held segment: refused (counted) by a decode engine fetching over HTTP, and by one on
    the same host reading the segment itself; both answer as one engine does."""
    _, prefill, decode = split_cluster
    prompt = [23 + (13 * i) % 700 for i in range(40)]
    plain = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    right = choices(prefill.url, plain)
    for engine in (decode, prefill):  # HTTP when decode has a /dev/shm of its own; the segment itself (shm)
        params = hold(prefill, prompt)
        with open(Path("/dev/shm", params["transfer_id"]), "r+b") as segment:  # its length, then the payload
            end = 8 + int.from_bytes(segment.read(8), "little")
            segment.seek(8 + 8)  # the payload's magic, then its header's length and the header: then the blocks
            blocks = 8 + 8 + 4 + int.from_bytes(segment.read(4), "little")
            segment.seek(blocks)
            segment.write(bytes(end - blocks))  # every block zeroed
        before = counts(engine)
        transfer = {"transfer_id": params["transfer_id"], "remote_url": prefill.url}
        assert choices(engine.url, {**plain, "kv_transfer_params": transfer}) == right
        assert counts(engine) == {**before, "refused": before["refused"] + 1}
    assert choices(decode.url, plain) == right


def test_blocks_of_another_prompt_are_refused(split_cluster):
    _, prefill, decode = split_cluster
    theirs, ours = [31 + (17 * i) % 600 for i in range(40)], [37 + (19 * i) % 600 for i in range(40)]
    plain = {"prompt": ours, "max_tokens": 6, "temperature": 0}
    right = choices(prefill.url, plain)
    params = hold(prefill, theirs)
    before = counts(decode)
    transfer = {"transfer_id": params["transfer_id"], "remote_url": prefill.url}
    assert choices(decode.url, {**plain, "kv_transfer_params": transfer}) == right
    assert counts(decode) == {**before, "refused": before["refused"] + 1}
