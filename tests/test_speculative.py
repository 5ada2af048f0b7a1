"""Speculative decoding (issue 32): proposals (prompt lookup) verified by the model in one step per sequence
(``agents.runtime.verify_steps``). Greedy output is that of plain decoding, token for token (a fake model that
reads every context back through the cache, then the real tiny model through the engine); the blocks grown for
rejected proposals are given back; proposals, the step and the accepted tokens cross shared memory."""

from __future__ import annotations

import numpy as np
import pytest

from agents.runtime.verify_steps import accept
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.core.speculative import NgramProposer
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from llm_serving.protocol.step import StepKind
from tests.test_scheduler import EOS, FakeKVModel, config, logprob_of
from tests.tiny_engine import tiny_engine_config


def echo_token(tokens: list[int]) -> int:
    """A fake model that mostly repeats itself (period 5), so prompt lookup is often right, and sometimes not."""
    if len(tokens) % 7 == 0:
        return (tokens[-1] * 3 + 1) % 40
    return tokens[-5] if len(tokens) >= 5 else (tokens[-1] + 1) % 40


def expected(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        t = echo_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == EOS and not params.ignore_eos:
            return out, "eos"
        if len(out) >= params.max_new_tokens:
            return out, "length"


class FakeVerifier(FakeKVModel):
    """Picks ``echo_token`` of the context read through the cache after every query token of a verify step."""

    def step(self, batch: StepBatch) -> StepOutput:
        batch.validate()
        bs = self.block_size
        self.kv[batch.slot_mapping] = batch.input_ids
        picks = []
        for i in range(batch.batch_size):
            q, c = int(batch.query_lens[i]), int(batch.context_lens[i])
            rows = range(c - q + 1, c + 1) if batch.draft_lens is not None else [c]
            for n in rows:
                pos = np.arange(n)
                ctx = self.kv[batch.block_tables[i, pos // bs] * bs + pos % bs].tolist()
                assert min(ctx) >= 0
                picks.append(echo_token(ctx))
        picks = np.array(picks, np.int32)
        lps = np.array([logprob_of(t) for t in picks.tolist()], np.float32)
        return accept(batch, picks, lps) if batch.draft_lens is not None else StepOutput(picks, lps)


class OracleProposer:
    """Proposes each sequence's known greedy continuation (by its longest matching prompt), the last proposal wrong
    every other time, so steps accept all, some or none of the proposals: for the verify graphs on real models."""

    def __init__(self, references: dict[tuple, list[int]], vocab_size: int) -> None:
        self.references, self.vocab_size, self.calls = references, vocab_size, 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        prompt = max((p for p in self.references if tuple(tokens[: len(p)]) == p), key=len)
        done = len(tokens) - len(prompt)
        proposal = self.references[prompt][done: done + k]
        self.calls += 1
        if proposal and self.calls % 2:
            proposal[-1] = (proposal[-1] + 1) % self.vocab_size
        return proposal


def check_oracle_run(scheduler: Scheduler, runner, references: dict[tuple, tuple[list, list]], vocab_size: int) -> None:
    """Serve each prompt of ``references`` (prompt -> transformers' greedy ids and logprobs) on the real ``runner``
    with the oracle proposing: every token and logprob is transformers', some proposals kept, every block returned."""
    from tests.test_chunked_model import serve as serve_on

    scheduler.speculation.proposer = OracleProposer({p: ref for p, (ref, _) in references.items()}, vocab_size)
    seqs = [Sequence(f"s{i}", list(p), SamplingParams(len(ref))) for i, (p, (ref, _)) in enumerate(references.items())]
    serve_on(scheduler, runner, seqs)
    assert scheduler.speculation.proposed > scheduler.speculation.accepted > scheduler.speculation.steps > 0
    for seq in seqs:
        ref, ref_logprobs = references[tuple(seq.prompt_ids)]
        assert seq.output_ids == ref
        np.testing.assert_allclose(seq.output_logprobs, ref_logprobs, atol=1e-4)
    assert scheduler.num_used_blocks == 0


def serve(s: Scheduler, seqs: list[Sequence]) -> list[StepBatch]:
    model = FakeVerifier(s.config.num_blocks, s.config.block_size)
    for seq in seqs:
        s.add(seq)
    batches = []
    while s.has_unfinished():
        scheduled, batch = s.schedule()
        batches.append(batch)
        s.postprocess(scheduled, model.step(batch))
        held = sum(len(q.block_table) for q in s.running)
        assert held == s.num_used_blocks  # nothing held but the running sequences' tables
        for q in s.running:  # no block past the next input is kept
            assert len(q.block_table) <= s.kv_cache.blocks_needed(q.num_tokens) or q.is_prefilling
    return batches


def prompts() -> list[Sequence]:
    limits = [1, 2, 6, 11, 17, 30]
    return [Sequence(f"r{i}", [3 + (5 * i + j) % 31 for j in range(4 + i)],
                     SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0)) for i, n in enumerate(limits)]


def test_prompt_lookup_proposes_what_followed_the_longest_matching_tail():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert p.propose([5, 2, 3, 8, 1, 2, 3], 3) == [8, 1, 2]  # the 2-gram [2, 3] matched: the 3-gram did not
    assert p.propose([4, 7, 4, 8, 4], 5) == [8, 4]  # the latest occurrence, up to the end
    assert p.propose([1, 2, 3], 4) == [] and p.propose([1, 1], 0) == []
    assert NgramProposer(2, 2).propose([1, 2, 3, 2], 3) == []
    with pytest.raises(ValueError, match="min n-gram"):
        NgramProposer(3, 2)


def test_prompt_lookup_agrees_with_a_plain_search_on_random_sequences():
    """The one-pass lookup against the definition, written out: for n from the longest, the latest start ``i`` with
    ``tokens[i:i + n] == tokens[-n:]`` ending before the last token."""
    def search(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if k > 0 and starts:
                return tokens[starts[-1] + n: starts[-1] + n + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 30))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n, k = int(rng.integers(min_n, 6)), int(rng.integers(0, 5))
        assert NgramProposer(min_n, max_n).propose(tokens, k) == search(tokens, k, min_n, max_n), (tokens, k)


def test_accept_keeps_the_picks_up_to_the_first_wrong_proposal():
    # two sequences: last token + 3 proposals, last token + 1 proposal
    batch = StepBatch(np.array([7, 1, 2, 3, 9, 4], np.int32), np.arange(6, dtype=np.int32),
                      np.arange(6, dtype=np.int32), np.array([4, 2], np.int32), np.array([10, 6], np.int32),
                      np.zeros((2, 2), np.int32), draft_lens=np.array([3, 1], np.int32))
    picks = np.array([1, 2, 5, 6, 8, 0], np.int32)  # sequence 0 accepts 1, 2 (3 != 5); sequence 1 rejects 4
    out = accept(batch, picks, -picks.astype(np.float32))
    assert out.token_ids.tolist() == [1, 8] and out.num_more.tolist() == [2, 0]
    assert out.more_token_ids[0, :2].tolist() == [2, 5] and out.more_logprobs[0, :2].tolist() == [-2, -5]


@pytest.mark.parametrize("kw", [{}, {"chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": True}],
                         ids=["whole-prompts", "chunked-cached"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_plain_greedy_output(kw, k):
    s = Scheduler(config(speculative="ngram", num_speculative_tokens=k, max_num_seqs=8, **kw))
    seqs = prompts()
    batches = serve(s, seqs)
    for seq in seqs:
        assert (seq.output_ids, seq.finish_reason) == expected(seq.prompt_ids, seq.params), seq
        assert len(seq.output_logprobs) == len(seq.output_ids)
    verify = [b for b in batches if b.draft_lens is not None]
    assert verify and max(int(b.draft_lens.max()) for b in verify) == k
    assert 0 < s.speculation.accepted < s.speculation.proposed  # some proposals right, some wrong
    assert len(batches) < len(serve(Scheduler(config(max_num_seqs=8, **kw)), prompts()))  # fewer model steps
    assert s.num_used_blocks == 0 and s.kv_cache.accounting()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("rounds", [2, 5])
def test_verify_rounds_in_the_agent_keep_greedy_output_and_free_every_block(method, rounds):
    """A verify step of several rounds (``agents.runtime.verify_rounds``: prompt lookup over the history the step
    carries, or placeholders a draft fills, here the fake model's own next token half the time) gives exactly plain
    greedy decoding's tokens, ends where a request ends, and leaves no block held past the next input."""
    from agents.runtime.verify_rounds import run_verify_rounds
    from llm_serving.protocol.batch import verify_round_proposals

    s = Scheduler(config(speculative=method, num_speculative_tokens=3, speculative_step_tokens=16, max_num_seqs=8,
                         speculative_rounds=rounds))
    model, lookup = FakeVerifier(s.config.num_blocks, s.config.block_size), NgramProposer(1, 4)
    fills = []

    def agent_step(batch: StepBatch) -> StepOutput:
        if batch.num_steps == 1:
            return model.step(batch)
        assert batch.round_proposals == verify_round_proposals(3, 16, batch.batch_size)  # the master's k
        return run_verify_rounds(drafted if method == "draft" else model.step, batch, 4,
                                 lookup if method == "ngram" else None)

    def drafted(batch: StepBatch) -> StepOutput:  # a draft that knows the fake model, wrong every other proposal
        ids, ends = batch.input_ids.copy(), np.cumsum(batch.query_lens)
        for i, (end, d) in enumerate(zip(ends.tolist(), batch.draft_lens.tolist())):
            start = end - d - 1
            for j in range(start + 1, end):
                context = model.kv[batch.block_tables[i, np.arange(batch.positions[start]) // 4] * 4
                                   + np.arange(batch.positions[start]) % 4].tolist() + ids[start:j].tolist()
                ids[j] = echo_token(context) if len(fills) % 2 else (echo_token(context) + 1) % 40
                fills.append(ids[j])
        return model.step(StepBatch(**{**batch.__dict__, "input_ids": ids}))

    seqs = prompts()
    for q in seqs:
        s.add(q)
    multi = 0
    while s.has_unfinished():
        scheduled, batch = s.schedule()
        assert (batch.history_ids is not None) == (method == "ngram" and batch.num_steps > 1)
        multi += batch.num_steps > 1
        s.postprocess(scheduled, agent_step(batch))
        assert sum(len(q.block_table) for q in s.running) == s.num_used_blocks
        for q in s.running:
            assert len(q.block_table) <= s.kv_cache.blocks_needed(q.num_tokens) or q.is_prefilling
    for q in seqs:
        assert (q.output_ids, q.finish_reason) == expected(q.prompt_ids, q.params), q
        assert len(q.output_logprobs) == len(q.output_ids)
    assert multi and 0 < s.speculation.accepted < s.speculation.proposed and s.speculation.drafts > s.speculation.steps
    assert s.num_used_blocks == 0 and s.kv_cache.accounting()


def test_proposals_only_where_rejection_sampling_keeps_the_distribution():
    """Greedy and plain sampled sequences get proposals; penalised or adjusted ones none (their next logits depend on
    the tokens accepted); a sequence reporting top logprobs stops speculation (it needs every token's logits)."""
    def first_verify(*params: SamplingParams) -> StepBatch | None:
        s = Scheduler(config(speculative="ngram", max_num_seqs=8))
        seqs = [Sequence(f"r{i}", [3, 4, 3, 4, 3], p) for i, p in enumerate(params)]
        for seq in seqs:
            s.add(seq)
        scheduled, _ = s.schedule()
        rows = {i: np.zeros(40, np.float32) for i in range(len(seqs))}  # for the one reporting top logprobs
        s.postprocess(scheduled, StepOutput(np.full(len(seqs), 4, np.int32), np.zeros(len(seqs), np.float32),
                                            logits=rows))
        return s.schedule()[1]

    batch = first_verify(SamplingParams(6), SamplingParams(6, temperature=0.7, top_k=5, top_p=0.9, seed=1),
                         SamplingParams(6, temperature=0.7, repetition_penalty=1.2),
                         SamplingParams(6, temperature=0.7, logit_bias={5: 1.0}))
    assert (batch.draft_lens > 0).tolist() == [True, True, False, False] and batch.sampling is not None
    assert first_verify(SamplingParams(6), SamplingParams(6, top_logprobs=2)).draft_lens is None


def test_rejection_sampling_keeps_the_models_distribution():
    """Chi-square over 6 tokens: the first kept token follows p_0 and, given the first proposal was kept, the second
    follows p_1, whatever was proposed (a likely token, an unlikely one, one top-k removes); and every token is the
    one plain seeded sampling draws at its position."""
    from scipy.stats import chisquare

    from agents.runtime.sampler import filtered_probs, sample_row, speculative_sample_row

    logits = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04], [0.05, 0.1, 0.5, 0.2, 0.1, 0.05],
                              [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]], np.float32))
    for proposals, top_k in (([1, 2], 0), ([5, 3], 0), ([4, 2], 3)):
        runs = [speculative_sample_row(logits, proposals, 1.0, top_k, 1.0, seed, 7) for seed in range(12000)]
        for j in range(2):
            ids, probs = filtered_probs(logits[j].astype(np.float64), top_k, 1.0)
            p = np.zeros(6)
            p[ids] = probs
            tokens = [run[j] for run in runs if len(run) > j and run[:j] == proposals[:j]]
            if j and not tokens:  # a first proposal top-k removes is never kept (checked below)
                continue
            observed = np.bincount(tokens, minlength=6)
            support = p > 0
            assert observed[~support].sum() == 0, (proposals, j)
            assert chisquare(observed[support], p[support] * len(tokens)).pvalue > 1e-3, (proposals, j, observed)
        kept = np.mean([len(run) > 1 for run in runs])  # the first proposal kept as often as p_0 gives it
        ids, probs = filtered_probs(logits[0].astype(np.float64), top_k, 1.0)
        assert abs(kept - probs[ids == proposals[0]].sum()) < 0.02
        for seed, run in enumerate(runs[:300]):  # the draws of plain sampling, position by position
            plain = [sample_row(logits[j], 1.0, top_k, 1.0, 1.0, np.zeros(0, np.int32), seed, 7 + j)[0]
                     for j in range(len(run))]
            assert run == plain


def test_proposals_and_accepted_tokens_cross_shared_memory():
    s = Scheduler(config(speculative="ngram", num_speculative_tokens=3))
    s.add(Sequence("a", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(9, ignore_eos=True)))
    first, prefill = s.schedule()
    s.postprocess(first, FakeVerifier(s.config.num_blocks, s.config.block_size).step(prefill))
    _, batch = s.schedule()
    assert batch.draft_lens is not None
    channel = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=16, max_decode_steps=8))
    try:
        channel.write_step(3, batch)
        back = channel.read_step()[1]
        assert (back.draft_lens.tolist() == batch.draft_lens.tolist()
                and back.input_ids.tolist() == batch.input_ids.tolist())
        out = StepOutput(np.array([5], np.int32), np.array([-1.0], np.float32),
                         more_token_ids=np.array([[6, 7, 0]], np.int32),
                         more_logprobs=np.array([[-2, -3, 0]], np.float32), num_more=np.array([2], np.int32))
        channel.write_output(3, out)
        assert channel.read_output(3, 1).num_more.tolist() == [2]
        channel.write_output(4, StepOutput(np.array([5], np.int32), np.array([-1.0], np.float32)))
        assert channel.read_output(4, 1).num_more is None
        rounds = StepBatch(**{**batch.__dict__, "num_steps": 2, "history_offsets": np.array([0, 9], np.int32),
                              "history_ids": np.arange(9, dtype=np.int32)})
        rounds.validate()
        channel.write_step(4, rounds)
        back = channel.read_step()[1]
        assert back.num_steps == 2 and back.history_ids.tolist() == list(range(9))
        assert back.history_offsets.tolist() == [0, 9]
        counts = np.array([[2, 5, 3]], np.int32)
        channel.write_output(5, StepOutput(np.array([5], np.int32), np.array([-1.0], np.float32), spec_counts=counts))
        assert channel.read_output(5, 1).spec_counts.tolist() == [[2, 5, 3]]
        with pytest.raises(ValueError, match="tokens a sequence"):  # 3 rounds of 2 proposals + 1: 9 tokens
            channel.write_step(6, StepBatch(**{**rounds.__dict__, "num_steps": 3}))
        small = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=16, max_decode_steps=2))
        try:
            with pytest.raises(ValueError, match="tokens a sequence"):
                small.write_step(5, batch)
        finally:
            small.close()
    finally:
        channel.close()


