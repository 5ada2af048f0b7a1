"""Reasoning output: the ``<think>`` block of a thinking model's answer split from its content
(``tokenization.reasoning``), whole and streamed, and Qwen3's ``enable_thinking`` through ``chat_template_kwargs``."""

from __future__ import annotations

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
        pieces = [answer[a:b] for a, b in zip(bounds, bounds[1:])]
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
