"""Llama (sentencepiece) tokenizer and the per-request streaming detokenizer.

The master encodes prompts and turns sampled ids back into text; device agents only ever see ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

SPACE_MARK = "\u2581"  # sentencepiece's visible space "▁"
REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file could not be loaded, or an id/text cannot be processed."""


class Tokenizer:
    """A sentencepiece model with Llama's conventions: ``encode`` prepends ``<s>``; ``</s>`` ends generation.

    Special ids (control pieces and ``<unk>``) are dropped from decoded text by default, as Hugging Face does.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.model"
        if not path.is_file():
            raise TokenizerError(f"tokenizer model not found: {path}")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"cannot load sentencepiece model {path}: {e}") from e
        self.path = path
        self._sp = sp
        n = sp.get_piece_size()
        self._special = [sp.is_control(i) or sp.is_unknown(i) for i in range(n)]
        self._byte = [sp.is_byte(i) for i in range(n)]
        if sp.bos_id() < 0 or sp.eos_id() < 0:
            raise TokenizerError(f"sentencepiece model {path} has no <s>/</s> pieces; Llama needs both")
        # Whether a leading "▁" is dropped from the first piece (add_dummy_prefix); probed, not parsed.
        space = sp.piece_to_id(SPACE_MARK)
        self._drops_dummy_prefix = space != sp.unk_id() and sp.decode([space]) == ""

    # -- vocabulary -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def pad_id(self) -> int:
        """Llama has no pad piece; like its Hugging Face config, 0 is used when one is needed."""
        pad = self._sp.pad_id()
        return max(pad, 0)

    def is_special(self, token_id: int) -> bool:
        """True for ``<s>``, ``</s>``, ``<unk>`` and any other control piece."""
        return self._special[self._check_id(token_id)]

    def is_byte(self, token_id: int) -> bool:
        """True for byte-fallback pieces ``<0x00>`` .. ``<0xFF>``."""
        return self._byte[self._check_id(token_id)]

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(self._check_id(token_id))

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``; unknown pieces map to ``unk_id``, as in sentencepiece."""
        return self._sp.piece_to_id(piece)

    # -- text <-> ids ---------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Kept special tokens render as their piece (``<s>``), with a space after as in text.

        Decoding is piece-by-piece concatenation, except that the first rendered piece loses its dummy-prefix
        space and byte pieces merge into UTF-8 characters; ``IncrementalDecoder`` relies on exactly that.
        """
        ids = [self._check_id(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if not self._special[i]])
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._special[i]:
                self._flush_run(run, parts)
                parts.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        self._flush_run(run, parts)
        return "".join(parts)

    def _flush_run(self, run: list[int], parts: list[str]) -> None:
        if not run:
            return
        text = self._sp.decode(run)
        # sentencepiece strips the dummy-prefix space of each run; only the very first text may lose it.
        if parts and self._drops_dummy_prefix and self._sp.id_to_piece(run[0]).startswith(SPACE_MARK):
            text = " " + text
        parts.append(text)
        run.clear()

    def token_text(self, token_id: int) -> str:
        """Display text of one token (for per-token ``text``/logprob fields), independent of context.

        ``▁`` becomes a space; an ASCII byte piece becomes its character; a non-ASCII byte, which is only a
        fragment of a character, keeps its ``<0xNN>`` spelling; special tokens keep their piece.
        """
        piece = self.id_to_piece(token_id)
        if self._byte[token_id]:
            value = int(piece[3:5], 16)
            return chr(value) if value < 0x80 else piece
        if self._special[token_id]:
            return piece
        return piece.replace(SPACE_MARK, " ")

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token (the OpenAI logprobs ``bytes`` field); a byte piece is its single byte."""
        if self.is_byte(token_id):
            return [int(self._sp.id_to_piece(token_id)[3:5], 16)]
        return list(self.token_text(token_id).encode("utf-8"))

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._special):
            raise TokenizerError(f"token id {token_id} is out of range for vocab_size {len(self._special)}")
        return i


def _incomplete_utf8_tail(tail: Sequence[int]) -> bool:
    """True when the bytes in ``tail`` end with the start of a multi-byte character still missing bytes.

    Lead bytes 0xC0-0xF7 are all treated as openers (more than strictly valid UTF-8 needs): holding back a
    little too often only delays text by at most three tokens, while releasing too early would break it.
    """
    for back, b in enumerate(reversed(tail)):
        if 0x80 <= b < 0xC0:  # continuation byte: look further back for its lead
            continue
        if 0xC0 <= b < 0xF8:
            needed = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back + 1 < needed
        return False
    return False


class IncrementalDecoder:
    """Streams one request's generated text token by token.

    Each ``push`` decodes only a short window: the tokens already released last time (as context, so the
    dummy-prefix space and byte merging behave as in the full text) plus the not yet released ones, and
    returns the part after the context's text. Tokens are held back while they end in an unfinished UTF-8
    character, so no fragment or U+FFFD is streamed that a later byte would change.

    With ``prompt_ids`` the last few prompt tokens seed the context, so the concatenated output equals
    ``decode(prompt + generated)[len(decode(prompt)):]`` (for prompts ending on a whole character);
    without a prompt it equals ``decode(generated)``. Call ``flush`` once at the end to release a held tail.
    """

    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = [tokenizer._check_id(i) for i in prompt_ids]
        if skip_special_tokens:
            context = [i for i in context if not tokenizer.is_special(i)]
        self._window: list[int] = context[-self.CONTEXT_TOKENS:]
        self._read = len(self._window)  # window[:read] was released (or is prompt); window[read:] is pending
        self._chunks: list[str] = []
        self._text: str | None = ""
        self._flushed = False

    @property
    def text(self) -> str:
        """All text released so far."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly releasable text (may be empty)."""
        if self._flushed:
            raise TokenizerError("IncrementalDecoder.push after flush; use one decoder per request")
        token_id = self._tok._check_id(token_id)
        if self._skip and self._tok.is_special(token_id):
            return ""
        self._window.append(token_id)
        if self._pending_incomplete():
            return ""
        return self._release()

    def flush(self) -> str:
        """End the stream: release what is held back (an unfinished character renders as U+FFFD, as in
        ``decode``). Later pushes are refused, since their bytes could no longer join the released text."""
        self._flushed = True
        return self._release() if self._read < len(self._window) else ""

    def _pending_incomplete(self) -> bool:
        tail: list[int] = []
        for i in reversed(self._window[self._read:]):
            if not self._tok.is_byte(i) or len(tail) == 3:
                break
            tail.append(int(self._tok.id_to_piece(i)[3:5], 16))
        return _incomplete_utf8_tail(tail[::-1])

    def _release(self) -> str:
        w = self._window
        prefix = self._tok.decode(w[: self._read], self._skip)
        full = self._tok.decode(w, self._skip)
        delta = full[len(prefix):]
        # The released tokens become the next context; older ones are no longer needed.
        self._window = w[self._read:]
        self._read = len(self._window)
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta
