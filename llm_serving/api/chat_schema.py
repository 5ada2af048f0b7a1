"""The OpenAI chat completions body (``/v1/chat/completions``), parsed strictly as OpenAI documents it.

It shares the completions body's keys and conventions (``schema.OpenAIBody``): unknown keys are errors, OpenAI's
default temperature is 1, vLLM's ``top_k``/``repetition_penalty``/``ignore_eos`` are accepted, the engine's own
checks name the field as this body calls it. ``max_completion_tokens`` is OpenAI's current name for
``max_tokens``; without either, a chat answer may fill the context (up to ``model_config.max_generate_length``).
Structured output (``response_format`` and vLLM's keys) is ``structured_schema``'s, tools ``tools``'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, field_validator

from llm_serving.api.body_model import Int64, NonNegInt64, refuse, validate_body
from llm_serving.api.schema import OpenAIBody
from llm_serving.api.tools import ToolRequest, parse_tools
from llm_serving.core.logprobs import MAX_TOP_LOGPROBS
from llm_serving.describe import json_kind
from llm_serving.request_errors import MessageError
from llm_serving.tokenization.chat_template import RESERVED_VARIABLES, check_messages


class ChatRequest(OpenAIBody):
    """An OpenAI chat completions body; ``messages`` as ``chat_template.check_messages`` returns them."""

    messages: tuple[dict[str, Any], ...] = Field(default=None, validate_default=True)
    max_tokens_sent: Int64 | None = Field(default=None, alias="max_tokens")  # the values are the engine's to check
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # alternatives per position
    tools_sent: Any = Field(default=None, alias="tools")  # ``api.tools`` reads these three
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # further variables of the chat template (vLLM's key), e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: reasoning tokens before ``</think>`` is forced (``core.thinking_budget``; needs a reasoning parser)
    thinking_token_budget: NonNegInt64 | None = None
    _tools: ToolRequest | None = PrivateAttr(default=None)

    @property
    def max_tokens(self) -> int | None:
        """The answer's token limit; None: as many as the context allows, up to model_config.max_generate_length."""
        return self.max_tokens_sent if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def field_names(self) -> Mapping[str, str]:
        """Engine field -> this body's name (the token limit's as it was sent)."""
        sent = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"max_new_tokens": sent, "prompt": "messages"}

    @property
    def tools(self) -> ToolRequest | None:
        """The tools the model may call (``api.tools``); None: no calls are read."""
        return self._tools

    @field_validator("messages", mode="plain")
    @classmethod
    def _messages(cls, messages: Any) -> tuple[dict[str, Any], ...]:
        """Bad messages (tools, images included) are a 400 naming the message."""
        if messages is None:
            raise refuse("missing 'messages': the conversation, a list of {\"role\", \"content\"} objects")
        try:
            return tuple(check_messages(messages))
        except MessageError as exc:
            raise refuse(str(exc), unsupported=exc.unsupported) from None

    @field_validator("chat_template_kwargs", mode="plain")
    @classmethod
    def _template_kwargs(cls, kwargs: Any) -> dict[str, Any] | None:
        if kwargs is None:
            return None
        if not isinstance(kwargs, dict):
            raise refuse(f"{{field}} must be an object of template variables, got {json_kind(kwargs)}")
        taken = sorted(set(kwargs) & set(RESERVED_VARIABLES))
        if taken:
            raise refuse(f"{{field}} may not set {', '.join(taken)}: the server gives the template those")
        return kwargs

    def _check(self) -> None:
        new, old = self.max_completion_tokens, self.max_tokens_sent
        if new is not None and old is not None and new != old:
            raise refuse(f"max_completion_tokens ({new}) and max_tokens ({old}) disagree; send one of them",
                         "max_completion_tokens")
        if "top_logprobs" in self.model_fields_set and not self.logprobs:
            raise refuse("top_logprobs needs logprobs=true", "top_logprobs")

    def _finish(self) -> None:
        tools = self._tools = parse_tools({"tools": self.tools_sent, "tool_choice": self.tool_choice,
                                           "parallel_tool_calls": self.parallel_tool_calls})
        held = tools.constraint() if tools is not None else None
        if self.thinking_token_budget is not None and (held is not None or self._sampling.constraint is not None):
            taken = "tool_choice" if held is not None else self._sampling.constraint.field  # type: ignore[union-attr]
            raise refuse(f"thinking_token_budget and {taken} both hold the answer; send one of them",
                         "thinking_token_budget")
        if tools is None or held is None:
            return
        if self._sampling.constraint is not None:
            raise refuse(f"tool_choice {tools.choice} holds the answer to tool calls; "
                         f"{self._sampling.constraint.field} cannot hold it too", self._sampling.constraint.field)
        self._sampling = replace(self._sampling, constraint=held)


def parse_chat(body: Any) -> ChatRequest:
    """Validate a chat completions body."""
    return validate_body(ChatRequest, body)
