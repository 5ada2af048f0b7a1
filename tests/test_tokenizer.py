"""Tokenizer training, Llama id conventions, round trips and streaming detokenization."""

from __future__ import annotations

import codecs
import io
import itertools
import random

import pytest
import sentencepiece as spm

from llm_serving.tokenization.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError
from llm_serving.tokenization.training import _LLAMA_OPTIONS, DEFAULT_CORPUS, train_tokenizer

TEXTS = [
    "The lighthouse keeper wrote 14 March 1987 in his logbook.",
    "  two leading spaces, and  double  spaces inside ",
    "Lines\nwith\ttabs\n\nand blank lines\n",
    "Café, naïve façade, Zürich, São Paulo, Kraków, Dvořák, Ångström.",
    "中文：早上好！我每天早上七点起床。日本語：おはようございます。한국어: 감사합니다.",
    "Emoji 🙂🚀🌍 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 and math ∑ π²/6 ≈ 1.6449, −40 °C, €19.99",
    "rare script: ᚠᛇᚻ ꦧꦱꦗ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="module")
def tok_strip_all(tmp_path_factory) -> Tokenizer:
    """Same corpus, but ``remove_extra_whitespaces``: sentencepiece then strips the leading "▁" of every piece
    until some text is produced (as all versions before 0.1.97 do), not only the first piece's."""
    sentences = [line for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=1000,
                                   **{**_LLAMA_OPTIONS, "remove_extra_whitespaces": True})
    path = tmp_path_factory.mktemp("tok_strip_all") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    tok = Tokenizer(path)
    space, the = tok.piece_to_id("▁"), tok.piece_to_id("▁the")
    assert tok.decode([space, space, the]) == "the"  # the behaviour this fixture exists for
    return tok


def _byte_id(tok: Tokenizer, value: int) -> int:
    return tok.piece_to_id(f"<0x{value:02X}>")


# -- training --------------------------------------------------------------------------------------------------
def test_training_is_deterministic_and_path_independent(tmp_path):
    a = train_tokenizer(tmp_path / "a" / "tokenizer", vocab_size=900)
    b = train_tokenizer(tmp_path / "b" / "other", vocab_size=900)
    assert a.name == "tokenizer.model" and b.name == "other.model"
    assert a.read_bytes() == b.read_bytes()
    assert Tokenizer(a).vocab_size == 900


def test_training_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=10"):
        train_tokenizer(tmp_path / "t", vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size=400.*required_chars"):
        train_tokenizer(tmp_path / "t", vocab_size=400)  # the corpus has more distinct characters
    with pytest.raises(ValueError, match="missing.txt"):
        train_tokenizer(tmp_path / "t", corpus=tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer(tmp_path / "t", corpus=empty)


# -- vocabulary conventions ------------------------------------------------------------------------------------
def test_llama_id_conventions(tok):
    assert tok.vocab_size == 1000
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 0)
    assert [tok.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert all(tok.is_special(i) for i in range(3))
    assert tok.piece_to_id("<pad>") == tok.unk_id  # no pad piece, as in Llama
    byte_ids = [_byte_id(tok, v) for v in range(256)]
    assert byte_ids == list(range(3, 259))  # byte fallback pieces follow the specials, as in Llama
    assert all(tok.is_byte(i) and not tok.is_special(i) for i in byte_ids)
    assert not tok.is_special(tok.piece_to_id("▁the"))


def test_encode_prepends_bos_only(tok):
    ids = tok.encode("The keeper wrote.")
    assert ids[0] == tok.bos_id and tok.eos_id not in ids
    assert tok.encode("The keeper wrote.", add_bos=False) == ids[1:]
    assert tok.encode("") == [tok.bos_id]
    # split_digits: every digit is its own token
    digits = [tok.id_to_piece(i) for i in tok.encode("2024", add_bos=False)]
    assert "".join(digits).lstrip("▁") == "2024" and digits[-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    """Lossless but for one leading space, which transformers 5 drops as well: its first "▁" is read back as the
    dummy prefix (encoding gives it none when the text starts with a space: ``sp_prompt``)."""
    ids = tok.encode(text)
    want = text.removeprefix(" ")
    assert tok.decode(ids) == want
    assert tok.decode([*ids, tok.eos_id]) == want
    assert tok.decode(ids[1:]) == want


def test_byte_fallback_is_used_for_rare_characters(tok):
    ids = tok.encode("ꦧ🙂", add_bos=False)
    assert sum(tok.is_byte(i) for i in ids) == 3 + 4  # two characters spelled as UTF-8 bytes
    assert tok.unk_id not in ids


def test_decode_with_special_tokens_kept(tok):
    ids = tok.encode("keeper")
    assert tok.decode([*ids, tok.eos_id], skip_special_tokens=False) == "<s> keeper</s>"
    assert tok.decode([tok.unk_id], skip_special_tokens=False) == "<unk>"
    assert tok.decode([tok.unk_id]) == ""


def test_token_text_and_bytes(tok):
    the = tok.piece_to_id("▁the")
    assert tok.token_text(the) == " the" and tok.token_bytes(the) == [32, 116, 104, 101]
    assert tok.token_text(_byte_id(tok, 0x41)) == "A"
    assert tok.token_text(_byte_id(tok, 0x0A)) == "\n"
    assert tok.token_text(_byte_id(tok, 0xE4)) == "<0xE4>" and tok.token_bytes(_byte_id(tok, 0xE4)) == [0xE4]
    assert tok.token_text(tok.eos_id) == "</s>"


# -- errors ----------------------------------------------------------------------------------------------------
def test_missing_and_invalid_model_files(tmp_path, tok):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(TokenizerError, match="not found.*nope"):
        Tokenizer(missing)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(TokenizerError, match="bad.model"):
        Tokenizer(bad)
    # a directory holding tokenizer.model is accepted
    assert Tokenizer(tok.path.parent).vocab_size == tok.vocab_size


def test_invalid_ids_and_inputs(tok):
    with pytest.raises(TokenizerError, match="token id 1000 .*vocab_size 1000"):
        tok.decode([5, 1000])
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.id_to_piece(-1)
    with pytest.raises(TokenizerError, match="expects str"):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="token id 5000"):
        IncrementalDecoder(tok).push(5000)


# -- streaming -------------------------------------------------------------------------------------------------
def _stream(tok, gen, prompt=(), skip=True) -> tuple[list[str], str]:
    dec = IncrementalDecoder(tok, prompt, skip_special_tokens=skip)
    chunks = [dec.push(i) for i in gen]
    chunks.append(dec.flush())
    assert dec.text == "".join(chunks)
    return chunks, dec.text


def _random_ids(tok, rng: random.Random, n: int, shares: tuple[float, ...] = (0.45, 0.0, 0.1, 0.15),
                any_piece: bool = False) -> list[int]:
    """Mix of ordinary pieces (any id of the vocabulary with ``any_piece``), lone "▁" pieces, specials, random
    (often invalid) bytes, in these ``shares``, and valid multi-byte characters spelt in bytes (the rest)."""
    space = tok.piece_to_id("▁")
    cuts = list(itertools.accumulate(shares))
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < cuts[0]:
            out.append(rng.randrange(0 if any_piece else 259, tok.vocab_size))
        elif r < cuts[1]:
            out.append(space)
        elif r < cuts[2]:
            out.append(rng.randrange(0, 3))
        elif r < cuts[3]:
            out.append(_byte_id(tok, rng.randrange(256)))
        else:
            ch = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF),
                                 rng.randrange(0x1F300, 0x1FAFF)]))
            out.extend(_byte_id(tok, b) for b in ch.encode("utf-8"))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode_for_random_sequences(tok, skip):
    rng = random.Random(1234 + skip)
    for _ in range(300):
        gen = _random_ids(tok, rng, rng.randrange(1, 30))
        _, text = _stream(tok, gen, skip=skip)
        assert text == tok.decode(gen, skip_special_tokens=skip), gen


