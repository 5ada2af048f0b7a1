"""Issue 35, tensor parallelism across hosts: ranks 2 and 3 of a tp-4 pool in a network namespace this test makes
(a veth pair with addresses of its own, and a private /dev/shm, so they reach the master only over the network)
join with ``llm-serving agent --join``; ranks 1-3 take their steps from rank 0's broadcast; greedy ids equal tp 1
and transformers; a remote rank killed mid-run, the service heals when it joins again; the join's refusals,
the step broadcast's framing and the configuration checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agents.runtime.step_broadcast import HEADER_WORDS, STOP, StepBroadcast
from agents.runtime.step_source import BroadcastSteps
from llm_serving.config.serving_config import ConfigError
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import agent_spec, resolve_model
from llm_serving.executor.agent_pool import AgentPool, AgentStartupError
from llm_serving.executor.collective_launch import free_port
from llm_serving.executor.rank_join import PROTOCOL, JoinListener, JoinRefused, join_pool
from llm_serving.protocol.batch import StepBatch
from tests.test_agent_pool import random_batch
from tests.test_engine import our_segments, wait_for
from tests.test_tensor_parallel import EOS, alive, tp_config, wait_gone, workload

ROOT = Path(__file__).resolve().parents[1]


# ---- the step broadcast's framing (a recorded collective stands for MindSpore's) -----------------------------
class RecordedCollective:
    """Rank 0's broadcasts recorded, then played back to a follower in order (what the collective delivers)."""

    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []

    def send(self, words: np.ndarray) -> np.ndarray:
        assert words.dtype == np.int32  # the CPU broadcast kernel's type
        self.sent.append(words.copy())
        return words

    def receive(self, words: np.ndarray) -> np.ndarray:
        got = self.sent.pop(0)
        assert got.shape == words.shape, "a follower must expect the shape rank 0 broadcasts"
        return got


