"""What to send: token counts, and the requests built from an alpaca dataset (read and checked by
``llm_serving.bench.dataset``).

A request's prompt is the contest's ``instruction[":" + input]`` and its ``max_new_tokens`` the token count
of the reference ``output``. With ``--tokenizer`` the served sentencepiece model counts prompt tokens (with
``<s>``) and ``max_new_tokens`` (reference output, without ``<s>``, like the contest's
``tokenizer.tokenize``). Without it both are estimated as ``ceil(words * --tokens-per-word)`` over
whitespace-separated words, +1 for ``<s>`` on prompts (1.3 suits English with a Llama-2 vocabulary). The
server's own counts replace these when it reports them (see ``loadtest.protocol``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_serving.bench import BenchError
from llm_serving.bench.dataset import contest_prompt


@dataclass
class BenchRequest:
    index: int
    prompt: str
    max_new_tokens: int
    prompt_tokens: int
    # Token ids to send instead of the text (OpenAI endpoint only): every system then gets the same ids, so
    # outputs are comparable across servers whatever their tokenizers do with the text.
    prompt_ids: list[int] | None = None


class TokenCounter:
    """Counts tokens with the served tokenizer when given, else estimates from whitespace-separated words."""

    def __init__(self, tokenizer_path: str | Path | None = None, tokens_per_word: float = 1.3):
        if tokens_per_word <= 0:
            raise BenchError(f"--tokens-per-word must be > 0, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word
        self._sp = None
        self.path: Path | None = None
        if tokenizer_path is not None:
            # sentencepiece itself rather than llm_serving.tokenizer, so this package needs nothing from the
            # server it measures; imported here because only --tokenizer uses it.
            import sentencepiece as spm

            path = Path(tokenizer_path)
            path = path / "tokenizer.model" if path.is_dir() else path
            try:  # sentencepiece's own message says what is wrong (missing file, not a model)
                self._sp = spm.SentencePieceProcessor(model_file=str(path))
            except (OSError, RuntimeError) as e:
                raise BenchError(f"--tokenizer: cannot load sentencepiece model {path}: {e}") from e
            self.path = path

    @property
    def method(self) -> str:
        if self._sp is not None:
            return f"tokenizer {self.path}"
        return f"estimate: ceil(words x {self.tokens_per_word})"

    def count(self, text: str, add_bos: bool) -> int:
        if self._sp is not None:  # Llama's <s> is one id in front of the pieces
            return len(self._sp.encode(text)) + int(add_bos)
        return math.ceil(len(text.split()) * self.tokens_per_word) + int(add_bos)


def build_requests(records: Sequence[dict[str, str]], num_prompts: int, counter: TokenCounter,
                   shuffle: bool = False, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests cycling through the records in order (or a seeded shuffle of them)."""
    order = np.arange(len(records))
    if shuffle:
        np.random.default_rng(seed).shuffle(order)
    out = []
    for i in range(num_prompts):
        rec = records[int(order[i % len(records)])]
        prompt = contest_prompt(rec)
        out.append(BenchRequest(i, prompt, max(counter.count(rec["output"], add_bos=False), 1),
                                counter.count(prompt, add_bos=True)))
    return out