def test_on_the_model_greedy_tokens_are_those_of_plain_decoding(tmp_path):
    """Greedy requests, and sampled ones of top_k 1 (a one-token distribution: rejection sampling must keep exactly
    the greedy tokens, through the sampled path's logits); prompt lookup in one round a step, and in up to 4 (the
    agent proposing in the later ones)."""
    from llm_serving.engine.loop import Engine

    prompts = [[1, 17, 230, 45, 9, 17, 230, 45], [1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 400, 401, 402, 403, 404, 405]]
    limits = [20, 25, 14]
    results = {}
    for method, rounds in (("", 1), ("ngram", 1), ("ngram", 4)):
        every_step = {"adaptive": False, "min_accepted": 0, "max_step_tokens": 64}  # the mechanism, not the policy
        cfg = tiny_engine_config(tmp_path, speculative={"method": method, "num_tokens": 3, "rounds": rounds,
                                                        **every_step})
        with Engine(cfg) as engine:
            engine.start(progress=None)
            streams = [engine.submit(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, limits)]
            done = [s.result(timeout=120) for s in streams]
            one_token = SamplingParams(20, ignore_eos=True, temperature=1.0, top_k=1, seed=3)
            sampled = engine.submit(prompts[0], one_token).result(timeout=120)
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0
        results[method, rounds] = [r.token_ids for r in done], [r.finish_reason for r in done]
        assert sampled.token_ids == done[0].token_ids
        if method:
            assert stats["spec_proposed_tokens"] > 0 and stats["spec_verify_steps"] > 0
        assert (stats["multi_step_batches"] > 0) == (rounds > 1)  # steps of several verify rounds
    assert results["ngram", 1] == results["", 1] == results["ngram", 4]


