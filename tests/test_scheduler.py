import random

import numpy as np
import pytest

from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence, SequenceStatus
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.request_errors import RequestRejected

EOS = 2
VOCAB = 40


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole context, so any KV mix-up changes results."""
    h = len(tokens)
    for t in tokens:
        h = (h * 131 + t + 7) % 1_000_003
    return h % VOCAB


def sampled_token(tokens: list[int], seed: int, draw_index: int) -> int:
    """The fake model's "random" draw: a function of context, seed and draw index only, like the agents'."""
    return next_token(tokens + [seed % 1_000_003, draw_index])


def logprob_of(token: int) -> float:
    return -token / 64.0


class FakeKVModel:
    """Reads its context through the KV cache it was told to write, the way the real model runner does."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)

    def step(self, batch: StepBatch) -> StepOutput:
        batch.validate()
        bs = self.block_size
        self.kv[batch.slot_mapping] = batch.input_ids
        tokens, sampling = [], batch.sampling
        for i in range(batch.batch_size):
            pos = np.arange(batch.context_lens[i])
            ctx = self.kv[batch.block_tables[i, pos // bs] * bs + pos % bs].tolist()
            assert min(ctx) >= 0
            if sampling is None:
                tokens.append(next_token(ctx))
                continue
            penalty_ids = sampling.penalty_token_ids[sampling.penalty_offsets[i]:sampling.penalty_offsets[i + 1]]
            assert penalty_ids.tolist() == (ctx if sampling.repetition_penalty[i] != 1.0 else [])
            if sampling.temperature[i] > 0:
                tokens.append(sampled_token(ctx, int(sampling.seeds[i]), int(sampling.draw_index[i])))
            else:
                tokens.append(next_token(ctx))
        return StepOutput(np.array(tokens, np.int32), np.array([logprob_of(t) for t in tokens], np.float32))


def expected_output(prompt: list[int], params: SamplingParams, eos: int | None = EOS,
                    seed: int | None = None) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        t = sampled_token(tokens, seed, len(out)) if params.temperature > 0 else next_token(tokens)
        tokens.append(t)
        out.append(t)
        if eos is not None and t == eos and not params.ignore_eos:
            return out, "eos"
        if len(out) >= params.max_new_tokens:
            return out, "length"


def config(**kw) -> SchedulerConfig:
    base = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, "max_prefill_batch": 4,
            "max_num_batched_tokens": 64, "max_model_len": 64, "eos_token_id": EOS}
    return SchedulerConfig(**{**base, **kw})


def seq(rid: str, n_prompt: int = 3, max_new: int = 4, arrival: float | None = None, ignore_eos: bool = False):
    prompt = [10 + (sum(map(ord, rid)) + i) % 25 for i in range(n_prompt)]
    return Sequence(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos), arrival_time=arrival)


def fixed_output(seqs, token: int = 5) -> StepOutput:
    return StepOutput(np.full(len(seqs), token, np.int32), np.full(len(seqs), -0.5, np.float32))


# ---- configuration and admission ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"num_blocks": 1}, "num_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 2.5}, "block_size"),
    ({"max_num_batched_tokens": 32}, "max_num_batched_tokens .32. must be >= max_model_len .64."),
    ({"policy": "lifo"}, "policy"),
    ({"max_wait_s": -1.0}, "max_wait_s"),
    ({"min_decode_steps_between_prefills": -1}, "min_decode_steps_between_prefills"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_add_rejects_requests_that_can_never_run():
    s = Scheduler(config(num_blocks=5, max_model_len=32, max_num_batched_tokens=32))  # 16 token slots of KV
    with pytest.raises(ValueError, match="was not admitted: 0 prompt tokens"):  # admission words it for users
        s.add(Sequence("e", [], SamplingParams(max_new_tokens=1)))
    with pytest.raises(ValueError, match="was not admitted: 30 prompt tokens, 33 in all"):
        s.add(seq("long", n_prompt=30, max_new=3))
    with pytest.raises(RequestRejected, match="needs up to 5 KV blocks .* only 4"):
        s.add(seq("kv", n_prompt=10, max_new=8))
    s.add(seq("fits", n_prompt=10, max_new=7))  # 16 tokens are ever fed: exactly fits
    with pytest.raises(RequestRejected, match="already in progress"):
        s.add(seq("fits"))
    assert s.num_waiting == 1
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)


