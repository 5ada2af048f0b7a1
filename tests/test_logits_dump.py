"""The logits dump (issue 13, item 6): the per-sequence switch through the step batch, the shared-memory
logits rows, the runner reading logits back only for steps that ask, one row per generated position across
preemption and agent restarts, ``llm-serving generate --dump-logits`` against Hugging Face, and the 7B config."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from agents.runtime.standin import StandinRunner
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.engine.loop import Engine
from llm_serving.executor.agent_pool import AgentPool
from llm_serving.models.default_model import ensure_default_model
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.shm_channel import ChannelError, ChannelLayout, StepChannel

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
TINY_MODEL = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "vocab_size": VOCAB, "seed": 5}


def decode_batch(n: int, want: list[bool] | None = None) -> StepBatch:
    return StepBatch(np.arange(3, 3 + n, dtype=np.int32), np.full(n, 4, np.int32),
                     np.arange(16, 16 + n, dtype=np.int32), np.ones(n, np.int32), np.full(n, 5, np.int32),
                     np.ones((n, 2), np.int32), want_logits=None if want is None else np.array(want))


# ---- protocol ----------------------------------------------------------------------------------------------
def test_channel_carries_only_the_wanted_logits_rows():
    layout = ChannelLayout(max_tokens=16, max_batch=4, max_blocks_per_seq=2, max_logits_rows=4, logits_width=VOCAB)
    master = StepChannel.create(layout)
    try:
        agent = StepChannel.attach(master.name, layout)
        master.write_step(1, decode_batch(4))
        assert agent.read_step()[1].want_logits is None  # the flag is off: no copy, no view
        agent.write_output(1, StepOutput(np.arange(4, dtype=np.int32), np.zeros(4, np.float32)))
        assert master.read_output(1, 4).logits == {}

        master.write_step(2, decode_batch(4, [False, True, False, True]))
        step, batch = agent.read_step()
        assert batch.want_logits.tolist() == [False, True, False, True]
        assert batch.take(np.array([0, 2])).want_logits is None  # a part where no row asks reads nothing
        rows = {1: np.full(VOCAB, 1.5, np.float32), 3: np.linspace(-3, 3, VOCAB, dtype=np.float32)}
        agent.write_output(step, StepOutput(np.arange(4, dtype=np.int32), np.zeros(4, np.float32), logits=rows))
        out = master.read_output(2, 4)
        assert sorted(out.logits) == [1, 3]
        for row, values in rows.items():
            np.testing.assert_array_equal(out.logits[row], values)
            assert out.logits[row].dtype == np.float32

        with pytest.raises(ValueError, match="shape"):
            agent.write_output(3, StepOutput(np.zeros(1, np.int32), np.zeros(1, np.float32),
                                             logits={0: np.zeros(VOCAB + 1, np.float32)}))
        agent.close()
        with pytest.raises(ChannelError, match="max_logits_rows"):
            StepChannel.attach(master.name, dataclasses.replace(layout, max_logits_rows=2))
    finally:
        master.close()
    small = StepChannel.create(dataclasses.replace(layout, max_logits_rows=1))
    try:
        with pytest.raises(ValueError, match="logits row count 2 exceeds"):
            small.write_step(1, decode_batch(4, [True, True, False, False]))
    finally:
        small.close()


# ---- scheduler: which steps ask, one row per generated position ----------------------------------------------
def test_scheduler_asks_once_per_position_across_preemptions():
    """The stand-in's logits peak at the token it returns, so row k of a dump must peak at output token k; a
    recomputed prefill must not add the rows of tokens generated before the preemption."""
    sched = Scheduler(SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_prefill_batch=4,
                                      max_num_batched_tokens=64, max_model_len=32, eos_token_id=None))
    runner = StandinRunner(VOCAB)
    asks = {"none": 0, "five": 5, "all": 100, "twenty": 20}
    seqs = {}
    for i, (rid, n) in enumerate(asks.items()):
        seqs[rid] = Sequence(rid, [1, 7 + i, 9, 11, 13, 15 + i], SamplingParams(max_new_tokens=20),
                             logits_tokens=n)
        sched.add(seqs[rid])
    asked: dict[str, int] = dict.fromkeys(asks, 0)
    while sched.has_unfinished():
        scheduled, batch = sched.schedule()
        want = batch.want_logits
        assert want is None or want.any()
        for seq, flag in zip(scheduled, want if want is not None else [False] * len(scheduled)):
            assert flag == (seq.num_output_tokens < seq.logits_tokens)
            asked[seq.request_id] += bool(flag)
        output = runner.step(batch)
        assert sorted(output.logits) == ([] if want is None else np.flatnonzero(want).tolist())
        sched.postprocess(scheduled, output)
    assert sched.num_preemptions > 0
    for rid, seq in seqs.items():
        n = min(asks[rid], seq.num_output_tokens)
        assert asked[rid] == len(seq.logits) == n
        assert [int(np.argmax(row)) for row in seq.logits] == seq.output_ids[:n]
    assert asked["none"] == 0


def test_a_step_rerun_in_parts_keeps_each_rows_logits():
    """``recovery.run_isolated``: the halves' logits rows go back to their rows in the whole step."""
    from llm_serving.engine.recovery import run_isolated
    from llm_serving.executor.agent_pool import AgentStepError

    class HalvesPool:
        def __init__(self) -> None:
            self.runner, self.batches = StandinRunner(VOCAB), []

        def submit(self, batch: StepBatch) -> int:
            self.batches.append(batch)
            return len(self.batches)

        def collect(self, step: int, batch_size: int) -> StepOutput:
            batch = self.batches[step - 1]
            if batch.batch_size > 2:
                raise AgentStepError("too big", rank=0)
            return self.runner.step(batch)

    batch = decode_batch(4, [True, False, True, True])
    out = run_isolated(HalvesPool(), batch, AgentStepError("first try", rank=0))
    whole = StandinRunner(VOCAB).step(batch)
    assert sorted(out.logits) == [0, 2, 3] and out.token_ids.tolist() == whole.token_ids.tolist()
    for row in (0, 2, 3):
        np.testing.assert_array_equal(out.logits[row], whole.logits[row])


