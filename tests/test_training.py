"""Training the shipped pair (issue 32, agents.training): the corpus is the standard library's text, split by
module; the training net is Hugging Face's Llama (its logits equal transformers' on the exported bf16 weights,
GQA and tied embeddings included); a few steps lower the loss; bf16 rounding is to nearest even; and the shipped
models load and beat the unigram baseline they report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agents.training.corpus import HELD_OUT_EVERY, stdlib_corpus
from agents.training.export import from_bf16_bits, to_bf16_bits
from llm_serving.protocol.model_config import LlamaConfig
from tests.script_runner import run_script

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "llm_serving" / "models" / "pydoc"


def test_the_corpus_is_the_standard_librarys_text_split_by_module():
    corpus = stdlib_corpus()
    train, held = corpus.chars
    assert train > 1_000_000 and 0.01 < held / train < 3 / HELD_OUT_EVERY
    assert any("Return" in doc for doc in corpus.train[:200])
    assert stdlib_corpus().held_out == corpus.held_out  # the same split every time


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1e-40, np.inf, np.nan], np.float32)
    y = from_bf16_bits(to_bf16_bits(x))
    assert y[0] == 1.0 and y[1] == 1.0  # a tie goes to the even mantissa
    assert y[2] == 1.0 + 4 * 2**-8 and y[3] == -2.5 and np.isinf(y[5]) and np.isnan(y[6])


TRAIN_SCRIPT = """
import json, sys
import numpy as np
from agents.training.llama_train import set_graph_mode
from agents.training.trainer import TrainSettings, train
from agents.training.export import write_model_dir
from llm_serving.protocol.model_config import LlamaConfig
set_graph_mode()
out, tok = sys.argv[1], sys.argv[2]
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
text = np.tile(np.arange(3, 40, dtype=np.int32), 60)  # a repeated pattern: easy to learn
settings = TrainSettings(steps=30, batch_size=4, seq_len=32, peak_lr=1e-2, warmup_steps=5, eval_every=15)
net, report = train(config, settings, text, text[:400], log=lambda line: None)
write_model_dir(__import__("pathlib").Path(out), config, net.hf_tensors(), __import__("pathlib").Path(tok), report)
ids = np.arange(3, 35, dtype=np.int32)[None]
from mindspore import Tensor
from agents.training.llama_train import TrainLlama, load_hf_tensors
from agents.weights.checkpoints import SafetensorsFile
again = TrainLlama(config, 32, 1)
load_hf_tensors(again, dict(SafetensorsFile(__import__("pathlib").Path(out) / "model.safetensors").items()))
np.save(out + "/logits.npy", again.logits(Tensor(ids)).asnumpy())
print(json.dumps(report["history"]))
"""


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory) -> tuple[Path, list]:
    from llm_serving.tokenization.training import train_tokenizer

    d = tmp_path_factory.mktemp("training")
    tok = train_tokenizer(d / "tok", vocab_size=1000)  # any tokenizer: the tests feed ids
    out = d / "model"
    res = run_script(d, f"import sys\nsys.argv = ['train', {str(out)!r}, {str(tok)!r}]\n" + TRAIN_SCRIPT)
    assert res.returncode == 0, res.stderr[-2000:]
    return out, json.loads(res.stdout.strip().splitlines()[-1])


def test_a_few_steps_lower_the_held_out_loss(trained_tiny):
    _, history = trained_tiny
    assert history[-1]["held_out_perplexity"] < history[0]["held_out_perplexity"] < 64  # below uniform


def test_the_training_net_is_hugging_faces_llama(trained_tiny):
    torch = pytest.importorskip("torch")
    from tests.hf_reference import load_hf

    out, _ = trained_tiny
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    hf = load_hf(out)
    with torch.no_grad():
        ref = hf(torch.arange(3, 35)[None]).logits[0].numpy()
    ours = np.load(out / "logits.npy")
    assert np.abs(ours - ref).max() < 2e-4 * max(1.0, np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", ["target", "draft"])
def test_the_shipped_models_load_and_beat_the_unigram_baseline(name):
    report = json.loads((PAIR / name / "TRAINING.json").read_text())
    assert report["held_out_perplexity"] < report["corpus"]["unigram_held_out_perplexity"] / 4
    config = LlamaConfig.from_model_dir(PAIR / name)
    assert config.vocab_size == 4096 and config.tie_word_embeddings
    assert (PAIR / name / "tokenizer.model").read_bytes() == (PAIR / "target" / "tokenizer.model").read_bytes()
