"""Hugging Face ``tokenizer.json`` tokenizers (Llama 3, Qwen) through the ``tokenizers`` library: the same prompt
and chat ids as transformers' ``AutoTokenizer``, streamed text that never breaks a character, and a model
directory with only a tokenizer.json served through the whole engine, greedy ids equal to transformers'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.tokenization.chat_template import load_chat_template
from llm_serving.tokenization.hf_tokenizer import HFTokenizer, load_tokenizer
from llm_serving.tokenization.tokenizer import REPLACEMENT_CHAR, Tokenizer
from tests.hf_reference import hf_greedy, load_hf
from tests.hf_tokenizer_fixture import MULTIBYTE, build_hf_tokenizer

TEXTS = ["Hello world", "  two leading spaces\nand a newline\n\n", "def f(x):\n    return x + 1",
         *MULTIBYTE, "<|eot_id|> written in plain text", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "数据 and naïve text?"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"))  # id 0 is not <|begin_of_text|>: HF masks pad id 0


@pytest.fixture(scope="module")
def auto(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_prompt_ids_are_autotokenizers(tokenizer_dir, auto):
    tok = load_tokenizer(tokenizer_dir)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(auto)
    assert (tok.bos_id, tok.eos_id) == (auto.bos_token_id, auto.eos_token_id)
    for text in TEXTS:
        assert tok.encode(text) == auto(text)["input_ids"], text
        assert tok.encode(text, add_bos=False) == auto(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(tok.encode(text)) == auto.decode(auto(text)["input_ids"], skip_special_tokens=True)


def test_chat_prompt_ids_are_apply_chat_templates(tokenizer_dir, auto):
    tok = load_tokenizer(tokenizer_dir)
    template = load_chat_template(ServingConfig(), tokenizer_dir, tok)
    want = auto.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert template.prompt_ids(MESSAGES) == list(want)
    assert template.prompt_ids(MESSAGES)[0] == tok.bos_id  # the template's bos_token, once


def test_streamed_text_is_the_decoded_text_and_never_a_broken_character(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    prompt = tok.encode("Question: ")
    for text in MULTIBYTE:
        ids = tok.encode(text, add_bos=False)
        assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids) or text.isascii()  # characters span tokens
        decoder = tok.incremental_decoder(prompt)
        chunks = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(chunks) == text and not any(REPLACEMENT_CHAR in c for c in chunks), chunks
    # bytes of one character over several tokens: held back, then released whole
    decoder = tok.incremental_decoder()
    assert decoder.push(tok.encode("🙂", add_bos=False)[0]) == "" or len(tok.encode("🙂", add_bos=False)) == 1


def test_token_bytes_and_text_of_byte_level_pieces(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    for text in ("café", "数据", "🙂 ok"):
        ids = tok.encode(text, add_bos=False)
        assert bytes(b for i in ids for b in tok.token_bytes(i)).decode("utf-8") == text
    space_a = tok.encode(" a", add_bos=False)
    assert "".join(tok.token_text(i) for i in space_a) == " a"
    assert tok.token_text(tok.bos_id) == "<|begin_of_text|>" and tok.is_special(tok.bos_id)


def test_a_directory_with_both_files_loads_sentencepiece_first(tmp_path, tokenizer_dir):
    from llm_serving.tokenization.training import train_tokenizer

    model = train_tokenizer(tmp_path / "tokenizer")  # tokenizer.model
    (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    assert isinstance(load_tokenizer(model), Tokenizer) and isinstance(load_tokenizer(tmp_path), Tokenizer)
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), HFTokenizer)


def test_a_tokenizer_json_model_is_served_through_the_engine(tmp_path, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    eot = tok.piece_to_id("<|eot_id|>")
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.bos_id, eos_token_id=eot)
    model_dir = build_random_model(tmp_path / "llama3ish", config, seed=4, std=0.3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_text((tokenizer_dir / name).read_text())
    assert not (model_dir / "tokenizer.model").exists()
    cfg = ServingConfig.from_dict({
        "model_config": {"model_path": str(model_dir), "seq_length": [32], "prefill_batch_size": [2],
                         "decode_batch_size": [2]},
        "pa_config": {"num_blocks": 32, "block_size": 8, "decode_seq_length": 96},
        "serving_config": {"compile_cache": False}})
    prompt = "数据并行 and naïve"
    with Engine(cfg) as engine:
        engine.start(progress=None)
        result = engine.submit(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)).result(timeout=120)
    ids = tok.encode(prompt)
    assert result.prompt_ids == ids
    assert result.token_ids == hf_greedy(load_hf(model_dir), ids, 10)[0]
    assert result.text == tok.decode(ids + result.token_ids)[len(tok.decode(ids)):]
    assert np.isfinite(result.logprobs).all()
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == eot
