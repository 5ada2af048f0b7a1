"""Request parsing/validation (api_schema), stop strings and the metrics text format, without a server."""

from __future__ import annotations

import random

import pytest

from llm_serving.api_schema import (
    ApiError,
    Limits,
    parse_completion,
    parse_generate,
    parse_json,
)
from llm_serving.config import ServingConfig
from llm_serving.metrics import ServerMetrics
from llm_serving.sequence import SamplingParams
from llm_serving.stop_strings import StopMatcher

LIMITS = Limits(max_new_tokens=100, max_prompt_len=64, max_model_len=128)


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# ---- llm-serving body ----------------------------------------------------------------------------------------
def test_generate_body_with_string_booleans_and_numbers():
    req = parse_generate({"inputs": "hi", "stream": "True", "parameters": {
        "max_new_tokens": "7", "do_sample": "False", "top_k": "1", "top_p": "0.8", "temperature": 0.7,
        "return_full_text": "True", "details": "false", "seed": 3, "stop": "\n", "repetition_penalty": 1.0}},
        LIMITS)
    assert (req.inputs, req.max_new_tokens, req.stream, req.return_full_text, req.details) == ("hi", 7, True,
                                                                                               True, False)
    assert req.stop == ("\n",) and req.sampling.top_p == 0.8 and req.sampling.seed == 3
    assert not req.sampling.wants_sampling
    assert parse_generate({"inputs": "x"}, LIMITS).max_new_tokens is None
    assert parse_generate({"inputs": "x", "stream": False}, LIMITS, stream=True).stream  # the route decides
    assert parse_generate({"inputs": "x", "sse": True}, LIMITS).sse


@pytest.mark.parametrize("body, param, status", [
    ([1, 2], None, 400),
    ({}, "inputs", 400),
    ({"inputs": 5}, "inputs", 400),
    ({"inputs": ""}, "inputs", 400),
    ({"inputs": "x", "parameters": []}, None, 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": -1}}, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": 10**9}}, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": "many"}}, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": 1.5}}, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"do_sample": "yes"}}, "do_sample", 400),
    ({"inputs": "x", "parameters": {"temperature": -1}}, "temperature", 400),
    ({"inputs": "x", "parameters": {"top_p": 0}}, "top_p", 400),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, "top_p", 400),
    ({"inputs": "x", "parameters": {"top_k": -2}}, "top_k", 400),
    ({"inputs": "x", "parameters": {"top_k": 2**40}}, "top_k", 400),
    ({"inputs": "x", "parameters": {"repetition_penalty": -1.5}}, "repetition_penalty", 400),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, "temperature", 400),
    ({"inputs": "x", "parameters": {"seed": -1}}, "seed", 400),
    ({"inputs": "x", "parameters": {"repetition_penalty": 0}}, "repetition_penalty", 400),
    ({"inputs": "x", "parameters": {"stop": [1]}}, "stop", 400),
    ({"inputs": "x", "parameters": {"stop": [""]}}, "stop", 400),
    ({"inputs": "x", "parameters": {"max_new_token": 5}}, "max_new_token", 400),
    ({"inputs": "x", "prompt": "y"}, "prompt", 400),
    ({"inputs": "x", "stream": "maybe"}, "stream", 400),
    ({"inputs": "x", "parameters": {"watermark": True}}, "watermark", 422),
])
def test_generate_body_errors_name_the_parameter(body, param, status):
    err = error_of(parse_generate, body, LIMITS)
    assert err.status == status and err.param == param
    if param:
        assert param in err.message
    if status == 422:
        assert "not supported" in err.message


def generate_params(parameters: dict, max_new: int = 9) -> SamplingParams:
    return parse_generate({"inputs": "x", "parameters": parameters}, LIMITS).sampling.to_params(max_new)


@pytest.mark.parametrize("parameters, expected", [
    ({}, SamplingParams(9)),
    # do_sample false is greedy whatever the sampling knobs say; a repetition penalty still applies (as in HF)
    ({"do_sample": False, "temperature": 0.9, "top_k": 5, "top_p": 0.5, "seed": 4},
     SamplingParams(9, seed=4)),
    ({"repetition_penalty": "1.2"}, SamplingParams(9, repetition_penalty=1.2)),
    # do_sample true without a positive temperature: Hugging Face's default temperature 1.0
    ({"do_sample": True}, SamplingParams(9, temperature=1.0)),
    ({"do_sample": "True", "temperature": 0}, SamplingParams(9, temperature=1.0)),
    ({"do_sample": "true", "temperature": "0.7", "top_k": "40", "top_p": 0.9, "repetition_penalty": 1.1,
      "seed": "12"}, SamplingParams(9, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=12)),
])
def test_generate_sampling_maps_to_engine_params(parameters, expected):
    params = generate_params(parameters)
    assert params == expected
    assert params.needs_logits == (expected.temperature > 0 or expected.repetition_penalty != 1.0)
    assert parse_generate({"inputs": "x", "parameters": parameters}, LIMITS).sampling.wants_sampling == (
        expected.temperature > 0)


