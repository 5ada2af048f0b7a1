"""Issue 14, tensor parallelism: the sharding plan, each rank's slice read from every checkpoint format, and
the whole engine on CPU at tp 2 (native and portable ops) and tp 4 (fewer kv heads than ranks, an uneven
vocabulary split) against tp 1 and transformers; a rank killed mid-run; the collectives' helpers gone on every
exit path (normal, rank death, master killed, start-up failure); a standby pool promoted after a rank's death.

One engine runs at a time (module-scoped results, each engine stopped before the next starts).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from agents.weights.checkpoints import load_weights, save_mindspore_checkpoint
from agents.weights.sharded import load_shard, shard_shapes
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import agent_spec, kv_cache_blocks, resolve_model, scheduler_config
from llm_serving.executor.agent_pool import AgentPool, AgentStartupError
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_shards, tensor_parallel_problems
from tests.test_engine import our_segments, wait_for

ROOT = Path(__file__).resolve().parents[1]
EOS = 2
# vocab 998: 4 ranks hold 250, 250, 250 and 248 rows (the last range shorter, its gather padded)
TINY = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "vocab_size": 998, "seed": 5}
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=11)


def tp_config(data_dir: Path, tp: int, kernels: str = "auto", **sections) -> ServingConfig:
    d = {"default_model": {"data_dir": str(data_dir), **TINY},
         "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [8],
                          "kernels": kernels},
         "pa_config": {"num_blocks": 48, "block_size": 8, "decode_seq_length": 64},
         "serving_config": {"num_agents": tp, "agent_restart_backoff_s": 0.01}, "scheduler": {"policy": "fcfs"}}
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return ServingConfig.from_dict(d)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_models")


def alive(pid: int) -> bool:
    """Running (a zombie left for a reaper that never comes counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# ---- the plan and the configuration ------------------------------------------------------------------------
def test_plan_splits_heads_ffn_and_vocabulary():
    cfg = LlamaConfig(vocab_size=998, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    two = [ShardPlan(cfg, 2, r) for r in range(2)]
    assert [(p.heads, p.kv_heads, p.kv_head_start, p.ffn) for p in two] == [(2, 1, 0, 80), (2, 1, 1, 80)]
    assert two[1].qkv_rows() == [(32, 64), (64 + 16, 64 + 32), (96 + 16, 96 + 32)]
    four = [ShardPlan(cfg, 4, r) for r in range(4)]  # kv heads replicated: ranks 0, 1 read kv head 0
    assert [p.kv_head_start for p in four] == [0, 0, 1, 1] and {p.kv_heads for p in four} == {1}
    assert [p.vocab_range for p in four] == [(0, 250), (250, 500), (500, 750), (750, 998)]
    assert four[3].attention_config.hidden_size == 16 and four[3].attention_config.num_key_value_heads == 1
    assert (kv_shards(cfg, 2), kv_shards(cfg, 4)) == (2, 2)
    assert ShardPlan(cfg).attention_config is cfg  # tp 1: the whole model, the same graphs as before
    problems = tensor_parallel_problems(cfg, 3)
    assert any("num_attention_heads 4" in p for p in problems) and any("num_key_value_heads 2" in p for p in problems)
    odd_ffn = dataclasses.replace(cfg, intermediate_size=150)
    assert tensor_parallel_problems(odd_ffn, 4) == ["intermediate_size 150 is not divisible by 4 ranks"]
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ShardPlan(cfg, 2, 2)


def test_num_agents_is_checked_against_the_heads_and_grows_the_kv_cache(data_dir):
    with pytest.raises(ConfigError, match="serving_config.num_agents: 3 agents .*num_attention_heads 4") as info:
        resolve_model(tp_config(data_dir, 3))
    assert info.value.key == "serving_config.num_agents"
    for tp, blocks in ((1, 48), (2, 96), (4, 96)):  # kv heads split over 2 ranks; over 4, replicated in pairs
        cfg = tp_config(data_dir, tp)
        model = resolve_model(cfg)
        assert kv_cache_blocks(cfg, model.llama_config) == blocks
        assert scheduler_config(cfg, EOS, model.llama_config).num_blocks == blocks
        spec = agent_spec(cfg, model)
        assert spec.runner_config["num_blocks"] == blocks and spec.tensor_parallel_size == tp


# ---- each rank reads only its slice ------------------------------------------------------------------------
def expected_slice(full: dict[str, np.ndarray], cfg: LlamaConfig, plan: ShardPlan, key: str) -> np.ndarray:
    """The rank's part of a canonical tensor, cut from the whole fused one."""
    w, kind, hd = full[key], key.rsplit(".", 1)[-1], cfg.head_dim
    lo, hi = plan.rank * plan.ffn, (plan.rank + 1) * plan.ffn
    if kind in ("embed_tokens", "lm_head"):
        return w[slice(*plan.vocab_range)]
    if kind == "w_qkv":
        q = w[plan.rank * plan.heads * hd: (plan.rank + 1) * plan.heads * hd]
        kv = [w[base + plan.kv_head_start * hd: base + (plan.kv_head_start + plan.kv_heads) * hd]
              for base in (cfg.hidden_size, cfg.hidden_size + cfg.kv_dim)]
        return np.concatenate([q, *kv])
    if kind == "wo":
        return w[:, plan.rank * plan.heads * hd: (plan.rank + 1) * plan.heads * hd]
    if kind == "w_gate_up":
        return np.concatenate([w[lo:hi], w[cfg.intermediate_size + lo: cfg.intermediate_size + hi]])
    if kind == "w_down":
        return w[:, lo:hi]
    return w


def write_two_chunk_ckpt(weights: dict[str, np.ndarray], path: Path) -> None:
    """A .ckpt as MindSpore writes tensors past its slice size: one tensor's rows in two messages."""
    from mindspore.train.checkpoint_pb2 import Checkpoint

    with open(path, "wb") as f:
        for name, value in weights.items():
            parts = np.array_split(value, 2) if name == "embed_tokens" else [value]
            for part in parts:
                msg = Checkpoint()
                entry = msg.value.add()
                entry.tag = name
                entry.tensor.dims.extend(value.shape)
                entry.tensor.tensor_type = "Float32"
                entry.tensor.tensor_content = np.ascontiguousarray(part, np.float32).tobytes()
                f.write(msg.SerializeToString())


@pytest.mark.parametrize("tp", [2, 4])
def test_every_format_gives_each_rank_exactly_its_slice(tmp_path, tp):
    cfg = LlamaConfig(vocab_size=998, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    single = build_random_model(tmp_path / "single", cfg, seed=1)
    sharded = build_random_model(tmp_path / "sharded", cfg, seed=1, shards=3)
    full = load_weights(single, cfg)
    ckpt = save_mindspore_checkpoint(full, tmp_path / "canonical" / "model.ckpt")
    write_two_chunk_ckpt(full, tmp_path / "chunks.ckpt")
    for source in (single, sharded, ckpt, tmp_path / "chunks.ckpt"):
        for rank in range(tp):
            plan = ShardPlan(cfg, tp, rank)
            got = load_shard(source, cfg, plan)
            assert {k: v.shape for k, v in got.items()} == shard_shapes(cfg, plan)
            for key in full:
                np.testing.assert_array_equal(got[key], expected_slice(full, cfg, plan, key), err_msg=f"{key}")
    assert sum(load_shard(ckpt, cfg, ShardPlan(cfg, tp, r))["lm_head"].shape[0] for r in range(tp)) == 998


def as_bfloat16_checkpoint(model_dir: Path) -> Path:
    """The directory's model.safetensors rewritten in BF16, as the format lays it out (numpy cannot write it)."""
    import json
    import struct

    from safetensors.numpy import load_file

    from agents.weights.sharded import bf16_bits

    path = model_dir / "model.safetensors"
    tensors = {name: bf16_bits(value) for name, value in load_file(path).items()}
    header, blobs, offset = {}, [], 0
    for name, bits in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + bits.nbytes]}
        blobs.append(bits.tobytes())
        offset += bits.nbytes
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return model_dir


def test_a_rank_reads_its_slice_straight_into_the_serving_dtype(tmp_path):
    """float16 and bfloat16 (uint16 bits: numpy has no bfloat16) per tensor as read, a bfloat16 checkpoint's bits
    kept exactly; into a bfloat16 model they load as the float32 slice rounded would."""
    import mindspore as ms

    from agents.model.llama import LlamaModel, load_weights_into, model_weights
    from agents.weights.sharded import bf16_bits

    cfg = LlamaConfig(vocab_size=998, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    plan = ShardPlan(cfg, 2, 1)
    source = as_bfloat16_checkpoint(build_random_model(tmp_path / "bf16", cfg, seed=2))
    wide = load_shard(source, cfg, plan)
    half, bits = load_shard(source, cfg, plan, np.float16), load_shard(source, cfg, plan, "bfloat16")
    for key, value in wide.items():
        assert half[key].dtype == np.float16 and bits[key].dtype == np.uint16, key
        np.testing.assert_array_equal(half[key], value.astype(np.float16))
        np.testing.assert_array_equal((bits[key].astype(np.uint32) << 16).view(np.float32), value)  # exact
    assert bf16_bits(np.array([1.0, 1.00390625, 1.01171875], np.float32)).tolist() == [0x3F80, 0x3F80, 0x3F82]
    model = LlamaModel(cfg, 8, 16, 64, ms.bfloat16, shard=plan)
    load_weights_into(model, bits)
    held = model_weights(model)
    for key, value in wide.items():
        np.testing.assert_array_equal(held[key].astype(np.float32), value, err_msg=key)


# ---- the whole engine --------------------------------------------------------------------------------------
def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(14)
    greedy = [([1] + [rng.randrange(3, 998) for _ in range(rng.randint(3, 30))],
               SamplingParams(max_new_tokens=rng.randint(4, 16))) for _ in range(10)]
    return greedy + [(greedy[i][0], SAMPLED) for i in (0, 3)]


def serve(cfg: ServingConfig, kill_rank: int | None = None) -> dict:
    """Run the workload through one engine; with ``kill_rank``, run it again while that rank is killed."""
    engine = Engine(cfg)
    t0 = time.monotonic()
    engine.start(progress=None)
    out = {"start_s": time.monotonic() - t0, "pids": engine.agent_pids,
           "helpers": engine._agents.pool.helper_pids}
    try:
        out["results"] = [s.result(timeout=120) for s in [engine.submit(p, sp) for p, sp in workload()]]
        if cfg.scheduler.decode_steps > 1 or cfg.speculative.method:  # the greedy requests alone: nothing sampled,
            greedy = [(p, sp) for p, sp in workload() if sp.temperature == 0]  # so several tokens a step
            out["greedy_again"] = [s.result(timeout=120) for s in [engine.submit(p, sp) for p, sp in greedy]]
            out["multi_step_batches"] = engine.stats()["multi_step_batches"]
            out["spec_verify_steps"] = engine.stats()["spec_verify_steps"]
            out["steps_sent_ahead"] = engine.stats()["steps_sent_ahead"]
        if kill_rank is not None:
            pool = engine._agents.pool
            segment, before = pool.shm_name, engine.stats()
            streams = [engine.submit(p, sp) for p, sp in workload()]
            wait_for(lambda: engine.stats()["decode_steps"] > before["decode_steps"] + 2, 60, "decoding")
            os.kill(out["pids"][kill_rank], signal.SIGKILL)
            out["after_kill"] = [s.result(timeout=180) for s in streams]
            out["stats"] = engine.stats()
            out["segment_gone"] = segment not in our_segments()
            out["new_helpers"] = engine._agents.pool.helper_pids
            out["new_pids"] = engine.agent_pids
    finally:
        engine.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(data_dir) -> dict:
    """tp 1, 2 (native, then portable) and 4, one engine at a time; the tp-2 native one speculates (its own first
    layer drafts, sliced as the model on each rank) and loses rank 1 midway; tp 4 decodes up to four steps per round
    trip (multi-step: every rank feeds the tokens of the exact greedy pick) and sends them ahead of each other
    (asynchronous scheduling, the default without speculation: every rank feeds its own picks)."""
    self_spec = {"method": "self", "draft_layers": 1, "adaptive": False, "min_accepted": 0, "max_step_tokens": 64}
    out = {"tp1": serve(tp_config(data_dir, 1)),
           "tp2": serve(tp_config(data_dir, 2, speculative=self_spec), kill_rank=1),
           "tp2_portable": serve(tp_config(data_dir, 2, kernels="portable")),
           "tp4": serve(tp_config(data_dir, 4, scheduler={"decode_steps": 4}))}
    from tests.hf_reference import hf_greedy, load_hf

    hf = load_hf(resolve_model(tp_config(data_dir, 1)).model_path)
    out["hf"] = [hf_greedy(hf, p, sp.max_new_tokens, eos_token_id=EOS) for p, sp in workload()
                 if sp.temperature == 0]
    return out


@pytest.mark.parametrize("name", ["tp2", "tp2_portable", "tp4"])
def test_tensor_parallel_greedy_matches_tp1_and_transformers(runs, name):
    greedy = len(runs["hf"])
    assert len(runs[name]["pids"]) == int(name[2]) and len(runs[name]["helpers"]) == 1
    for got, ref, (hf_ids, hf_logprobs) in zip(runs[name]["results"], runs["tp1"]["results"], runs["hf"]):
        assert got.token_ids == ref.token_ids == hf_ids
        np.testing.assert_allclose(got.logprobs, hf_logprobs, atol=1e-4)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
    assert len({t for r in runs[name]["results"][:greedy] for t in r.token_ids}) > 30  # not degenerate
    if name in ("tp2", "tp4"):  # verified proposals, or four steps a round trip: every rank fed the same tokens
        assert (runs[name]["steps_sent_ahead"] > 0) == (name == "tp4")  # tp2 speculates: nothing is sent ahead
        assert runs[name]["multi_step_batches" if name == "tp4" else "spec_verify_steps"] > 0
        again = [r.token_ids for r in runs[name]["greedy_again"]]
        assert again == [r.token_ids for r in runs["tp1"]["results"][:greedy]]


@pytest.mark.parametrize("name", ["tp2", "tp2_portable", "tp4"])
def test_seeded_sampling_gives_the_text_of_tp1(runs, name):
    greedy = len(runs["hf"])
    sampled = [r.token_ids for r in runs[name]["results"][greedy:]]
    assert sampled == [r.token_ids for r in runs["tp1"]["results"][greedy:]]
    assert sampled[0] != runs["tp1"]["results"][0].token_ids[:10]  # really sampled, not greedy


def test_a_killed_rank_takes_its_pool_along_and_requests_are_recomputed(runs):
    tp2 = runs["tp2"]
    for got, (hf_ids, hf_logprobs) in zip(tp2["after_kill"], runs["hf"]):
        assert got.token_ids == hf_ids
        np.testing.assert_allclose(got.logprobs, hf_logprobs, atol=1e-4)
    assert tp2["stats"]["agent_restarts"] == 1 and tp2["stats"]["requests_recomputed"] > 0
    assert tp2["segment_gone"] and tp2["new_helpers"] != tp2["helpers"] and tp2["new_pids"] != tp2["pids"]
    for name in ("tp1", "tp2", "tp2_portable", "tp4"):  # every engine stopped: agents and schedulers gone
        pids = runs[name]["pids"] + runs[name]["helpers"] + runs[name].get("new_pids", [])
        wait_gone(pids + runs[name].get("new_helpers", []))
    assert not our_segments()


# ---- the helpers on the other exit paths ------------------------------------------------------------------
def test_start_up_failure_stops_the_scheduler(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    from llm_serving.protocol.wire import AgentSpec

    spec = AgentSpec("llama", str(tmp_path / "missing"), cfg.__dict__.copy(),
                     {"num_blocks": 8, "block_size": 4, "max_model_len": 16}, 16, 4, 4, tensor_parallel_size=2)
    pool = AgentPool(spec)
    with pytest.raises(AgentStartupError, match="WeightLoadError"):
        pool.start()
    assert len(pool.helper_pids) == 1
    wait_gone(pool.pids + pool.helper_pids)


def test_master_killed_while_ranks_join_leaves_nothing(data_dir, tmp_path):
    """SIGKILL the master while its ranks wait in MindSpore's init() (which holds their GIL): every agent,
    the agents' reapers, the scheduler and its MindSpore child exit."""
    model = resolve_model(tp_config(data_dir, 2))
    script = tmp_path / "master.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from llm_serving.executor.agent_pool import AgentPool
        from llm_serving.config.serving_config import ServingConfig
        from llm_serving.engine.wiring import ModelFiles, agent_spec
        from llm_serving.protocol.model_config import LlamaConfig
        cfg = ServingConfig.from_dict({{"serving_config": {{"num_agents": 2}},
                                       "pa_config": {{"num_blocks": 48, "block_size": 8, "decode_seq_length": 64}},
                                       "model_config": {{"seq_length": [32]}}}})
        model = ModelFiles({str(model.model_path)!r}, LlamaConfig(**{model.llama_config.__dict__!r}), None)
        def progress(line):
            print(line, flush=True)
        AgentPool(agent_spec(cfg, model)).start(progress)
    """))
    master = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    try:
        line = ""
        while "joining the collective cluster" not in line:
            line = master.stdout.readline()
            assert line, "the master exited before its ranks joined"
        deadline = time.monotonic() + 60
        while not any("agents.runtime.lifeline_reaper" in cmdline(p) for p in descendants(master.pid)):  # in init()
            assert time.monotonic() < deadline, "no rank reached MindSpore's init()"
            time.sleep(0.01)
        family = descendants(master.pid)
        assert len(family) >= 5  # 2 agents, a reaper, the scheduler and its MindSpore child
        master.kill()
        master.wait()
        wait_gone(family, timeout_s=15)
    finally:
        master.kill()
        master.wait()
        master.stdout.close()


def test_a_standby_pool_is_promoted_when_a_rank_dies_and_gives_the_same_greedy_ids(data_dir):
    """``serving_config.standby_agents`` at tp 2: the standby (its own ranks and scheduler) replaces the pool
    whose rank was killed; the interrupted requests' greedy ids are those of the undisturbed run; after shutdown
    (the next standby still starting or waiting) no agent or scheduler below this process is left."""
    engine = Engine(tp_config(data_dir, 2, serving_config={"standby_agents": True}))
    engine.start(progress=None)
    greedy = [(p, sp) for p, sp in workload() if sp.temperature == 0]
    try:
        reference = [s.result(timeout=120).token_ids for s in [engine.submit(p, sp) for p, sp in greedy]]
        wait_for(lambda: engine.stats()["standby"] == "ready", 300, "the standby ready")
        serving, helpers, standby = engine.agent_pids, engine._agents.pool.helper_pids, engine.stats()["standby_pids"]
        decoded = engine.stats()["decode_steps"]
        streams = [engine.submit(p, sp) for p, sp in greedy]
        wait_for(lambda: engine.stats()["decode_steps"] > decoded + 2, 60, "decoding")
        os.kill(serving[1], signal.SIGKILL)
        assert [s.result(timeout=180).token_ids for s in streams] == reference
        stats = engine.stats()
        assert stats["standby_promotions"] == 1 and stats["agent_restarts"] == 1 and engine.agent_pids == standby
        assert engine._agents.pool.helper_pids not in ([], helpers)  # the standby's own scheduler serves now
        wait_gone(serving + helpers)
        wait_for(lambda: len(engine.stats()["standby_pids"]) == 2, 60, "the next standby's ranks")
    finally:
        engine.shutdown()
    ours = ("agents.agent_main", "collective_scheduler")

    def left() -> list[str]:
        # this process's own children only: a session-wide server started earlier on this xdist worker
        # (conftest's tiny_server) has agents of its own further down
        return [f"{p}: {cmdline(p)}" for p in descendants(os.getpid())
                if alive(p) and parent(p) == os.getpid() and any(o in cmdline(p) for o in ours)]

    deadline = time.monotonic() + 30
    while left():
        assert time.monotonic() < deadline, f"still running 30 s after shutdown: {left()}"
        time.sleep(0.05)
    assert not our_segments()