@pytest.mark.parametrize("method", ["draft", "self"])
def test_a_draft_in_the_agent_keeps_greedy_tokens_and_frees_every_block(tmp_path, method):
    """The draft (a random model of the same vocabulary, or the target's first layer) proposes in the agent, a
    round's proposals in one looped draft call (and self-speculation also one call per proposal,
    ``draft_loop`` false); the draft model in up to 3 verify rounds a step."""
    from llm_serving.engine.loop import Engine
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig

    draft_dir = tmp_path / "draft"
    build_random_model(draft_dir, LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                       seed=9)
    spec = {"draft": {"method": "draft", "draft_model_path": str(draft_dir)},
            "self": {"method": "self", "draft_layers": 1}}[method]
    prompts = [[1, 17, 230, 45, 9], [1, 5, 6, 7, 5, 6], [1, 400, 401, 402]]
    limits = [21, 9, 30]
    results = {}
    every_step = {"adaptive": False, "min_accepted": 0, "max_step_tokens": 64}  # the mechanism, not the policy
    rounds = 3 if method == "draft" else 1
    speculative = {**spec, "num_tokens": 3, "rounds": rounds, **every_step}
    runs = {"plain": {}, "looped": {"speculative": speculative}}
    if method == "self":
        runs["per-step"] = {"speculative": {**speculative, "draft_loop": False}}
    for name, sections in runs.items():
        lines: list[str] = []
        with Engine(tiny_engine_config(tmp_path, **sections)) as engine:
            engine.start(progress=lines.append)
            streams = [engine.submit(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, limits)]
            done = [s.result(timeout=120) for s in streams]
            late = engine.submit(prompts[0], SamplingParams(5, ignore_eos=True)).result(timeout=120)  # alone
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0
        results[name] = [r.token_ids for r in done] + [late.token_ids]
        assert any("draft warmed loop3 batch=4" in line for line in lines) == (name == "looped")
    assert results["looped"] == results["plain"] == results.get("per-step", results["plain"])
    assert stats["spec_verify_steps"] > 0 and stats["spec_proposed_tokens"] > 0
    assert (stats["multi_step_batches"] > 0) == (rounds > 1)  # steps of several verify rounds
    if method == "self":  # the first layer of two agrees with the model sometimes, never always on random weights
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def test_early_exit_serves_the_first_layers(tmp_path):
    from llm_serving.engine.loop import Engine

    prompt, outputs = [1, 17, 230, 45, 9], {}
    for layer in (None, 1, 2):
        with Engine(tiny_engine_config(tmp_path, model_config={"early_exit_layer": layer})) as engine:
            engine.start(progress=None)
            outputs[layer] = engine.submit(prompt, SamplingParams(12, ignore_eos=True)).result(timeout=120).token_ids
    assert outputs[2] == outputs[None] != outputs[1]  # all of the tiny model's 2 layers, or only its first


