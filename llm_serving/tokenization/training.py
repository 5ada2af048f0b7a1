"""Train a small Llama-style sentencepiece tokenizer from the packaged corpus.

Real Llama-2 tokenizers cannot be downloaded here, so tests and the tiny demo model use one trained
locally with the same conventions: BPE, ``<unk>``=0, ``<s>``=1, ``</s>``=2, no pad piece, byte fallback,
digits split, a dummy-prefix space, and identity normalization. Training reads sentences from memory
and writes the model proto itself, so the result does not embed file paths and is byte-identical
across runs and directories.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import sentencepiece as spm

# One corpus serves both the load-test workloads and this tokenizer (llm_serving/bench/data/corpus.txt)
from llm_serving.bench.workload import DEFAULT_CORPUS

# Options mirroring the trainer_spec stored in Llama-2's tokenizer.model, minus its vocabulary size (the trainer's
# keyword options: its stub takes them as **kwargs: Any).
_LLAMA_OPTIONS: dict[str, Any] = {
    "model_type": "bpe",
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
    "unk_piece": "<unk>",
    "bos_piece": "<s>",
    "eos_piece": "</s>",
    "byte_fallback": True,
    "split_digits": True,
    "split_by_unicode_script": True,
    "split_by_number": True,
    "split_by_whitespace": True,
    "allow_whitespace_only_pieces": True,
    "add_dummy_prefix": True,
    "remove_extra_whitespaces": False,
    "normalization_rule_name": "identity",
    "character_coverage": 0.99995,
    "max_sentence_length": 4192,
    "max_sentencepiece_length": 16,
    # Determinism: one thread, every sentence, no shuffling.
    "num_threads": 1,
    "input_sentence_size": 0,
    "shuffle_input_sentence": False,
    "minloglevel": 2,
}

# 3 special pieces + 256 byte pieces must fit. The packaged corpus's characters need about 830 in all;
# sentencepiece reports the exact figure for a given corpus.
MIN_VOCAB_SIZE = 300


def train_tokenizer(model_prefix: str | Path, vocab_size: int = 1000, corpus: Path | None = None) -> Path:
    """Train on ``corpus`` (default: the packaged one) and write ``<model_prefix>.model``; return its path."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small; byte fallback needs at least {MIN_VOCAB_SIZE}")
    corpus = Path(corpus) if corpus is not None else DEFAULT_CORPUS
    try:
        sentences = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read tokenizer training corpus {corpus}: {e}") from e
    if not sentences:
        raise ValueError(f"tokenizer training corpus {corpus} has no text")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, **_LLAMA_OPTIONS
        )
    except RuntimeError as e:  # e.g. vocab_size larger than the corpus supports
        raise ValueError(f"sentencepiece training on {corpus} with vocab_size={vocab_size} failed: {e}") from e
    out = Path(f"{model_prefix}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(model.getvalue())
    return out