def test_prefill_then_decode_batches_have_consistent_arrays():
    s = Scheduler(config(block_size=4))
    a, b = seq("a", n_prompt=5, max_new=8), seq("b", n_prompt=3, max_new=8)
    s.add(a)
    s.add(b)
    seqs, batch = s.schedule()
    batch.validate()
    assert seqs == [a, b] and batch.describe().computes_prompts
    assert batch.input_ids.tolist() == a.prompt_ids + b.prompt_ids
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.query_lens.tolist() == [5, 3] and batch.context_lens.tolist() == [5, 3]
    assert batch.block_tables.tolist() == [a.block_table, b.block_table + [0]]
    ta, tb = a.block_table, b.block_table
    assert batch.slot_mapping.tolist() == [ta[0] * 4 + i for i in range(4)] + [ta[1] * 4] + [tb[0] * 4 + i
                                                                                           for i in range(3)]
    for arr in (batch.input_ids, batch.positions, batch.slot_mapping, batch.query_lens, batch.context_lens,
                batch.block_tables):
        assert arr.dtype == np.int32
    assert s.postprocess(seqs, StepOutput(np.array([7, 8], np.int32), np.array([-1, -2], np.float32))) == []
    assert a.output_ids == [7] and b.output_logprobs == [-2.0]

    seqs, batch = s.schedule()
    batch.validate()
    assert seqs == [a, b] and not batch.describe().computes_prompts
    assert batch.input_ids.tolist() == [7, 8] and batch.positions.tolist() == [5, 3]
    assert batch.context_lens.tolist() == [6, 4] and batch.query_lens.tolist() == [1, 1]
    assert batch.slot_mapping.tolist() == [ta[1] * 4 + 1, tb[0] * 4 + 3]
    s.postprocess(seqs, fixed_output(seqs))
    _, batch = s.schedule()  # b's 5th token starts its second block
    assert len(b.block_table) == 2 and batch.slot_mapping.tolist()[1] == b.block_table[1] * 4


def test_finishes_on_eos_or_length_and_frees_blocks():
    s = Scheduler(config())
    a, b, c = seq("a", max_new=3), seq("b", max_new=3, ignore_eos=True), seq("c", max_new=1)
    for x in (a, b, c):
        s.add(x)
    seqs, _ = s.schedule()
    finished = s.postprocess(seqs, fixed_output(seqs, token=5))
    assert finished == [c] and c.finish_reason == "length" and c.block_table == []
    seqs, _ = s.schedule()
    assert seqs == [a, b]
    finished = s.postprocess(seqs, fixed_output(seqs, token=EOS))
    assert finished == [a] and a.finish_reason == "eos" and a.output_ids == [5, EOS]
    seqs, _ = s.schedule()
    assert s.postprocess(seqs, fixed_output(seqs, token=EOS)) == [b]
    assert b.finish_reason == "length" and b.output_ids == [5, EOS, EOS]
    assert s.schedule() is None and not s.has_unfinished() and s.num_used_blocks == 0


def test_no_eos_token_means_only_length_ends():
    s = Scheduler(config(eos_token_id=None))
    a = seq("a", max_new=2)
    s.add(a)
    for _ in range(2):
        seqs, _ = s.schedule()
        finished = s.postprocess(seqs, fixed_output(seqs, token=EOS))
    assert finished == [a] and a.finish_reason == "length"


def test_postprocess_checks_output_shape():
    s = Scheduler(config())
    s.add(seq("a"))
    seqs, _ = s.schedule()
    with pytest.raises(ValueError, match="for 1 sequences"):
        s.postprocess(seqs, fixed_output(seqs + seqs))


# ---- abort ----------------------------------------------------------------------------------------------------
def test_abort_waiting_and_running():
    s = Scheduler(config(max_prefill_batch=1))
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    seqs, _ = s.schedule()
    s.postprocess(seqs, fixed_output(seqs))
    assert s.abort("b") and b.status is SequenceStatus.FINISHED and b.finish_reason == "abort"
    assert s.num_waiting == 0
    used = s.num_used_blocks
    assert s.abort("a") and a.block_table == [] and s.num_used_blocks == used - 1
    assert not s.abort("a") and not s.abort("nope")
    assert s.schedule() is None