def test_on_the_native_cpu_ops_verified_tokens_are_hugging_faces(tmp_path):
    """The oracle proposes the greedy continuation (wrong at the end every other time): the verify graph of the
    native CPU ops keeps exactly transformers' greedy tokens and logprobs. The portable ops refuse verify graphs."""
    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.weights.checkpoints import load_weights
    from llm_serving.core.scheduler_config import SchedulerConfig
    from llm_serving.models.random_model import build_random_model
    from tests.hf_reference import hf_greedy, load_hf
    from tests.test_chunked_model import CONFIG, RC

    model_dir = build_random_model(tmp_path, CONFIG, seed=5, std=0.15)
    rc = RunnerConfig(**{**RC.__dict__, "verify_tokens": 4, "kernels": "native"})
    with pytest.raises(ValueError, match="ragged mixed steps, which the portable ops backend lacks"):
        ModelRunner(CONFIG, load_weights(model_dir, CONFIG), RunnerConfig(**{**rc.__dict__, "kernels": "portable"}))
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), rc)
    runner.warmup()
    hf = load_hf(model_dir)
    rng = np.random.default_rng(11)
    prompts = [[1] + rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (3, 17, 40, 70)]
    references = {tuple(p): hf_greedy(hf, p, 15) for p in prompts}
    scheduler = Scheduler(SchedulerConfig(num_blocks=rc.num_blocks, block_size=rc.block_size, max_num_seqs=8,
                                          max_prefill_batch=8, max_num_batched_tokens=64,
                                          max_model_len=rc.max_model_len,
                                          eos_token_id=None, chunked_prefill=True, speculative="ngram",
                                          num_speculative_tokens=4, speculative_step_tokens=64,
                                          speculative_min_accepted=0))
    check_oracle_run(scheduler, runner, references, CONFIG.vocab_size)


