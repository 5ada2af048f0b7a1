"""Reasoning output: the ``<think>`` block of a thinking model's answer split from its content
(``tokenization.reasoning``), whole and streamed, and Qwen3's ``enable_thinking`` through ``chat_template_kwargs``."""

from __future__ import annotations

import itertools
import random

import pytest

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.tokenization.reasoning import ReasoningSplitter

QWEN_OPEN = "<|im_start|>assistant\n<think>\n"  # a thinking template: the prompt opens the block
QWEN_PLAIN = "<|im_start|>assistant\n"  # Qwen3's own: the model writes <think>
QWEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false

CASES = [  # parser, prompt, answer, (reasoning_content, content)
    ("qwen3", QWEN_PLAIN, "<think>\nsum the two</think>\n\nIt is 4.", ("\nsum the two", "\n\nIt is 4.")),
    ("qwen3", QWEN_OPEN, "sum the two\n</think>\n\nIt is 4.", ("sum the two\n", "\n\nIt is 4.")),
    ("qwen3", QWEN_PLAIN, "It is 4.", (None, "It is 4.")),
    ("qwen3", QWEN_OFF, "It is 4. <think>not a block</think>", (None, "It is 4. <think>not a block</think>")),
    ("qwen3", QWEN_PLAIN, "<thing> is not the tag", (None, "<thing> is not the tag")),
    ("qwen3", QWEN_PLAIN, "<thi", (None, "<thi")),  # ends before it could be the tag
    ("qwen3", QWEN_OPEN, "still thinking </thi", ("still thinking </thi", None)),  # cut short inside
    ("qwen3", QWEN_PLAIN, "<think>a</think>", ("a", None)),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "x < y, so</think>y", ("x < y, so", "y")),
    ("deepseek_r1", "<｜Assistant｜>", "<think>x</think>y", ("x", "y")),  # an older template: the model opens it
    ("deepseek_r1", "<｜Assistant｜>", "cut short", ("cut short", None)),  # vLLM's reading: all reasoning
]


@pytest.mark.parametrize("parser, prompt, answer, expected", CASES)
def test_whole_answers_split_as_vllm_answers_them(parser, prompt, answer, expected):
    assert ReasoningSplitter(parser, prompt).split(answer) == expected


@pytest.mark.parametrize("parser, prompt, answer, expected", CASES)
def test_streamed_pieces_join_to_the_whole_split_wherever_the_tags_break(parser, prompt, answer, expected):
    """Every way of cutting the answer in two, and random cuts into many pieces (a tag across pieces included):
    the reasoning pieces join to reasoning_content, the content pieces to content."""
    rng = random.Random(answer)
    cuts = [[i] for i in range(len(answer) + 1)]
    cuts += [sorted(rng.sample(range(len(answer) + 1), min(4, len(answer)))) for _ in range(20)]
    cuts.append(list(range(len(answer) + 1)))  # a character a piece
    for cut in cuts:
        bounds = [0, *cut, len(answer)]
        pieces = [answer[a:b] for a, b in itertools.pairwise(bounds)]
        splitter = ReasoningSplitter(parser, prompt)
        fed = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        reasoning, content = "".join(r for r, _ in fed), "".join(c for _, c in fed)
        assert (reasoning if splitter.found else None, content or None) == (
            expected[0], expected[1] or None), pieces


def test_the_parser_is_a_config_key_checked_by_name():
    assert ServingConfig().with_values({"tokenizer.reasoning_parser": "deepseek_r1"}).tokenizer.reasoning_parser == (
        "deepseek_r1")
    with pytest.raises(ConfigError, match="tokenizer.reasoning_parser: expected one of qwen3, deepseek_r1"):
        ServingConfig().with_values({"tokenizer.reasoning_parser": "granite"})
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter("granite", "")


# ---- served: a hidden Qwen3-style template, the tiny real model held to a thinking answer by a regex ------------
QWEN3_STYLE = (  # Qwen3's thinking variants' generation prompt: the block opened, or closed empty when switched off
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}")
THINKING = r"[a-z ]{4,16}</think>\n\n[A-Z][a-z ]{4,16}\."
ANSWER = r"[A-Z][a-z ]{4,16}\."
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from test_server import ServerProcess

    from tests.tiny_engine import TINY_SERVED, set_args

    data = tmp_path_factory.mktemp("reasoning-serve")
    template = data / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE)
    server = ServerProcess(data, *set_args(TINY_SERVED), "--set", f"tokenizer.chat_template={template}",
                           "--reasoning-parser", "qwen3")
    yield server
    assert server.stop() == 0, server.output


