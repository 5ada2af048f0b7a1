"""Request parsing/validation (api.schema), the admission check, stop strings and the metrics text format,
without a server."""

from __future__ import annotations

import random

import pytest

from llm_serving.api.chat_schema import parse_chat
from llm_serving.api.metrics import ServerMetrics
from llm_serving.api.openai_routes import OPENAI_FINISH
from llm_serving.api.schema import (
    CompletionRequest,
    GenerateRequest,
    parameter_error,
    parse_completion,
    parse_generate,
    parse_json,
)
from llm_serving.api.tgi_routes import TGI_FINISH
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import FINISH_REASONS, SAMPLING_RANGES, SamplingParams
from llm_serving.engine.admission import RequestLimits
from llm_serving.engine.stop_strings import StopMatcher, cut_at_stop
from llm_serving.request_errors import AdmissionError, ApiError, InvalidParameter, RequestRejected

LIMITS = RequestLimits(max_new_tokens=100, max_model_len=128, vocab_size=1000)


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# ---- llm-serving body ----------------------------------------------------------------------------------------
def test_generate_body_with_string_booleans_and_numbers():
    req = parse_generate({"inputs": "hi", "stream": "True", "parameters": {
        "max_new_tokens": "7", "do_sample": "False", "top_k": "1", "top_p": "0.8", "temperature": 0.7,
        "return_full_text": "True", "details": "false", "seed": 3, "stop": "\n", "repetition_penalty": 1.0}},
)
    assert (req.inputs, req.max_new_tokens, req.stream, req.return_full_text, req.details) == ("hi", 7, True,
                                                                                               True, False)
    assert req.stop == ("\n",) and req.sampling.top_p == 0.8 and req.sampling.seed == 3
    assert not req.sampling.wants_sampling
    assert parse_generate({"inputs": "x"}).max_new_tokens is None
    assert parse_generate({"inputs": "x", "stream": False}, stream=True).stream  # the route decides
    assert parse_generate({"inputs": "x", "sse": True}).sse


@pytest.mark.parametrize("body, param, status", [
    ([1, 2], None, 400),
    ({}, "inputs", 400),
    ({"inputs": 5}, "inputs", 400),
    ({"inputs": ""}, "inputs", 400),
    ({"inputs": "x", "parameters": []}, None, 400),
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
    ({"inputs": "x", "parameters": {"max_new_token": 5}}, "max_new_token", 400),
    ({"inputs": "x", "prompt": "y"}, "prompt", 400),
    ({"inputs": "x", "stream": "maybe"}, "stream", 400),
    ({"inputs": "x", "parameters": {"watermark": True}}, "watermark", 422),
])
def test_generate_body_errors_name_the_parameter(body, param, status):
    err = error_of(parse_generate, body)
    assert err.status == status and err.param == param
    if param:
        assert param in err.message
    if status == 422:
        assert "not supported" in err.message


def generate_params(parameters: dict, max_new: int = 9) -> SamplingParams:
    return parse_generate({"inputs": "x", "parameters": parameters}).sampling.to_params(max_new)


def engine_checked(body: dict, completion: bool = False, prompt_len: int = 10) -> SamplingParams:
    """A body's engine parameters through the engine's checks (SamplingParams' values, then the admission
    check with the HTTP routes' clip), refusals named as the route does (``Server.start_generation``)."""
    req = parse_completion(body) if completion else parse_generate(body)
    if completion:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default, as the route sends it
        params = req.sampling.to_params(max_tokens, req.ignore_eos, req.stop, req.FIELD_NAMES)
    else:
        max_new = LIMITS.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens
        params = req.sampling.to_params(max_new, stop=req.stop, field_names=req.FIELD_NAMES)
    try:
        return LIMITS.admit([1] * prompt_len, params, clip_to_context=True)
    except InvalidParameter as exc:
        raise parameter_error(exc, req.FIELD_NAMES) from None


@pytest.mark.parametrize("body, completion, param, in_message", [
    ({"inputs": "x", "parameters": {"max_new_tokens": -1}}, False, "max_new_tokens", "must be >= 1, got -1"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, False, "max_new_tokens", "must be >= 1, got 0"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 10**9}}, False, "max_new_tokens",
     "1000000000 exceeds model_config.max_generate_length 100"),
    ({"inputs": "x", "parameters": {"stop": [""]}}, False, "stop", "every stop string must have 1..256"),
    ({"inputs": "x", "parameters": {"stop": ["s"] * 17}}, False, "stop", "has 17 strings; at most 16"),
    ({"prompt": "x", "temperature": 0, "max_tokens": 0}, True, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"prompt": "x", "temperature": 0, "max_tokens": 101}, True, "max_tokens",
     "max_tokens 101 exceeds model_config.max_generate_length 100"),
    ({"prompt": "x", "temperature": 0, "stop": "s" * 257}, True, "stop", "every stop string must have 1..256"),
])
def test_engine_checked_values_are_refused_under_the_dialects_name(body, completion, param, in_message):
    err = error_of(engine_checked, body, completion)
    assert (err.status, err.param, err.error_type) == (400, param, "invalid_request")
    assert in_message in err.message and param in err.message


