"""Structured output (issue 30): a JSON schema, JSON mode, a regex or a list of choices holds the answer token by
token. The grammar's masks are checked against the tokens' bytes on both tokenizer kinds, the agent's sampler
against them, the masks across shared memory; then the real (tiny, random) model through the official openai client:
every answer, greedy and sampled, parses and validates against its schema (``jsonschema``), ends with "stop", and
gives its KV blocks back; malformed constraints are 400s naming the key."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import openai
import pytest
from hf_tokenizer_fixture import build_hf_tokenizer
from test_server import ServerProcess

from agents.runtime.sampler import sample
from llm_serving.core.grammar import compiler_for
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import OutputConstraint, SamplingParams, Sequence
from llm_serving.protocol.batch import SamplingBatch, SamplingExtras
from llm_serving.protocol.shm_channel import ChannelLayout, StepChannel
from llm_serving.request_errors import InvalidParameter
from llm_serving.tokenization.hf_tokenizer import HFTokenizer
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer
from tests.tiny_engine import openai_client

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}


def allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> list[Tokenizer | HFTokenizer]:
    root = tmp_path_factory.mktemp("grammar")
    return [Tokenizer(train_tokenizer(root / "sp", 1000)), HFTokenizer(build_hf_tokenizer(root / "hf", 600))]


@pytest.mark.parametrize("constraint, check", [
    (OutputConstraint("json", json.dumps(PERSON)), lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    (OutputConstraint("regex", r"(yes|no), [0-9]{2}"), lambda text: re.fullmatch(r"(yes|no), [0-9]{2}", text)),
    (OutputConstraint("choice", json.dumps(["red wine", "blue"])), lambda text: text in ("red wine", "blue")),
])
def test_random_walks_through_the_mask_always_complete_a_valid_answer(tokenizers, constraint, check):
    """Any token the mask allows keeps the answer completable: uniformly random picks among them end in a valid
    answer, on a sentencepiece and a byte-level BPE vocabulary (the model's rows padded past the tokenizer's)."""
    rng = np.random.default_rng(0)
    for tok in tokenizers:
        vocab = tok.vocab_size + 7
        compiler = compiler_for(tok, [tok.eos_id], vocab)
        for _ in range(5):
            matcher, ids, done = compiler.matcher(constraint), [], False
            row = np.zeros(matcher.mask_words, np.int32)
            while not done and len(ids) < 200:
                matcher.fill_mask(row)
                choices = allowed(row, vocab)
                assert choices.size and choices.max() < tok.vocab_size  # never the padding rows
                token = int(rng.choice(choices))
                if token == tok.eos_id:
                    break
                assert matcher.allows(token)
                done = matcher.advance(token)
                ids.append(token)
            text = bytes(b for i in ids for b in tok.token_bytes(i)).decode()
            assert check(text), (type(tok).__name__, text)
        with pytest.raises(InvalidParameter, match="guided_regex cannot be used: .*unclosed group"):
            compiler.matcher(OutputConstraint("regex", "(a", "guided_regex"))
        with pytest.raises(InvalidParameter, match="response_format cannot be used"):
            compiler.matcher(OutputConstraint("json", json.dumps({"type": "strin"})))


def test_the_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone():
    vocab = 70
    logits = np.tile(np.linspace(0, 5, vocab, dtype=np.float32), (3, 1))  # the best token is the last
    masks = np.full((3, 3), -1, np.int32)
    masks[0] = masks[2] = 0
    masks[0, 0] = 1 << 5 | 1 << 9  # row 0 greedy: tokens 5 and 9 only
    masks[2, 1] = -(1 << 31)  # row 2 sampled: token 63 only
    batch = SamplingBatch(np.array([0, 0, 1.0], np.float32), np.zeros(3, np.int32), np.ones(3, np.float32),
                          np.ones(3, np.float32), np.arange(3, dtype=np.int64), np.zeros(3, np.int32),
                          np.zeros(4, np.int32), np.zeros(0, np.int32))
    batch.extras = SamplingExtras(np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                  np.zeros(3, np.int32), np.zeros(4, np.int32), np.zeros(0, np.int32),
                                  np.zeros(0, np.float32), masks)
    assert batch.special_rows().tolist() == [True, False, True]
    ids, logprobs = sample(logits, np.full(3, vocab - 1, np.int32), np.zeros(3, np.float32), batch)
    assert ids.tolist() == [9, vocab - 1, 63]
    raw = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert logprobs[0] == pytest.approx(raw[9], abs=1e-5)  # the model's own logprob, not the masked one


def test_the_masks_cross_shared_memory_only_in_steps_that_have_them(tokenizers):
    from tests.test_prefix_cache import chunked_prefix

    tok = tokenizers[0]
    compiler = compiler_for(tok, [tok.eos_id], tok.vocab_size)
    sched = Scheduler(chunked_prefix(prefix_caching=False))
    any_object = OutputConstraint("json", json.dumps({"type": "object"}))
    constrained = Sequence("json", [5, 6, 7], SamplingParams(4, constraint=any_object))
    constrained.constraint = compiler.matcher(constrained.params.constraint)
    sched.add(constrained)
    sched.add(Sequence("free", [5, 6, 8], SamplingParams(4, temperature=0.5)))
    _, batch = sched.schedule()
    masks = batch.sampling.extras.token_masks
    assert masks.shape == (2, (tok.vocab_size + 31) // 32) and (masks[1] == -1).all()
    assert tok.token_bytes(int(allowed(masks[0], tok.vocab_size)[0]))[0] == ord("{")
    channel = StepChannel.create(ChannelLayout(max_tokens=32, max_batch=4, max_blocks_per_seq=16,
                                               max_logits_rows=1, logits_width=tok.vocab_size))
    try:
        channel.write_step(1, batch)
        np.testing.assert_array_equal(channel.read_step()[1].sampling.extras.token_masks, masks)
        plain = Scheduler(chunked_prefix(prefix_caching=False))
        plain.add(Sequence("bias", [5, 6], SamplingParams(4, logit_bias={3: 1.0})))
        _, other = plain.schedule()
        channel.write_step(2, other)
        assert channel.read_step()[1].sampling.extras.token_masks is None
    finally:
        channel.close()


# ---- the real (tiny) model through the openai client --------------------------------------------------------------
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def served(tiny_server):
    return tiny_server


def _kv_blocks_used(server: ServerProcess) -> float:
    import urllib.request

    metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    return float(re.search(r"^llm_serving_kv_blocks_used (\S+)", metrics, re.MULTILINE).group(1))


def test_json_schema_answers_validate_greedy_sampled_and_streamed(served):
    client = openai_client(served)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy = client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=120, temperature=0,
                                            response_format=fmt)
    sampled = client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=120, temperature=1.0,
                                             seed=3, n=3, response_format=fmt)
    for choice in [*greedy.choices, *sampled.choices]:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    assert len({c.message.content for c in sampled.choices}) > 1
    free = client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=20, temperature=0)
    assert not free.choices[0].message.content.startswith("{")  # the random model writes no JSON by itself
    streamed = client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=120, temperature=0,
                                              response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == greedy.choices[0].message.content
    mode = client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=60, temperature=0.7, seed=1,
                                          response_format={"type": "json_object"})
    if mode.choices[0].finish_reason == "stop":  # an object may outgrow 60 tokens; a closed one parses
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
    else:
        assert mode.choices[0].message.content.startswith("{")


def test_vllms_keys_on_completions_and_the_blocks_come_back(served):
    client = openai_client(served)
    regex = client.completions.create(model="llama2", prompt="The answer is", max_tokens=20, temperature=0.9,
                                      seed=2, n=2, extra_body={"guided_regex": r"(yes|no) \(p=0\.[0-9]{2}\)"})
    for choice in regex.choices:
        assert re.fullmatch(r"(yes|no) \(p=0\.[0-9]{2}\)", choice.text) and choice.finish_reason == "stop"
    picked = client.completions.create(model="llama2", prompt="Pick a colour:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["crimson red", "teal"]}})
    assert picked.choices[0].text in ("crimson red", "teal")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    guided = client.completions.create(model="llama2", prompt="Status:", max_tokens=30, temperature=0,
                                       extra_body={"guided_json": json.dumps(schema)})
    jsonschema.validate(json.loads(guided.choices[0].text), schema)
    deadline = time.monotonic() + 10
    while _kv_blocks_used(served) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_blocks_used(served) == 0


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format cannot be used: Invalid type: strin"),
    ({"guided_regex": "(a"}, "guided_regex cannot be used"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "send one of them"),
    ({"response_format": {"type": "yaml"}}, "type 'yaml' is not supported"),
    ({"structured_outputs": {"grammar": "start: x"}}, "supports json, regex and choice"),
])
def test_malformed_constraints_are_400s_naming_the_key(standin_server, extra, message):
    client = openai_client(standin_server)
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.chat.completions.create(model="llama2", messages=CHAT, max_tokens=5, extra_body=extra)
    assert client.completions.create(model="llama2", prompt="still serving", max_tokens=2).choices


def test_a_token_outside_the_grammar_fails_only_its_request(standin_server):
    """The stand-in agents answer by their own rule, not the mask: the engine's check fails that request alone,
    with the reason, and the server serves on."""
    client = openai_client(standin_server)
    with pytest.raises(openai.APIError, match="does not match the requested output format"):
        client.completions.create(model="llama2", prompt="x", max_tokens=5, extra_body={"guided_regex": "q+"})
    assert client.completions.create(model="llama2", prompt="still serving", max_tokens=2).choices