class WrongProposer:
    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [99] * k  # the fake model's tokens are < 40: never kept


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_a_sequence_whose_proposals_keep_failing_pauses_them(threshold):
    s = Scheduler(config(speculative="ngram", speculative_min_accepted=threshold, max_model_len=64))
    s.speculation.proposer = WrongProposer()
    seq = Sequence("a", [3, 4, 5], SamplingParams(40, ignore_eos=True))
    batches = serve(s, [seq])
    assert (seq.output_ids, seq.finish_reason) == expected(seq.prompt_ids, seq.params)
    verified = sum(b.draft_lens is not None for b in batches)
    if threshold:  # one verification, then 8 plain steps, again and again
        assert verified == len(range(0, 39, 9)) and s.speculation.accepted == 0
    else:
        assert verified == 38  # every decode step after the prefill but the last (its one token is its last)


def verify_share(verify_s: float | None) -> tuple[list[bool], float]:
    """Decode steps of one long request (whether each speculated), reporting each step's wall time as the engine
    does: ``verify_s`` for a verify step, 0.01 s for a plain one (None: no times reported)."""
    s = Scheduler(config(speculative="ngram", speculative_adaptive=True, max_model_len=256, num_blocks=128,
                         max_num_batched_tokens=256))
    model = FakeVerifier(s.config.num_blocks, s.config.block_size)
    s.add(Sequence("a", [3, 4, 5, 6, 7], SamplingParams(150, ignore_eos=True)))
    kinds = []
    while s.has_unfinished():
        scheduled, batch = s.schedule()
        s.postprocess(scheduled, model.step(batch))
        if batch.kind in (StepKind.DECODE, StepKind.VERIFY):
            kinds.append(batch.draft_lens is not None)
            if verify_s is not None:
                s.note_step_time(verify_s if batch.draft_lens is not None else 0.01)
    return kinds, sum(kinds[2:]) / len(kinds[2:])


