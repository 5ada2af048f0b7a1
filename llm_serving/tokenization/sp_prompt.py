"""Prompt text to ids with a sentencepiece Llama model, as transformers 5's ``AutoTokenizer`` does it.

transformers 5 serves a ``tokenizer.model`` through a converted ``tokenizers`` pipeline, so a prompt is not simply
``sentencepiece.encode(text)``:
- special tokens spelled in the text (``<s>``, ``</s>``, ``<unk>``) are their ids, the text between them
  encoded piece by piece;
- the dummy-prefix space (Metaspace) goes before a piece that does not already start with a space: every piece
  with ``legacy`` true in ``tokenizer_config.json``, only the text at the very start otherwise (``legacy`` false or
  absent), none with ``add_prefix_space`` false. sentencepiece alone adds one before every text, so " Hello"
  became "▁▁Hello" and a special token's text was encoded as characters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import sentencepiece as spm

PREFIX_SCHEMES = ("always", "first", "never")


def prefix_scheme(config_file: Path) -> str:
    """Where transformers 5 puts the dummy-prefix space, from ``tokenizer_config.json`` (absent: "first")."""
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, ValueError):
        settings = {}
    if not isinstance(settings, dict):
        settings = {}
    if settings.get("add_prefix_space") is False:
        return "never"
    return "always" if settings.get("legacy") is True else "first"


def bare_model(model_file: Path) -> spm.SentencePieceProcessor:
    """The sentencepiece model with the dummy-prefix space switched off (needs protobuf)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


class PromptEncoder:
    """``encode(text)``: the ids of prompt text (no BOS) for one sentencepiece model and prefix scheme."""

    def __init__(self, sp: spm.SentencePieceProcessor, model_file: Path, special: dict[str, int], scheme: str) -> None:
        if scheme not in PREFIX_SCHEMES:
            raise ValueError(f"prefix scheme must be one of {PREFIX_SCHEMES}, got {scheme!r}")
        self.scheme = scheme
        self._sp, self._model_file = sp, model_file
        self._special = special
        longest_first = sorted(special, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if special else None
        # the other schemes need it for most pieces: built now, so a missing protobuf fails at load; "always" only
        # for a piece that starts with a space, built then
        self._bare = bare_model(model_file) if scheme != "always" else None

    def encode(self, text: str) -> list[int]:
        parts = self._split.split(text) if self._split is not None else [text]
        if len(parts) == 1 and self.scheme != "never" and not text.startswith(" "):
            return self._sp.encode(text)  # the common prompt: one text, its prefix where sentencepiece puts it
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self._special[part])
            elif part:
                ids.extend(self._piece(part, first=k == 0))
        return ids

    def _piece(self, part: str, first: bool) -> list[int]:
        prefixed = self.scheme == "always" or (self.scheme == "first" and first)
        if prefixed and not part.startswith(" "):
            return self._sp.encode(part)
        if self._bare is None:
            self._bare = bare_model(self._model_file)
        return self._bare.encode(part)
