"""Issue 51: a standby agent pool (``serving_config.standby_agents``) promoted when the serving agents fail.

Stand-in agent processes (the real ``AgentPool``, the stand-in runner) for the processes' paths: promotion, a
standby's death, shutdown while it starts; in-process pools for the orders of events real processes cannot be
made to show on cue (a failure while the standby still starts, a standby that then fails to start). The MindSpore
tensor-parallel promotion, greedy ids included, is in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path

import aiohttp
import pytest

from llm_serving.config.serving_config import ConfigError
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.standby import Standby, memory_shortfall
from llm_serving.executor.agent_pool import AgentDiedError, AgentPool, AgentStartupError
from tests.test_engine import our_segments, standin_expected, standin_factory, tiny_config, wait_for
from tests.test_self_healing import FAST_RECOVERY, ScriptedPool, gone, health
from tests.test_server import ServerProcess, long_completion, sse_payloads

STANDBY = {**FAST_RECOVERY, "standby_agents": True}
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("standby_models")


def standby_engine(data_dir: Path, pools: list, **serving) -> Engine:
    cfg = tiny_config(data_dir, serving_config={"num_agents": 2, **STANDBY, **serving})
    engine = Engine(cfg, standin_agents=True, pool_factory=standin_factory(pools, step_delay_s=0.01))
    engine.start(progress=None)
    return engine


def all_gone(pools: list[AgentPool]) -> None:
    wait_for(lambda: all(gone(p) for pool in pools for p in pool.pids), what="every agent process gone")
    assert all(pool.shm_name is None for pool in pools) and not our_segments()


def test_a_killed_agent_is_replaced_by_the_standby_and_its_requests_recomputed(data_dir):
    pools: list[AgentPool] = []
    engine = standby_engine(data_dir, pools)
    try:
        wait_for(lambda: engine.stats()["standby"] == "ready", what="the standby ready")
        serving, standby = engine.agent_pids, engine.stats()["standby_pids"]
        assert len(standby) == 2 and set(standby).isdisjoint(serving)
        running = [engine.submit([1, 3 + i], LONG) for i in range(8)]
        wait_for(lambda: engine.stats()["decode_steps"] >= 3, what="decoding")
        os.kill(serving[1], signal.SIGKILL)
        wait_for(lambda: engine.stats()["agent_restarts"] == 1, what="the standby promoted")
        assert engine.agent_pids == standby  # promoted, not started anew
        for i, s in enumerate(running):  # recomputed by the promoted agents: the tokens of a run without the kill
            assert s.result(timeout=20).token_ids == standin_expected([1, 3 + i], LONG)[0]
        wait_for(lambda: engine.stats()["standby"] == "ready", what="the next standby ready")
        stats = engine.stats()
        assert stats["standby_promotions"] == 1 and len(pools) == 3 and stats["standby_pids"] == pools[2].pids
        assert stats["requests_failed"] == 0 and stats["requests_recomputed"] >= 8 and stats["kv_blocks_used"] == 0
        wait_for(lambda: all(gone(p) for p in serving), what="the failed pool's processes gone")
        assert pools[0].shm_name is None
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        assert engine.submit([1, 9], params).result(timeout=10).token_ids == standin_expected([1, 9], params)[0]
    finally:
        engine.shutdown()
    all_gone(pools)


def test_a_standby_that_dies_while_waiting_is_replaced_and_serving_goes_on(data_dir):
    pools: list[AgentPool] = []
    engine = standby_engine(data_dir, pools)
    try:
        wait_for(lambda: engine.stats()["standby"] == "ready", what="the standby ready")
        serving, standby = engine.agent_pids, engine.stats()["standby_pids"]
        streams = [engine.submit([1, 20 + i], LONG) for i in range(4)]
        os.kill(standby[0], signal.SIGKILL)
        wait_for(lambda: engine.stats()["standby_deaths"] == 1 and engine.stats()["standby"] == "ready",
                 what="a new standby")
        for i, s in enumerate(streams):
            assert s.result(timeout=20).token_ids == standin_expected([1, 20 + i], LONG)[0]
        stats = engine.stats()
        assert engine.agent_pids == serving and stats["agent_restarts"] == 0 and stats["requests_recomputed"] == 0
        assert len(pools) == 3 and stats["standby_pids"] == pools[2].pids and pools[1].shm_name is None
        assert all(gone(p) for p in standby)
    finally:
        engine.shutdown()
    all_gone(pools)


class StoppedAtSpawn(AgentPool):
    """A pool whose processes are stopped (SIGSTOP) as soon as they are spawned: its start-up never ends."""

    def _spawn(self, rank: int) -> None:
        super()._spawn(rank)
        os.kill(self.pids[-1], signal.SIGSTOP)


def test_shutdown_while_the_standby_starts_leaves_nothing(data_dir):
    pools: list[AgentPool] = []

    def factory(spec):
        pools.append((StoppedAtSpawn if pools else AgentPool)(spec))
        return pools[-1]

    engine = Engine(tiny_config(data_dir, serving_config={"num_agents": 2, **STANDBY}), standin_agents=True,
                    pool_factory=factory)
    engine.start(progress=None)
    wait_for(lambda: len(pools) == 2 and len(pools[1].pids) == 2, what="the standby's processes")
    assert engine.stats()["standby"] == "starting"
    engine.shutdown()
    all_gone(pools)
    assert engine.stats()["standby"] == "closed"


NO_PID = 10**9  # the in-process pools' pids: numbers no process has


class HeldStart(ScriptedPool):
    """A scripted pool whose start waits for its ``release`` where ``held``, then fails with its start error if
    it has one; closing it releases it."""

    def __init__(self, spec, start_error=None, held: bool = False) -> None:
        super().__init__(spec, start_error)
        self.held, self.release = held, threading.Event()

    def start(self, progress=None) -> None:
        if self.held:
            self.release.wait(30)
        super().start(progress)

    def close(self, graceful: bool = True) -> None:
        super().close(graceful)
        self.release.set()


def held_engine(data_dir: Path, pools: list, standby_error: Exception | None = None) -> Engine:
    """An engine on in-process pools whose first standby (the second pool) starts only when released."""

    def factory(spec):
        first_standby = len(pools) == 1
        pool = HeldStart(spec, standby_error if first_standby else None, held=first_standby)
        pool.pids = [NO_PID + len(pools)]
        pools.append(pool)
        return pool

    engine = Engine(tiny_config(data_dir, serving_config=STANDBY), pool_factory=factory)
    engine.start(progress=None)
    return engine


def test_a_failure_while_the_standby_still_starts_waits_for_it_and_promotes_it(data_dir):
    pools: list[HeldStart] = []
    engine = held_engine(data_dir, pools)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        pools[0].fail_next = AgentDiedError("agent rank 0 died")
        first = engine.submit([1, 5], params)
        wait_for(lambda: engine.state == "recovering", what="recovering")
        queued = engine.submit([1, 6], params)
        assert engine.stats()["standby"] == "starting" and len(pools) == 2  # no fresh pool: it waits for the standby
        pools[1].release.set()
        for prompt, stream in (([1, 5], first), ([1, 6], queued)):
            assert stream.result(timeout=10).token_ids == standin_expected(prompt, params)[0]
        stats = engine.stats()
        assert engine.agent_pids == [NO_PID + 1] and stats["agent_restarts"] == 1 and stats["standby_promotions"] == 1
        wait_for(lambda: engine.stats()["standby"] == "ready" and len(pools) == 3, what="the next standby")
    finally:
        engine.shutdown()
    assert not any(p.alive for p in pools)


def test_a_standby_that_fails_to_start_while_awaited_gives_way_to_new_agents(data_dir):
    pools: list[HeldStart] = []
    engine = held_engine(data_dir, pools, standby_error=AgentStartupError("out of memory"))
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        pools[0].fail_next = AgentDiedError("agent rank 0 died")
        stream = engine.submit([1, 5], params)
        wait_for(lambda: engine.state == "recovering", what="recovering")
        pools[1].release.set()
        assert stream.result(timeout=10).token_ids == standin_expected([1, 5], params)[0]
        stats = engine.stats()
        assert stats["agent_restarts"] == 1 and stats["standby_promotions"] == 0
        assert engine.agent_pids == [NO_PID + 2]  # started anew once the standby failed
    finally:
        engine.shutdown()
    assert not any(p.alive for p in pools)


def test_a_standby_that_keeps_failing_is_given_up_and_says_why(data_dir):
    pools: list[ScriptedPool] = []

    def factory(spec):
        pools.append(ScriptedPool(spec, AgentStartupError("no device") if pools else None))
        return pools[-1]

    engine = Engine(tiny_config(data_dir, serving_config={**STANDBY, "agent_restart_limit": 2}), pool_factory=factory)
    engine.start(progress=None)
    try:
        wait_for(lambda: engine.stats()["standby"].startswith("failed"), what="the standby given up")
        assert "no device" in engine.stats()["standby"] and len(pools) == 4  # the first and 3 standby starts
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        assert engine.submit([1, 8], params).result(timeout=10).token_ids == standin_expected([1, 8], params)[0]
    finally:
        engine.shutdown()


def test_memory_shortfall_compares_the_agents_resident_memory_with_what_is_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    rss_kib = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith("VmRSS:")).split()[1])
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {rss_kib * 4} kB\n")
    assert memory_shortfall([os.getpid()], str(meminfo)) is None
    meminfo.write_text(f"MemAvailable: {rss_kib} kB\n")
    why = memory_shortfall([os.getpid(), os.getpid()], str(meminfo))
    assert why is not None and "standby needs as much" in why
    assert memory_shortfall([os.getpid()], str(tmp_path / "missing")) is None  # no /proc: not checked


def test_a_standby_refused_for_memory_is_never_started():
    started: list[int] = []
    standby = Standby(lambda spec: started.append(1) or ScriptedPool(spec), None,  # type: ignore[arg-type]
                      fits=lambda: "the host has 0.1 GiB available")
    standby.join(5)
    assert standby.state == "refused: the host has 0.1 GiB available" and not started
    assert standby.take() is None and standby.state.startswith("refused")


def test_standby_agents_config_is_refused_where_it_cannot_work(data_dir):
    with pytest.raises(ConfigError, match=r"serving_config.standby_agents.*CPU agents only"):
        tiny_config(data_dir, serving_config={"standby_agents": True}, model_config={"device_target": "Ascend",
                                                                                      "dtype": "float16"})
    with pytest.raises(ConfigError, match=r"serving_config.standby_agents.*every rank must run on this host"):
        tiny_config(data_dir, serving_config={"standby_agents": True, "num_agents": 2, "local_agents": 1,
                                              "join_address": "127.0.0.1:7999"})
    assert tiny_config(data_dir).serving_config.standby_agents is False


def test_served_engine_promotes_its_standby_and_health_shows_it(tmp_path):
    """Through `llm-serving serve`: /health lists the standby; a stream interrupted by the serving agent's SIGKILL
    ends normally on the promoted agents, which /health then lists as serving; the server exits 0 leaving no
    segment."""
    server = ServerProcess(tmp_path, "--standin-agents", "--standin-step-delay", "0.01",
                           "--set", "serving_config.standby_agents=true",
                           "--set", "serving_config.agent_restart_backoff_s=0.01")
    try:
        async def standby_ready(s: aiohttp.ClientSession) -> dict:
            while True:
                status, body = await health(s, server.url)
                if status == 200 and body["standby"]["state"] == "ready":
                    return body
                await asyncio.sleep(0.05)

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                body = await asyncio.wait_for(standby_ready(s), 30)
                serving, standby = body["agent_pids"], body["standby"]["pids"]
                assert len(serving) == len(standby) == 1 and serving != standby
                r = await s.post(f"{server.url}/v1/completions", json=long_completion(200))
                await r.content.readline()
                os.kill(serving[0], signal.SIGKILL)
                frames = sse_payloads([x.decode().strip() async for x in r.content if x.strip()])
                assert frames[-1] == "[DONE]" and json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
                body = await asyncio.wait_for(standby_ready(s), 30)
                assert body["agent_pids"] == standby and body["standby"]["pids"] not in ([], standby, serving)
        asyncio.run(go())
        assert server.stop() == 0, server.output
        assert server.shm_segments() == []
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_chaos_agent_sections_pass_with_a_standby(tmp_path):
    """``scripts/chaos_agents.py`` against a served engine with a standby: a promotion can be over before any poll
    of /health sees "recovering"; the sections judge the recovery by the new agents /health lists."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import chaos

    server = ServerProcess(tmp_path, "--standin-agents", "--standin-step-delay", "0.02", "--set",
                           "serving_config.step_timeout_min_s=1", "--set", "serving_config.standby_agents=true")
    try:
        out = tmp_path / "figures.json"
        code = chaos.main(["--url", server.url, "--sections", "sigkill,sigstop", "--json", str(out),
                           "--agents-requests", "40", "--agents-max-new-tokens", "24"])
        figures = json.loads(out.read_text())
        assert code == 0, figures
        for name in ("sigkill", "sigstop"):
            f = figures[name]
            assert f["answered_ok"] == f["identical_to_reference"] == 40 and f["agent_restarts"] == 1, f
            assert f["ready_again_after_s"] is not None and f["kv_blocks_used_after"] == 0, f
        assert server.stop() == 0, server.output
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
