"""Chat templates: the rendered prompt's token ids against transformers' ``apply_chat_template`` on a
LlamaTokenizer built from the same locally trained sentencepiece model; the Llama-2 format against Meta's
reference encoding; where the template comes from; message checks and template errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import LlamaTokenizer

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.request_errors import ChatTemplateError, MessageError
from llm_serving.tokenization.chat_template import (
    LLAMA2_CHAT_TEMPLATE,
    ChatTemplate,
    check_messages,
    load_chat_template,
)
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer

SYSTEM = {"role": "system", "content": "You answer briefly, in plain words."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [SYSTEM, {"role": "user", "content": "  What does a miller do?\n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me about the river.\nBriefly."}],
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello!  "},
     {"role": "user", "content": "Numbers: 1 2 3, Café, 中文, 🙂"}, {"role": "assistant", "content": "Noted."},
     {"role": "user", "content": "And again?"}],
    [{"role": "user", "content": "a literal</s>end token and <s>start"}],  # spelled special tokens are tokens
]

# A second template, in the style model directories carry: namespace, loop controls, tojson, whitespace
# control by trim_blocks/lstrip_blocks, add_generation_prompt; no segment after a special token starts with a
# space (transformers 5 drops sentencepiece's dummy prefix there, see test_leading_space_after_special).
DIR_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = m['content'] %}
        {% continue %}
    {% endif %}
    {% if m['role'] == 'user' %}
Q{{ loop.index }}{% if ns.system %} ({{ ns.system | tojson }}){% endif %}: {{ m['content'] }}
    {% elif m['role'] == 'assistant' %}
A: {{ m['content'] | trim }}{{ eos_token }}
    {% else %}
        {{ raise_exception('unexpected role ' + m['role']) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:
{%- endif %}"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chat-tok")
    train_tokenizer(d / "tokenizer")
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir / "tokenizer.model")


def hf_ids(hf: LlamaTokenizer, messages: list[dict], **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(out if isinstance(out, list) else out["input_ids"])


def dir_with_config(tmp_path: Path, model_dir: Path, settings: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(model_dir / "tokenizer.model", d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", **settings}))
    return d


# ---- token ids equal transformers' --------------------------------------------------------------------------
@pytest.mark.parametrize("legacy, prefix", [(True, "always"), (False, "first")])
def test_default_llama2_template_equals_transformers(model_dir, tok, legacy, prefix):
    hf = LlamaTokenizer.from_pretrained(str(model_dir), legacy=legacy)
    ours = ChatTemplate(LLAMA2_CHAT_TEMPLATE, "default", tok, prefix)
    for conv in CONVERSATIONS:
        text = hf.apply_chat_template(conv, chat_template=LLAMA2_CHAT_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
        assert ours.render(check_messages(conv)) == text
        assert ours.prompt_ids(check_messages(conv)) == hf_ids(hf, conv, chat_template=LLAMA2_CHAT_TEMPLATE)


@pytest.mark.parametrize("settings", [{"legacy": True}, {"legacy": False}, {"add_prefix_space": False},
                                      {"legacy": False, "add_prefix_space": False}])
def test_template_from_a_model_directory_equals_transformers(tmp_path, model_dir, tok, settings):
    d = dir_with_config(tmp_path, model_dir, {"chat_template": DIR_TEMPLATE, **settings})
    hf = LlamaTokenizer.from_pretrained(str(d))  # reads chat_template, legacy, add_prefix_space from the dir
    ours = load_chat_template(ServingConfig(), d, Tokenizer(d / "tokenizer.model"))
    assert ours.origin == str(d / "tokenizer_config.json")
    for conv in CONVERSATIONS:
        assert ours.render(check_messages(conv)) == hf.apply_chat_template(conv, tokenize=False,
                                                                            add_generation_prompt=True)
        assert ours.prompt_ids(check_messages(conv)) == hf_ids(hf, conv), (settings, conv)
        without = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=False)
        assert ours.prompt_ids(check_messages(conv), add_generation_prompt=False) == list(without["input_ids"])


def test_default_format_is_metas_reference_encoding(tok):
    """Llama-2's reference: each exchange ``<s>[INST] user [/INST] answer </s>`` encoded on its own (contents
    stripped, the system prompt in a <<SYS>> block of the first user turn), the last ``<s>[INST] user [/INST]``."""
    ours = ChatTemplate(LLAMA2_CHAT_TEMPLATE, "default", tok)
    for conv in CONVERSATIONS[:4]:
        turns = list(conv)
        if turns[0]["role"] == "system":
            sys_block = f"<<SYS>>\n{turns[0]['content']}\n<</SYS>>\n\n"
            turns = [{**turns[1], "content": sys_block + turns[1]["content"]}, *turns[2:]]
        want: list[int] = []
        for user, answer in zip(turns[::2], turns[1::2]):
            text = f"[INST] {user['content'].strip()} [/INST] {answer['content'].strip()} "
            want += [tok.bos_id, *tok.encode(text, add_bos=False), tok.eos_id]
        want += [tok.bos_id, *tok.encode(f"[INST] {turns[-1]['content'].strip()} [/INST]", add_bos=False)]
        assert ours.prompt_ids(check_messages(conv)) == want


def test_leading_space_after_special_follows_sentencepiece(tok):
    """Text right after a special token that starts with a space keeps sentencepiece's dummy prefix ("▁" +
    " x"), as Meta's reference and this server's completions encode it; transformers 5's converted tokenizer
    drops it there, the one place the two differ (not reachable with the Llama-2 template)."""
    ours = ChatTemplate("{{ bos_token }} x", "t", tok)
    assert ours.prompt_ids([]) == [tok.bos_id, *tok.encode(" x", add_bos=False)]


# ---- where the template comes from -------------------------------------------------------------------------------
def test_sources_in_order(tmp_path, model_dir, tok):
    d = dir_with_config(tmp_path, model_dir, {"legacy": False})
    assert load_chat_template(ServingConfig(), d, tok).origin == "the Llama-2 chat format (default)"
    assert load_chat_template(ServingConfig(), d / "model.ckpt", tok).prefix == "first"  # a checkpoint file's dir
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}named"}]}))
    assert load_chat_template(ServingConfig(), d, tok).render([]) == "<s>named"
    (d / "chat_template.jinja").write_text("{{ bos_token }}file")
    assert load_chat_template(ServingConfig(), d, tok).render([]) == "<s>file"
    own = tmp_path / "own.jinja"
    own.write_text("{{ eos_token }}yaml")
    cfg = ServingConfig.from_dict({"tokenizer": {"chat_template": str(own)}})
    template = load_chat_template(cfg, d, tok)
    assert template.render([]) == "</s>yaml" and "tokenizer.chat_template" in template.origin


def test_bad_templates_are_config_errors(tmp_path, model_dir, tok):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ConfigError, match=r"tokenizer.chat_template: the chat template of .*bad.jinja .* is not "
                                          r"valid Jinja: line 1"):
        load_chat_template(ServingConfig.from_dict({"tokenizer": {"chat_template": str(bad)}}), model_dir, tok)
    missing = ServingConfig.from_dict({"tokenizer": {"chat_template": str(tmp_path / "none.jinja")}})
    with pytest.raises(ConfigError, match="cannot read the chat template .*none.jinja"):
        load_chat_template(missing, model_dir, tok)
    d = dir_with_config(tmp_path, model_dir, {"chat_template": 42})
    with pytest.raises(ConfigError, match="chat_template must be a template string"):
        load_chat_template(ServingConfig(), d, tok)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*tokenizer_config.json as JSON"):
        load_chat_template(ServingConfig(), d, tok)


# ---- messages and template errors --------------------------------------------------------------------------------
def test_messages_are_normalized():
    got = check_messages([
        {"role": "developer", "content": "rules", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
         "name": "ann"},
        {"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None, "annotations": [],
         "function_call": None, "audio": None},
    ])
    assert got == [{"role": "system", "content": "rules"}, {"role": "user", "content": "one\ntwo", "name": "ann"},
                   {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("messages, unsupported, match", [
    ([], False, "non-empty list"),
    ("hello", False, "non-empty list"),
    ([["user", "hi"]], False, r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "hi"}], False, r"messages\[0\].role must be one of system, user, assistant"),
    ([{"content": "hi"}], False, "role must be one of"),
    ([{"role": "user"}], False, r"messages\[0\].content is missing"),
    ([{"role": "user", "content": None}], False, "content is missing"),
    ([{"role": "user", "content": 5}], False, "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], False, r"content\[0\] must be"),
    ([{"role": "user", "content": "hi", "extra": 1}], False, "unknown key"),
    ([{"role": "user", "content": "hi", "name": 3}], False, "name must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], True, "only text parts"),
    ([{"role": "tool", "content": "42"}], False, "tool_call_id must be the id of the call it answers"),
    ([{"role": "function", "content": "42"}], True, "role 'function' is not supported"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}], False, r"tool_calls\[0\] must be"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
     False, "arguments is not JSON"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], False, "unknown key"),
])
def test_bad_messages(messages, unsupported, match):
    with pytest.raises(MessageError, match=match) as err:
        check_messages(messages)
    assert err.value.unsupported is unsupported


@pytest.mark.parametrize("messages, match", [
    ([{"role": "assistant", "content": "hi"}], "message 0 is assistant, expected user"),
    ([SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 2 is user, expected assistant"),
    ([SYSTEM], "needs a user message after the system message"),
    ([{"role": "user", "content": "a"}, SYSTEM], "message 1 is system, expected assistant"),
])
def test_llama2_template_refuses_what_the_format_cannot_say(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(LLAMA2_CHAT_TEMPLATE, "default", tok).prompt_ids(check_messages(messages))


def test_template_failures_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError, match="has no attribute 'nope'"):
        ChatTemplate("{{ messages[0]['nope'].x }}", "t", tok).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}", "t", tok).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="unsafe|access"):  # the sandbox
        ChatTemplate("{{ messages.__class__.__mro__ }}", "t", tok).render([])
    stamp = ChatTemplate("{{ strftime_now('%Y') }}{{ {'k': 'é<'} | tojson }}", "t", tok).render([])
    assert stamp[4:] == '{"k": "é<"}' and stamp[:4].isdigit()
