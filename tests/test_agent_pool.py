"""Agent processes over shared memory: round trips, several ranks, deaths, start-up errors, clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from llm_serving.executor.agent_pool import AgentDiedError, AgentPool, AgentStartupError, AgentStepError
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.shm_channel import NAME_PREFIX
from llm_serving.protocol.wire import AgentSpec

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
SHM_DIR = Path("/dev/shm")


def standin_spec(**overrides) -> AgentSpec:
    base = {"kind": "standin", "model_path": None, "llama_config": {"vocab_size": VOCAB}, "runner_config": {},
            "max_tokens": 512, "max_batch": 128, "max_blocks_per_seq": 32}
    base.update(overrides)
    return AgentSpec(**base)


def expected_tokens(batch: StepBatch) -> np.ndarray:
    """The stand-in's documented rule, written out independently of agents.runtime.standin."""
    out, start = [], 0
    for q, ctx in zip(batch.query_lens.tolist(), batch.context_lens.tolist()):
        start += q
        out.append((int(batch.input_ids[start - 1]) * 31 + ctx) % VOCAB)
    return np.array(out, np.int32)


def random_batch(rng: np.random.Generator, is_prefill: bool, batch_size: int, width: int) -> StepBatch:
    q = rng.integers(1, 9, batch_size).astype(np.int32) if is_prefill else np.ones(batch_size, np.int32)
    ctx = (q + (0 if is_prefill else rng.integers(1, 60, batch_size))).astype(np.int32)
    n = int(q.sum())
    return StepBatch(rng.integers(0, VOCAB, n).astype(np.int32), rng.integers(0, 64, n).astype(np.int32),
                     rng.integers(0, 4096, n).astype(np.int32), q, ctx,
                     rng.integers(0, 256, (batch_size, width)).astype(np.int32))


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{NAME_PREFIX}{os.getpid()}_")}