@pytest.mark.parametrize("parameters, expected", [
    ({}, SamplingParams(9)),
    # do_sample false is greedy whatever the sampling knobs say; a repetition penalty still applies (as in HF)
    ({"do_sample": False, "temperature": 0.9, "top_k": 5, "top_p": 0.5, "seed": 4},
     SamplingParams(9, seed=4)),
    ({"repetition_penalty": "1.2"}, SamplingParams(9, repetition_penalty=1.2)),
    # do_sample true without a temperature: Hugging Face's default temperature 1.0
    ({"do_sample": True}, SamplingParams(9, temperature=1.0)),
    # temperature 0 is greedy on every route, do_sample or not
    ({"do_sample": "True", "temperature": 0}, SamplingParams(9)),
    ({"do_sample": True, "temperature": "0", "top_k": 5, "seed": 2}, SamplingParams(9, seed=2)),
    ({"do_sample": "true", "temperature": "0.7", "top_k": "40", "top_p": 0.9, "repetition_penalty": 1.1,
      "seed": "12"}, SamplingParams(9, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=12)),
])
def test_generate_sampling_maps_to_engine_params(parameters, expected):
    params = generate_params(parameters)
    assert params == expected
    assert params.needs_logits == (expected.temperature > 0 or expected.repetition_penalty != 1.0)
    assert parse_generate({"inputs": "x", "parameters": parameters}).sampling.wants_sampling == (
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
                            "ignore_eos": True, "n": 1, "presence_penalty": 0})
    assert (req.model, req.prompts, req.max_tokens, req.stream) == ("m", ("hi",), 5, True)
    assert req.usage.include_usage
    assert req.stop == ("a", "b") and req.logprobs == 1 and req.ignore_eos
    assert parse_completion({"prompt": [1, 2, 3], "temperature": 0}).prompts == ((1, 2, 3),)
    assert parse_completion({"prompt": ["a", [5]], "temperature": 0}).prompts == ("a", (5,))
    assert parse_completion({"prompt": "a", "temperature": 0}).max_tokens is None  # the route: 16, clipped


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
    req = parse_completion({"prompt": "x", "max_tokens": 5, **body})
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
    ({"prompt": "x", "logprobs": 6}, "logprobs", 400),  # OpenAI's range is 0..5
    ({"temperature": 0}, "prompt", 400),
    ({"prompt": "", "temperature": 0}, "prompt", 400),
    ({"prompt": [], "temperature": 0}, "prompt", 400),
    ({"prompt": [[1], "x", 3], "temperature": 0}, "prompt", 400),
    ({"prompt": "x", "temperature": 0, "max_tokens": "5"}, "max_tokens", 400),
    ({"prompt": "x", "temperature": 0, "n": 0}, "n", 400),
    ({"prompt": "x", "temperature": 0, "n": 3, "best_of": 2}, "best_of", 400),
    ({"prompt": "x", "temperature": 0, "frequency_penalty": 2.5}, "frequency_penalty", 400),
    ({"prompt": "x", "temperature": 0, "logit_bias": {"a": 1}}, "logit_bias", 400),
    ({"prompt": "x", "temperature": 0, "stop_token_ids": "2"}, "stop_token_ids", 400),
    ({"prompt": "x", "temperature": 0, "min_p": 1.5}, "min_p", 400),
    ({"prompt": "x", "temperature": 0, "stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"prompt": "x", "temperature": 0, "bogus": 1}, "bogus", 400),
])
def test_completion_body_errors(body, param, status):
    err = error_of(parse_completion, body)
    assert err.status == status and err.param == param


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "echo": "true"}, "echo must be a boolean (true/false), got \"true\" (str)"),
    ({"prompt": "x", "max_tokens": 5.0}, "max_tokens must be an integer, got 5.0 (float)"),
    ({"prompt": "x", "seed": 2**63}, f"seed is too large: {2**63}"),
    ({"prompt": "x", "temperature": True}, "temperature must be a finite number, got true (bool)"),
    ({"prompt": "x", "model": 3}, "model must be a string, got 3 (int)"),
    ({"prompt": "x", "top_p": 0}, "top_p must be > 0, got 0"),
    ({"prompt": "x", "top_k": 2**31}, f"top_k must be <= {2**31 - 1}, got {2**31}"),
    ({"prompt": "x", "user": "u" * 1025}, "user has 1025 characters; at most 1024"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage must be a boolean (true/false), got 1 (int)"),
    ({"prompt": "x", "stream": True, "stream_options": []}, "'stream_options' must be a JSON object, got [] (list)"),
    ([], "the request body must be a JSON object, got [] (list)"),
])
def test_completion_body_errors_quote_the_value_and_the_bound(body, message):
    assert error_of(parse_completion, body).message == message