def test_decode_steps_speculate_only_where_measured_faster():
    """With verify steps slower than plain ones (per token) a batch speculates only to measure again every 16th
    step; faster, it speculates as often as without measurements (where proposals and pauses allow)."""
    slow, slow_share = verify_share(1.0)
    fast, fast_share = verify_share(0.001)
    _, unmeasured_share = verify_share(None)
    assert slow[:2] == fast[:2] == [True, False]  # each mode measured first
    # the faster mode loses one step in 16 to probing the other
    assert slow_share < 0.12 and fast_share >= unmeasured_share - 0.1, (slow_share, fast_share, unmeasured_share)


def test_the_policies_default_by_method_and_yield_to_the_config():
    """Pauses and the measured choice: off for prompt lookup, on for the drafts (docs/speculative.md "The policies
    per method"); verify rounds 8 for prompt lookup, 1 for the drafts; a value in the config wins."""
    from llm_serving.config.serving_config import ServingConfig
    from llm_serving.config.yaml_sections import ConfigError
    from llm_serving.engine.wiring import scheduler_config

    def policies(section: dict) -> tuple[float, bool]:
        cfg = scheduler_config(ServingConfig.from_dict({"speculative": section}), 2)
        return cfg.speculative_min_accepted, cfg.speculative_adaptive

    def rounds(section: dict) -> int:
        return scheduler_config(ServingConfig.from_dict({"speculative": section}), 2).speculative_rounds

    assert rounds({"method": "ngram"}) == 8 and rounds({"method": "self", "draft_layers": 1}) == 1
    assert (rounds({"method": "ngram", "rounds": 2}) == 2
            and rounds({"method": "self", "draft_layers": 1, "rounds": 3}) == 3)
    with pytest.raises(ConfigError, match="speculative.rounds"):
        rounds({"method": "ngram", "rounds": 0})

    assert policies({"method": "ngram"}) == (0.0, False)
    assert policies({"method": "self", "draft_layers": 1}) == (0.5, True)
    assert policies({"method": "self", "draft_layers": 1, "min_accepted": 0, "adaptive": False}) == (0.0, False)
    assert policies({"method": "ngram", "adaptive": True}) == (0.0, True)