# ---- runner: logits leave the device only for steps that ask -------------------------------------------------
class _Spy:
    """A graph's logits output that counts how often it is read back."""

    def __init__(self, tensor, reads: list[int]) -> None:
        self.tensor, self.reads = tensor, reads

    def asnumpy(self) -> np.ndarray:
        self.reads.append(1)
        return self.tensor.asnumpy()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.weights.checkpoints import load_weights
    from llm_serving.models.random_model import build_random_model

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model_dir = build_random_model(tmp_path_factory.mktemp("dump_runner"), config, seed=7, std=0.2)
    rc = RunnerConfig(num_blocks=32, block_size=4, max_model_len=32, prefill_batch_sizes=(2,),
                      prefill_seq_lengths=(8,), decode_batch_sizes=(2,), decode_block_widths=(4,),
                      kernels="portable")
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    return runner


def test_runner_reads_logits_back_only_for_steps_that_ask(runner, monkeypatch):
    from tests.paged_driver import contiguous_prefill, sampling_batch

    reads: list[int] = []
    run = runner._run

    def spied(shape, arrays):
        token_ids, logprobs, logits = run(shape, arrays)
        return token_ids, logprobs, _Spy(logits, reads)

    monkeypatch.setattr(runner, "_run", spied)
    prompts = [[1, 5, 9, 20, 30], [1, 40, 50]]
    prefill = contiguous_prefill(prompts, runner.rc.block_size)

    plain = runner.step(prefill)  # nobody asks: greedy ids only, the logits stay on the device
    assert reads == [] and plain.logits == {}

    asked = runner.step(dataclasses.replace(prefill, want_logits=np.array([False, True])))
    assert len(reads) == 1 and sorted(asked.logits) == [1]
    reference = runner.step_logits(prefill)
    np.testing.assert_array_equal(asked.logits[1], reference[1])
    assert asked.logits[1].dtype == np.float32 and int(np.argmax(asked.logits[1])) == asked.token_ids[1]
    np.testing.assert_array_equal(asked.token_ids, plain.token_ids)

    reads.clear()  # a sampled step that also dumps reads the logits once, for both
    sampled = dataclasses.replace(prefill, want_logits=np.array([True, False]), sampling=sampling_batch(
        [{"temperature": 0.8, "seed": 1}, {}], prompts, [0, 0]))
    out = runner.step(sampled)
    assert len(reads) == 1 and sorted(out.logits) == [0]
    np.testing.assert_array_equal(out.logits[0], reference[0])  # raw model logits, not the tempered ones

    reads.clear()  # a step run in two calls: only the call holding a row that asks reads back
    tables = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    decode = StepBatch(np.array([5, 6, 7], np.int32), np.full(3, 4, np.int32),
                       np.array([8, 16, 24], np.int32), np.ones(3, np.int32), np.full(3, 5, np.int32), tables,
                       want_logits=np.array([False, False, True]))
    monkeypatch.setattr(runner, "plan", lambda batch: [np.array([0, 1]), np.array([2])])
    out = runner.step(decode)
    assert len(reads) == 1 and sorted(out.logits) == [2]


