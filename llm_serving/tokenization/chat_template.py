"""Chat prompts: a conversation rendered by the model's chat template (Jinja2) and tokenized as transformers does.

The template, first found: the YAML key ``tokenizer.chat_template`` (a Jinja file), ``chat_template.jinja`` or
the ``chat_template`` of ``tokenizer_config.json`` in the model directory, else ``LLAMA2_CHAT_TEMPLATE``. It is
loaded once, on first use, by the ``ServedChatTemplate`` made beside the served tokenizer (``Engine.start``);
every user (the chat and tokenizer routes, ``serve``'s start-up, the offline ``LLM``) takes it from there.

Rendering keeps the contract transformers' ``apply_chat_template`` documents, so the templates that Hugging Face
model directories carry work unchanged: a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``
and loop controls, the variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``unk_token``, ``tools`` (a request's tools, else none; ``documents`` is none), the functions
``raise_exception(message)`` and ``strftime_now(format)``, and a ``tojson`` that keeps non-ASCII text and does not
escape HTML.

The rendered text spells the special tokens (``<s>``, ``</s>``): each becomes its id and the text between them
is encoded without a BOS, as transformers tokenizes it (``add_special_tokens=False``); special tokens typed
inside messages become ids too, as there by default. Whether a text piece after a special token gets
sentencepiece's dummy-prefix space follows the model's ``tokenizer_config.json`` as transformers reads it:
``legacy`` true or absent: every piece gets it (each turn encoded on its own, as Meta's reference does; absent
means false to transformers 5, so a model directory that wants that says so); ``legacy`` false: only text at
the very start; ``add_prefix_space`` false: none. Text pieces are encoded as prompts are on the completions route
(``Tokenizer.encode``, ``sp_prompt``): a piece that starts with a space gets no dummy prefix of its own, as in
transformers 5's converted tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.describe import json_kind
from llm_serving.request_errors import ChatTemplateError, MessageError
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer, HFTokenizer
from llm_serving.tokenization.sp_prompt import PREFIX_SCHEMES

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions
# Keys OpenAI clients send back with an assistant message; accepted when null or empty.
NEUTRAL_MESSAGE_KEYS = ("function_call", "refusal", "audio", "annotations")
# What the server itself gives a template, so a request's chat_template_kwargs may not set them
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
                      "pad_token", "raise_exception")

# The Llama-2 chat format: [INST] turns, the system prompt as a <<SYS>> block inside the first one, each
# exchange between <s> and </s>, contents stripped. Written for llm-serving from the format's description.
LLAMA2_CHAT_TEMPLATE = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = none -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if not turns -%}
    {{- raise_exception('Llama-2 chat needs a user message after the system message') -}}
{%- endif -%}
{%- for message in turns -%}
    {%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
    {%- if message['role'] != expected -%}
        {{- raise_exception('Llama-2 chat: after an optional first system message the roles must alternate '
                            ~ 'user, assistant, user, ...; message ' ~ (loop.index0 + (0 if system is none else 1))
                            ~ ' is ' ~ message['role'] ~ ', expected ' ~ expected) -}}
    {%- endif -%}
    {%- if expected == 'user' -%}
        {%- set text = message['content'] -%}
        {%- if loop.first and system is not none -%}
            {%- set text = '<<SYS>>\n' ~ system ~ '\n<</SYS>>\n\n' ~ text -%}
        {%- endif -%}
        {{- bos_token ~ '[INST] ' ~ (text | trim) ~ ' [/INST]' -}}
    {%- else -%}
        {{- ' ' ~ (message['content'] | trim) ~ ' ' ~ eos_token -}}
    {%- endif -%}
{%- endfor -%}
"""



# ---- messages ----------------------------------------------------------------------------------------------
def check_messages(raw: Any) -> list[dict[str, Any]]:
    """The messages as the template sees them: ``role``, ``content`` (text) and an optional ``name``; an assistant
    message's ``tool_calls`` (each call's ``arguments`` as an object, as transformers' templates read them) and a
    tool message's ``tool_call_id``.

    Null-valued keys are dropped (as transformers does); a content given as text parts is joined with newlines.
    """
    if not isinstance(raw, list) or not raw:
        raise MessageError(f"'messages' must be a non-empty list of message objects, got {json_kind(raw)}")
    return [_check_message(m, i) for i, m in enumerate(raw)]