def test_abort_while_step_in_flight_drops_its_token():
    s = Scheduler(config())
    a, b = seq("a", max_new=5), seq("b", max_new=5)
    s.add(a)
    s.add(b)
    seqs, _ = s.schedule()
    assert s.abort("a")
    assert s.num_used_blocks == len(b.block_table)  # freed at once
    assert s.postprocess(seqs, fixed_output(seqs)) == []
    assert a.output_ids == [] and b.output_ids == [5]
    seqs, batch = s.schedule()
    assert seqs == [b] and batch.batch_size == 1


def test_finish_request_with_stop_reason():
    s = Scheduler(config())
    a = seq("a")
    s.add(a)
    seqs, _ = s.schedule()
    s.postprocess(seqs, fixed_output(seqs))
    assert s.finish_request("a", "stop") and a.finish_reason == "stop" and s.num_used_blocks == 0
    s.add(seq("b"))
    with pytest.raises(ValueError, match="unknown finish_reason 'bored'"):
        s.finish_request("b", "bored")
    assert s.num_waiting == 1 and s.abort("b")


# ---- limits and interleaving ----------------------------------------------------------------------------------
def test_prefill_respects_batch_seq_token_and_block_limits():
    s = Scheduler(config(max_num_seqs=3, max_prefill_batch=2, max_num_batched_tokens=64, max_model_len=64))
    for i in range(5):
        s.add(seq(f"s{i}", n_prompt=10, max_new=4))
    seqs, batch = s.schedule()
    assert [x.request_id for x in seqs] == ["s0", "s1"]  # max_prefill_batch
    s.postprocess(seqs, fixed_output(seqs))
    seqs, _ = s.schedule()
    assert [x.request_id for x in seqs] == ["s2"]  # only one decode slot left
    s.postprocess(seqs, fixed_output(seqs))
    _, batch = s.schedule()
    assert not batch.describe().computes_prompts and batch.batch_size == 3

    s = Scheduler(config(max_num_batched_tokens=64, max_model_len=64))
    for i in range(3):
        s.add(seq(f"t{i}", n_prompt=30, max_new=4))
    seqs, batch = s.schedule()
    assert len(seqs) == 2 and batch.num_tokens == 60  # a third prompt would exceed the token budget

    s = Scheduler(config(num_blocks=8, block_size=4))  # 7 usable blocks
    for i in range(3):
        s.add(seq(f"u{i}", n_prompt=12, max_new=4))  # 3 blocks + 1 to decode its first token
    seqs, _ = s.schedule()
    assert len(seqs) == 1  # a second prompt fits, but would leave no block for the first decode
    assert s.num_free_blocks == 4


def test_min_decode_steps_between_prefills():
    s = Scheduler(config(max_prefill_batch=1, min_decode_steps_between_prefills=2))
    for i in range(3):
        s.add(seq(f"s{i}", max_new=20, ignore_eos=True))
    kinds = []
    for _ in range(7):
        seqs, batch = s.schedule()
        kinds.append("P" if batch.describe().computes_prompts else "D")
        s.postprocess(seqs, fixed_output(seqs))
    assert "".join(kinds) == "PDDPDDP"

    s = Scheduler(config(max_prefill_batch=1))  # default: prefill has priority
    for i in range(3):
        s.add(seq(f"s{i}", max_new=20, ignore_eos=True))
    kinds = []
    for _ in range(4):
        seqs, batch = s.schedule()
        kinds.append("P" if batch.describe().computes_prompts else "D")
        s.postprocess(seqs, fixed_output(seqs))
    assert "".join(kinds) == "PPPD"