def assert_gone(pids: list[int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process {pid} is still running"
            time.sleep(0.05)


@pytest.fixture
def pool():
    p = AgentPool(standin_spec())
    p.start()
    yield p
    p.close()


def test_round_trip_matches_the_standin_rule(pool):
    rng = np.random.default_rng(0)
    assert pool.alive and len(pool.pids) == 1 and pool.shm_name in our_segments()
    # Alternate big and small batches so stale rows from an earlier step would show up.
    for is_prefill, b, w in [(True, 40, 7), (False, 128, 32), (False, 3, 1), (True, 1, 2), (False, 128, 5)]:
        batch = random_batch(rng, is_prefill, b, w)
        out = pool.run_step(batch)
        np.testing.assert_array_equal(out.token_ids, expected_tokens(batch))
        np.testing.assert_array_equal(out.logprobs, np.full(b, -1.0, np.float32))
        assert out.token_ids.dtype == np.int32 and out.logprobs.dtype == np.float32
    assert pool.steps == 5


def test_outputs_are_copies_not_shared_memory_views(pool):
    rng = np.random.default_rng(1)
    first_batch = random_batch(rng, False, 16, 4)
    first = pool.run_step(first_batch)
    pool.run_step(random_batch(rng, False, 16, 4))
    np.testing.assert_array_equal(first.token_ids, expected_tokens(first_batch))


def test_submit_then_collect_lets_the_caller_work_while_a_step_runs(pool):
    """One step in flight at a time: a second submit or a collect of another step is refused and changes nothing."""
    rng = np.random.default_rng(3)
    first, second = random_batch(rng, False, 8, 4), random_batch(rng, True, 5, 2)
    step = pool.submit(first)
    with pytest.raises(RuntimeError, match=rf"steps \[{step}\] are still in flight"):
        pool.submit(second)
    with pytest.raises(RuntimeError, match=f"step {step + 1} is not the oldest in flight"):
        pool.collect(step + 1, second.batch_size)
    np.testing.assert_array_equal(pool.collect(step, first.batch_size).token_ids, expected_tokens(first))
    with pytest.raises(RuntimeError, match="is not the oldest in flight"):
        pool.collect(step, first.batch_size)  # collected already
    np.testing.assert_array_equal(pool.collect(pool.submit(second), 5).token_ids, expected_tokens(second))


def test_two_steps_in_flight_the_second_fed_the_picks_of_the_first():
    """Asynchronous scheduling's pool: two segments, the second step sent while the first runs (its batch written
    into the other segment), answers collected in order; a fed step takes the first step's tokens as its inputs,
    row for row, on every rank; after a failed step a fed one fails too, and the pool serves on."""
    p = AgentPool(standin_spec(steps_in_flight=2, step_delay_s=0.05, tensor_parallel_size=2))
    try:
        p.start()
        assert len(our_segments()) == 2
        rng = np.random.default_rng(5)
        first = random_batch(rng, False, 6, 3)
        fed = StepBatch(np.zeros(5, np.int32), first.positions[1:] + 1, first.slot_mapping[1:],
                        first.query_lens[1:], first.context_lens[1:] + 1, first.block_tables[1:],
                        fed_rows=np.arange(1, 6, dtype=np.int32))  # row 0 ended with the first step
        a, b = p.submit(first), p.submit(fed)
        with pytest.raises(RuntimeError, match=r"steps \[1, 2\] are still in flight"):
            p.submit(first)
        with pytest.raises(RuntimeError, match="step 2 is not the oldest in flight"):
            p.collect(b, 6)
        picks = p.collect(a, 6).token_ids
        np.testing.assert_array_equal(picks, expected_tokens(first))
        unfed = StepBatch(picks[1:], fed.positions, fed.slot_mapping, fed.query_lens, fed.context_lens,
                          fed.block_tables)
        np.testing.assert_array_equal(p.collect(b, 5).token_ids, expected_tokens(unfed))
        with pytest.raises(ValueError):  # refused before it reaches the agents: nothing in flight after it
            p.submit(random_batch(rng, False, 129, 3))
        wrong = StepBatch(np.zeros(5, np.int32), fed.positions, fed.slot_mapping, fed.query_lens,
                          fed.context_lens, fed.block_tables, fed_rows=np.arange(2, 7, dtype=np.int32))
        with pytest.raises(AgentStepError, match="feeds rows 2..6 of the step before, which picked 5 tokens"):
            p.collect(p.submit(wrong), 5)
        with pytest.raises(AgentStepError, match="the step before failed"):  # nothing to feed after a failure
            p.collect(p.submit(fed), 5)
        np.testing.assert_array_equal(p.run_step(first).token_ids, expected_tokens(first))
    finally:
        p.close()
    assert not our_segments()


def test_close_while_a_step_is_in_flight_fails_its_collect():
    p = AgentPool(standin_spec(step_delay_s=0.5))
    p.start()
    step = p.submit(random_batch(np.random.default_rng(4), False, 8, 4))
    p.close()
    with pytest.raises(AgentDiedError):
        p.collect(step, 8)
    assert not our_segments()


def test_batch_beyond_capacity_is_refused_and_pool_keeps_serving(pool):
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="batch_size 129 exceeds"):
        pool.run_step(random_batch(rng, False, 129, 4))
    with pytest.raises(ValueError, match="block table width 33 exceeds"):
        pool.run_step(random_batch(rng, False, 4, 33))
    batch = random_batch(rng, False, 8, 4)
    np.testing.assert_array_equal(pool.run_step(batch).token_ids, expected_tokens(batch))


def test_round_trip_is_light():
    """The whole master + IPC path at decode batch 128 stays far below a model step (target <= 0.5 ms)."""
    with AgentPool(standin_spec()) as p:
        p.start()
        batch = random_batch(np.random.default_rng(3), False, 128, 32)
        p.run_step(batch)
        t0 = time.perf_counter()
        for _ in range(200):
            p.run_step(batch)
        per_step = (time.perf_counter() - t0) / 200
    assert per_step < 2e-3, f"{per_step * 1e3:.2f} ms per step"


def test_two_agents_both_serve_and_only_rank0_answers():
    with AgentPool(standin_spec(tensor_parallel_size=2)) as p:
        progress: list[str] = []
        p.start(progress.append)
        assert any(line.startswith("agent 0:") for line in progress)
        assert any(line.startswith("agent 1:") for line in progress)
        rng = np.random.default_rng(4)
        for _ in range(20):
            batch = random_batch(rng, bool(rng.integers(2)), int(rng.integers(1, 65)), 8)
            np.testing.assert_array_equal(p.run_step(batch).token_ids, expected_tokens(batch))
        # Rank 1 takes part in every step: its death is noticed as well.
        pids, name = p.pids, p.shm_name
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(AgentDiedError, match="rank 1"):
            p.run_step(random_batch(rng, False, 4, 8))
    assert_gone(pids)
    assert not (SHM_DIR / name).exists()


def test_agent_killed_mid_step_raises_quickly_and_leaks_nothing():
    p = AgentPool(standin_spec(step_delay_s=2.0))
    p.start()
    pids, name = p.pids, p.shm_name
    killer = threading.Timer(0.3, os.kill, (pids[0], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(AgentDiedError, match=r"rank 0 .* died during step 1: killed by signal SIGKILL"):
        p.run_step(random_batch(np.random.default_rng(5), False, 8, 4))
    assert time.monotonic() - t0 < 1.5  # the step alone would have taken 2 s
    assert not p.alive
    assert not (SHM_DIR / name).exists() and not our_segments()
    assert_gone(pids)
    with pytest.raises(AgentDiedError, match="died during step 1"):
        p.run_step(random_batch(np.random.default_rng(5), False, 8, 4))
    p.close()
    p.close()


def test_close_is_idempotent_and_interrupts_a_running_step():
    p = AgentPool(standin_spec(step_delay_s=2.0))
    p.start()
    pids, name = p.pids, p.shm_name
    errors: list[BaseException] = []

    def step() -> None:
        try:
            p.run_step(random_batch(np.random.default_rng(6), False, 8, 4))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    p.close()
    worker.join(5)
    assert time.monotonic() - t0 < 1.5 and not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], AgentDiedError) and "closed" in str(errors[0])
    p.close()
    assert not p.alive and p.shm_name is None and not (SHM_DIR / name).exists()
    assert_gone(pids)
    with pytest.raises(AgentDiedError, match="closed"):
        p.run_step(random_batch(np.random.default_rng(6), False, 8, 4))


def test_bad_model_path_is_one_clear_startup_error(tmp_path):
    missing = tmp_path / "no-such-model"
    spec = standin_spec(kind="llama", model_path=str(missing),
                        llama_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "num_key_value_heads": 2},
                        runner_config={"num_blocks": 8, "block_size": 4, "max_model_len": 16},
                        tensor_parallel_size=2)
    p = AgentPool(spec)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(AgentStartupError, match=f"agent rank [01] failed to start: .*{missing}") as info:
        p.start()
    assert "WeightLoadError" in str(info.value) and info.value.rank in (0, 1)
    assert len(p.pids) == 2 and not p.alive
    assert_gone(p.pids)
    # none of this process's or its agents' (other processes, e.g. another xdist worker, make their own meanwhile)
    made = {n for n in set(os.listdir(SHM_DIR)) - before
            if any(n.startswith(f"{NAME_PREFIX}{pid}_") for pid in (os.getpid(), *p.pids))}
    assert not our_segments() and not made
    p.close()


