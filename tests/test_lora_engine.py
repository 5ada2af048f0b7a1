"""The engine's adapters with stand-in agents in their own processes: configured adapters checked before the agents
start, loads sent before the steps that need them, a load the agents refuse failing only that adapter's requests,
and the load/unload calls' refusals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from llm_serving.config.serving_config import ConfigError
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine, EngineError, SequenceError
from llm_serving.executor.agent_pool import AgentPool
from llm_serving.protocol.lora import AdapterError
from llm_serving.request_errors import ModelNotFound
from tests.adapter_dirs import adapter_dir
from tests.test_engine import standin_factory, tiny_config, wait_for

VOCAB = 1000


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_engine_models")


def expected(prompt: list[int], n: int, shift: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append((tokens[-1] * 31 + len(tokens) + shift) % VOCAB)
        tokens.append(out[-1])
    return out


def lora_engine(data_dir: Path, modules: dict[str, Path], **lora) -> Engine:
    cfg = tiny_config(data_dir, lora={"enable": True, "modules": {k: str(v) for k, v in modules.items()}, **lora})
    engine = Engine(cfg, standin_agents=True)
    engine.start(progress=None)
    return engine


def test_a_load_the_agents_refuse_fails_only_that_adapter_s_requests(data_dir, tmp_path):
    good, bad = adapter_dir(tmp_path, "good", 4), adapter_dir(tmp_path, "bad", 4)
    engine = lora_engine(data_dir, {"good": good, "bad": bad}, max_loras=2, max_lora_rank=8)
    try:
        # changed on disk after the master checked it: the agents read rank 64, above their slots' 8
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        prompts = [[1, 10 + i, 20 + i] for i in range(3)]
        base, ok, broken = (engine.submit(p, params, adapter=a) for p, a in zip(prompts, (None, "good", "bad")))
        assert base.result(timeout=30).token_ids == expected(prompts[0], 5, 0)
        assert ok.result(timeout=30).token_ids == expected(prompts[1], 5, 5)
        with pytest.raises(SequenceError, match="loading LoRA adapter .*bad"):
            broken.result(timeout=30)
        again = engine.submit(prompts[1], params, adapter="good")  # the engine serves on, good still loaded
        assert again.result(timeout=30).token_ids == expected(prompts[1], 5, 5)
        stats = engine.stats()
        assert stats["requests_failed"] == 1 and stats["kv_blocks_used"] == 0 and stats["agent_restarts"] == 0
        assert stats["lora_requests"] == {"good": 2, "bad": 1}
    finally:
        engine.shutdown()


def test_load_unload_calls_and_their_refusals(data_dir, tmp_path):
    engine = lora_engine(data_dir, {}, max_loras=1, max_lora_rank=8)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        with pytest.raises(ModelNotFound):
            engine.submit([1, 2, 3], params, adapter="a")
        engine.load_adapter("a", str(adapter_dir(tmp_path, "a", 2)))
        assert engine.submit([1, 2, 3], params, adapter="a").result(timeout=30).token_ids == expected([1, 2, 3], 4, 3)
        with pytest.raises(AdapterError, match="max_lora_rank 8"):
            engine.load_adapter("b", str(adapter_dir(tmp_path, "b", 9)))
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_adapter("a", str(tmp_path / "a"))
        assert engine.unload_adapter("a") == 0
        with pytest.raises(ModelNotFound):
            engine.unload_adapter("a")
        with pytest.raises(ModelNotFound):
            engine.submit([1, 2, 3], params, adapter="a")
    finally:
        engine.shutdown()


def test_a_bad_configured_adapter_stops_the_start_naming_its_key(data_dir, tmp_path):
    cfg = tiny_config(data_dir, lora={"enable": True, "max_lora_rank": 8,
                                      "modules": {"wide": str(adapter_dir(tmp_path, "wide", 16))}})
    engine = Engine(cfg, standin_agents=True)
    with pytest.raises(ConfigError, match="max_lora_rank 8") as err:
        engine.start(progress=None)
    assert err.value.key == "lora.modules.wide" and engine.agent_pids == []
    plain = Engine(tiny_config(data_dir), standin_agents=True)
    plain.start(progress=None)
    try:
        with pytest.raises(EngineError, match="lora.enable"):
            plain.load_adapter("a", str(tmp_path / "wide"))
        with pytest.raises(ModelNotFound):
            plain.submit([1, 2], SamplingParams(max_new_tokens=2), adapter="wide")
    finally:
        plain.shutdown()


def test_new_agents_after_a_crash_load_the_adapters_again(data_dir, tmp_path):
    pools: list[AgentPool] = []
    cfg = tiny_config(data_dir, serving_config={"agent_restart_backoff_s": 0.01, "step_timeout_min_s": 0.5},
                      lora={"enable": True, "max_loras": 2, "max_lora_rank": 8,
                            "modules": {"a": str(adapter_dir(tmp_path, "a", 2)),
                                        "b": str(adapter_dir(tmp_path, "b", 6))}})
    engine = Engine(cfg, standin_agents=True, pool_factory=standin_factory(pools, 0.01))
    engine.start(progress=None)
    try:
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        plan = [([1, 20 + i, 3], [None, "a", "b"][i % 3]) for i in range(6)]
        streams = [engine.submit(p, params, adapter=a) for p, a in plan]
        wait_for(lambda: engine.stats()["tokens_generated"] >= 30, what="streams under way")
        os.kill(engine.agent_pids[0], signal.SIGKILL)
        for (prompt, adapter), stream in zip(plan, streams):  # recomputed on the new agents, each its own adapter
            shift = {None: 0, "a": 3, "b": 7}[adapter]
            assert stream.result(timeout=60).token_ids == expected(prompt, 40, shift)
        stats = engine.stats()
        assert stats["agent_restarts"] == 1 and stats["requests_recomputed"] > 0 and stats["lora_slot_loads"] >= 4
        assert stats["kv_blocks_used"] == 0 and stats["requests_failed"] == 0
    finally:
        engine.shutdown()