# ---- preemption -----------------------------------------------------------------------------------------------
def test_preemption_recomputes_without_reemitting_tokens():
    cfg = config(num_blocks=7, block_size=2, max_model_len=12, max_num_batched_tokens=12)  # 6 usable blocks
    s, model = Scheduler(cfg), FakeKVModel(7, 2)
    a, b = seq("a", n_prompt=4, max_new=8, ignore_eos=True), seq("b", n_prompt=3, max_new=8, ignore_eos=True)
    s.add(a)
    s.add(b)
    seen_preempted_prefill = False
    while s.has_unfinished():
        seqs, batch = s.schedule()
        if batch.describe().computes_prompts and b in seqs and b.output_ids:
            seen_preempted_prefill = True
            start = batch.query_lens[: seqs.index(b)].sum()
            n = b.num_tokens
            assert batch.input_ids[start: start + n].tolist() == b.prompt_ids + b.output_ids
            assert batch.positions[start: start + n].tolist() == list(range(n))
        s.postprocess(seqs, model.step(batch))
    assert seen_preempted_prefill and b.num_preemptions >= 1 and a.num_preemptions == 0
    for x in (a, b):
        assert (x.output_ids, x.finish_reason) == expected_output(x.prompt_ids, x.params)
        assert x.output_logprobs == [logprob_of(t) for t in x.output_ids]
    assert s.num_used_blocks == 0


def test_preempted_sequences_are_readmitted_first_oldest_first():
    s = Scheduler(config(num_blocks=9, block_size=2, max_model_len=16, max_num_batched_tokens=16,
                         max_num_seqs=8))
    seqs = [seq(f"s{i}", n_prompt=3, max_new=10, ignore_eos=True) for i in range(3)]
    for x in seqs:
        s.add(x)
    late = seq("late", n_prompt=1, max_new=1)
    steps = 0
    while s.num_preemptions < 2:
        batch_seqs, _ = s.schedule()
        s.postprocess(batch_seqs, fixed_output(batch_seqs))
        steps += 1
        assert steps < 50
    s.add(late)
    assert [x.request_id for x in s.waiting][:2] == ["s1", "s2"]
    assert [x.request_id for x in s.running] == ["s0"]


# ---- policies -------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission_order(s: Scheduler) -> list[str]:
    order = []
    while s.has_unfinished():
        seqs, batch = s.schedule()
        if batch.describe().computes_prompts:
            order += [x.request_id for x in seqs]
        s.postprocess(seqs, fixed_output(seqs))
    return order


def test_fcfs_admits_in_arrival_order():
    s = Scheduler(config(max_prefill_batch=1, max_num_seqs=1, policy="fcfs"))
    for rid, max_new in [("a", 2), ("b", 9), ("c", 5)]:
        s.add(seq(rid, max_new=max_new))
    assert admission_order(s) == ["a", "b", "c"]


def test_longest_output_first_orders_by_max_new_tokens():
    clock = Clock()
    s = Scheduler(config(max_prefill_batch=1, max_num_seqs=1, policy="longest_output_first", max_wait_s=None),
                  clock=clock)
    for rid, max_new in [("a", 2), ("b", 9), ("c", 5), ("d", 9)]:
        s.add(seq(rid, max_new=max_new))
    assert admission_order(s) == ["b", "d", "c", "a"]  # ties keep arrival order


def test_starvation_guard_admits_long_waiters_first():
    clock = Clock()
    s = Scheduler(config(max_prefill_batch=1, max_num_seqs=1, policy="longest_output_first", max_wait_s=10.0),
                  clock=clock)
    s.add(seq("short", max_new=2))  # arrives at t=0
    clock.now = 5.0
    s.add(seq("long", max_new=9))
    s.add(seq("mid", max_new=5))
    clock.now = 9.0
    seqs, _ = s.schedule()
    assert [x.request_id for x in seqs] == ["long"]  # "short" has waited 9 s < 10 s
    s.abort("long")
    clock.now = 10.0
    seqs, _ = s.schedule()
    assert [x.request_id for x in seqs] == ["short"]  # waited 10 s: admitted before "mid"
    s.abort("short")
    assert admission_order(s) == ["mid"]