def test_unknown_keys_are_listed_by_the_names_they_are_sent_under():
    err = error_of(parse_completion, {"prompt": "x", "prompts": ["y"], "max_token": 3})
    assert (err.param, err.error_type) == ("prompts", "invalid_request")
    assert err.message.startswith("the request body has unknown key(s) 'prompts', 'max_token'; known keys: ")
    known = err.message.split("known keys: ")[1].split(", ")
    assert {"prompt", "best_of", "stream_options", "kv_transfer_params"} <= set(known)
    assert not {"prompts", "best_of_sent", "usage", "kv_transfer"} & set(known)
    err = error_of(parse_completion, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True,
                                                                                       "usage": True}})
    assert err.param == "usage" and err.message == ("'stream_options' has unknown key(s) 'usage'; known keys: "
                                                    "include_usage, continuous_usage_stats")


def test_null_means_absent():
    nulls = {key: None for key in ("model", "temperature", "top_p", "n", "best_of", "stop", "stream",
                                   "stream_options", "echo", "logprobs", "logit_bias", "user", "kv_transfer_params")}
    req = parse_completion({"prompt": "x", **nulls})
    assert req == parse_completion({"prompt": "x"})
    assert (req.n, req.best_of, req.stop, req.stream, req.usage.include_usage) == (1, 1, (), False, False)
    assert req.sampling.to_params(5) == SamplingParams(5, temperature=1.0)
    assert error_of(parse_completion, {"prompt": None}).message == "missing 'prompt'"


@pytest.mark.parametrize("key", [k for k in SAMPLING_RANGES if k != "temperature"])
def test_openai_ranges_are_the_engines(key):
    """Each sampling key is refused just past the engine's bound (``SAMPLING_RANGES``) and taken at it."""
    r = SAMPLING_RANGES[key]
    step = 1 if key == "top_k" else 1e-9
    for bound, outside in ((r.lo, -step), (r.hi, step)):
        if bound is None:
            continue
        if not r.lo_open or bound != r.lo:
            parse_completion({"prompt": "x", key: bound})
        assert error_of(parse_completion, {"prompt": "x", key: bound + outside}).param == key
    if r.lo_open:
        assert error_of(parse_completion, {"prompt": "x", key: r.lo}).param == key


