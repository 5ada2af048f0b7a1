"""Alternatives per generated token (OpenAI's ``logprobs`` / ``top_logprobs``): the most likely tokens of the
model's raw distribution at each position, equal to transformers' log-softmax of the same model (ids, order and
values), greedy and sampled, the chosen token's own logprob from the same distribution; only the sequences that
ask read logits back; and the shapes the OpenAI routes answer with."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from llm_serving.core.logprobs import top_logprobs
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.wiring import resolve_model
from llm_serving.request_errors import InvalidParameter
from tests.tiny_engine import openai_client, tiny_engine_config

PROMPTS = [[1, 17, 230, 45, 9, 301], [1, 88, 12, 900, 4, 4, 51, 7, 300]]


def test_top_logprobs_orders_the_distribution_and_bounds_k():
    logits = np.array([0.0, 3.0, 1.0, 3.0, -2.0], np.float32)
    top = top_logprobs(logits, 3)
    lse = np.log(np.exp(logits.astype(np.float64)).sum())
    assert [i for i, _ in top] == [1, 3, 2]  # a tie keeps the lower id first
    np.testing.assert_allclose([lp for _, lp in top], logits[[1, 3, 2]] - lse)
    assert len(top_logprobs(logits, 20)) == 5
    with pytest.raises(InvalidParameter, match="top_logprobs must be in 0..20"):
        SamplingParams(top_logprobs=21)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two greedy requests (one asking for 20 alternatives), a seeded sampled one asking for 5."""
    cfg = tiny_engine_config(tmp_path_factory.mktemp("top"))
    with Engine(cfg) as engine:
        engine.start(progress=None)
        streams = [engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True, top_logprobs=20)),
                   engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True)),
                   engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9,
                                                            seed=5, top_logprobs=5))]
        results = [s.result(timeout=120) for s in streams]
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(resolve_model(cfg).model_path, dtype=torch.float32).eval()
    return results, hf


def hf_log_softmax(hf, ids: list[int]) -> np.ndarray:
    """float64 log-softmax of every position's next-token logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("which, k", [(0, 20), (2, 5)])
def test_the_alternatives_are_transformers_log_softmax(served, which, k):
    results, hf = served
    res = results[which]
    prompt = PROMPTS[0] if which == 0 else PROMPTS[1]
    assert len(res.top_logprobs) == len(res.token_ids) == 6
    table = hf_log_softmax(hf, prompt + res.token_ids)
    for pos, (token, logprob, top) in enumerate(zip(res.token_ids, res.logprobs, res.top_logprobs)):
        row = table[len(prompt) - 1 + pos]
        want = np.argsort(-row, kind="stable")[:k]
        assert [i for i, _ in top] == want.tolist(), pos
        np.testing.assert_allclose([lp for _, lp in top], row[want], atol=1e-4)
        assert logprob == pytest.approx(row[token], abs=1e-4)  # the chosen token, from the same distribution
        if token in dict(top):  # one computation: the same number in token_logprobs and in top_logprobs
            assert logprob == dict(top)[token], pos
    if which == 0:  # greedy: the chosen token is the first alternative
        assert [top[0][0] for top in res.top_logprobs] == res.token_ids
    else:
        assert any(top[0][0] != t for top, t in zip(res.top_logprobs, res.token_ids))  # sampled off the argmax


def test_a_request_without_alternatives_gets_none_and_the_same_tokens(served):
    results, _ = served
    assert results[1].top_logprobs == [] and results[1].token_ids == results[0].token_ids


def test_the_routes_answer_alternatives_in_openais_shapes(standin_server):
    """Stand-in agents (one peaked logit per row): the chosen token is each position's most likely one."""
    client = openai_client(standin_server)
    done = client.completions.create(model="llama2", prompt="hello", max_tokens=4, logprobs=5, seed=1)
    lp = done.choices[0].logprobs
    assert all(len(top) == 5 and max(top, key=top.get) == token for top, token in zip(lp.top_logprobs, lp.tokens))
    chat = client.chat.completions.create(model="llama2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=3, temperature=0.7, seed=2)
    for c in chat.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)
    streamed = [c for c in client.chat.completions.create(
        model="llama2", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2,
        temperature=0, stream=True) if c.choices and c.choices[0].logprobs]
    assert streamed and all(len(c.choices[0].logprobs.content[0].top_logprobs) == 2 for c in streamed)


