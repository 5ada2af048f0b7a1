"""Reasoning output (vLLM's ``--reasoning-parser``, ``tokenizer.reasoning_parser``): what a thinking model writes
between ``<think>`` and ``</think>`` is answered apart from the rest, as the chat message's ``reasoning_content``.

Where the thinking starts differs by family, so the prompt decides: Qwen3's template leaves the tag to the model
(``<think>`` is then the answer's first text), its thinking variants and DeepSeek-R1 distills' templates open it
in the prompt (``<think>\\n`` ends the prompt) and the model writes only ``</think>``. A prompt that ends with the
start tag starts inside the reasoning; ``deepseek_r1`` always does (vLLM's reading: no ``</think>`` at all means
the whole answer is reasoning, the answer cut short while thinking). With ``enable_thinking: false`` Qwen3's template
closes an empty block in the prompt, so the answer is all content. Only the answer's leading block is read: a tag
later in the content is content.
"""

from __future__ import annotations

from llm_serving.config.sections import REASONING_PARSERS
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer, HFTokenizer

START, END = "<think>", "</think>"


def starts_inside(parser: str, prompt_text: str) -> bool:
    """Whether the answer starts inside the reasoning block (module docstring)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    return parser == "deepseek_r1" or prompt_text.rstrip().endswith(START)


def tag_ids(tokenizer: AnyTokenizer, tag: str) -> list[int]:
    """The ids that spell ``tag`` in an answer: Qwen3's and DeepSeek's tags are one added token each; a
    sentencepiece tokenizer spells it in pieces, without the dummy-prefix space."""
    return tokenizer.encode_rendered(tag) if isinstance(tokenizer, HFTokenizer) else tokenizer.encode_exact(tag)


class ReasoningSplitter:
    """Splits one answer's text, fed piece by piece as it streams (``feed``) or whole (``split``), into reasoning
    and content; text that may be the start of a tag is held until the next piece tells."""

    def __init__(self, parser: str, prompt_text: str) -> None:
        self._inside = starts_inside(parser, prompt_text)
        self.found = self._inside  # whether the answer has a reasoning part (else reasoning_content is null)
        self._opening = True  # the answer's first characters may be the model's own start tag
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The next ``(reasoning, content)`` pieces the answer's next ``text`` gives; ``final`` with its last."""
        buf, self._held = self._held + text, ""
        if self._opening:
            if buf.startswith(START):
                buf, self._inside, self.found = buf[len(START):], True, True
            elif START.startswith(buf) and not final:
                self._held = buf
                return "", ""
            self._opening = False
        if not self._inside:
            return "", buf
        at = buf.find(END)
        if at >= 0:
            self._inside = False
            return buf[:at], buf[at + len(END):]
        keep = 0 if final else _partial_tag(buf, END)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's ``(reasoning_content, content)`` as vLLM answers them: None for a part that is not
        there (no reasoning block; nothing after it)."""
        reasoning, content = self.feed(text, final=True)
        if not self.found:
            return None, content
        return reasoning, content or None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be coming)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