def test_chat_body():
    user = [{"role": "user", "content": "hi"}]
    req = parse_chat({"messages": user, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
                      "temperature": 0})
    assert (req.messages, req.max_tokens, req.top_logprobs, req.tools) == ((user[0],), 7, 2, None)
    assert req.field_names == {"max_new_tokens": "max_completion_tokens", "prompt": "messages"}
    req = parse_chat({"messages": user, "max_tokens": 5, "max_completion_tokens": 5})
    assert req.max_tokens == 5
    assert parse_chat({"messages": user, "max_tokens": 4}).field_names["max_new_tokens"] == "max_tokens"
    assert parse_chat({"messages": user}).max_tokens is None  # the context's, up to max_generate_length
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "f"}}
    req = parse_chat({"messages": user, "tools": [tool], "tool_choice": named})
    assert req.tools is not None and req.sampling.constraint is not None
    assert req.sampling.constraint.field == "tool_choice"
    err = error_of(parse_chat, {"messages": user, "tools": [tool], "tool_choice": named,
                                "response_format": {"type": "json_object"}})
    assert err.param == "response_format" and "cannot hold it too" in err.message
    err = error_of(parse_chat, {"messages": user, "best_of": 2})
    assert err.param == "best_of" and "unknown key" in err.message  # a completions key
    err = error_of(parse_chat, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert (err.param, err.error_type) == ("messages", "unsupported")


# ---- the admission check ----------------------------------------------------------------------------------------
def test_admission_clips_to_the_context_only_when_asked_and_refuses_long_prompts():
    params = SamplingParams(5)
    assert LIMITS.admit([1] * 10, params) is params
    assert LIMITS.admit([1] * 10, SamplingParams(100), clip_to_context=True).max_new_tokens == 100
    clipped = LIMITS.admit([1] * 60, SamplingParams(100, stop="x"), clip_to_context=True)
    assert clipped == SamplingParams(68, stop="x")  # clipped: 60 + 68 = max_model_len
    with pytest.raises(RequestRejected, match=r"prompt \(60 tokens\) \+ max_new_tokens \(100\) = 160 exceeds "
                                              "max_model_len 128"):
        LIMITS.admit([1] * 60, SamplingParams(100))  # offline: refused, not clipped
    # any prompt shorter than the model length is served, whatever the prefill buckets (chunked prefill)
    assert LIMITS.admit([1] * 127, SamplingParams(100), clip_to_context=True).max_new_tokens == 1
    for n, kind in ((128, "prompt_too_long"), (0, "invalid_request")):
        with pytest.raises(AdmissionError) as info:
            LIMITS.admit([1] * n, params, clip_to_context=True)
        assert (info.value.field, info.value.error_type) == ("prompt", kind)
        err = parameter_error(info.value, GenerateRequest.FIELD_NAMES)
        assert (err.status, err.error_type, err.param) == (400, kind, "inputs") and "inputs" in err.message
    with pytest.raises(AdmissionError, match=r"prompt token ids \[1000, -1\] are outside the vocabulary 0..999"):
        LIMITS.admit([1, 1000, -1], params)
    cfg = ServingConfig()
    limits = RequestLimits.from_config(cfg, 1000)
    assert (limits.max_new_tokens, limits.max_model_len) == (
        cfg.model_config.max_generate_length, cfg.pa_config.decode_seq_length)
    assert CompletionRequest.FIELD_NAMES["max_new_tokens"] == "max_tokens"


def test_finish_reasons_have_a_name_in_each_api():
    assert set(TGI_FINISH) == set(OPENAI_FINISH) == set(FINISH_REASONS)


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


def test_cut_at_stop_cuts_where_the_matcher_stops():
    assert cut_at_stop("a b\n\nUser: x", ("\n\nUser", "zz")) == "a b"
    assert cut_at_stop("a b\n", ("\n\nUser",)) == "a b\n"


# ---- metrics --------------------------------------------------------------------------------------------------
def scrape(m: ServerMetrics) -> tuple[str, dict[str, float]]:
    """The exposition text and its samples (``name{labels}`` -> value); every sample line is name value."""
    text = m.render().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value.replace("+Inf", "inf"))
            assert name.split("{")[0].removeprefix("vllm:").replace("_", "").isalnum()
    return text, samples


def test_metrics_text_format():
    stats = {"num_waiting": 3, "num_running": 5, "kv_blocks_used": 7, "kv_blocks_free": 9, "ready": True,
             "new key!": 1.5, "note": "not a number"}
    m = ServerMetrics(lambda: stats, lambda: 4)
    m.requests.labels("success").inc(2)
    m.requests.labels("rejected").inc()
    m.ttft.observe(0.03)
    m.ttft.observe(100.0)
    text, samples = scrape(m)
    expected = {
        'llm_serving_requests_total{outcome="success"}': 2, 'llm_serving_requests_total{outcome="rejected"}': 1,
        'llm_serving_requests_total{outcome="aborted"}': 0,
        'llm_serving_time_to_first_token_seconds_bucket{le="0.025"}': 0,
        'llm_serving_time_to_first_token_seconds_bucket{le="0.05"}': 1,
        'llm_serving_time_to_first_token_seconds_bucket{le="60.0"}': 1,
        'llm_serving_time_to_first_token_seconds_bucket{le="+Inf"}': 2,
        "llm_serving_time_to_first_token_seconds_count": 2, "llm_serving_queue_length": 3,
        "llm_serving_running_batch_size": 5, "llm_serving_kv_blocks_used": 7, "llm_serving_kv_blocks_free": 9,
        "llm_serving_engine_ready": 1, "llm_serving_engine_new_key_": 1.5, "llm_serving_requests_in_flight": 4,
    }
    expected.update({f'llm_serving_request_finish_total{{reason="{r}"}}': 0 for r in FINISH_REASONS})
    assert {name: samples.get(name) for name in expected} == expected
    assert "# TYPE llm_serving_running_batch_size gauge" in text.splitlines()
    assert "note" not in text


def test_metrics_of_two_servers_in_one_process_are_separate():
    a, b = ServerMetrics(), ServerMetrics(lambda: {"steps": 4})
    a.requests.labels("success").inc()
    a.prompt_tokens.inc(12)
    _, sa = scrape(a)
    _, sb = scrape(b)
    assert sa['llm_serving_requests_total{outcome="success"}'] == 1 and sa["llm_serving_prompt_tokens_total"] == 12
    assert sb['llm_serving_requests_total{outcome="success"}'] == 0 and sb["llm_serving_prompt_tokens_total"] == 0
    assert sb["llm_serving_engine_steps_total"] == 4 and "llm_serving_engine_steps_total" not in sa