def test_a_looped_draft_round_proposes_what_per_step_draft_calls_propose(tmp_path):
    """A round's proposals in one looped draft call (``SpeculativeRunner.propose``) are those of one draft call per
    proposal, for sequences wanting 4, 2, none and 3 proposals (the loop runs 4 steps for all): the K/V of every
    token before a sequence's end equal, none written outside the sequences' own blocks and the dummy block; the
    round sizes a draft warms follow the verify step's token cap."""
    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.runtime.speculative_runner import SpeculativeRunner, draft_loops
    from agents.weights.checkpoints import load_weights
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.batch import verify_batch
    from llm_serving.protocol.model_config import LlamaConfig

    assert draft_loops(4, 8, (1, 8, 32)) == ((3, 2), (4, 1))  # 4 proposals alone, 3 for two, 1 (no loop) for three
    assert draft_loops(3, None, (4,)) == ((3, 4),)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model_dir = build_random_model(tmp_path, config, seed=4, std=0.3)
    block = 4
    rc = RunnerConfig(num_blocks=24, block_size=block, max_model_len=64, prefill_batch_sizes=(4,),
                      prefill_seq_lengths=(8,), decode_batch_sizes=(4,), decode_block_widths=(16,),
                      kernels="native", draft_loops=((4, 4),))
    draft = ModelRunner(config, load_weights(model_dir, config), rc)
    draft.warmup()
    assert ("loop4", 4, 16) in draft.graph_shapes()
    rng = np.random.default_rng(2)
    prompt_lens, drafts = [7, 4, 7, 10], [4, 2, 0, 3]  # the third ends on a block's end: its loop steps go past it
    tables = [[1, 2, 3], [5, 6], [8, 9], [11, 12, 13, 14]]  # each row's blocks for its prompt and proposals
    width = max(map(len, tables))
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    prompts = [rng.integers(3, 256, n).astype(np.int32) for n in prompt_lens]
    lens = np.array(prompt_lens, np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    rows = np.repeat(np.arange(4), lens)
    slots = block_tables[rows, positions // block] * block + positions % block
    prefill = draft.step(StepBatch(np.concatenate(prompts), positions, slots.astype(np.int32), lens, lens.copy(),
                                   block_tables))
    batch = verify_batch(prefill.token_ids.tolist(), [[0] * d for d in drafts], lens + 1, block_tables, block)
    spec = SpeculativeRunner(draft, draft, looped=False)  # propose() runs only the draft

    def cache() -> np.ndarray:
        return draft.model.layers[0].attention.cache_blocks(block)[0].copy()  # [blocks, 2 * kv heads, block, dim]

    def own(c: np.ndarray) -> list[np.ndarray]:  # each row's K/V up to its last token and proposals but the last
        return [c[np.array(t)[np.arange(n + d) // block], :, np.arange(n + d) % block]
                for t, n, d in zip(tables, prompt_lens, drafts)]

    before = cache()
    per_step, written = spec.propose(batch)
    assert not written.any()
    stepped = cache()
    spec.looped = True
    looped, written = spec.propose(batch)
    assert written.tolist() == [False, True, False, True]  # the loop ran past the last proposal of 2 and 3
    after = cache()
    assert looped.tolist() == per_step.tolist()
    assert sorted(set(looped[batch.input_ids == 0].tolist())) != [0]  # the placeholders were filled
    for a, b in zip(own(after), own(stepped)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    others = np.setdiff1d(np.arange(1, rc.num_blocks), np.concatenate([np.array(t) for t in tables]))
    np.testing.assert_array_equal(after[others], before[others])  # no other sequence's block written
