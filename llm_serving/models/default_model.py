"""The embedded default model: the shipped trained model, or a small random-weight Llama built once and cached.

With no ``model_config.model_path`` the server still has to serve something without downloads. By default
(``default_model.weights: trained``) that is the target of the trained pair in ``pydoc/`` (scripts/train_model_pair.py):
readable text, nothing to build. With ``weights: random`` the ``default_model`` section describes a Llama that is
generated locally: a sentencepiece tokenizer trained on
the packaged corpus and seeded random weights in Hugging Face format. The build is deterministic, so the
cache directory is named by a hash of everything that determines its content; a changed section builds a
new directory instead of serving stale weights. Concurrent first starts (several servers, test workers)
each build into a private temporary directory and publish it with an atomic rename: the first rename wins
and the others discard their copy. Never imports MindSpore.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llm_serving.config.sections import DefaultModelSection
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.tokenization.training import train_tokenizer

FORMAT_VERSION = 1  # bump when the build recipe changes, so old caches are not reused
WEIGHT_STD = 0.2  # std of the random weights: well-separated logits, so greedy output is stable
MIN_POSITIONS = 4096  # max_position_embeddings written to config.json (at least the served context)
# the target of the trained pair (scripts/train_model_pair.py), shipped with the package
TRAINED_MODEL = Path(__file__).resolve().parent / "pydoc" / "target"
_READY_FILE = "BUILD_INFO.json"  # written last inside the temporary dir: its presence marks a whole build


def default_llama_config(section: DefaultModelSection, max_model_len: int = 0) -> LlamaConfig:
    return section.llama_config(max(MIN_POSITIONS, max_model_len))


def build_key(section: DefaultModelSection, max_model_len: int = 0) -> str:
    """Hash of everything that determines the built files (not ``data_dir``)."""
    recipe = {
        "format": FORMAT_VERSION,
        "std": WEIGHT_STD,
        "seed": section.seed,
        "tokenizer_vocab_size": section.vocab_size,
        "llama": dataclasses.asdict(default_llama_config(section, max_model_len)),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def default_model_dir(section: DefaultModelSection, max_model_len: int = 0) -> Path:
    return Path(section.data_dir) / f"default-llama-{build_key(section, max_model_len)}"


def ensure_default_model(section: DefaultModelSection, max_model_len: int = 0,
                         progress: Callable[[str], None] | None = None) -> Path:
    """The model directory (config.json, model.safetensors, tokenizer.model): the shipped trained model, or the
    cached random one, built if missing."""
    if section.weights == "trained":
        if not (TRAINED_MODEL / "model.safetensors").is_file():
            raise OSError(f"default_model.weights trained: the shipped model is missing from {TRAINED_MODEL} (an "
                          "install without package data?); python scripts/train_model_pair.py makes it again")
        return TRAINED_MODEL
    final = default_model_dir(section, max_model_len)
    if (final / _READY_FILE).is_file():
        return final
    config = default_llama_config(section, max_model_len)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    except OSError as exc:
        raise OSError(f"default_model.data_dir {section.data_dir}: cannot create the model cache there: "
                      f"{exc}") from exc
    try:
        if progress:
            progress(f"building the embedded default model (hidden {section.hidden_size}, "
                     f"{section.num_layers} layers, vocab {section.vocab_size}) in {final}")
        tokenizer = train_tokenizer(tmp / "trained", vocab_size=section.vocab_size)
        build_random_model(tmp, config, seed=section.seed, std=WEIGHT_STD, tokenizer_model=tokenizer)
        tokenizer.unlink()  # build_random_model copied it to tmp/tokenizer.model
        info = {"key": build_key(section, max_model_len), "section": dataclasses.asdict(section)}
        (tmp / _READY_FILE).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(tmp, final)  # atomic publish; fails if another process published first
        except OSError:
            if not (final / _READY_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return final
