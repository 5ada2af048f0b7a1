"""Llama (sentencepiece) tokenizer and the per-request streaming detokenizer.

The master encodes prompts and turns sampled ids back into text; device agents only ever see ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from llm_serving.tokenization.sp_prompt import PromptEncoder, bare_model, prefix_scheme

SPACE_MARK = "\u2581"  # sentencepiece's visible space "▁"
REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file could not be loaded, or an id/text cannot be processed."""


class Tokenizer:
    """A sentencepiece model with Llama's conventions: ``encode`` prepends ``<s>``; ``</s>`` ends generation.

    Special ids (control pieces and ``<unk>``) are dropped from decoded text by default, as Hugging Face does.
    """

    def __init__(self, path: str | Path, prefix: str | None = None):
        """``prefix``: where prompt text gets the dummy-prefix space (``sp_prompt.PREFIX_SCHEMES``); None: as the
        ``tokenizer_config.json`` beside the model says (``sp_prompt.prefix_scheme``)."""
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
        self._anchor: tuple[int, str] | None = None  # see _decode_anchor
        self._special_pieces = {sp.id_to_piece(i): i for i in range(n) if self._special[i]}
        scheme = prefix if prefix is not None else prefix_scheme(path.parent / "tokenizer_config.json")
        self._prompt = PromptEncoder(sp, path, self._special_pieces, scheme)
        self._bare: spm.SentencePieceProcessor | None = None  # see encode_exact

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
        ids = self._prompt.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def encode_exact(self, text: str) -> list[int]:
        """Ids whose bytes (``token_bytes``) are exactly ``text``: no BOS, no dummy-prefix space (what a grammar
        engine needs to turn text it forces into tokens)."""
        if self._bare is None:
            self._bare = bare_model(self.path)
        return self._bare.encode(text)

    def prompt_encoder(self, scheme: str) -> PromptEncoder:
        """This model's prompt encoder with the dummy-prefix ``scheme`` (a chat template may read the model's
        tokenizer_config.json otherwise than plain prompts are: ``chat_template``)."""
        if scheme == self._prompt.scheme:
            return self._prompt
        return PromptEncoder(self._sp, self.path, self._special_pieces, scheme)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Kept special tokens render as their piece (``<s>``), with a space after as in text.

        Decoding is piece-by-piece concatenation, except that byte pieces merge into UTF-8 characters and
        pieces at the start of the text lose their dummy-prefix space (only the first, or every one until
        some text is produced, depending on the sentencepiece version and model); ``IncrementalDecoder``
        relies only on that, and on nothing being stripped once there is text.
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

    def template_variables(self) -> dict[str, str]:
        """The special tokens a chat template may name, as their pieces."""
        return {"bos_token": self.id_to_piece(self.bos_id), "eos_token": self.id_to_piece(self.eos_id),
                "unk_token": self.id_to_piece(self.unk_id)}

    def incremental_decoder(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                            ) -> IncrementalDecoder:
        """A streaming decoder of one request's generated ids (``IncrementalDecoder``)."""
        return IncrementalDecoder(self, prompt_ids, skip_special_tokens)

    def _decode_anchor(self) -> tuple[int, str]:
        """A piece that renders as itself, a non-space text, wherever it stands: after it, ids decode exactly
        as they do inside a longer text (no dummy prefix stripped, no bytes merged). Used for streaming."""
        if self._anchor is None:
            sp = self._sp
            for i in range(sp.get_piece_size()):
                piece = sp.id_to_piece(i)
                if (self._special[i] or self._byte[i] or sp.is_unused(i) or not piece
                        or SPACE_MARK in piece or sp.decode([i]) != piece or piece[0].isspace()):
                    continue
                self._anchor = (i, piece)
                break
            else:
                raise TokenizerError(f"sentencepiece model {self.path} has no plain text piece to stream with")
        return self._anchor

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._special):
            raise TokenizerError(f"token id {token_id} is out of range for vocab_size {len(self._special)}")
        return i


def _unfinished_tail_len(tail: Sequence[int]) -> int:
    """How many bytes at the end of ``tail`` begin a multi-byte character that still misses bytes (0: none).

    Lead bytes 0xC0-0xF7 are all treated as openers (more than strictly valid UTF-8 needs): holding back a
    little too often only delays text by at most three tokens, while releasing too early would break it.
    Everything before such a lead byte is final, since no character can continue across a lead byte.
    """
    for back, b in enumerate(reversed(tail)):
        if 0x80 <= b < 0xC0:  # continuation byte: look further back for its lead
            continue
        if 0xC0 <= b < 0xF8:
            needed = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back + 1 if back + 1 < needed else 0
        return 0
    return 0


