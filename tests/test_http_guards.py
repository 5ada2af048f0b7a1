"""Issue 18, findings 1, 2, 3 and 6 without a server: sampling values checked as the agents hold them
(float32), no exception but ApiError for hostile JSON, caps on lists and strings, the API key's checks."""

from __future__ import annotations

import numpy as np
import pytest

from llm_serving.api.guards import check_prompt_count
from llm_serving.api.schema import parse_completion, parse_generate, parse_json
from llm_serving.core.sequence import SamplingParams
from llm_serving.front.api_key import bearer_matches, exposure_warning
from llm_serving.front.errors import MAX_ERROR_CHARS, error_response
from llm_serving.front.guards import MAX_JSON_DEPTH, check_json
from llm_serving.request_errors import ApiError, InvalidParameter


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# ---- finding 1: a value that float32 (the step arrays, the agents) turns into another one is refused -------
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 1.0, "top_p": 1e-300}, "top_p"),  # the issue's: 0 in float32, IndexError on the agent
    ({"temperature": 1.0, "top_k": 1, "top_p": 5e-324}, "top_p"),
    ({"temperature": 1e-300}, "temperature"),  # sampled in float64, greedy (0) on the agent
    ({"temperature": 1e300}, "temperature"),  # inf in float32
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0: logits divided by zero
    ({"repetition_penalty": 1e39}, "repetition_penalty"),  # inf
])
def test_sampling_values_are_checked_as_float32(kwargs, field):
    for name, value in kwargs.items():
        if name != "top_k" and value != 1.0:
            with np.errstate(over="ignore"):
                f32 = np.array(value, dtype=np.float64).astype(np.float32)
            assert f32 == 0 or np.isinf(f32)  # what the agent would get
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(8, **kwargs)
    assert info.value.field == field and "float32" in str(info.value)


def test_small_float32_values_still_serve():
    p = SamplingParams(8, temperature=1e-30, top_p=1e-40, repetition_penalty=3e38)  # subnormal top_p is > 0
    assert p.top_p == 1e-40 and p.temperature == 1e-30  # kept as sent (float64); only checked in float32
    assert SamplingParams(8, top_p=0.9).top_p == 0.9


def test_float32_underflow_is_a_400_naming_the_field_on_both_routes():
    err = error_of(parse_generate({"inputs": "hello world", "parameters": {
        "max_new_tokens": 4, "do_sample": True, "top_p": 1e-300}}).sampling.to_params, 4)
    assert (err.status, err.param) == (400, "top_p")
    req = parse_completion({"prompt": "x", "top_p": 5e-324, "top_k": 1})
    assert error_of(req.sampling.to_params, 4).param == "top_p"


# ---- finding 2: hostile JSON values are 400s, not exceptions -----------------------------------------------
def test_integer_beyond_pythons_digit_limit_is_a_400():
    for raw in (b'{"inputs": "x", "parameters": {"seed": ' + b"9" * 5000 + b"}}", b"[" + b"1" * 4301 + b"]"):
        err = error_of(parse_json, raw)
        assert (err.status, err.error_type) == (400, "invalid_json") and "digits" in err.message


@pytest.mark.parametrize("key", ["temperature", "top_p", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty"])
def test_huge_integer_in_a_float_field_is_a_400(key):
    err = error_of(parse_completion, {"prompt": "x", key: 10**400})
    assert (err.status, err.param) == (400, key)
    if key not in ("presence_penalty", "frequency_penalty"):
        err = error_of(parse_generate, {"inputs": "x", "parameters": {key: -(10**400)}})
        assert (err.status, err.param) == (400, key)


@pytest.mark.parametrize("body", [
    {"inputs": "\ud800"}, {"inputs": "ok", "parameters": {"stop": ["a\udfffb"]}}, {"\udc80": 1},
    {"prompt": ["fine", "x\ud83d"]},
])
def test_lone_surrogates_are_refused(body):
    err = error_of(check_json, body)
    assert (err.status, err.error_type) == (400, "invalid_json") and "surrogate" in err.message
    check_json({"inputs": "a pair is fine: \U0001f600"})


def test_json_nesting_deeper_than_any_request_is_refused():
    value: object = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        value = [value]
    err = error_of(check_json, {"inputs": "x", "parameters": {"stop": value}})
    assert err.status == 400 and "deep" in err.message
    check_json({"prompt": [[1, 2], [3]], "stream_options": {"include_usage": True}})


def test_error_messages_are_bounded():
    err = error_of(parse_generate, {"inputs": "x", "parameters": {"truncate": "y" * 100_000}})
    assert err.status == 422 and len(err.message) < 500
    err = error_of(parse_generate, {"inputs": "x", **{f"k{i}": 1 for i in range(10_000)}})
    assert err.status == 400 and len(err.message) < 2000
    resp = error_response(ApiError(400, "z" * 100_000, "invalid_request"), openai=False)
    assert len(resp.body) < MAX_ERROR_CHARS + 200


# ---- finding 3: caps on lists and strings; a request that can never be admitted is a 400, not a 503 --------
def test_prompt_list_is_capped():
    err = error_of(parse_completion, {"prompt": ["hi"] * 2000})
    assert (err.status, err.param) == (400, "prompt") and "2000" in err.message
    assert len(parse_completion({"prompt": ["hi"] * 64}).prompts) == 64
    err = error_of(check_prompt_count, 64, max_queue_size=16)
    assert err.status == 400 and "max_queue_size" in err.message
    check_prompt_count(16, max_queue_size=16)


def test_user_string_is_capped():
    err = error_of(parse_completion, {"prompt": "x", "user": "u" * 100_000})
    assert (err.status, err.param) == (400, "user")


# ---- finding 6: API key and the exposure warning -----------------------------------------------------------
def test_bearer_matching():
    assert bearer_matches("Bearer s3cret", "s3cret") and bearer_matches("bearer   s3cret ", "s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Basic s3cret", "Bearer s3cret2",
                   "Bearer \udcff", "Bearer sécret"):
        assert not bearer_matches(header, "s3cret")


def test_exposure_warning_only_beyond_loopback_without_a_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        message = exposure_warning(host, None)
        assert message and "api_key" in message and host in message
        assert exposure_warning(host, "k") is None


# ---- engine failures: a request's own failure is a 500, the engine's a 503 to retry ------------------------
def test_engine_failures_map_to_their_status():
    import asyncio
    import json

    from llm_serving.api.responses import engine_errors, openai_stream_error
    from llm_serving.engine.live_requests import SequenceError
    from llm_serving.engine.request_stream import EngineError

    async def failing(exc):
        raise exc

    own = error_of(asyncio.run, engine_errors(failing(SequenceError("sampling failed: IndexError"))))
    assert (own.status, own.error_type) == (500, "generation_failed") and "sampling failed" in own.message
    assert "Retry-After" not in error_response(own, openai=True).headers
    down = error_of(asyncio.run, engine_errors(failing(EngineError("the agents are restarting"))))
    assert (down.status, down.error_type) == (503, "engine_error")
    assert error_response(down, openai=False).headers["Retry-After"] == "1"
    event = openai_stream_error(SequenceError("post-processing its output failed"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "generation_failed"