def test_agent_dying_before_ready_and_slow_start_are_startup_errors():
    broken = AgentPool(standin_spec(extra_env={"PYTHONHOME": "/nonexistent"}))  # the interpreter cannot start
    with pytest.raises(AgentStartupError, match=r"rank 0 \(pid \d+\) exited with exit code 1 before it was ready"):
        broken.start()
    slow = AgentPool(standin_spec(tensor_parallel_size=2), startup_timeout_s=0.01)
    with pytest.raises(AgentStartupError, match=r"agent rank\(s\) \[0, 1\] not ready after 0.01s"):
        slow.start()
    assert_gone(broken.pids + slow.pids)
    assert not our_segments()


def test_step_timeout_fails_the_pool():
    with AgentPool(standin_spec(step_delay_s=2.0), step_timeout_s=0.3) as p:
        p.start()
        pids = p.pids
        t0 = time.monotonic()
        with pytest.raises(AgentDiedError, match="did not answer step 1 within 0.3s"):
            p.run_step(random_batch(np.random.default_rng(7), False, 2, 1))
        assert time.monotonic() - t0 < 1.5 and not p.alive
    assert_gone(pids)
    assert not our_segments()


def test_master_death_takes_the_agents_along(tmp_path):
    """SIGKILL the master: its agents exit (lifeline EOF) and its resource tracker unlinks the segment."""
    script = tmp_path / "master.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from llm_serving.executor.agent_pool import AgentPool
        from llm_serving.protocol.wire import AgentSpec
        spec = AgentSpec("standin", None, {"vocab_size": 10}, {}, 8, 4, 2, tensor_parallel_size=2)
        pool = AgentPool(spec)
        pool.start()
        print(pool.shm_name, *pool.pids, flush=True)
        time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    master = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, text=True)
    try:
        name, *pids = master.stdout.readline().split()
        assert (SHM_DIR / name).exists()
        master.kill()
        master.wait()
        assert_gone([int(pid) for pid in pids])
        deadline = time.monotonic() + 5
        while (SHM_DIR / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (SHM_DIR / name).exists()
    finally:
        master.kill()
        master.wait()
        master.stdout.close()
        master.stderr.close()


def test_clean_shutdown_leaves_no_segment_and_no_tracker_warnings(tmp_path):
    script = tmp_path / "master.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from llm_serving.executor.agent_pool import AgentPool, AgentSpec
        from llm_serving.protocol.batch import StepBatch
        pool = AgentPool(AgentSpec("standin", None, {"vocab_size": 10}, {}, 8, 4, 2))
        pool.start()
        one = np.ones(1, np.int32)
        print(pool.shm_name, pool.run_step(StepBatch(one, one, one, one, one, one[None])).token_ids[0])
        pool.close()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    name, token = done.stdout.split()
    assert token == str((1 * 31 + 1) % 10)
    assert not (SHM_DIR / name).exists()
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr


def test_real_llama_agent_matches_transformers(tmp_path):
    """One MindSpore agent on a tiny random Llama: greedy tokens equal Hugging Face's; step errors are
    reported without killing the agent."""
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig
    from tests.hf_reference import hf_greedy, load_hf
    from tests.paged_driver import PagedDriver

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model_dir = build_random_model(tmp_path / "tiny", config, seed=3, std=0.3)
    runner_config = {"num_blocks": 16, "block_size": 4, "max_model_len": 16, "prefill_batch_sizes": [2],
                     "prefill_seq_lengths": [16], "decode_batch_sizes": [2], "decode_block_widths": [4]}
    spec = AgentSpec("llama", str(model_dir), vars(config), runner_config, max_tokens=32, max_batch=2,
                     max_blocks_per_seq=4)
    prompts = [[1, 5, 9, 33, 7], [1, 100, 3, 4, 8, 90, 12, 6, 77]]
    with AgentPool(spec) as p:
        lines: list[str] = []
        p.start(lines.append)
        assert any("warmed decode" in line for line in lines)
        geometry = SimpleNamespace(block_size=4, num_blocks=16)
        tokens, logprobs = PagedDriver(SimpleNamespace(rc=geometry, step=p.run_step), seed=1).generate(prompts, 6)
        too_long = StepBatch(np.ones(1, np.int32), np.array([20], np.int32), np.ones(1, np.int32),
                             np.ones(1, np.int32), np.array([21], np.int32), np.ones((1, 4), np.int32))
        with pytest.raises(AgentStepError, match="rank 0 failed step .*exceeds the largest compiled bucket"):
            p.run_step(too_long)
        assert p.alive and p.slowest_warmup_step_s > 0
        # a sampled prefill whose second sequence has a top_p of 0 (issue 18): that row fails, the first does not
        from llm_serving.protocol.batch import FAILED_TOKEN, SamplingBatch

        lens = np.array([len(q) for q in prompts], np.int32)
        tables = np.array([[1, 2, 0, 0], [3, 4, 5, 0]], np.int32)
        slots = np.concatenate([tables[i][np.arange(n) // 4] * 4 + np.arange(n) % 4 for i, n in enumerate(lens)])
        sampling = SamplingBatch(np.full(2, 0.7, np.float32), np.zeros(2, np.int32), np.array([0.9, 0.0], np.float32),
                                 np.ones(2, np.float32), np.array([5, 6], np.int64), np.zeros(2, np.int32),
                                 np.zeros(3, np.int32), np.zeros(0, np.int32))
        out = p.run_step(StepBatch(np.concatenate(prompts).astype(np.int32),
                                   np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
                                   slots.astype(np.int32), lens, lens, tables, sampling))
        assert 0 <= out.token_ids[0] < 128 and out.token_ids[1] == FAILED_TOKEN and list(out.errors) == [1]
        assert "sampling failed: IndexError" in out.errors[1] and p.alive
    hf = load_hf(model_dir)
    for prompt, got, got_lp in zip(prompts, tokens, logprobs):
        ref, ref_lp = hf_greedy(hf, prompt, 6)
        assert got == ref
        np.testing.assert_allclose(got_lp, ref_lp, atol=1e-4)


# ---- issue 18: containment and what self-healing needs from the pool -----------------------------------------
def sampled_batch(top_p: list[float]) -> StepBatch:
    """A decode step of len(top_p) sampled sequences (temperature 0.7) with the given top_p values."""
    from llm_serving.protocol.batch import SamplingBatch

    n = len(top_p)
    batch = random_batch(np.random.default_rng(8), False, n, 2)
    batch.sampling = SamplingBatch(np.full(n, 0.7, np.float32), np.zeros(n, np.int32), np.array(top_p, np.float32),
                                   np.ones(n, np.float32), np.arange(n, dtype=np.int64) * 7919, np.full(n, 3, np.int32),
                                   np.zeros(n + 1, np.int32), np.zeros(0, np.int32))
    return batch


def test_a_sequence_failing_its_sampling_fails_alone():
    """Issue 18 finding 1 on the agent: a top_p that is 0 in float32 raised for the whole step."""
    from llm_serving.protocol.batch import FAILED_TOKEN

    with AgentPool(standin_spec(tensor_parallel_size=2)) as p:
        p.start()
        batch = sampled_batch([0.9, 1e-300, 1.0, 0.0])
        out = p.run_step(batch)
        want = expected_tokens(batch)
        assert out.token_ids.tolist() == [want[0], FAILED_TOKEN, want[2], FAILED_TOKEN]
        assert sorted(out.errors) == [1, 3] and all("sampling failed: IndexError" in e for e in out.errors.values())
        assert "top_p 0.0" in out.errors[1]
        clean = sampled_batch([0.5, 0.9])
        out = p.run_step(clean)  # the next step reports no stale failure
        assert out.errors == {} and out.token_ids.tolist() == expected_tokens(clean).tolist()


def test_ready_reports_the_slowest_warm_up_step():
    with AgentPool(standin_spec(step_delay_s=0.03, tensor_parallel_size=2)) as p:
        assert p.slowest_warmup_step_s is None
        p.start()
        assert p.slowest_warmup_step_s == 0.03


def test_close_during_start_up_ends_it_at_once():
    p = AgentPool(standin_spec())
    errors: list[BaseException] = []
    original = p._wait_ready

    def slow_wait(progress):  # the agents are up; the pool is still waiting for them when close() comes
        time.sleep(0.5)
        original(progress)

    p._wait_ready = slow_wait
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(AgentStartupError, p.start).value))
    worker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    p.close()
    worker.join(5)
    assert not worker.is_alive() and time.monotonic() - t0 < 2.0
    assert "closed during start-up" in str(errors[0]) and not p.alive
    assert_gone(p.pids)
    assert not our_segments()


def test_stopped_agents_are_listed():
    with AgentPool(standin_spec(tensor_parallel_size=2)) as p:
        p.start()
        assert p.stopped_pids() == []
        os.kill(p.pids[1], signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            while p.stopped_pids() != [p.pids[1]]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            os.kill(p.pids[1], signal.SIGCONT)
        deadline = time.monotonic() + 5
        while p.stopped_pids():
            assert time.monotonic() < deadline
            time.sleep(0.01)