def test_served_reasoning_split_streamed_and_not_and_enable_thinking(thinking_server):
    import re

    import openai

    from tests.tiny_engine import openai_client

    client = openai_client(thinking_server)
    ask = {"model": "llama2", "messages": ASK, "max_tokens": 80, "temperature": 0}
    whole = client.chat.completions.create(**ask, extra_body={"guided_regex": THINKING})
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert whole.choices[0].finish_reason == "stop" and re.fullmatch(r"[a-z ]{4,16}", reasoning)
    assert re.fullmatch(THINKING, f"{reasoning}</think>{message.content}")  # nothing lost, no tag left
    chunks = list(client.chat.completions.create(**ask, stream=True, extra_body={"guided_regex": THINKING}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert all("</think>" not in (d.content or "") for d in deltas)
    off = client.chat.completions.create(**ask, extra_body={"guided_regex": ANSWER,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert re.fullmatch(ANSWER, off.choices[0].message.content)
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens  # the template closed an empty block
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set messages"):
        client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"messages": []}})


def test_the_thinking_budget_forces_the_end_tag_then_answers_freely(thinking_server):
    """thinking_token_budget 3 on a prompt that opened the block: the random model's first 3 tokens are the
    reasoning, then the end tag's ids are forced (the served tokenizer spells </think> in pieces), then free text."""
    import openai

    from tests.tiny_engine import openai_client

    client = openai_client(thinking_server)
    ask = {"model": "llama2", "messages": ASK, "max_tokens": 24, "temperature": 0, "logprobs": True}
    free = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert free.choices[0].message.content is None  # the random model never closes the block by itself
    answer = client.chat.completions.create(**ask, extra_body={"thinking_token_budget": 3, "ignore_eos": True})
    choice = answer.choices[0]
    pieces = [bytes(t.bytes) for t in choice.logprobs.content]
    thought = b"".join(pieces[:3]).decode(errors="replace")
    assert choice.message.model_extra["reasoning_content"] == thought
    forced = next(n for n in range(1, 20) if b"".join(pieces[3:3 + n]) == b"</think>")
    assert b"".join(pieces[3 + forced:]).decode(errors="replace") == choice.message.content
    assert answer.usage.completion_tokens == 24
    streamed = list(client.chat.completions.create(**ask, stream=True,
                                                   extra_body={"thinking_token_budget": 3, "ignore_eos": True}))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget and guided_regex both hold"):
        client.chat.completions.create(**ask, extra_body={"thinking_token_budget": 3, "guided_regex": "a+"})


def test_a_thinking_budget_without_a_reasoning_parser_is_a_400(standin_server):
    import openai

    from tests.tiny_engine import openai_client

    with pytest.raises(openai.BadRequestError, match="thinking_token_budget needs a reasoning model"):
        openai_client(standin_server).chat.completions.create(
            model="llama2", messages=ASK, max_tokens=4, extra_body={"thinking_token_budget": 2})


def test_the_budget_matcher_counts_inside_the_block_only_and_forces_the_end_ids_one_a_step():
    import numpy as np

    from llm_serving.core.thinking_budget import BudgetSpec, ThinkingBudget

    def allowed(m: ThinkingBudget) -> list[int]:
        row = np.zeros(m.mask_words, np.int32)
        m.fill_mask(row)
        return [t for t in range(70) if row[t // 32].view(np.uint32) >> (t % 32) & 1]

    spec = BudgetSpec(2, start_ids=(5,), end_ids=(63, 7), inside=False)
    m = ThinkingBudget(spec, 70)
    for token in (5, 10, 11):  # the answer opens the block itself, then thinks two tokens
        assert len(allowed(m)) == 70 and m.allows(token)
        assert m.advance(token) is False
    assert allowed(m) == [63] and not m.allows(7)  # bit 31 of word 1 as well: 63 = 32 + 31
    with pytest.raises(ValueError, match="forces its end tag"):
        m.advance(7)
    m.advance(63)
    assert allowed(m) == [7]
    m.advance(7)
    assert len(allowed(m)) == 70  # the answer, free
    early = ThinkingBudget(BudgetSpec(5, (5,), (63, 7), inside=True), 70)
    for token in (10, 63, 7, 12, 13, 14, 15):  # its own end tag closes the block before the budget
        early.advance(token)
    assert len(allowed(early)) == 70
    plain = ThinkingBudget(spec, 70)
    for token in (9, 5, 5, 5):  # no block at the answer's start: nothing counts
        plain.advance(token)
    assert len(allowed(plain)) == 70