def test_parse_json_errors():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"  ", b"{not json", b"\xff\xfe"):
        err = error_of(parse_json, raw)
        assert err.status == 400 and err.error_type == "invalid_json"


# ---- OpenAI body -----------------------------------------------------------------------------------------------
def test_completion_body():
    req = parse_completion({"model": "m", "prompt": "hi", "temperature": 0, "max_tokens": 5, "stream": True,
                            "stream_options": {"include_usage": True}, "stop": ["a", "b"], "logprobs": 1,
                            "ignore_eos": True, "n": 1, "presence_penalty": 0}, LIMITS)
    assert (req.model, req.prompts, req.max_tokens, req.stream, req.include_usage) == ("m", ("hi",), 5, True, True)
    assert req.stop == ("a", "b") and req.logprobs == 1 and req.ignore_eos
    assert parse_completion({"prompt": [1, 2, 3], "temperature": 0}, LIMITS).prompts == ((1, 2, 3),)
    assert parse_completion({"prompt": ["a", [5]], "temperature": 0}, LIMITS).prompts == ("a", (5,))
    assert parse_completion({"prompt": "a", "temperature": 0}, LIMITS).max_tokens == 16  # OpenAI's default


@pytest.mark.parametrize("body, expected", [
    ({}, SamplingParams(5, temperature=1.0)),  # OpenAI's default temperature is 1: sampling
    ({"temperature": 0, "top_p": 0.5, "seed": 3}, SamplingParams(5, seed=3)),  # 0 is greedy
    ({"temperature": 0.7, "top_p": 0.9, "seed": -8, "ignore_eos": True},
     SamplingParams(5, True, temperature=0.7, top_p=0.9, seed=-8)),
    ({"temperature": 1.5, "top_k": 20, "repetition_penalty": 1.3},  # vLLM's extra parameters
     SamplingParams(5, temperature=1.5, top_k=20, repetition_penalty=1.3)),
    ({"temperature": 0, "repetition_penalty": 0.8}, SamplingParams(5, repetition_penalty=0.8)),
])
def test_completion_sampling_maps_to_engine_params(body, expected):
    req = parse_completion({"prompt": "x", "max_tokens": 5, **body}, LIMITS)
    assert req.sampling.to_params(req.max_tokens, req.ignore_eos) == expected


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "x", "temperature": "0"}, "temperature", 400),  # strict JSON types here
    ({"prompt": "x", "temperature": -0.5}, "temperature", 400),
    ({"prompt": "x", "temperature": 2.5}, "temperature", 400),  # OpenAI's range is 0..2
    ({"prompt": "x", "top_p": 0}, "top_p", 400),
    ({"prompt": "x", "top_p": 1.01}, "top_p", 400),
    ({"prompt": "x", "top_k": -1}, "top_k", 400),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", 400),
    ({"prompt": "x", "seed": 1.5}, "seed", 400),
    ({"prompt": "x", "logprobs": 1}, "logprobs", 422),  # the top-1 alternative is unknown when sampling
    ({"prompt": "x", "temperature": 0, "repetition_penalty": 1.2, "logprobs": 1}, "logprobs", 422),
    ({"temperature": 0}, "prompt", 400),
    ({"prompt": "", "temperature": 0}, "prompt", 400),
    ({"prompt": [], "temperature": 0}, "prompt", 400),
    ({"prompt": [[1], "x", 3], "temperature": 0}, "prompt", 400),
    ({"prompt": "x", "temperature": 0, "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "temperature": 0, "max_tokens": 101}, "max_tokens", 400),
    ({"prompt": "x", "temperature": 0, "n": 2}, "n", 422),
    ({"prompt": "x", "temperature": 0, "logprobs": 3}, "logprobs", 422),
    ({"prompt": "x", "temperature": 0, "frequency_penalty": 0.5}, "frequency_penalty", 422),
    ({"prompt": "x", "temperature": 0, "stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"prompt": "x", "temperature": 0, "bogus": 1}, "bogus", 400),
])
def test_completion_body_errors(body, param, status):
    err = error_of(parse_completion, body, LIMITS)
    assert err.status == status and err.param == param


# ---- limits ------------------------------------------------------------------------------------------------------
def test_new_token_budget_clips_to_the_context_and_refuses_long_prompts():
    assert LIMITS.new_token_budget(10, None) == 100
    assert LIMITS.new_token_budget(10, 5) == 5
    assert LIMITS.new_token_budget(60, 100) == 68  # clipped: 60 + 68 = max_model_len
    for n in (65, 0):
        assert error_of(LIMITS.new_token_budget, n, 5).status == 400
    assert error_of(LIMITS.new_token_budget, 65, 5).error_type == "prompt_too_long"
    cfg = ServingConfig()
    limits = Limits.from_config(cfg)
    assert (limits.max_new_tokens, limits.max_prompt_len, limits.max_model_len) == (
        cfg.model_config.max_generate_length, cfg.model_config.seq_length[-1], cfg.pa_config.decode_seq_length)


# ---- stop strings -----------------------------------------------------------------------------------------------
def run_matcher(stops, pieces):
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped, out


def test_stop_string_split_across_pieces_is_trimmed_and_never_streamed():
    text, stopped, out = run_matcher(["\n\nUser"], ["Hi", " there\n", "\nUs", "er: more"])
    assert (text, stopped) == ("Hi there", True)
    assert out[:2] == ["Hi", " there"]  # the "\n" that might start the stop string was held back
    text, stopped, _ = run_matcher(["\n\nUser"], ["a\n", "\nb", "c"])
    assert (text, stopped) == ("a\n\nbc", False)  # a false start is released


def test_stop_matcher_matches_a_reference_on_random_splits():
    rng = random.Random(0)
    alphabet = "ab \n"
    for _ in range(300):
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(full) + 1), k=min(len(full) + 1, rng.randint(0, 6))))
        pieces = [full[i:j] for i, j in zip([0, *cuts], [*cuts, len(full)])]
        # reference: feed one character at a time, stop at the first prefix that contains a stop string
        ends = [p for p in range(len(full) + 1) if any(s in full[:p] for s in stops)]
        hits = ends[:1]
        expected = full
        if hits:
            p = hits[0]
            expected = full[: p - max(len(s) for s in stops if full[:p].endswith(s))]
        text, stopped, out = run_matcher(stops, pieces)
        assert (text, stopped) == (expected, bool(hits)), (full, stops, pieces)
        released = ""
        for chunk in out:  # nothing released may ever be taken back
            released += chunk
            assert expected.startswith(released)


