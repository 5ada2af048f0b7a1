"""Structured output: a request's answer held to a JSON schema, a regex or a list of choices, token by token.

The master keeps one ``TokenMatcher`` per constrained sequence (llguidance's ``LLMatcher``), writes the bitmask of
the tokens it allows next into the step (``SamplingExtras.token_masks``), and the agent's sampler sets every other
token's logit to -inf before choosing, greedy or sampled. The token the agent returns is then consumed here; when the
grammar can take nothing more (a JSON object closed) the request ends with finish reason "stop", and the end ids
are allowed only where the grammar is complete.

JSON is held to one layout: ``", "`` between items, ``": "`` after keys, no other whitespace. A grammar that allows
free whitespace lets a model that likes newlines fill its whole budget with them and never close the object (the
failure vLLM's ``disable_any_whitespace`` exists for); this layout is also ``json.dumps``' default, the one models
saw most.

Why llguidance: measured in ``scripts/bench_structured.py`` (docs/benchmarks.md) against outlines-core and xgrammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import llguidance
import numpy as np
import numpy.typing as npt

from llm_serving.core.sequence import OutputConstraint
from llm_serving.core.thinking_budget import KIND as THINKING_KIND
from llm_serving.core.thinking_budget import BudgetSpec, ThinkingBudget
from llm_serving.request_errors import InvalidParameter

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

    from llm_serving.core.sequence import Sequence
    from llm_serving.protocol.batch import StepBatch

_JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SPECIAL_MARK = b"\xff"  # llguidance's spelling of a special token: bytes no text can produce


class TokenMatcher:
    """One sequence's progress through its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.mask_words = (vocab_size + 31) // 32

    def fill_mask(self, row: npt.NDArray[np.int32]) -> None:
        """Write the allowed next tokens into ``row`` (int32 ``[mask_words]``, bit ``t % 32`` of word ``t // 32``)."""
        if not row.flags.c_contiguous or row.dtype != np.int32 or row.shape != (self.mask_words,):
            raise ValueError(f"mask row must be a contiguous int32 [{self.mask_words}], got {row.dtype} {row.shape}")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (nothing consumed)."""
        return self._matcher.validate_tokens([token]) == 1

    def advance(self, token: int) -> bool:
        """Consume ``token``; True once the grammar takes no more tokens (the answer is complete)."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed here: {self._matcher.get_error()}")
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles a model's constraints against its vocabulary (``compiler_for``); one per served tokenizer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._grammar = lru_cache(maxsize=256)(self._compile)

    def matcher(self, constraint: OutputConstraint) -> TokenMatcher | ThinkingBudget:
        """A fresh matcher at the start of the answer; InvalidParameter (naming ``constraint.field``) when the
        constraint cannot be compiled. A thinking budget needs no grammar (``core.thinking_budget``)."""
        if constraint.kind == THINKING_KIND:
            return ThinkingBudget(BudgetSpec.parse(constraint.spec), self.vocab_size)
        grammar = self._grammar(constraint)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameter(constraint.field, f"{{field}} cannot be used: {_one_line(matcher.get_error())}")
        return TokenMatcher(matcher, self.vocab_size)

    def _compile(self, constraint: OutputConstraint) -> str:
        try:
            if constraint.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.spec, overrides=_JSON_LAYOUT)
            elif constraint.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(constraint.spec)
            else:  # Lark string literals are JSON strings
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(constraint.spec)))
        except ValueError as exc:
            raise InvalidParameter(constraint.field, f"{{field}} cannot be used: {_one_line(str(exc))}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            raise InvalidParameter(constraint.field, f"{{field}} cannot be used: {_one_line(messages[0])}")
        return grammar


def _one_line(message: str) -> str:
    """llguidance's multi-line message (with its caret diagram) as one line for an HTTP error."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


@dataclass
class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    tokens: list[bytes]
    eos_token_id: int
    special_token_ids: list[int]
    encode: Callable[[str], list[int]]
    bos_token_id: int | None = None

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


@runtime_checkable
class JsonTokenizer(Protocol):
    """A served ``tokenizer.json`` tokenizer (``tokenization``'s ``HFTokenizer``): llguidance reads its JSON."""

    def to_json(self) -> str: ...


class PieceTokenizer(Protocol):
    """What ``compiler_for`` reads of a sentencepiece tokenizer (``tokenization``'s ``Tokenizer``)."""

    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> list[int]: ...
    def is_special(self, token_id: int) -> bool: ...
    def id_to_piece(self, token_id: int) -> str: ...
    def encode_exact(self, text: str) -> list[int]: ...


ServedTokenizer = JsonTokenizer | PieceTokenizer


def compiler_for(tokenizer: ServedTokenizer, end_ids: Iterable[int], vocab_size: int) -> GrammarCompiler:
    """The compiler of a served tokenizer; ``end_ids`` end a request (allowed where the grammar is complete),
    ``vocab_size`` is the model's (its logits rows; the ids past the tokenizer's never allowed).

    A ``tokenizer.json`` is read by llguidance itself (through the same ``tokenizers`` library); a sentencepiece
    model is given as its tokens' bytes, special tokens marked so that no text matches them, and its encoder
    without the dummy-prefix space (llguidance tokenizes the text a grammar forces, which must keep its bytes).
    """
    ends = sorted(set(end_ids))
    if not ends:
        raise ValueError("structured output needs at least one end-of-sequence id")
    if isinstance(tokenizer, JsonTokenizer):
        return GrammarCompiler(llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=ends),
                               vocab_size)
    n = tokenizer.vocab_size
    special = [i for i in range(n) if tokenizer.is_special(i)]
    tokens = [bytes(tokenizer.token_bytes(i)) for i in range(n)]
    for i in special:
        tokens[i] = _SPECIAL_MARK + tokenizer.id_to_piece(i).encode()
    tokens += [_SPECIAL_MARK + b"<pad_%d>" % i for i in range(n, vocab_size)]
    vocabulary = _Vocabulary(tokens, ends[0], special, tokenizer.encode_exact)
    return GrammarCompiler(llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size,
                                                  eos_token=ends), vocab_size)


def masked_rows(seqs: list[Sequence], batch: StepBatch, token_ids: Iterable[int]) -> dict[int, str]:
    """Rows of a step whose new token their grammar does not allow (reason by row), among those whose token is
    the sequence's next (not a prompt chunk short of its end). A token the mask allowed always passes, so this only
    catches a path that chose without the mask; steps without masks are passed over in O(1)."""
    extras = batch.sampling.extras if batch.sampling is not None else None
    if extras is None or extras.token_masks is None:
        return {}
    out = {}
    for row, (seq, token) in enumerate(zip(seqs, token_ids)):
        matcher = seq.constraint
        if matcher is None or token < 0 or seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
            continue
        if not matcher.allows(int(token)):
            out[row] = f"token {int(token)} does not match the requested output format ({matcher.error or 'rejected'})"
    return out
