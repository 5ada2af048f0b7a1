"""`python -m agents.tools.generate` end to end: tokenizer + loader + runner + scheduler, against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agents.weights.convert import convert
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer
from tests.hf_reference import hf_greedy, load_hf

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Hello", "The river ran past the old mill and", "Numbers: 1 2 3", "Ünïcödé and emoji 🙂 too",
           "A", "Once upon a time, in a small village by the sea, there lived", "tea?", "Why is the sky blue"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen")
    tok = train_tokenizer(root / "tok", vocab_size=1000)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return build_random_model(root / "model", config, seed=3, std=0.2, tokenizer_model=tok)


def run_generate(model: Path, prompts_file: Path, *extra: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "agents.tools.generate", "--model", str(model), "--prompts",
                          str(prompts_file), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_generate_matches_transformers(model_dir, tmp_path):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    results = run_generate(model_dir, prompts_file, "--max-new-tokens", "24", "--batch-size", "4")
    tokenizer = Tokenizer(model_dir / "tokenizer.model")
    hf = load_hf(model_dir)
    assert [r["prompt"] for r in results] == PROMPTS
    for r in results:
        assert r["prompt_ids"] == tokenizer.encode(r["prompt"])
        ref, ref_lp = hf_greedy(hf, r["prompt_ids"], 24, eos_token_id=tokenizer.eos_id)
        assert r["token_ids"] == ref
        assert r["logprobs"] == pytest.approx(ref_lp, abs=1e-4)
        assert r["text"] == tokenizer.decode(ref)

    tokenizer_config = json.dumps({"chat_template": "{{ messages[0]['content'] }}", "legacy": True})
    (model_dir / "tokenizer_config.json").write_text(tokenizer_config)
    converted = convert(model_dir, tmp_path / "converted")
    assert (converted / "model.ckpt").is_file()
    assert (converted / "tokenizer_config.json").read_text() == tokenizer_config  # the chat template travels
    assert run_generate(converted, prompts_file, "--max-new-tokens", "24", "--batch-size", "4") == results


def test_generate_reports_bad_inputs(model_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    out = subprocess.run([sys.executable, "-m", "agents.tools.generate", "--model", str(model_dir),
                          "--prompts", str(bad), "--max-new-tokens", "4"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert "must hold a JSON list of strings" in out.stderr