def batches_equal(a: StepBatch, b: StepBatch) -> None:
    for name in ("kind", "num_steps"):
        assert getattr(a, name) == getattr(b, name)
    for name in ("input_ids", "positions", "slot_mapping", "query_lens", "context_lens", "block_tables", "fed_rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name


def test_a_step_crosses_in_one_broadcast_or_two_and_failures_and_the_end_too():
    rng = np.random.default_rng(3)
    small = random_batch(rng, False, 4, 8)
    fed = replace(small, fed_rows=np.arange(4, dtype=np.int32))
    large = random_batch(rng, True, 8, 64)  # a prefill of several thousand tokens: more than the header holds
    large = replace(large, input_ids=rng.integers(0, 998, 6000).astype(np.int32))
    wire = RecordedCollective()
    rank0, follower = StepBroadcast(wire.send), BroadcastSteps(StepBroadcast(wire.receive))
    for step, batch in ((5, small), (6, large), (7, fed)):
        before = len(wire.sent)
        rank0.send(step, batch)
        assert len(wire.sent) - before == (2 if batch is large else 1)
        assert wire.sent[-1].size == HEADER_WORDS or int(wire.sent[-1].size).bit_count() == 1  # power-of-2 rest
        assert follower.next_step() == step
        batches_equal(follower.read_step(step), batch)
    rank0.send(8, None)  # rank 0 could not read step 8: the follower answers it with an error, and stays in step
    assert follower.next_step() == 8
    with pytest.raises(RuntimeError, match="rank 0 could not read step 8"):
        follower.read_step(8)
    rank0.stop()
    assert follower.next_step() is None and not wire.sent
    assert STOP < 0


# ---- joining ------------------------------------------------------------------------------------------------
def remote_spec(tmp_path: Path, tp: int = 3, local: int = 1, port: int | None = None):
    cfg = tp_config(tmp_path, 1, serving_config={"num_agents": 1})
    spec = agent_spec(cfg, resolve_model(cfg))
    return replace(spec, tensor_parallel_size=tp, local_ranks=local,
                   join_address=f"127.0.0.1:{port or free_port()}")


def hello(address: str, message: bytes) -> dict:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(message)
        return json.loads(sock.makefile("rb").readline())


def test_the_pool_admits_each_remote_rank_once_and_refuses_clearly(tmp_path):
    spec = remote_spec(tmp_path)
    listener = JoinListener(spec, lambda rank, ip: {"MS_NODE_ID": str(rank), "MS_WORKER_IP": ip})
    answers: list = []
    try:
        def serve_joins(n: int) -> None:
            for _ in range(n):
                answers.append(listener.accept())

        thread = threading.Thread(target=serve_joins, args=(5,))
        thread.start()
        sock, got_spec, env = join_pool(spec.join_address, 2)
        assert got_spec == spec and env == {"MS_NODE_ID": "2", "MS_WORKER_IP": "127.0.0.1"}
        with pytest.raises(JoinRefused, match="rank 0 is not one that joins this pool .*ranks 1..2 of 3") as info:
            join_pool(spec.join_address, 0)
        assert not info.value.retry
        again = hello(spec.join_address, json.dumps({"protocol": PROTOCOL, "rank": 2}).encode() + b"\n")
        assert again == {"error": "rank 2 has already joined", "retry": True}
        other = hello(spec.join_address, json.dumps({"protocol": "llm-serving-join/0", "rank": 1}).encode() + b"\n")
        assert "run the same llm-serving build on every host" in other["error"] and not other["retry"]
        assert "expected a JSON line" in hello(spec.join_address, b"GET / HTTP/1.0\r\n")["error"]
        thread.join(10)
        assert answers[0][0] == 2 and [type(a) for a in answers[1:]] == [str] * 4
        assert listener.waiting_for == [1]
        sock.close()
    finally:
        listener.close()


def test_a_joining_rank_waits_for_a_pool_to_listen(tmp_path):
    spec = remote_spec(tmp_path)
    said: list[str] = []
    result: list = []
    thread = threading.Thread(target=lambda: result.append(join_pool(spec.join_address, 1, 0.05, said.append)))
    thread.start()
    wait_for(lambda: said, 10, "the first refused connection")
    assert "no pool accepts joins at" in said[0] and len(said) == 1  # said once, however often it retries
    listener = JoinListener(spec, lambda rank, ip: {})
    try:
        joined = listener.accept()
        thread.join(10)
        assert joined[0] == 1 and result[0][1] == spec
        result[0][0].close()
    finally:
        listener.close()


def test_a_rank_that_never_joins_fails_the_start_naming_the_command(tmp_path):
    pool = AgentPool(remote_spec(tmp_path, tp=2), startup_timeout_s=8)
    with pytest.raises(AgentStartupError, match=r"rank\(s\) \[1\] never joined at 127.0.0.1:\d+ .*llm-serving "
                                                r"agent --join 127.0.0.1:\d+ --rank R"):
        pool.start()
    wait_gone(pool.pids + pool.helper_pids)
    assert not our_segments()


def test_remote_ranks_are_configured_or_refused_by_key(tmp_path):
    def config(**serving):
        return tp_config(tmp_path, 2, serving_config={"num_agents": 2, **serving})

    for serving, key, words in (({"local_agents": 3}, "local_agents", "must be in 1..num_agents (2)"),
                                ({"local_agents": 1}, "join_address", "is needed when only 1 of the 2 ranks"),
                                ({"local_agents": 1, "join_address": "10.0.0.1"}, "join_address", "HOST:PORT"),
                                ({"join_address": "h:0"}, "join_address", "HOST:PORT"),
                                ({"join_address": "[::1]:29700"}, "join_address", "an IPv4 address or a host name")):
        with pytest.raises(ConfigError, match=re.escape(words)) as info:
            config(**serving)
        assert info.value.key == f"serving_config.{key}"
    cfg = config(local_agents=1, join_address="10.0.0.1:29700")
    spec = agent_spec(cfg, resolve_model(cfg))
    assert (spec.local_ranks, spec.join_address, spec.has_remote_ranks) == (1, "10.0.0.1:29700", True)


# ---- two "hosts": the master's, and a network namespace ---------------------------------------------------
@pytest.fixture(scope="module")
def netns():
    """A network namespace with a veth pair to this one: (namespace, master's address, the namespace's)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = os.getpid() % 10000
    name, outer, inner = f"llmsrv{tag}", f"lsv{tag}a", f"lsv{tag}b"
    subnet = f"10.213.{tag % 250}"
    master_ip, remote_ip = f"{subnet}.1", f"{subnet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    for stale in (["netns", "del", name], ["link", "del", outer]):  # left by a killed run with this pid's tag
        subprocess.run(["ip", *stale], check=False, capture_output=True)
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", name)
        ip("addr", "add", f"{master_ip}/30", "dev", outer)
        ip("link", "set", outer, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"{remote_ip}/30", "dev", inner)
        ip("netns", "exec", name, "ip", "link", "set", inner, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, master_ip, remote_ip
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)  # the veth pair goes too
        subprocess.run(["ip", "link", "del", outer], check=False, capture_output=True)


class RemoteHost:
    """``llm-serving agent --join`` in the namespace, with a /dev/shm of its own; its output collected."""

    def __init__(self, netns: str, address: str, rank: int) -> None:
        self.lines: list[str] = []
        argv = ["ip", "netns", "exec", netns, "unshare", "--mount", "sh", "-c",
                'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh",
                sys.executable, "-m", "llm_serving", "agent", "--join", address, "--rank", str(rank),
                "--ranks-here", "2"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def agent_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.lines if (m := re.search(r"joined .* \(agent pid (\d+)\)", line))]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def across_hosts(netns, tmp_path_factory) -> dict:
    """tp 1 on this host; then tp 4 with ranks 0 and 1 here (rank 1 following rank 0's broadcast, as the ranks of
    a server's first host do) and ranks 2 and 3 in the namespace, run once, then again while rank 3 is killed."""
    data = tmp_path_factory.mktemp("multi_host")
    out: dict = {}
    tp1 = Engine(tp_config(data, 1))
    tp1.start(progress=None)
    try:
        out["tp1"] = [s.result(timeout=120) for s in [tp1.submit(p, sp) for p, sp in workload()]]
    finally:
        tp1.shutdown()
    name, master_ip, _remote_ip = netns
    address = f"{master_ip}:{free_port(master_ip)}"
    remotes = [RemoteHost(name, address, rank) for rank in (2, 3)]
    progress: list[str] = []
    engine = Engine(tp_config(data, 4, serving_config={"num_agents": 4, "local_agents": 2, "join_address": address}))
    try:
        engine.start(progress=progress.append)
        out["progress"], out["pids"] = progress, engine.agent_pids
        out["remote_pids"] = [pid for r in remotes for pid in r.agent_pids()]
        out["results"] = [s.result(timeout=120) for s in [engine.submit(p, sp) for p, sp in workload()]]
        greedy = [(p, sp) for p, sp in workload() if sp.temperature == 0]  # nothing sampled: steps sent ahead
        out["greedy_again"] = [s.result(timeout=120) for s in [engine.submit(p, sp) for p, sp in greedy]]
        out["steps_sent_ahead"] = engine.stats()["steps_sent_ahead"]
        before = engine.stats()
        streams = [engine.submit(p, sp) for p, sp in workload()]
        wait_for(lambda: engine.stats()["decode_steps"] > before["decode_steps"] + 2, 60, "decoding")
        os.kill(remotes[1].agent_pids()[0], signal.SIGKILL)
        out["after_kill"] = [s.result(timeout=180) for s in streams]
        out["stats"], out["new_pids"] = engine.stats(), engine.agent_pids
        out["remote_pids_after"] = [r.agent_pids() for r in remotes]
    finally:
        engine.shutdown()
        every = [pid for r in remotes for pid in r.agent_pids()]
        wait_for(lambda: not any(alive(p) for p in every), 15, "the remote agents to exit")
        for r in remotes:
            r.stop()
        out["remote_log"] = [line for r in remotes for line in r.lines]
    from tests.hf_reference import hf_greedy, load_hf

    hf = load_hf(resolve_model(tp_config(data, 1)).model_path)
    out["hf"] = [hf_greedy(hf, p, sp.max_new_tokens, eos_token_id=EOS) for p, sp in workload() if sp.temperature == 0]
    return out


def test_a_rank_in_another_namespace_serves_the_tokens_of_tp1_and_transformers(across_hosts):
    run = across_hosts
    assert all(any(f"rank {r} joined from" in line for line in run["progress"]) for r in (2, 3)), run["progress"]
    assert any("waiting for ranks 2..3 to join at" in line for line in run["progress"])
    assert len(run["pids"]) == 2 and len(run["remote_pids"]) == 2  # ranks 0 and 1 are this host's children
    for got, ref, (hf_ids, hf_logprobs) in zip(run["results"], run["tp1"], run["hf"]):
        assert got.token_ids == ref.token_ids == hf_ids
        np.testing.assert_allclose(got.logprobs, hf_logprobs, atol=1e-4)
    greedy = len(run["hf"])
    assert [r.token_ids for r in run["results"][greedy:]] == [r.token_ids for r in run["tp1"][greedy:]]  # sampled
    assert [r.token_ids for r in run["greedy_again"]] == [ids for ids, _ in run["hf"]]
    assert run["steps_sent_ahead"] > 0  # fed steps crossed the broadcast: each rank fed its own picks


def test_a_killed_remote_rank_heals_when_it_joins_again(across_hosts):
    run = across_hosts
    for got, (hf_ids, _) in zip(run["after_kill"], run["hf"]):
        assert got.token_ids == hf_ids
    assert run["stats"]["agent_restarts"] == 1 and run["stats"]["requests_recomputed"] > 0
    # every joining command started its rank again for the new pool (rank 2's agent was stopped with the pool)
    assert [len(pids) for pids in run["remote_pids_after"]] == [2, 2] and run["new_pids"] != run["pids"]
    wait_gone(run["pids"] + run["new_pids"])
    assert not our_segments()


def test_the_join_command_and_the_step_sources_import_no_mindspore():
    """The join command runs on the remote host before any agent (the master's side never imports MindSpore);
    the step sources import it only when a broadcast is made."""
    code = ("import sys, agents.runtime.step_source, llm_serving.cli.commands.agent, "
            "llm_serving.executor.rank_join; print('mindspore' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize(("args", "words"), [(["--join", "nohost", "--rank", "1"], "--join: expected HOST:PORT"),
                                             (["--join", "h:1", "--rank", "0"], "--rank must be >= 1")])
def test_the_join_command_refuses_bad_arguments_in_one_line(args, words):
    done = subprocess.run([sys.executable, "-m", "llm_serving", "agent", *args], check=False, capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr
