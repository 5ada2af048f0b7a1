"""Hugging Face ``tokenizer.json`` tokenizers (Llama 3's and Qwen's byte-level BPE, and any other the ``tokenizers``
library loads), with the conventions transformers' ``AutoTokenizer`` applies from ``tokenizer_config.json``:
its post-processor adds the special tokens of a plain prompt (Llama 3's ``<|begin_of_text|>``), special tokens
written in a chat prompt are matched as such, and ``bos_token``/``eos_token`` name the template's variables.

The interface is the sentencepiece ``Tokenizer``'s (``llm_serving.tokenization.tokenizer``), so the engine, the
API and the chat templates take either; ``load_tokenizer`` picks by the files present.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tokenizers

from llm_serving.tokenization.tokenizer import REPLACEMENT_CHAR, Tokenizer, TokenizerError

HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is spelled as, back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_name(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken-like mapping with its content."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A ``tokenizers`` tokenizer with ``tokenizer_config.json``'s settings (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / HF_TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer file not found: {file}")
        try:
            self._tok = _Tokenizers.from_file(str(file))
        except Exception as exc:
            raise TokenizerError(f"cannot load {file}: {exc}") from exc
        self.path = file
        settings_file = file.parent / "tokenizer_config.json"
        self.settings: dict[str, Any] = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        added = self._tok.get_added_tokens_decoder()
        self._special = {i for i, token in added.items() if token.special}
        self._size = self._tok.get_vocab_size(with_added_tokens=True)
        self._byte_level = "ByteLevel" in json.dumps(json.loads(file.read_text()).get("decoder"))

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for libraries that load the ``tokenizers`` format)."""
        return self._tok.to_str()

    # -- vocabulary -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._size

    def _named_id(self, name: str) -> int | None:
        text = _token_name(self.settings.get(name))
        return self._tok.token_to_id(text) if text is not None else None

    @property
    def bos_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def unk_id(self) -> int | None:
        return self._named_id("unk_token")

    @property
    def pad_id(self) -> int:
        pad = self._named_id("pad_token")
        return pad if pad is not None else 0

    def template_variables(self) -> dict[str, str]:
        """The special tokens a chat template may name (``bos_token`` ...), as tokenizer_config.json spells them."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: _token_name(self.settings.get(name)) or "" for name in names}

    def is_special(self, token_id: int) -> bool:
        return self._check_id(token_id) in self._special

    def is_byte(self, token_id: int) -> bool:
        """A byte-fallback piece ``<0xNN>`` (sentencepiece-converted tokenizers); byte-level BPE has none."""
        piece = self.id_to_piece(token_id)
        return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(self._check_id(token_id))
        return piece if piece is not None else ""

    def piece_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    # -- text <-> ids ---------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """A plain prompt's ids as ``AutoTokenizer(text)`` gives them: the post-processor's special tokens (e.g.
        ``<|begin_of_text|>``) with ``add_bos``, none without."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat prompt's ids as ``apply_chat_template(tokenize=True)`` gives them: special tokens
        written in the text are theirs, no post-processor tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([self._check_id(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes (a byte-level piece's bytes, a byte-fallback piece's byte)."""
        piece = self.id_to_piece(token_id)
        if self.is_special(token_id):
            return list(piece.encode("utf-8"))
        if self.is_byte(token_id):
            return [int(piece[3:5], 16)]
        if self._byte_level:
            table = _byte_decoder()
            return [table[c] for c in piece] if all(c in table for c in piece) else list(piece.encode("utf-8"))
        return list(piece.replace("\u2581", " ").encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """Display text of one token: its bytes as text, a fragment of a character as ``\\xNN`` escapes."""
        if self.is_special(token_id):
            return self.id_to_piece(token_id)
        raw = bytes(self.token_bytes(token_id))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" for b in raw)

    def incremental_decoder(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                            ) -> OffsetDecoder:
        return OffsetDecoder(self, prompt_ids, skip_special_tokens)

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < self._size:
            raise TokenizerError(f"token id {token_id} is out of range for vocab_size {self._size}")
        return i


class OffsetDecoder:
    """Streams one request's text token by token for tokenizers whose text of a token depends on its neighbours
    (byte-level BPE spells one character over several tokens): the text of the ids since ``prefix`` less that of
    the ids already released, held back while it ends in an unfinished character (U+FFFD), as vLLM's
    incremental detokenization does. What ``push`` and ``flush`` release together is the continuation's text:
    ``decode(prompt + generated)[len(decode(prompt)):]`` (with the prompt's last few ids as context)."""

    CONTEXT = 6  # prompt ids kept before the generated ones: enough for any merge across the boundary

    def __init__(self, tokenizer: HFTokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids = [tokenizer._check_id(i) for i in prompt_ids][-self.CONTEXT:]
        self._prefix = 0  # ids[prefix:read] is context whose text is already out (or prompt)
        self._read = len(self._ids)
        self._chunks: list[str] = []
        self._flushed = False

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        if self._flushed:
            raise TokenizerError("push after flush; use one decoder per request")
        self._ids.append(self._tok._check_id(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        self._flushed = True
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self._chunks.append(delta)
        return delta


AnyTokenizer = Tokenizer | HFTokenizer  # a served tokenizer: either kind (same interface, see the module doc)


def load_tokenizer(path: str | Path) -> AnyTokenizer:
    """The tokenizer at ``path``: a ``tokenizer.model`` (sentencepiece) or ``tokenizer.json`` file, or a model
    directory holding one (sentencepiece first, as Llama 2 directories ship both)."""
    path = Path(path)
    if path.is_dir():
        if (path / SENTENCEPIECE_FILE).is_file():
            return Tokenizer(path / SENTENCEPIECE_FILE)
        if (path / HF_TOKENIZER_FILE).is_file():
            return HFTokenizer(path / HF_TOKENIZER_FILE)
        raise TokenizerError(f"no {SENTENCEPIECE_FILE} or {HF_TOKENIZER_FILE} in {path}")
    return HFTokenizer(path) if path.suffix == ".json" else Tokenizer(path)
