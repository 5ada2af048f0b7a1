"""The OpenAI chat completions body (``/v1/chat/completions``), parsed strictly as OpenAI documents it.

It shares the completions body's conventions (``schema``): unknown keys are errors, OpenAI's default
temperature is 1, vLLM's ``top_k``/``repetition_penalty``/``ignore_eos`` are accepted, the engine's own
checks name the field as this body calls it. ``max_completion_tokens`` is OpenAI's current name for
``max_tokens``; without either, a chat answer may fill the context (up to ``model_config.max_generate_length``).
Structured output (``response_format`` and vLLM's keys) is ``structured_schema``'s, tools ``tools``'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llm_serving.api.schema import (
    MAX_CHOICES,
    OPENAI_SAMPLING_KEYS,
    KvTransferParams,
    SamplingOptions,
    StreamUsage,
    _no_unknown,
    _object,
    _Reader,
    invalid,
    openai_sampling,
    parse_kv_transfer,
    parse_stream_options,
    unsupported,
)
from llm_serving.api.structured_schema import STRUCTURED_KEYS
from llm_serving.api.tools import ToolRequest, parse_tools
from llm_serving.core.logprobs import MAX_TOP_LOGPROBS
from llm_serving.request_errors import MessageError
from llm_serving.tokenization.chat_template import check_messages

_CHAT_KEYS = ("model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
              "logprobs", "top_logprobs", "user", *OPENAI_SAMPLING_KEYS, "tools",
              "tool_choice", "parallel_tool_calls", *STRUCTURED_KEYS, "kv_transfer_params")


@dataclass(frozen=True)
class ChatRequest:
    """An OpenAI chat completions body; ``messages`` as ``chat_template.check_messages`` returns them."""

    model: str | None
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None  # None: as many as the context allows, up to model_config.max_generate_length
    sampling: SamplingOptions
    field_names: Mapping[str, str]  # engine field -> this body's name (max_tokens or max_completion_tokens)
    stop: tuple[str, ...] = ()
    stream: bool = False
    usage: StreamUsage = field(default_factory=StreamUsage)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, the model's most likely tokens there
    ignore_eos: bool = False
    n: int = 1  # choices
    tools: ToolRequest | None = None  # the tools the model may call (``api.tools``); None: no calls are read
    kv_transfer: KvTransferParams | None = None  # prefill/decode disaggregation (``kv_transfer_params``)


def parse_chat(body: Any) -> ChatRequest:
    """Validate a chat completions body; bad messages (tools, images included) are a 400 naming the message."""
    body = _object(body, "the request body")
    _no_unknown(body, _CHAT_KEYS, "the request body")
    r = _Reader(body, "", lenient=False)
    model = r.str("model")
    if body.get("messages") is None:
        raise invalid("missing 'messages': the conversation, a list of {\"role\", \"content\"} objects", "messages")
    try:
        messages = tuple(check_messages(body["messages"]))
    except MessageError as exc:
        if exc.unsupported:
            raise unsupported(str(exc), "messages") from None
        raise invalid(str(exc), "messages") from None
    max_tokens, max_name = _max_tokens(r)
    sampling = openai_sampling(body, r)
    n = r.int("n", lo=1, hi=MAX_CHOICES) or 1
    tools = parse_tools(body)
    held = tools.constraint() if tools is not None else None
    if held is not None:
        if sampling.constraint is not None:
            raise invalid(f"tool_choice {tools.choice} holds the answer to tool calls; {sampling.constraint.field} "
                          "cannot hold it too", sampling.constraint.field)
        sampling = replace(sampling, constraint=held)
    r.str("user")
    logprobs, top_logprobs = _logprobs(r)
    stream = r.bool("stream", False)
    return ChatRequest(
        model=model, messages=messages, max_tokens=max_tokens, sampling=sampling,
        field_names={"max_new_tokens": max_name, "prompt": "messages"}, stop=r.stop("stop"), stream=stream,
        usage=parse_stream_options(body, stream), logprobs=logprobs, top_logprobs=top_logprobs,
        ignore_eos=r.bool("ignore_eos", False), n=n, tools=tools, kv_transfer=parse_kv_transfer(body, stream, n),
    )


def _max_tokens(r: _Reader) -> tuple[int | None, str]:
    """The answer's token limit and the name it was sent under (its value is the engine's to check)."""
    new, old = r.int("max_completion_tokens"), r.int("max_tokens")
    if new is not None and old is not None and new != old:
        raise invalid(f"max_completion_tokens ({new}) and max_tokens ({old}) disagree; send one of them",
                      "max_completion_tokens")
    if new is not None:
        return new, "max_completion_tokens"
    return old, "max_tokens"


def _logprobs(r: _Reader) -> tuple[bool, int]:
    """``logprobs`` and ``top_logprobs`` (alternatives per position, from the model's raw distribution)."""
    logprobs = r.bool("logprobs", False)
    top = r.int("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
    return logprobs, top or 0