# ---- sampling parameters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, error, match", [
    ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
    ({"temperature": float("nan")}, TypeError, "temperature must be a finite number"),
    ({"temperature": "0.5"}, TypeError, "temperature must be a finite number"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, ValueError, "top_k must be in 0.."),
    ({"top_k": 2**31}, ValueError, "top_k must be in 0.."),
    ({"top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be > 0"),
    ({"repetition_penalty": -1.2}, ValueError, "repetition_penalty must be > 0"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"seed": True}, TypeError, "seed must be an int"),
])
def test_sampling_params_validation(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(4, **kw)


def test_sampling_params_defaults_are_greedy_and_frozen():
    p = SamplingParams(4)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (0.0, 0, 1.0, 1.0, None)
    assert not p.needs_logits and SamplingParams(4, temperature=1).temperature == 1.0
    assert SamplingParams(4, temperature=0.5).needs_logits and SamplingParams(4, repetition_penalty=1.1).needs_logits
    assert not SamplingParams(4, top_k=5, top_p=0.5).needs_logits  # greedy: top-k/top-p change nothing
    with pytest.raises(AttributeError):
        p.temperature = 1.0


def test_greedy_steps_carry_no_sampling_and_mixed_steps_carry_every_sequence():
    s = Scheduler(config())
    greedy = Sequence("g", [11, 12, 13], SamplingParams(6))
    sampled = Sequence("s", [14, 15], SamplingParams(6, temperature=0.7, top_k=5, top_p=0.9, seed=42))
    penalised = Sequence("p", [16, 17, 16, 18], SamplingParams(6, repetition_penalty=1.3))
    s.add(greedy)
    seqs, batch = s.schedule()
    assert batch.sampling is None  # all greedy: the agents keep the in-graph argmax
    s.postprocess(seqs, fixed_output(seqs, 7))
    assert s.schedule()[1].sampling is None
    s.postprocess(seqs, fixed_output(seqs, 8))
    s.add(sampled)
    s.add(penalised)
    seqs, batch = s.schedule()
    assert seqs == [sampled, penalised] and batch.describe().computes_prompts
    sb = batch.sampling
    assert sb.temperature.tolist() == pytest.approx([0.7, 0.0]) and sb.top_k.tolist() == [5, 0]
    assert sb.top_p.tolist() == pytest.approx([0.9, 1.0]) and sb.repetition_penalty.tolist() == pytest.approx([1, 1.3])
    assert sb.seeds[0] == 42 and sb.seeds[1] == penalised.seed and sb.draw_index.tolist() == [0, 0]
    assert sb.penalty_offsets.tolist() == [0, 0, 4] and sb.penalty_token_ids.tolist() == [16, 17, 16, 18]
    assert sb.needs_logits
    s.postprocess(seqs, fixed_output(seqs, 9))

    seqs, batch = s.schedule()  # decode: every running sequence, greedy ones at temperature 0
    sb = batch.sampling
    assert seqs == [greedy, sampled, penalised] and not batch.describe().computes_prompts
    assert sb.temperature.tolist() == pytest.approx([0.0, 0.7, 0.0])
    assert sb.draw_index.tolist() == [2, 1, 1]  # tokens generated so far
    assert sb.penalty_offsets.tolist() == [0, 0, 0, 5] and sb.penalty_token_ids.tolist() == [16, 17, 16, 18, 9]
    assert sb.seeds.tolist() == [greedy.seed, 42, penalised.seed] and sb.seeds.dtype == np.int64
    s.postprocess(seqs, fixed_output(seqs, 10))
    s.abort("s")
    assert s.schedule()[1].sampling.temperature.tolist() == [0.0, 0.0]  # the penalty still needs logits
    s.finish_request("p", "stop")
    assert s.schedule()[1].sampling is None  # back on the fast path


def test_seeds_are_fixed_at_admission_and_stored_as_int64():
    s = Scheduler(config())
    given = {"a": 5, "b": -1, "c": 2**64 + 5, "d": 2**63}
    for rid, seed in given.items():
        s.add(Sequence(rid, [3, 4], SamplingParams(4, temperature=1.0, seed=seed)))
    s.add(Sequence("r1", [3, 4], SamplingParams(4, temperature=1.0)))
    s.add(Sequence("r2", [3, 4], SamplingParams(4, temperature=1.0)))
    by_id = {x.request_id: x for x in s.waiting}
    assert [by_id[r].seed for r in given] == [5, -1, 5, -2**63]  # congruent modulo 2**64
    r1, r2 = by_id["r1"].seed, by_id["r2"].seed
    assert r1 != r2 and all(-2**63 <= v < 2**63 for v in (r1, r2))


def test_sampled_draws_do_not_depend_on_batch_or_preemption():
    """Every sequence's tokens follow from (context, seed, draw index) alone, however it is batched."""
    cfg = config(num_blocks=9, block_size=2, max_model_len=16, max_num_batched_tokens=16, max_num_seqs=6)
    alone_cfg = config(num_blocks=64, block_size=2, max_model_len=16, max_num_batched_tokens=16)
    params = [SamplingParams(10, True, temperature=0.9, seed=i) for i in range(5)] + [
        SamplingParams(10, True), SamplingParams(10, True, temperature=0.5, repetition_penalty=1.2)]

    def run(c: SchedulerConfig, batch: list[int]) -> tuple[dict[int, list[int]], int]:
        s, model = Scheduler(c), FakeKVModel(c.num_blocks, c.block_size)
        # unseeded requests get a random seed at admission; preset one so both runs use the same
        xs = {i: Sequence(f"r{i}", [20 + i, 21, 22], params[i], seed=None if params[i].seed is not None else 100 + i)
              for i in batch}
        for x in xs.values():
            s.add(x)
        while s.has_unfinished():
            seqs, b = s.schedule()
            s.postprocess(seqs, model.step(b))
        return {i: x.output_ids for i, x in xs.items()}, s.num_preemptions

    together, preemptions = run(cfg, list(range(len(params))))
    assert preemptions > 0
    for i, p in enumerate(params):
        alone, _ = run(alone_cfg, [i])
        assert together[i] == alone[i] == expected_output([20 + i, 21, 22], p, seed=p.seed if p.seed is not None
                                                          else 100 + i)[0]
    assert together[0] != together[1]  # different seeds draw differently


# ---- randomized end-to-end property test ----------------------------------------------------------------------
def check_invariants(s: Scheduler, seqs, batch: StepBatch, retired: set[int]) -> None:
    cfg, bs = s.config, s.config.block_size
    batch.validate()
    assert (batch.sampling is None) == (not any(x.params.needs_logits for x in seqs))
    if batch.sampling is not None:
        assert batch.sampling.seeds.tolist() == [x.seed for x in seqs]
        assert batch.sampling.draw_index.tolist() == [x.num_output_tokens for x in seqs]
    owned = [b for x in s.running for b in x.block_table]
    assert len(owned) == len(set(owned)), "two running sequences share a block"
    assert 0 not in owned and len(owned) == s.num_used_blocks
    assert all(x.block_table == [] for x in s.waiting)
    assert all(id(x) not in retired and x.status is SequenceStatus.RUNNING for x in seqs)
    if batch.describe().computes_prompts:
        assert len(seqs) <= cfg.max_prefill_batch and batch.num_tokens <= cfg.max_num_batched_tokens
    assert len(s.running) <= cfg.max_num_seqs
    start = 0
    for i, x in enumerate(seqs):
        n = x.num_tokens
        q = n if batch.describe().computes_prompts else 1
        assert batch.query_lens[i] == q and batch.context_lens[i] == n
        toks = slice(start, start + q)
        assert batch.input_ids[toks].tolist() == x.all_token_ids[n - q:]
        assert batch.positions[toks].tolist() == list(range(n - q, n))
        assert batch.slot_mapping[toks].tolist() == [x.block_table[p // bs] * bs + p % bs for p in range(n - q, n)]
        row = batch.block_tables[i].tolist()
        assert row[: len(x.block_table)] == x.block_table and not any(row[len(x.block_table):])
        start += q


@pytest.mark.parametrize("policy, interleave, seed", [
    ("fcfs", 0, 1),
    ("longest_output_first", 0, 2),
    ("longest_output_first", 3, 3),
])
def test_randomized_arrivals_aborts_and_preemptions(policy, interleave, seed):
    rng, sampling_rng = random.Random(seed), random.Random(-seed)
    cfg = SchedulerConfig(num_blocks=17, block_size=4, max_num_seqs=6, max_prefill_batch=3,
                          max_num_batched_tokens=48, max_model_len=48, eos_token_id=EOS, policy=policy,
                          max_wait_s=8.0, min_decode_steps_between_prefills=interleave)
    clock = Clock()
    s, model = Scheduler(cfg, clock=clock), FakeKVModel(cfg.num_blocks, cfg.block_size)
    total, added, aborted, retired, streamed = 3000, [], set(), set(), {}

    def random_abort():
        live = [x for x in added if not x.is_finished]
        if live:
            victim = rng.choice(live)
            assert s.abort(victim.request_id)
            aborted.add(victim.request_id)
            retired.add(id(victim))

    while len(added) < total or s.has_unfinished():
        clock.now += 1.0
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            if len(added) < total:
                sampling = sampling_rng.choice([{}, {}, {"temperature": 0.8}, {"repetition_penalty": 1.2},
                                                {"temperature": 1.0, "seed": sampling_rng.randrange(10)}])
                x = Sequence(f"r{len(added)}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24))],
                             SamplingParams(max_new_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.3,
                                            **sampling), arrival_time=clock.now)
                s.add(x)
                added.append(x)
        if rng.random() < 0.02:
            random_abort()
        step = s.schedule()
        if step is None:
            assert not s.has_unfinished()
            continue
        seqs, batch = step
        check_invariants(s, seqs, batch, retired)
        output = model.step(batch)
        if rng.random() < 0.02:
            random_abort()  # while the step is in flight
        before = {x.request_id: x.num_output_tokens for x in seqs}
        for x in s.postprocess(seqs, output):
            retired.add(id(x))
        for x in seqs:  # stream the new token, as the server does
            if x.request_id in aborted:
                assert x.num_output_tokens == before[x.request_id]
            else:
                assert x.num_output_tokens == before[x.request_id] + 1
                streamed.setdefault(x.request_id, []).append(x.output_ids[-1])

    assert s.num_used_blocks == 0 and s.num_free_blocks == cfg.num_blocks - 1
    assert s.num_waiting == 0 and s.num_running == 0
    assert s.num_preemptions > 20
    assert 50 < len(aborted) < total // 4
    assert sum(x.params.temperature > 0 for x in added) > total // 4
    for x in added:
        want, reason = expected_output(x.prompt_ids, x.params, seed=x.seed)
        if x.request_id in aborted:
            assert x.finish_reason == "abort" and want[: x.num_output_tokens] == x.output_ids
        else:
            assert (x.output_ids, x.finish_reason) == (want, reason), x
            assert streamed[x.request_id] == want  # preemption never re-emits a token
            assert x.output_logprobs == pytest.approx([logprob_of(t) for t in want])


# ---- priority ------------------------------------------------------------------------------------------------
def prio(rid: str, priority: int, arrival: float, n_prompt: int = 4, max_new: int = 8) -> Sequence:
    prompt = [10 + (sum(map(ord, rid)) + i) % 25 for i in range(n_prompt)]
    return Sequence(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True, priority=priority),
                    arrival_time=arrival)


def test_priority_admits_by_priority_then_arrival():
    s = Scheduler(config(policy="priority", max_num_seqs=1, max_prefill_batch=1))
    for rid, p, t in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", -1, 4.0)]:
        s.add(prio(rid, p, t, max_new=2))
    started = []
    while s.has_unfinished():
        seqs, _ = s.schedule()
        started += [q.request_id for q in seqs if q.request_id not in started]
        s.postprocess(seqs, fixed_output(seqs))
    assert started == ["e", "b", "d", "c", "a"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_priority_preempts_the_lowest_priority_running_sequence(policy, victim):
    """Two sequences outgrow a cache of 6 usable blocks; "low" (priority 5) was admitted first, "high" (priority 0)
    after it: fcfs preempts the newest, priority the lowest priority, and each resumes exactly."""
    cfg = config(policy=policy, num_blocks=7, block_size=2, max_model_len=12, max_num_batched_tokens=12)
    s, model = Scheduler(cfg), FakeKVModel(7, 2)
    low, high = prio("low", 5, 0.0), prio("high", 0, 1.0, n_prompt=3)
    s.add(low)
    seqs, batch = s.schedule()  # "low" alone
    assert seqs == [low]
    s.postprocess(seqs, model.step(batch))
    s.add(high)
    while s.has_unfinished():
        seqs, batch = s.schedule()
        s.postprocess(seqs, model.step(batch))
    by_id = {"low": low, "high": high}
    assert by_id[victim].num_preemptions >= 1
    assert by_id["high" if victim == "low" else "low"].num_preemptions == 0
    for x in (low, high):
        assert (x.output_ids, x.finish_reason) == expected_output(x.prompt_ids, x.params)
    assert s.num_used_blocks == 0