# ---- the engine over real agent processes: preemption and an agent restart -----------------------------------
def engine_config(data_dir: Path, **sections) -> ServingConfig:
    d = {"default_model": {"data_dir": str(data_dir), **TINY_MODEL},
         "model_config": {"seq_length": [32], "prefill_batch_size": [4], "decode_batch_size": [8]},
         "pa_config": {"num_blocks": 24, "block_size": 4, "decode_seq_length": 64},
         "scheduler": {"policy": "fcfs"}}
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return ServingConfig.from_dict(d)


def test_engine_dumps_survive_preemption_and_an_agent_restart(tmp_path):
    """Stand-in agent processes (no MindSpore): the rows cross shared memory; the cache is small enough to
    preempt, and the agent is killed mid-run, so running requests are recomputed by a new agent."""
    pools: list[AgentPool] = []

    def factory(spec):
        pools.append(AgentPool(dataclasses.replace(spec, step_delay_s=0.004)))
        return pools[-1]

    engine = Engine(engine_config(tmp_path), pool_factory=factory)
    engine.start(progress=None)
    try:
        assert pools[0].spec.max_logits_rows == 8 and pools[0].spec.layout.logits_width == VOCAB
        rng = np.random.default_rng(0)
        work = [([1] + rng.integers(3, VOCAB, 5 + i % 7).tolist(), int(rng.integers(8, 30)), [0, 3, 1000][i % 3])
                for i in range(12)]
        streams = [engine.submit(p, SamplingParams(max_new_tokens=m, ignore_eos=True), logits_tokens=n)
                   for p, m, n in work]
        deadline = time.monotonic() + 30
        while engine.stats()["decode_steps"] < 15:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(pools[0].pids[0], signal.SIGKILL)
        results = [s.result(timeout=60) for s in streams]
        stats = engine.stats()
        assert stats["agent_restarts"] == 1 and stats["requests_recomputed"] > 0 and stats["num_preemptions"] > 0
        for (_, max_new, asked), res in zip(work, results):
            assert len(res.token_ids) == max_new
            if asked == 0:
                assert res.logits is None
                continue
            n = min(asked, max_new)
            assert res.logits.shape == (n, VOCAB) and res.logits.dtype == np.float32
            assert np.argmax(res.logits, axis=1).tolist() == res.token_ids[:n]
    finally:
        engine.shutdown()


# ---- llm-serving generate --dump-logits --------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def run_check(ref: Path, ours: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_precision.py"), str(ref), str(ours)],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump_cli")
    sections = {"default_model": {"data_dir": str(root / "models"), **TINY_MODEL},
                "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [4]},
                "pa_config": {"num_blocks": 64, "block_size": 8, "decode_seq_length": 64}}
    config_file = root / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(sections))
    cfg = ServingConfig.from_yaml(config_file)
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(["Hello world", "The sea was calm that morning, and the boats",
                                   [1, 17, 300, 42], "Once upon a time"]))
    return {"root": root, "config": config_file, "prompts": prompts,
            "model": ensure_default_model(cfg.default_model, cfg.max_model_len)}