# ---- the prompt's logprobs (OpenAI's echo with logprobs; lm-evaluation-harness' loglikelihood requests) --------
def test_a_scored_prompt_has_transformers_logprobs_and_the_same_answer(tmp_path):
    """Each prompt token after the first: its logprob under the position before it, and that position's most
    likely tokens, equal to transformers' log-softmax; generating after scoring gives the unscored answer; a
    request of 0 tokens ends after scoring."""
    cfg = tiny_engine_config(tmp_path)
    prompt = PROMPTS[1] + [77, 88, 12]
    with Engine(cfg) as engine:
        engine.start(progress=None)
        scored = engine.submit(prompt, SamplingParams(0, prompt_logprobs=3))
        generated = engine.submit(prompt, SamplingParams(4, ignore_eos=True, prompt_logprobs=0))
        plain = engine.submit(prompt, SamplingParams(4, ignore_eos=True))
        scored, generated, plain = (s.result(timeout=120) for s in (scored, generated, plain))
        with pytest.raises(InvalidParameter, match="scoring a prompt .* needs two or more"):
            engine.submit([5], SamplingParams(0, prompt_logprobs=1))
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(resolve_model(cfg).model_path, dtype=torch.float32).eval()
    table = hf_log_softmax(hf, prompt)
    assert scored.finish_reason == "length" and scored.token_ids == [] and len(scored.prompt_logprobs) == 11
    for pos, (logprob, top) in enumerate(scored.prompt_logprobs, start=1):
        row = table[pos - 1]
        assert logprob == pytest.approx(row[prompt[pos]], abs=1e-4)
        assert [i for i, _ in top] == np.argsort(-row, kind="stable")[:3].tolist()
    assert generated.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert [lp for lp, _ in generated.prompt_logprobs] == pytest.approx([lp for lp, _ in scored.prompt_logprobs],
                                                                        abs=1e-6)


def test_lm_evals_loglikelihood_request_is_answered(standin_server):
    """lm-evaluation-harness' local-completions body for a loglikelihood request: token ids, max_tokens 0 or 1,
    logprobs 1, echo; the first prompt token's logprob is null; a streamed one is refused."""
    client = openai_client(standin_server)
    ids = [1, 40, 41, 42, 43]
    for max_tokens in (0, 1):
        done = client.completions.create(model="llama2", prompt=[ids], max_tokens=max_tokens, logprobs=1,
                                         echo=True, temperature=0)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) for x in lp.token_logprobs[1:]) and all(lp.top_logprobs[1:])
        assert done.usage.completion_tokens == max_tokens and done.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="served without stream"):
        client.completions.create(model="llama2", prompt=[ids], max_tokens=1, logprobs=1, echo=True, stream=True)
    with pytest.raises(openai.BadRequestError, match="0 only when scoring the prompt"):
        client.completions.create(model="llama2", prompt=[ids], max_tokens=0)


def test_echo_of_a_string_prompt_joins_its_tokens_at_their_offsets(standin_server):
    """Echo with logprobs on a string prompt: BOS keeps its piece (as vLLM shows it) at offset 0 adding no text,
    the first word has no dummy-prefix space, and every token is the text at its offset, the answer's included."""
    client = openai_client(standin_server)
    prompt = "def main():\n    return 1"
    done = client.completions.create(model="llama2", prompt=prompt, max_tokens=3, logprobs=1, echo=True,
                                     temperature=0)
    text, lp = done.choices[0].text, done.choices[0].logprobs
    assert text.startswith(prompt) and lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    assert lp.tokens[1] and prompt.startswith(lp.tokens[1])  # no dummy-prefix space
    assert "".join(lp.tokens[1:]) == text
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert text[offset:offset + len(token)] == token


def test_only_a_finished_sequence_without_a_new_token_ends_its_stream():
    """A scored prompt with nothing to generate ends without a token; a sequence preempted (waiting again) or
    still short of its prompt's end with no new token must not (its stream would end without a finish reason)."""
    from llm_serving.core.scheduler import Scheduler
    from llm_serving.core.sequence import Sequence, SequenceStatus
    from llm_serving.engine.live_requests import LiveRequests
    from llm_serving.engine.request_stream import RequestStream
    from tests.test_prefix_cache import chunked_prefix

    class NoText:  # the streams' decoder; no token text is needed here
        def incremental_decoder(self, prompt_ids=()):
            return self

        def push(self, token_id: int) -> str:
            return ""

        def flush(self) -> str:
            return ""

    live = LiveRequests(Scheduler(chunked_prefix()), {"requests_finished": 0, "tokens_generated": 0,
                                                      "requests_aborted": 0})
    waiting, done = Sequence("w", [5, 6, 7]), Sequence("d", [5, 6, 7], SamplingParams(0, prompt_logprobs=0))
    streams = {s.request_id: RequestStream(s.request_id, None, s.prompt_ids, NoText(), lambda rid: None)
               for s in (waiting, done)}
    for seq in (waiting, done):
        live.add(seq, streams[seq.request_id])
    waiting.status = SequenceStatus.WAITING  # preempted while its step was in flight
    done.finish("length")
    live.deliver([waiting, done])
    assert [s.request_id for s in live.sequences()] == ["w"]
    assert streams["d"].result(timeout=1).finish_reason == "length" and not streams["w"].finished