@pytest.mark.parametrize("skip", [True, False])
def test_stream_after_prompt_equals_suffix_of_full_decode(tok, skip):
    rng = random.Random(99 + skip)
    prompts = [tok.encode(t) for t in TEXTS] + [[tok.bos_id]]
    for _ in range(300):
        prompt = rng.choice(prompts)
        gen = _random_ids(tok, rng, rng.randrange(1, 30))
        whole, head = tok.decode(prompt + gen, skip), tok.decode(prompt, skip)
        assert whole.startswith(head)
        _, text = _stream(tok, gen, prompt, skip=skip)
        assert text == whole[len(head):], (prompt, gen)


@pytest.mark.parametrize("text", TEXTS[:-1])
def test_streaming_real_text_never_emits_broken_characters(tok, text):
    ids = tok.encode("Prompt: " + text)
    cut = len(tok.encode("Prompt:"))
    prompt, gen = ids[:cut], ids[cut:]
    chunks, streamed = _stream(tok, gen, prompt)
    assert streamed == " " + text
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[-1] == ""  # nothing was left for flush
    # multi-byte characters spelled as bytes are released whole, after their last byte
    if any(tok.is_byte(i) and tok.id_to_piece(i) >= "<0x80>" for i in gen):
        assert chunks.count("") > 1


