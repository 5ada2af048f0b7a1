"""Hugging Face tokenizer directories trained here: byte-level BPE (the ``tokenizers`` library) on text every
machine has (Python's own sources) plus some multi-byte text. Llama 3's style: ``<|begin_of_text|>`` added by the
post-processor, its header tokens and chat template in ``tokenizer_config.json``. Qwen's (``build_chatml_tokenizer``):
no BOS, ChatML's ``<|im_start|>``/``<|im_end|>`` and its template (a default system turn), ``<|im_end|>`` the
eos_token of tokenizer_config.json while config.json names ``<|endoftext|>``."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|reserved_special_token_0|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
MULTIBYTE = ["naïve café déjà vu", "数据并行与张量并行", "東京の天気は晴れです", "emoji 🙂🚀 end", "ΑΒΓ αβγ"]
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


CHATML_SPECIAL = ["<|fim_pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # id 0 a filler: HF masks pad id 0
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in ("textwrap.py", "string.py", "json/__init__.py", "heapq.py"):
        lines += (stdlib / name).read_text(encoding="utf-8").splitlines()
    return lines + MULTIBYTE * 3


def byte_level_bpe(special: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on ``corpus()`` with ``special`` first in its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def build_hf_tokenizer(out: Path, vocab_size: int = 600) -> Path:
    """Write tokenizer.json and tokenizer_config.json to ``out``; returns ``out``."""
    tok = byte_level_bpe(SPECIAL, vocab_size)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}))
    return out


def build_chatml_tokenizer(out: Path, vocab_size: int = 600) -> Path:
    """Write a Qwen-style tokenizer.json and tokenizer_config.json to ``out``; returns ``out``."""
    tok = byte_level_bpe(CHATML_SPECIAL, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False}))
    return out