class IncrementalDecoder:
    """Streams one request's generated text token by token.

    The concatenation of every ``push`` and the final ``flush`` equals the tokenizer's text of the
    continuation: ``decode(prompt + generated)[len(decode(prompt)):]`` with ``prompt_ids``, and
    ``decode(generated)`` without (both with this decoder's ``skip_special_tokens``). One exception: when
    the prompt (without its special tokens if they are skipped) ends with an unfinished UTF-8 character,
    ``decode(prompt)`` ends in U+FFFD that later bytes could turn into a character, so it is no prefix of
    the full text; the generated tokens are then rendered as if a whole character stood between them and the
    prompt, i.e. ``decode(prompt + [c] + generated)[len(decode(prompt + [c])):]`` for a plain text piece
    ``c`` such as "a" (leading continuation bytes become U+FFFD; the prompt's text is never rewritten).

    How: sentencepiece renders a text piece by piece (``▁`` as a space, byte pieces merged into UTF-8
    characters), except that pieces at the start of a text lose a leading ``▁`` (the dummy prefix). Which
    ones depends on the sentencepiece version and model options: only the first piece (0.1.97+ with Llama's
    options) or every piece until some text is produced (older versions, or ``remove_extra_whitespaces``);
    so ``[▁, ▁word]`` is " word" or "word" on its own, but "  word" after text. Nothing is stripped once
    there is text, so the ids not yet released are decoded after an anchor piece (plain text such as "he",
    see ``Tokenizer._decode_anchor``), which makes them render as inside the full text, and the text after
    the anchor's is returned. Until the current run (the ids since the start or, with special tokens kept,
    since the last special token, after which ``decode`` starts a new sentencepiece decode) has text, its
    first ids are decoded along instead, so that sentencepiece itself decides what they strip: at most the
    special token and one lone ``▁``, since further lone ``▁`` that render nothing there change nothing.

    Tokens are held back while they end in an unfinished UTF-8 character, so no fragment or U+FFFD is
    streamed that a later byte would change; what precedes that character's lead byte is released at once.
    Generated bytes never join bytes of the prompt (hence the exception above). Each ``push`` decodes at
    most seven ids (anchor, run start, three held bytes, the new id). Call ``flush`` once at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._anchor_id, self._anchor_text = tokenizer._decode_anchor()
        self._space_id = tokenizer.piece_to_id(SPACE_MARK)
        # window[:read] was released (or is prompt) and is kept only as context; window[read:] is pending.
        self._window: list[int] = []
        self._read = 0
        self._anchored = False  # whether the window follows text: decoded after the anchor piece
        context = [tokenizer._check_id(i) for i in prompt_ids]
        if skip_special_tokens:
            context = [i for i in context if not tokenizer.is_special(i)]
        if context:
            self._keep_context(context)
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
        end = len(self._window) - self._unfinished_len()
        return self._release(end) if end > self._read else ""

    def flush(self) -> str:
        """End the stream: release what is held back (an unfinished character renders as U+FFFD, as in
        ``decode``). Later pushes are refused, since their bytes could no longer join the released text."""
        self._flushed = True
        return self._release(len(self._window)) if self._read < len(self._window) else ""

    def _unfinished_len(self) -> int:
        tail: list[int] = []
        for i in reversed(self._window[self._read:]):
            if not self._tok.is_byte(i) or len(tail) == 3:
                break
            tail.append(int(self._tok.id_to_piece(i)[3:5], 16))
        return _unfinished_tail_len(tail[::-1])

    def _render(self, ids: list[int]) -> str:
        if not self._anchored:
            return self._tok.decode(ids, self._skip)
        return self._tok.decode([self._anchor_id, *ids], self._skip)[len(self._anchor_text):]

    def _release(self, end: int) -> str:
        """Release window[:end] (ending on a whole character) and return its new text."""
        w = self._window
        prefix = self._render(w[: self._read]) if self._read else ""
        delta = self._render(w[:end])[len(prefix):]
        pending = w[end:]
        self._keep_context(w[:end])
        self._window += pending
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta

    def _keep_context(self, released: list[int]) -> None:
        """Make the window the context that the ids after ``released`` need (``released`` ends whole)."""
        tok = self._tok
        last = max((k for k, i in enumerate(released) if tok.is_special(i)), default=-1)
        run = released[last + 1:]
        if last < 0 and self._anchored:  # continues a run that already has text: no context needed
            blank = False
        elif all(i == self._space_id for i in run):
            # Lone "▁" pieces that all rendered as nothing: one of them stands for all (see the class doc).
            blank = tok.decode(run[:2]) == ""
            run = run[-1:]
        else:  # any other piece renders text even at the start (at most one "▁" is stripped from it)
            blank = False
        if blank:
            self._window = released[last:last + 1] + run if last >= 0 else run
            self._anchored = self._anchored or last >= 0
        else:
            self._window = []
            self._anchored = True
        self._read = len(self._window)