def test_generate_dumps_logits_equal_to_transformers_and_check_precision(cli_setup, tmp_path):
    """Greedy on the real tiny model: row k equals Hugging Face's logits where token k is predicted (prompt +
    the tokens before k fed to it); check_precision passes on that pair and fails on a perturbed copy."""
    import torch

    from tests.hf_reference import load_hf

    ours = tmp_path / "ours"
    res = run_cli("generate", "--config", str(cli_setup["config"]), "--prompts", str(cli_setup["prompts"]),
                  "--max-new-tokens", "8", "--ignore-eos", "--dump-logits", str(ours), "--dump-logits-tokens", "6")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert sorted(p.name for p in ours.iterdir()) == [f"{i}.npy" for i in range(len(lines))]
    hf = load_hf(cli_setup["model"])
    ref = tmp_path / "ref"
    ref.mkdir()
    for i, line in enumerate(lines):
        dump = np.load(ours / f"{i}.npy")
        assert dump.shape == (6, VOCAB) and dump.dtype == np.float32
        prompt, tokens = line["prompt_ids"], line["token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[:5]])).logits[0, len(prompt) - 1:].numpy()
        np.testing.assert_allclose(dump, logits, atol=1e-4, rtol=1e-4)
        assert np.argmax(dump, axis=1).tolist() == tokens[:6]
        np.save(ref / f"{i}.npy", logits.astype(np.float32))

    check = run_check(ref, ours)
    assert check.returncode == 0 and "PASS" in check.stdout, check.stdout + check.stderr
    worse = tmp_path / "worse"
    worse.mkdir()
    for i in range(len(lines)):
        dump = np.load(ours / f"{i}.npy")
        if i == 2:
            dump[3, 10] += 0.006 * np.abs(dump[3]).max()  # 6 per mille of the row's scale, on one entry
        np.save(worse / f"{i}.npy", dump)
    check = run_check(ref, worse)
    assert check.returncode == 1 and "FAIL" in check.stdout
    assert "2.npy position 3" in check.stdout and "1 over the tolerance" in check.stdout


def test_generate_dump_defaults_to_every_position_and_reads_the_config(cli_setup, tmp_path):
    """Stand-in agents: no --dump-logits-tokens means every generated position; the config keys work alone."""
    base = ["generate", "--prompts", str(cli_setup["prompts"]), "--max-new-tokens", "5", "--ignore-eos",
            "--standin-agents"]
    res = run_cli(*base, "--config", str(cli_setup["config"]), "--dump-logits", str(tmp_path / "all"))
    assert res.returncode == 0, res.stderr[-3000:]
    for i, line in enumerate(json.loads(x) for x in res.stdout.splitlines()):
        dump = np.load(tmp_path / "all" / f"{i}.npy")
        assert dump.shape == (5, VOCAB) and np.argmax(dump, axis=1).tolist() == line["token_ids"]

    sections = yaml.safe_load(cli_setup["config"].read_text())
    sections["serving_config"] = {"dump_logits_dir": "from_config", "dump_logits_tokens": 2}
    config_file = tmp_path / "dump.yaml"
    config_file.write_text(yaml.safe_dump(sections))
    res = run_cli(*base, "--config", str(config_file))
    assert res.returncode == 0, res.stderr[-3000:]
    assert {np.load(p).shape for p in (tmp_path / "from_config").iterdir()} == {(2, VOCAB)}  # relative to the yaml

    res = run_cli(*base, "--config", str(cli_setup["config"]), "--dump-logits-tokens", "3")
    assert res.returncode == 2 and "--dump-logits-tokens needs --dump-logits" in res.stderr


# ---- the contest config -------------------------------------------------------------------------------------
def test_llama2_7b_ascend_config_loads_and_its_kv_cache_fits_a_910b():
    cfg = ServingConfig.from_yaml(ROOT / "configs" / "llama2_7b_ascend.yaml")
    m, pa = cfg.model_config, cfg.pa_config
    assert (m.device_target, m.dtype, pa.block_size) == ("Ascend", "float16", 16)
    assert m.decode_batch_size[-1] == 128 and m.prefill_batch_size[-1] > 1 and cfg.num_agents == 1
    llama7b = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32)
    params = sum(int(np.prod(s)) for s in _hf_shapes(llama7b))
    assert params == 6_738_415_616
    from agents.runtime import kv_budget
    from llm_serving.protocol.parallel import ShardPlan, kv_block_bytes

    # the cache is sized from the NPU's memory at start-up (tests/test_kv_budget.py), as the agent does it
    assert pa.auto_blocks and pa.utilization == 0.9
    shard = ShardPlan(llama7b)
    reserve = kv_budget.step_reserve_bytes(shard, cfg.max_num_batched_tokens + 128, 129, "float16", "Ascend")
    per_block = kv_block_bytes(shard, pa.block_size, "float16")
    assert per_block == 8 * 2**20
    for device_gib, at_least in ((32, 128 * 160), (64, 128 * 512)):  # 160- and 512-token sequences, 128 of them
        budget = kv_budget.plan_blocks(device_gib * kv_budget.GIB, pa.utilization, params * 2, reserve, per_block,
                                       pa.block_size, cfg.max_model_len)
        assert (budget.num_blocks - 1) * pa.block_size >= at_least, (device_gib, budget)


def _hf_shapes(config: LlamaConfig) -> list[tuple[int, ...]]:
    from llm_serving.models.random_model import hf_shapes

    return list(hf_shapes(config).values())