def _check_message(raw: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise MessageError(f"{where} must be an object with 'role' and 'content', got {json_kind(raw)}")
    msg = {k: v for k, v in raw.items() if v is not None}
    for key in NEUTRAL_MESSAGE_KEYS:
        if msg.pop(key, None) not in (None, [], ""):
            raise MessageError(f"{where}.{key} is not supported (no function_call or audio here)", unsupported=True)
    role = msg.get("role")
    if role == "function":
        raise MessageError(f"{where}.role 'function' is not supported (use tool)", unsupported=True)
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise MessageError(f"{where}.role must be one of {', '.join(ROLES)}, got {json_kind(msg.get('role'))}")
    extra = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}.get(role, ())
    unknown = [k for k in msg if k not in ("role", "content", "name", *extra)]
    if unknown:
        raise MessageError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; known keys: role, "
                           f"content, name{''.join(', ' + k for k in extra)}")
    calls = msg.pop("tool_calls", [])
    if "content" not in msg and not calls:
        raise MessageError(f"{where}.content is missing")
    out: dict[str, Any] = {"role": role, "content": _content(msg.get("content", ""), where)}
    if "name" in msg:
        if not isinstance(msg["name"], str):
            raise MessageError(f"{where}.name must be a string, got {json_kind(msg['name'])}")
        out["name"] = msg["name"]
    if calls:
        out["tool_calls"] = _tool_calls(calls, where)
    if role == "tool":
        if not isinstance(msg.get("tool_call_id"), str):
            raise MessageError(f"{where}.tool_call_id must be the id of the call it answers, got "
                               f"{json_kind(msg.get('tool_call_id'))}")
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, each ``arguments`` JSON text read into an object."""
    if not isinstance(calls, list):
        raise MessageError(f"{where}.tool_calls must be a list, got {json_kind(calls)}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                               f"{{\"name\", \"arguments\"}}}}, got {json_kind(call)}")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise MessageError(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{where}.content must be a string or a list of text parts, got {json_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
            texts.append(part["text"])
        elif isinstance(kind, str) and kind != "text":
            raise MessageError(f"{where}.content[{j}] has type {kind!r}; only text parts are supported",
                               unsupported=True)
        else:
            raise MessageError(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": string}}, got "
                               f"{json_kind(part)}")
    return "\n".join(texts)


# ---- the template --------------------------------------------------------------------------------------------
def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template bound to the served tokenizer; ``origin`` says where it came from.

    Raises ``jinja2.TemplateSyntaxError`` for a template that does not compile.
    """

    def __init__(self, source: str, origin: str, tokenizer: AnyTokenizer, prefix: str = "always") -> None:
        if prefix not in PREFIX_SCHEMES:
            raise ValueError(f"prefix must be one of {PREFIX_SCHEMES}, got {prefix!r}")
        self.source, self.origin, self.prefix = source, origin, prefix
        self._template = _environment().from_string(source)
        self._variables = tokenizer.template_variables()
        # a tokenizers tokenizer matches the special tokens written in the text itself (encode_rendered); a
        # sentencepiece one splits them out with the template's dummy-prefix scheme (sp_prompt)
        self._encode = (tokenizer.encode_rendered if isinstance(tokenizer, HFTokenizer)
                        else tokenizer.prompt_encoder(prefix).encode)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text; ChatTemplateError with the template's message when it refuses the messages. ``extra``:
        further variables (a request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``), never one of
        ``RESERVED_VARIABLES``."""
        try:
            return self._template.render(**(extra or {}), messages=[dict(m) for m in messages], tools=tools,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **self._variables)
        except jinja2.TemplateError as exc:  # raise_exception, an undefined name, a sandbox refusal
            raise ChatTemplateError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the template's own code failed on these messages
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: special-token spellings as their ids, the text between them encoded."""
        return self._encode(text)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The conversation's prompt token ids (``check_messages`` output in, BOS included by the template)."""
        return self.encode(self.render(messages, add_generation_prompt, tools))

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               extra: Mapping[str, Any] | None = None) -> tuple[str, list[int]]:
        """The generation prompt's text (where a reasoning block may open: ``tokenization.reasoning``) and ids."""
        text = self.render(messages, True, tools, extra)
        return text, self.encode(text)


