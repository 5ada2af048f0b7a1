"""Tool calling on the chat route (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``).

The tools go to the model's chat template (its ``tools`` variable, as transformers' ``apply_chat_template`` passes
them); what the model answers is read back as tool calls:
- ``tool_choice`` a named function: the answer is held to that function's ``parameters`` schema (structured output,
  ``core.grammar``) and is the call's ``arguments``; it finishes with "stop", as OpenAI and vLLM answer a forced
  function;
- ``"required"``: held to a JSON list of calls ``[{"name": ..., "arguments": {...}}]`` of one to
  ``MAX_PARALLEL_CALLS`` calls (one when ``parallel_tool_calls`` is false), each name one of the tools and its
  arguments that tool's schema. The bound lets a small model that keeps choosing "," end (it otherwise wrote calls
  until max_tokens); an answer cut short before its list closes is an error, as vLLM's validation answers it;
- ``"auto"`` (the default with tools): free text, read as calls where it is one, as the open models write them: Hermes'
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Qwen 2.5/3, Hermes), or an answer that is one
  JSON object ``{"name": ..., "arguments"|"parameters": ...}`` naming a tool (Llama 3.1's JSON tool calling);
  anything else is content;
- ``"none"``: no calls are read.
Other answers with calls have ``finish_reason`` "tool_calls" and ``content`` the text outside the calls (null if
none).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llm_serving.api.errors import invalid
from llm_serving.core.sequence import OutputConstraint
from llm_serving.describe import json_kind

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls in one "required" answer: past what one turn asks for, so a looping model ends
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_ARGUMENTS = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]  # the arguments' JSON schema
    spec: Mapping[str, Any]  # the tool as sent (``{"type": "function", "function": {...}}``), for the template


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how it lets the model use them (``choice``: none, auto, required or function)."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None  # the named function of choice "function" (and of no other choice)
    parallel: bool = True

    def __post_init__(self) -> None:
        if (self.choice == "function") != (self.function is not None):
            raise ValueError(f"tool choice {self.choice!r} with function {self.function!r}: a function is named "
                             "exactly by choice 'function'")

    def template_tools(self) -> list[Mapping[str, Any]] | None:
        return [t.spec for t in self.tools] or None

    def constraint(self) -> OutputConstraint | None:
        """What the answer is held to: a named function's arguments, or the list of calls ``required`` asks for."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.function)
            return OutputConstraint("json", json.dumps(tool.parameters), "tool_choice")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                  "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        return OutputConstraint("json", json.dumps(schema), "tool_choice")

    @property
    def finish_reason(self) -> str:
        """An answer with calls: "stop" for a named function (OpenAI's and vLLM's), "tool_calls" otherwise."""
        return "stop" if self.choice == "function" else "tool_calls"

    def check_finished(self, reason: str) -> None:
        """``required`` must answer calls: one ended by its token limit before the list closed is a 400 (vLLM
        refuses it too) rather than raw JSON text in ``content``."""
        if self.choice == "required" and reason == "length":
            raise invalid("tool_choice 'required': the answer reached max_tokens before its list of tool calls was "
                          "complete; raise max_tokens", "max_tokens")

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content (None when it is all calls) and its tool calls in OpenAI's shape."""
        if self.function is not None:  # choice "function"
            return None, [tool_call(self.function, text)]
        if self.choice == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut short by max_tokens: no complete list to read
                return text, []
            return None, [tool_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        if self.choice == "auto":
            return self._read_free_text(text)
        return text, []

    def _read_free_text(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        names = {t.name for t in self.tools}
        found = [c for c in (_call_of(m.group(1), names) for m in _HERMES_CALL.finditer(text)) if c is not None]
        if found:
            rest = _HERMES_CALL.sub("", text).strip()
            return rest or None, found
        whole = _call_of(text.strip(), names)
        return (None, [whole]) if whole is not None else (text, [])


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_of(text: str, names: set[str]) -> dict[str, Any] | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}`` naming one of ``names``, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        return tool_call(obj["name"], args)
    return tool_call(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """``tools``/``tool_choice``/``parallel_tool_calls`` of a chat body; None when no tool can be called."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {json_kind(parallel)}", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools to choose from", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} tools, got {json_kind(raw)}", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools have the same function name twice", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice or "auto", parallel=parallel is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise invalid(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": one of {names}}}}}, got {json.dumps(choice)[:200]}", "tool_choice")
    return ToolRequest(tools, "function", name, parallel is not False)


def _tool(raw: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict):
        raise invalid(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                      f"\"parameters\"}}}}, got {json_kind(raw)}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {json_kind(name)}", "tools")
    params = fn.get("parameters", _ANY_ARGUMENTS)
    if not isinstance(params, dict):
        raise invalid(f"{where}.function.parameters must be a JSON schema object, got {json_kind(params)}", "tools")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise invalid(f"{where}.function has unknown key(s) {sorted(unknown)}", "tools")
    return Tool(name, params, raw)
