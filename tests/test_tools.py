"""Tool calling on the chat route: the tools reach the chat template, a named function or ``required`` holds the
answer to valid calls (structured output), ``auto`` reads the calls open models write (Hermes' ``<tool_call>``
blocks, Llama 3.1's JSON) and leaves other text as content; calls come back in OpenAI's shape (streamed: a named
function's arguments as they come, other calls as one delta); history with calls and tool results reaches the
template; bad tools are 400s. The real tiny model (random weights) through the official openai client."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from llm_serving.api.tools import ToolRequest, parse_tools
from llm_serving.request_errors import ApiError
from llm_serving.tokenization.chat_template import ChatTemplate, check_messages
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer
from tests.tiny_engine import openai_client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)


def test_auto_reads_hermes_blocks_and_llama_json_and_leaves_text_alone():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    assert tools.choice == "auto" and tools.constraint() is None
    content, calls = tools.read('Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
                                '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
                                '"unit": "C"}}</tool_call>')
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = tools.read('{"name": "get_time", "parameters": {"zone": "CET"}}')  # Llama 3.1's JSON
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    for text in ("It is sunny.", '{"name": "unknown_tool", "arguments": {}}', "<tool_call>not json</tool_call>"):
        assert tools.read(text) == (text, [])
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).read('{"name": "get_weather"}')[1] == []
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.choice == "function" and named.read('{"city": "Oslo"}')[1][0]["function"]["name"] == "get_weather"
    for choice, function in (("auto", "get_weather"), ("function", None)):  # a function is named by that choice only
        with pytest.raises(ValueError, match="exactly by choice 'function'"):
            ToolRequest(named.tools, choice, function)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "must be 1-64 letters"),
    ({"tools": [WEATHER, WEATHER]}, "the same function name twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "one of ['get_weather']"),
    ({"tools": [{"type": "retrieval"}]}, "must be {\"type\": \"function\""),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
])
def test_bad_tools_are_400s(body, message):
    with pytest.raises(ApiError, match=re.escape(message)) as err:
        parse_tools(body)
    assert err.value.status == 400


def test_tools_and_calls_in_the_history_reach_the_template(tmp_path):
    tok = Tokenizer(train_tokenizer(tmp_path / "sp", 1000))
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                            "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                            "({{ c.function.name }} {{ c.function.arguments.city }}){% endfor %}"
                            "{{ m.tool_call_id or '' }};{% endfor %}", "test", tok)
    history = check_messages([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    assert template.render(history, tools=[WEATHER, TIME]) == (
        "[get_weather][get_time]user:What is the weather in Paris?;assistant:(get_weather Paris);tool:18 Ccall_1;")


def test_a_named_function_and_required_give_valid_calls(tiny_server):
    client = openai_client(tiny_server)
    named = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=60, temperature=0,
                                           tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # a forced function: OpenAI's "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))
    one = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=80, temperature=0.9, seed=5, n=3,
                                         tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    for choice in one.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    streamed = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=60, temperature=0,
                                              tools=[WEATHER, TIME], stream=True,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert deltas[-1].finish_reason == "stop" and len(calls) > 3  # the arguments as they are generated
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_") and calls[1].id is None
    assert "".join(c.function.arguments for c in calls) == named.choices[0].message.tool_calls[0].function.arguments
    buffered = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=80, temperature=0, stream=True,
                                              tools=[WEATHER, TIME], tool_choice="required")
    deltas = [c.choices[0] for c in buffered if c.choices]
    (call,) = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]  # one delta with the calls, at the end
    assert deltas[-1].finish_reason == "tool_calls" and call[0].index == 0
    jsonschema.validate(json.loads(call[0].function.arguments), schema_of(call[0].function.name))
    free = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=8, temperature=0,
                                          tools=[WEATHER])  # auto: the random model writes no call
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="cannot hold it too"):
        client.chat.completions.create(model="llama2", messages=ASK, max_tokens=8, tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"})


def test_tokenize_takes_the_tools_as_the_chat_route_does(standin_server):
    import urllib.error
    import urllib.request

    def tokenize(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{standin_server.url}/tokenize", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    status, plain = tokenize({"messages": ASK})
    assert status == 200
    status, with_tools = tokenize({"messages": ASK, "tools": [WEATHER]})
    assert status == 200 and with_tools["tokens"] == plain["tokens"]  # the Llama-2 format has no place for tools
    status, bad = tokenize({"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert status == 400 and "tools[0].function.name" in bad["error"]["message"]


def test_required_with_the_shipped_model_answers_tool_calls(tmp_path):
    """The embedded trained model, which never closes an open-ended list of calls itself: ``required`` ends
    within ``MAX_PARALLEL_CALLS`` calls with finish_reason "tool_calls", each call valid; an answer cut short by
    max_tokens is a 400 naming max_tokens (vLLM refuses unreadable calls), not raw JSON in ``content``."""
    from test_server import ServerProcess

    from llm_serving.api.tools import MAX_PARALLEL_CALLS
    from tests.tiny_engine import set_args

    server = ServerProcess(tmp_path, *set_args({"default_model.weights": "trained", "model_config.seq_length": [512],
                                                "pa_config.decode_seq_length": 1024,
                                                "model_config.prefill_batch_size": [1],
                                                "model_config.decode_batch_size": [2]}))
    try:
        client = openai_client(server)
        done = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=500, temperature=0,
                                              tools=[WEATHER, TIME], tool_choice="required")
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model="llama2", messages=ASK, max_tokens=5, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice="required")
        stream = client.chat.completions.create(model="llama2", messages=ASK, max_tokens=5, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice="required", stream=True)
        with pytest.raises(openai.APIError, match="max_tokens"):  # streamed: the error event ends it
            chunks = list(stream)
            raise AssertionError(f"the stream ended without its error: {chunks[-1]}")
    finally:
        assert server.stop() == 0, server.output