def test_multibyte_character_released_on_last_byte(tok):
    dec = IncrementalDecoder(tok, tok.encode("emoji"))
    parts = [dec.push(_byte_id(tok, b)) for b in "🙂".encode()]
    assert parts == ["", "", "", "🙂"]
    assert dec.push(tok.piece_to_id("▁the")) == " the"


def test_leading_space_of_first_generated_token_is_kept(tok):
    prompt = tok.encode("The keeper")
    gen = tok.encode("wrote the log", add_bos=False)  # first piece starts with "▁"
    assert tok.id_to_piece(gen[0]).startswith("▁")
    dec = IncrementalDecoder(tok, prompt)
    assert dec.push(gen[0]).startswith(" ")
    for i in gen[1:]:
        dec.push(i)
    assert dec.text == " wrote the log"
    # without a prompt the text matches decode(generated), which drops the dummy-prefix space
    assert _stream(tok, gen)[1] == "wrote the log" == tok.decode(gen)
    # after a bos-only prompt, as decode(prompt + gen) shows it
    assert _stream(tok, gen, [tok.bos_id])[1] == tok.decode([tok.bos_id, *gen])


def test_unfinished_character_is_held_then_flushed(tok):
    dec = IncrementalDecoder(tok, tok.encode("x"))
    assert dec.push(_byte_id(tok, 0xE4)) == ""
    assert dec.push(_byte_id(tok, 0xBD)) == ""
    assert dec.text == ""
    assert dec.flush() == "\ufffd\ufffd" == tok.decode([_byte_id(tok, 0xE4), _byte_id(tok, 0xBD)])
    with pytest.raises(TokenizerError, match="after flush"):
        dec.push(5)


