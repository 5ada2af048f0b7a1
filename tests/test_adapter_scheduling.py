"""The master's adapter handling without processes: the registry's checks, the slots' pins and LRU reuse, the
scheduler's admissions bounded by the slots, each step's ``lora_slots``, and prefix-cache keys per adapter, the
steps run by the stand-in runner itself (a row computed with an adapter answers the rule's token + 1 + its rank)."""

from __future__ import annotations

import numpy as np
import pytest

from agents.runtime.standin import StandinRunner
from llm_serving.core.adapters import Adapter, AdapterRegistry, AdapterSlots
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.protocol.lora import AdapterError
from tests.adapter_dirs import adapter_dir

VOCAB, LAYERS = 1000, 2


def registry(tmp_path, ranks: dict[str, int], max_rank: int = 16) -> AdapterRegistry:
    reg = AdapterRegistry(LAYERS, max_rank, ("base",))
    for name, rank in ranks.items():
        reg.add(name, adapter_dir(tmp_path, name, rank))
    return reg


def scheduler(max_loras: int, **kw) -> Scheduler:
    cfg = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 8, "max_prefill_batch": 8,
           "max_num_batched_tokens": 64, "max_model_len": 64, "eos_token_id": None, "chunked_prefill": True,
           "prefix_caching": True, "max_loras": max_loras}
    return Scheduler(SchedulerConfig(**{**cfg, **kw}))


def request(rid: str, adapter: Adapter | None, prompt: list[int] | None = None, n: int = 6) -> Sequence:
    seq = Sequence(rid, prompt or [7, 8, 9, 10, 11], SamplingParams(max_new_tokens=n))
    seq.adapter = adapter
    return seq


def step_once(sched: Scheduler, runner: StandinRunner, check=None) -> None:
    """One scheduled step: its adapter loads first, as the engine sends them."""
    step = sched.schedule()
    assert step is not None
    seqs, batch = step
    for load in sched.adapters.take_loads() if sched.adapters is not None else []:
        runner.load_adapter(load.slot, load.path)
    if check is not None:
        check(seqs, batch)
    sched.postprocess(seqs, runner.step(batch))


def run(sched: Scheduler, runner: StandinRunner, check=None) -> None:
    """Steps until every request ends."""
    while sched.has_unfinished():
        step_once(sched, runner, check)


def alone(seq: Sequence, max_loras: int = 1) -> list[int]:
    """What ``seq`` answers served by itself."""
    sched, copy = scheduler(max_loras), request("alone", seq.adapter, seq.prompt_ids, seq.params.max_new_tokens)
    sched.add(copy)
    run(sched, StandinRunner(VOCAB, lora={"max_loras": max_loras, "max_lora_rank": 64}, num_layers=LAYERS))
    return copy.output_ids


