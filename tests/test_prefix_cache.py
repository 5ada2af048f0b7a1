"""Prefix caching: block keys, the KV cache manager's cached and idle blocks, hits in the scheduler, and the block
accounting after runs with aborts, preemptions, evictions and agent restarts (fake model of tests.test_scheduler,
which reads every context back through the KV cache, so a wrong shared block changes results)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llm_serving.core.kv_cache_manager import KVCacheManager
from llm_serving.core.prefix_cache import extend_block_hashes
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence, SequenceStatus
from tests.test_scheduler import EOS, FakeKVModel, expected_output


def keys(tokens: list[int], block_size: int = 4) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, len(tokens) // block_size)
    return out


def test_block_keys_name_the_whole_prefix():
    base = list(range(10, 22))
    assert keys(base) == keys(base + [1, 2]) and len(keys(base)) == 3
    changed = base[:5] + [99] + base[6:]  # differs in block 1: keys differ from block 1 on
    assert keys(changed)[0] == keys(base)[0] and keys(changed)[1:] != keys(base)[1:]
    assert keys(changed)[2] != keys(base)[2]  # block 2's tokens are equal, its prefix is not
    assert len(set(keys(list(range(40))))) == 10


def computed(rid: str, tokens: list[int], kv: KVCacheManager) -> Sequence:
    """A sequence holding blocks for ``tokens``, all of them computed and registered."""
    seq = Sequence(rid, tokens)
    kv.start(seq, [], len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.cache_computed(seq)
    return seq


def test_cached_blocks_are_kept_idle_revived_by_a_hit_and_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=9, block_size=4, max_num_seqs=8, max_model_len=32, prefix_caching=True)
    a = computed("a", list(range(10, 22)) + [5], kv)  # 3 full blocks registered, a partial 4th
    a_blocks = list(a.block_table)
    assert kv.accounting() == {"free": 4, "idle_cached": 0, "held": 4, "cached": 3}
    kv.free(a)
    assert kv.accounting() == {"free": 5, "idle_cached": 3, "held": 0, "cached": 3}
    assert kv.num_free_blocks == 8  # idle cached blocks can be handed out

    b = Sequence("b", list(range(10, 22)) + [7, 8])
    hit = kv.computed_prefix(b)
    assert hit == a_blocks[:3] and kv.blocks_to_start(hit, b.num_tokens) == 4  # 3 revived, 1 new
    kv.start(b, hit, b.num_tokens)
    assert kv.accounting()["held"] == 4 and kv.prefix_cache_stats()["kv_blocks_cached"] == 0
    assert (kv.queried_tokens, kv.hit_tokens) == (13 + 14, 12)
    whole = Sequence("c", list(range(10, 22)))  # all 3 blocks cached: the last is left to compute
    assert kv.computed_prefix(whole) == a_blocks[:2]
    kv.free(b)

    others = [computed(f"x{i}", [50 + 8 * i + j for j in range(4)], kv) for i in range(5)]  # 5 fresh blocks
    assert kv.prefix_cache_stats()["kv_blocks_cached"] == 3 and kv.accounting()["free"] == 0
    d = Sequence("d", [1, 2, 3])
    assert kv.allocate_slots(d, 3)  # no free block: the least recently used idle one goes, the prefix's tail first
    assert d.block_table == [a_blocks[2]] and kv.prefix_cache_stats()["prefix_cache_evictions"] == 1
    assert kv.computed_prefix(b) == a_blocks[:2]
    for seq in others + [d]:
        kv.free(seq)
    counts = kv.accounting()
    assert counts["held"] == 0 and counts["free"] + counts["idle_cached"] == 8
    kv.reset_prefix_cache()  # new agents: their KV cache is empty
    assert kv.accounting() == {"free": 8, "idle_cached": 0, "held": 0, "cached": 0}
    assert kv.computed_prefix(b) == []


def test_sharing_a_block_nobody_holds_or_caches_and_freeing_twice_raise():
    kv = KVCacheManager(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=16, prefix_caching=True)
    a = Sequence("a", [1, 2, 3])
    kv.start(a, [], 3)
    block = a.block_table[0]
    kv.free(a)  # never computed: not cached, free again
    with pytest.raises(RuntimeError, match="cannot share block .*: it is free"):
        kv.start(Sequence("b", [1, 2, 3, 4, 5]), [block], 5)
    with pytest.raises(RuntimeError, match="double free"):
        kv.free(a)


def chunked_prefix(**kw) -> SchedulerConfig:
    base = {"num_blocks": 60, "block_size": 4, "max_num_seqs": 4, "max_prefill_batch": 4,
            "max_num_batched_tokens": 32, "max_model_len": 64, "eos_token_id": EOS, "chunked_prefill": True,
            "prefix_caching": True}
    return SchedulerConfig(**{**base, **kw})


def step_once(s: Scheduler, model: FakeKVModel) -> tuple[list[Sequence], np.ndarray]:
    seqs, batch = s.schedule()
    cache, bs = s.kv_cache._blocks.prefix_cache, s.config.block_size
    if cache is not None:  # a cached block is never written again
        assert not any(cache.is_cached(int(slot) // bs) for slot in batch.slot_mapping)
    s.postprocess(seqs, model.step(batch))
    return seqs, batch


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_a_request_sharing_a_prefix_computes_only_the_rest(chunked):
    cfg = chunked_prefix(chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else 64)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    system = [10 + i % 23 for i in range(21)]  # 5 full blocks and a token
    first = Sequence("first", system + [3, 4, 5], SamplingParams(6, ignore_eos=True))
    s.add(first)
    while s.has_unfinished():
        step_once(s, model)
    second = Sequence("second", system + [7, 8], SamplingParams(6, ignore_eos=True))
    s.add(second)
    seqs, batch = step_once(s, model)
    assert seqs == [second] and batch.query_lens.tolist() == [3] and batch.context_lens.tolist() == [23]
    stats = s.prefix_cache_stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_queried_tokens"]) == (20, 24 + 23)
    while s.has_unfinished():
        step_once(s, model)
    for seq in (first, second):
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.params)[0]


def test_a_preempted_sequence_resumes_on_its_own_cached_blocks():
    cfg = chunked_prefix(num_blocks=14, max_num_batched_tokens=16)  # 13 usable blocks
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    seqs = [Sequence(f"r{i}", [11 + (i * 5 + j) % 20 for j in range(18)], SamplingParams(24, ignore_eos=True))
            for i in range(3)]
    for seq in seqs:
        s.add(seq)
    recomputed = []
    while s.has_unfinished():
        stepped, batch = step_once(s, model)
        recomputed += [int(batch.context_lens[i] - batch.query_lens[i]) for i, seq in enumerate(stepped)
                       if seq.num_preemptions and batch.query_lens[i] > 1]
    assert s.num_preemptions > 0 and any(start > 0 for start in recomputed)  # resumed past cached blocks
    for seq in seqs:
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.params)[0]


@pytest.mark.parametrize("chunked,caching", [(True, True), (False, True), (True, False)],
                         ids=["chunked-cached", "unchunked-cached", "chunked-uncached"])
def test_block_accounting_after_aborts_preemptions_evictions_and_agent_restarts(chunked, caching):
    """Many requests sharing prefixes in a small cache; random aborts of waiting and running requests, and now
    and then all agents replaced (every running sequence requeued, the cache forgotten). After every step each
    block is exactly one of free, idle cached or held; at the end none is held and every answer is right."""
    cfg = chunked_prefix(num_blocks=24, max_num_batched_tokens=20 if chunked else 64, chunked_prefill=chunked,
                         prefix_caching=caching)
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    rng = random.Random(5)
    prefixes = [[10 + (p * 7 + j) % 25 for j in range(rng.randint(4, 20))] for p in range(3)]
    seqs, aborted = [], set()
    for i in range(40):
        tail = [rng.randrange(3, 40) for _ in range(rng.randint(1, 12))]
        seq = Sequence(f"r{i}", rng.choice(prefixes) + tail, SamplingParams(rng.randint(1, 16)))
        s.add(seq)
        seqs.append(seq)
    steps = restarts = 0
    while s.has_unfinished():
        stepped, batch = s.schedule()
        cache = s.kv_cache._blocks.prefix_cache
        assert cache is None or not any(cache.is_cached(int(slot) // 4) for slot in batch.slot_mapping)
        live = [seq for seq in seqs if not seq.is_finished]
        if rng.random() < 0.1:  # aborted while waiting, running, or in the step in flight
            victim = rng.choice(live)
            aborted.add(victim.request_id)
            assert s.abort(victim.request_id)
        s.postprocess(stepped, model.step(batch))
        steps += 1
        counts = s.kv_cache.accounting()
        assert counts["held"] == len({b for seq in s.running for b in seq.block_table})
        if steps % 25 == 0:
            s.requeue_running()
            restarts += 1
            assert s.kv_cache.accounting()["cached"] == 0
    counts = s.kv_cache.accounting()
    assert counts["held"] == 0 and counts["free"] + counts["idle_cached"] == cfg.num_blocks - 1
    assert s.num_preemptions > 0 and restarts > 0 and aborted
    if caching:
        stats = s.prefix_cache_stats()
        assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    for seq in seqs:
        if seq.request_id in aborted:
            assert seq.finish_reason == "abort" and seq.status is SequenceStatus.FINISHED
            continue
        out, reason = expected_output(seq.prompt_ids, seq.params)
        assert (seq.output_ids, seq.finish_reason) == (out, reason)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_the_choices_of_one_prompt_share_its_kv_blocks(chunked):
    """OpenAI's n: the choices after the first wait for its prompt, then start on its cached blocks and compute
    only the prompt's last partial block themselves; outputs are those of separate requests."""
    cfg = chunked_prefix(chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else 64)
    prompt = [10 + i % 23 for i in range(22)]  # 5 full blocks of 4 and 2 tokens
    s, model = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    choices = [Sequence(f"c{j}", prompt, SamplingParams(5, ignore_eos=True, temperature=0.8, seed=7 + j))
               for j in range(4)]
    s.add(choices[0])
    for seq in choices[1:]:
        s.add(seq, follows="c0")
    first, _ = step_once(s, model)
    assert first == [choices[0]]  # the others wait for its prompt
    seqs, batch = step_once(s, model)
    started = [seq for seq in seqs if seq is not choices[0]]
    assert started == choices[1:] and batch.describe().computes_prompts
    assert all(seq.num_cached_blocks == 5 for seq in started)  # each computed 2 tokens of its own
    held = {b for seq in choices for b in seq.block_table}
    assert len(held) == 5 + 4 < 4 * 6  # the shared prompt blocks and each choice's own last block
    while s.has_unfinished():
        step_once(s, model)
    alone, model2 = Scheduler(cfg), FakeKVModel(cfg.num_blocks, cfg.block_size)
    separate = [Sequence(f"s{j}", prompt, SamplingParams(5, ignore_eos=True, temperature=0.8, seed=7 + j))
                for j in range(4)]
    for seq in separate:
        alone.add(seq)
        while alone.has_unfinished():
            step_once(alone, model2)
    assert [c.output_ids for c in choices] == [c.output_ids for c in separate]
    assert len({tuple(c.output_ids) for c in choices}) > 1  # the seeds differ


def test_a_choice_whose_first_choice_ended_does_not_wait():
    cfg = chunked_prefix()
    s = Scheduler(cfg)
    first = Sequence("c0", [5, 6, 7, 8, 9], SamplingParams(3))
    s.add(first)
    s.add(Sequence("c1", [5, 6, 7, 8, 9], SamplingParams(3)), follows="c0")
    s.abort("c0")
    seqs, _ = s.schedule()
    assert [q.request_id for q in seqs] == ["c1"]