# ---- metrics --------------------------------------------------------------------------------------------------
def test_metrics_text_format():
    m = ServerMetrics()
    m.requests.inc("success", 2)
    m.requests.inc("rejected")
    m.ttft.observe(0.03)
    m.ttft.observe(100.0)
    text = m.render({"num_waiting": 3, "num_running": 5, "kv_blocks_used": 7, "kv_blocks_free": 9, "ready": True,
                     "new key!": 1.5, "note": "not a number"})
    lines = text.splitlines()
    assert 'llm_serving_requests_total{outcome="success"} 2' in lines
    assert 'llm_serving_requests_total{outcome="rejected"} 1' in lines
    assert 'llm_serving_requests_total{outcome="aborted"} 0' in lines
    assert 'llm_serving_time_to_first_token_seconds_bucket{le="0.025"} 0' in lines
    assert 'llm_serving_time_to_first_token_seconds_bucket{le="0.05"} 1' in lines
    assert 'llm_serving_time_to_first_token_seconds_bucket{le="60.0"} 1' in lines
    assert 'llm_serving_time_to_first_token_seconds_bucket{le="+Inf"} 2' in lines
    assert "llm_serving_time_to_first_token_seconds_count 2" in lines
    for line in ("llm_serving_queue_length 3", "llm_serving_running_batch_size 5", "llm_serving_kv_blocks_used 7",
                 "llm_serving_kv_blocks_free 9", "llm_serving_engine_ready 1", "llm_serving_engine_new_key_ 1.5",
                 "# TYPE llm_serving_running_batch_size gauge"):
        assert line in lines
    assert "note" not in text
    for line in lines:  # every sample line: name{labels} value
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))
            assert name.split("{")[0].replace("_", "").isalnum()