def test_registry_refuses_bad_adapters_by_key(tmp_path):
    reg = registry(tmp_path, {"a": 8}, max_rank=16)
    cases = {"big": ({"r": 32}, "r 32 .* above max_lora_rank 16"),
             "dora": ({"use_dora": True}, "use_dora"),
             "target": ({"target_modules": ["lm_head"]}, "target_modules .*lm_head"),
             "unknown": ({"target_modules": ["nonexistent_proj"]}, "target_modules .*adapts none"),
             "saved": ({"modules_to_save": ["lm_head"]}, "modules_to_save")}
    for name, (extra, match) in cases.items():
        with pytest.raises(AdapterError, match=match):
            reg.add(name, adapter_dir(tmp_path, name, int(extra.pop("r", 4)), **extra))
    weightless = adapter_dir(tmp_path, "weightless", 4)
    (weightless / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        reg.add("weightless", weightless)
    with pytest.raises(ValueError, match="already loaded"):
        reg.add("a", tmp_path / "a")
    with pytest.raises(ValueError, match="base model"):
        reg.add("base", tmp_path / "a")
    assert [a.name for a in reg.adapters] == ["a"]


def test_slots_pin_reuse_and_evict_least_recently_used(tmp_path):
    reg = registry(tmp_path, {"a": 1, "b": 2, "c": 3})
    a, b, c = (reg.get(n) for n in "abc")
    slots = AdapterSlots(2)
    assert slots.acquire(a) == 0 and slots.acquire(b) == 1 and slots.acquire(a) == 0
    assert [(s.slot, s.path) for s in slots.take_loads()] == [(0, a.path), (1, b.path)]
    assert slots.acquire(c) is None  # both pinned: c waits
    slots.release(1)  # b idle
    slots.release(0)
    slots.release(0)  # a idle, most recent
    assert slots.acquire(b) == 1 and slots.take_loads() == []  # still loaded: reused, no load
    slots.release(1)
    assert slots.acquire(c) == 0 and slots.evictions == 1  # a was the least recently used idle slot
    assert slots.slot_of(a) is None and slots.holder(0) is c and len(slots.take_loads()) == 1
    assert slots.acquire(a, may_load=False) is None  # a step sent ahead never loads
    with pytest.raises(RuntimeError):
        slots.reset()  # c is pinned


def test_three_adapters_and_the_base_in_one_batch_answer_each_their_own(tmp_path):
    reg = registry(tmp_path, {"a": 4, "b": 8, "c": 16})
    sched = scheduler(max_loras=3)
    seqs = [request(f"r{i}", reg.get(name) if name else None, [5 + i, 6, 7, 8, 9 + i])
            for i, name in enumerate(["a", None, "b", "c", None, "a"])]
    for seq in seqs:
        sched.add(seq)
    mixed = []

    def check(batch_seqs, batch):
        batch.validate()
        if len(batch_seqs) == len(seqs):
            mixed.append(batch.lora_slots.tolist())

    run(sched, StandinRunner(VOCAB, lora={"max_loras": 3, "max_lora_rank": 16}, num_layers=LAYERS), check)
    assert mixed and all(sorted(set(row)) == [-1, 0, 1, 2] for row in mixed)  # every step mixes them
    for seq in seqs:
        assert seq.output_ids == alone(seq), seq.request_id
    base = alone(seqs[1])
    assert all(seq.output_ids != base for seq in seqs if seq.adapter is not None)
    assert sched.adapters.loads == 3 and all(sched.adapters.pins(s) == 0 for s in range(3))


def test_more_adapters_than_slots_wait_and_all_finish(tmp_path):
    reg = registry(tmp_path, {f"x{i}": i + 1 for i in range(5)})
    sched = scheduler(max_loras=2)
    seqs = [request(f"r{i}", reg.get(f"x{i % 5}"), [3, i, 4, 5]) for i in range(10)]
    seqs += [request("base", None, [3, 9, 4, 5])]
    for seq in seqs:
        sched.add(seq)
    distinct = []

    def check(batch_seqs, batch):
        used = {seq.adapter for seq in batch_seqs if seq.adapter is not None}
        distinct.append(len(used))
        for seq, slot in zip(batch_seqs, batch.lora_slots.tolist() if batch.lora_slots is not None else []):
            assert (slot >= 0) == (seq.adapter is not None)
            assert seq.adapter is None or sched.adapters.holder(slot) is seq.adapter

    run(sched, StandinRunner(VOCAB, lora={"max_loras": 2, "max_lora_rank": 16}, num_layers=LAYERS), check)
    assert max(distinct) == 2  # never more adapters in a step than slots
    assert all(seq.finish_reason == "length" for seq in seqs)
    for seq in seqs:
        assert seq.output_ids == alone(seq), seq.request_id
    assert sched.adapters.loads >= 5 and sched.adapters.evictions >= 3


def test_a_request_waiting_for_a_slot_is_not_overtaken_by_newer_requests_of_the_busy_adapter(tmp_path):
    reg = registry(tmp_path, {"a": 4, "x": 8})
    sched = scheduler(max_loras=1)
    seqs = [request("a1", reg.get("a"), n=8), request("x", reg.get("x"), n=3), request("a2", reg.get("a"), n=3),
            request("base", None, n=3)]
    for seq in seqs:
        sched.add(seq)
    first_step: dict[str, int] = {}
    steps = [0]

    def check(batch_seqs, batch):
        steps[0] += 1
        for seq in batch_seqs:
            first_step.setdefault(seq.request_id, steps[0])

    run(sched, StandinRunner(VOCAB, lora={"max_loras": 1, "max_lora_rank": 16}, num_layers=LAYERS), check)
    assert first_step["base"] == first_step["a1"] == 1  # the base request does not wait for a slot
    assert first_step["a1"] < first_step["x"] < first_step["a2"]  # a2 waits behind x (FCFS), not beside a1
    for seq in seqs:
        assert seq.output_ids == alone(seq), seq.request_id


def test_preempted_adapter_sequences_give_back_their_slots_and_resume_with_them(tmp_path):
    reg = registry(tmp_path, {"a": 4, "b": 8})
    sched = scheduler(max_loras=2, num_blocks=12, max_model_len=40)  # 11 blocks of 4 for 6 sequences of up to 36
    seqs = [request(f"r{i}", reg.get("ab"[i % 2]) if i % 3 else None, [9, i, 4, 5, 6], n=30) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    run(sched, StandinRunner(VOCAB, lora={"max_loras": 2, "max_lora_rank": 16}, num_layers=LAYERS))
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.output_ids == alone(seq), seq.request_id
    assert all(sched.adapters.pins(s) == 0 for s in range(2)) and sched.kv_cache.num_used_blocks == 0


def test_prefix_cache_never_crosses_adapters(tmp_path):
    reg = registry(tmp_path, {"a": 4, "b": 4})
    sched = scheduler(max_loras=2)
    runner = StandinRunner(VOCAB, lora={"max_loras": 2, "max_lora_rank": 16}, num_layers=LAYERS)
    prompt = list(range(20, 33))  # 3 full blocks
    kv = sched.kv_cache

    def serve(seq: Sequence) -> int:
        before = kv.hit_tokens
        sched.add(seq)
        run(sched, runner)
        return kv.hit_tokens - before

    assert serve(request("base", None, prompt)) == 0
    assert serve(request("a1", reg.get("a"), prompt)) == 0  # the base's blocks are not a's
    assert serve(request("b1", reg.get("b"), prompt)) == 0
    assert serve(request("a2", reg.get("a"), prompt)) == 12  # a's own
    assert serve(request("base2", None, prompt)) == 12
    reg.remove("a")
    reg.add("a", tmp_path / "a")  # reloaded under the same name: a new generation, new keys
    assert serve(request("a3", reg.get("a"), prompt)) == 0


def test_requeue_empties_the_slots_and_a_recompute_loads_again(tmp_path):
    reg = registry(tmp_path, {"a": 4})
    sched = scheduler(max_loras=1)
    runner = StandinRunner(VOCAB, lora={"max_loras": 1, "max_lora_rank": 16}, num_layers=LAYERS)
    seq = request("r", reg.get("a"), n=8)
    sched.add(seq)
    step_once(sched, runner)
    sched.requeue_running()  # new agents: their slots are empty
    assert sched.adapters.holder(0) is None and seq.lora_slot == -1
    runner = StandinRunner(VOCAB, lora={"max_loras": 1, "max_lora_rank": 16}, num_layers=LAYERS)
    run(sched, runner)
    assert sched.adapters.loads == 2 and seq.output_ids == alone(seq)


def test_a_step_sent_ahead_never_loads_an_adapter(tmp_path):
    reg = registry(tmp_path, {"a": 4, "b": 8})
    sched = scheduler(max_loras=2, async_scheduling=True)
    runner = StandinRunner(VOCAB, lora={"max_loras": 2, "max_lora_rank": 16}, num_layers=LAYERS)
    first = request("first", reg.get("a"), n=12)
    sched.add(first)
    step_once(sched, runner)
    seqs, batch = sched.schedule()  # a decode step of first; b's request arrives while it runs
    late = request("late", reg.get("b"), n=3)
    sched.add(late)
    ahead = sched.schedule_ahead(seqs, batch)
    assert ahead is None or late not in ahead[0]  # admitting it would need a load between the two steps
    assert sched.adapters.take_loads() == [] and late.lora_slot == -1
    assert np.all(batch.lora_slots == [0])