class ServedChatTemplate:
    """The served model's chat template, loaded once, on first use (``get``): the one place it is loaded.

    Made beside the served tokenizer; loading waits for a first use, so a model whose template is bad still
    serves plain prompts (``serve`` asks for it at start-up, so there a bad one stops it).
    """

    def __init__(self, config: ServingConfig, model_path: str | Path, tokenizer: AnyTokenizer) -> None:
        self._config, self._model_path, self._tokenizer = config, model_path, tokenizer
        self._template: ChatTemplate | None = None

    def get(self) -> ChatTemplate:
        """The template (``load_chat_template``: a ConfigError, asked again next time, if it cannot be used)."""
        if self._template is None:
            self._template = load_chat_template(self._config, self._model_path, self._tokenizer)
        return self._template


# ---- where the template comes from -----------------------------------------------------------------------------
def load_chat_template(config: ServingConfig, model_path: str | Path, tokenizer: AnyTokenizer) -> ChatTemplate:
    """The served model's chat template (see the module docstring); a bad one is a ConfigError at start-up."""
    path = Path(model_path)
    model_dir = path if path.is_dir() else path.parent
    src = config.source
    settings, settings_file = {}, model_dir / "tokenizer_config.json"
    if settings_file.is_file():
        settings = _read_json(settings_file, src)
    key = "model_config.model_path"
    if config.tokenizer.chat_template is not None:
        key = "tokenizer.chat_template"
        file = Path(config.tokenizer.chat_template)
        source, origin = _read_text(file, key, src), f"{file} (tokenizer.chat_template)"
    elif (model_dir / "chat_template.jinja").is_file():
        file = model_dir / "chat_template.jinja"
        source, origin = _read_text(file, key, src), str(file)
    elif settings.get("chat_template") is not None:
        source, origin = _named_default(settings["chat_template"], settings_file, src), f"{settings_file}"
    else:
        source, origin = LLAMA2_CHAT_TEMPLATE, "the Llama-2 chat format (default)"
    prefix = _prefix_mode(settings)
    try:
        return ChatTemplate(source, origin, tokenizer, prefix)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{src}: {key}: the chat template of {origin} is not valid Jinja: line {exc.lineno}: "
                          f"{exc.message}", key=key, source=src) from None
    except ImportError as exc:
        raise ConfigError(f"{src}: {key}: {settings_file} sets legacy false or add_prefix_space false, whose "
                          f"tokenization needs the protobuf package: {exc}", key=key, source=src) from None


def _prefix_mode(settings: Mapping[str, Any]) -> str:
    if settings.get("add_prefix_space") is False:
        return "never"
    return "first" if settings.get("legacy") is False else "always"


def _named_default(value: Any, file: Path, src: str) -> str:
    """tokenizer_config.json's chat_template: a template, or a list of named ones (the "default" one is used)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
    raise ConfigError(f"{src}: model_config.model_path: {file}: chat_template must be a template string or a list "
                      f"of {{\"name\", \"template\"}} objects with a \"default\" one", key="model_config.model_path",
                      source=src)


def _read_text(file: Path, key: str, src: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{src}: {key}: cannot read the chat template {file}: {exc}", key=key, source=src) from None


def _read_json(file: Path, src: str) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{src}: model_config.model_path: cannot read {file} as JSON: {exc}",
                          key="model_config.model_path", source=src) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: model_config.model_path: {file} must hold a JSON object",
                          key="model_config.model_path", source=src)
    return data