@pytest.mark.parametrize("fixture", ["tok", "tok_strip_all"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("with_prompt", [True, False])
def test_stream_decodes_a_bounded_window(fixture, skip, with_prompt, request, monkeypatch):
    tok = request.getfixturevalue(fixture)
    rng = random.Random(7)
    space = tok.piece_to_id("▁")
    # lone "▁" pieces at the start render nothing on tok_strip_all: they must not pile up in the window
    gen = [space] * 50 + _random_ids(tok, rng, 2000) + [tok.eos_id] + [space] * 50 + [_byte_id(tok, 0xE4)] * 50
    prompt = tok.encode("a prompt with several tokens in it") if with_prompt else []
    longest = 0
    real_decode = Tokenizer.decode

    def spy(self, ids, skip_special_tokens=True):
        nonlocal longest
        ids = list(ids)
        longest = max(longest, len(ids))
        return real_decode(self, ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    _stream(tok, gen, prompt, skip)
    # anchor + context (a special token and a lone "▁" at most) + 3 held bytes + the new token
    assert 0 < longest <= 7


def _random_vocab_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Any id of the vocabulary, with lone "▁" pieces, special ids and byte pieces (also spelling whole UTF-8
    characters, so that bytes merge) drawn more often than their share of the vocabulary."""
    return _random_ids(tok, rng, n, shares=(0.4, 0.2, 0.1, 0.15), any_piece=True)


def _ends_mid_character(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether the trailing byte pieces of ``ids`` are the unfinished start of a valid UTF-8 character."""
    tail = bytearray()
    for i in reversed(ids):
        if not tok.is_byte(i):
            break
        tail.insert(0, int(tok.id_to_piece(i)[3:5], 16))
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(bytes(tail), final=False)
    return bool(decoder.getstate()[0])


@pytest.mark.parametrize("fixture", ["tok", "tok_strip_all"])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_of_continuation_for_random_vocab_ids(fixture, skip, request):
    """push + flush == decode(prompt + gen)[len(decode(prompt)):], or decode(gen) without a prompt.

    Excluded, as documented by IncrementalDecoder: a prompt (specials removed when skipped) ending with an
    unfinished UTF-8 character, whose decode is no prefix of the full text; there the generated tokens are
    rendered as if the one-character piece "a" stood between them and the prompt.
    """
    tok = request.getfixturevalue(fixture)
    rng = random.Random(2024 + 2 * skip + (fixture == "tok_strip_all"))
    letter = tok.piece_to_id("a")
    texts = [tok.encode(t) for t in TEXTS]
    mid_character = 0
    for n in range(2500):
        gen = _random_vocab_ids(tok, rng, rng.randrange(1, 40))
        kind = n % 3  # no prompt, random ids, encoded text (+ random ids)
        prompt = [] if kind == 0 else _random_vocab_ids(tok, rng, rng.randrange(1, 10))
        if kind == 2:
            prompt = rng.choice(texts) + prompt[: rng.randrange(3)]
        _, text = _stream(tok, gen, prompt, skip)
        if not prompt:
            assert text == tok.decode(gen, skip), gen
            continue
        if _ends_mid_character(tok, [i for i in prompt if not (skip and tok.is_special(i))]):
            mid_character += 1
            prompt = [*prompt, letter]
        whole, head = tok.decode(prompt + gen, skip), tok.decode(prompt, skip)
        assert whole.startswith(head), (prompt, gen)
        assert text == whole[len(head):], (prompt, gen)
    assert 50 < mid_character < 500  # the exclusion is exercised, and stays the exception


@pytest.mark.parametrize("fixture", ["tok", "tok_strip_all"])
def test_lone_space_piece_then_space_word_piece_keeps_both_spaces(fixture, request):
    """Regression: "▁" then "▁the" streamed one space where sentencepiece decodes two inside a text."""
    tok = request.getfixturevalue(fixture)
    space, the, he = tok.piece_to_id("▁"), tok.piece_to_id("▁the"), tok.piece_to_id("he")
    assert [tok.id_to_piece(i) for i in (space, the, he)] == ["▁", "▁the", "he"]
    assert tok.decode([he, space, the]) == "he  the"
    assert _stream(tok, [he, space, the]) == (["he", " ", " the", ""], "he  the")
    prompt = tok.encode("The keeper")
    assert tok.decode(prompt + [space, the]) == "The keeper  the"
    assert _stream(tok, [space, the], prompt)[1] == "  the"
    assert _stream(tok, [space, space, the], prompt)[1] == "   the"
    # At the start of a text sentencepiece strips the first piece's "▁" (Llama's options, sentencepiece
    # 0.1.97+) or every leading one (remove_extra_whitespaces, older versions); the stream follows it.
    expected = {"tok": [" the", "  the", "<s>  the"], "tok_strip_all": ["the", "the", "<s> the"]}[fixture]
    assert [tok.decode([space, the]), tok.decode([space, space, the]),
            tok.decode([tok.bos_id, space, the], skip_special_tokens=False)] == expected
    assert _stream(tok, [space, the])[1] == expected[0]
    assert _stream(tok, [space, space, the])[1] == expected[1]
    assert _stream(tok, [space, space, the], [tok.bos_id])[1] == expected[1]
    assert _stream(tok, [tok.bos_id, space, the], skip=False)[1] == expected[2]
    assert _stream(tok, [space, the], [tok.bos_id], skip=False)[1] == expected[2][3:]
    # after a special token kept in the text, a new run starts: the same rule applies to it
    kept = tok.decode([he, tok.eos_id, space, space, the], skip_special_tokens=False)
    assert _stream(tok, [he, tok.eos_id, space, space, the], skip=False)[1] == kept


def test_bytes_before_an_unfinished_character_are_released(tok):
    e4 = _byte_id(tok, 0xE4)
    dec = IncrementalDecoder(tok, tok.encode("x"))
    assert [dec.push(e4), dec.push(e4), dec.push(_byte_id(tok, 0xBD))] == ["", "\ufffd", ""]
    assert dec.push(_byte_id(tok, 0xA0)) == "你"


def test_prompt_ending_mid_character_is_not_rewritten(tok):
    prompt = [*tok.encode("x"), _byte_id(tok, 0xE4)]
    gen = [_byte_id(tok, 0xBD), _byte_id(tok, 0xA0), tok.piece_to_id("▁the")]
    assert tok.decode(prompt) == "x\ufffd" and tok.decode(prompt + gen) == "x你 the"  # no prefix of it
    assert _stream(tok, gen, prompt)[1] == "\ufffd\ufffd the"


@pytest.mark.parametrize("legacy", [True, False, None])
def test_prompt_ids_are_transformers_for_spaces_and_special_tokens_in_the_text(tmp_path, tok, legacy):
    """transformers 5 (a converted tokenizers pipeline over the same tokenizer.model): special tokens spelled in
    the text are their ids, and the dummy-prefix space goes only before text that does not start with one, after
    a special token too with legacy true (tokenizer_config.json beside the model; absent is legacy false)."""
    import json
    import shutil

    from transformers import LlamaTokenizer

    shutil.copy(tok.path, tmp_path / "tokenizer.model")
    settings = {} if legacy is None else {"legacy": legacy}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", **settings}))
    hf, ours = LlamaTokenizer.from_pretrained(str(tmp_path)), Tokenizer(tmp_path / "tokenizer.model")
    texts = [*TEXTS, " Hello", "Hello </s> world", "Hello </s>  world", "a\n</s>\nb", "</s> x", "x <unk> y",
             "<s>[INST] hi [/INST] ok </s><s>[INST] again", "\n\nstart"]
    for text in texts:
        assert ours.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"], text


SHIPPED_PROMPTS = ["def", "def main():\n    return 1", " leading space", "two  spaces", "Hello, world!", "x = [1, 2]",
                   "\n\nnewlines first", "tabs\tand\ttabs", "unicode é ü 中文", "emoji 🙂 here", "<s> inside text",
                   "text then </s> eos", "a", "", "   ", "import os\nimport sys", "class A:\n    pass\n", "1234567890",
                   "CamelCase snake_case", "# comment", "'quoted' \"double\"", "a\r\nb", "end with space ", "ÿ byte",
                   "def f(x):\n\treturn x*2", "    indented", "print('hi')", "<unk> token", "mixed <s>text</s>", "🙂"]


def test_the_shipped_model_directory_loads_in_transformers_with_the_servers_ids():
    """Clients that tokenize themselves (guidellm, aiperf, lm-eval) load the embedded model's directory with
    ``AutoTokenizer``: its tokenizer_config.json must give a Llama tokenizer with BOS and the server's ids."""
    from transformers import AutoTokenizer

    from llm_serving.models.default_model import TRAINED_MODEL
    from llm_serving.tokenization.hf_tokenizer import load_tokenizer

    ours, auto = load_tokenizer(TRAINED_MODEL), AutoTokenizer.from_pretrained(TRAINED_MODEL)
    assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id) == (1, 2)
    assert len(SHIPPED_PROMPTS) == 30
    for text in SHIPPED_PROMPTS:
        assert auto(text)["input_ids"] == ours.encode(text), text
        assert auto(text)["input_ids"][0] == 1
    # transformers 5 without sentencepiece (guidellm's and aiperf's environments) reads tokenizer.json alone: it
    # must hold the same pipeline (without it, transformers tried to read tokenizer.model as a tiktoken file)
    from tokenizers import Tokenizer as FastTokenizer

    fast = FastTokenizer.from_file(str(TRAINED_MODEL / "tokenizer.json"))
    for text in SHIPPED_PROMPTS:
        assert fast.encode(text).ids == ours.encode(text), text
