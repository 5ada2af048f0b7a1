"""``llm-serving generate`` (python -m llm_serving): JSON lines through the whole engine, the same as
``python -m agents.tools.generate`` on the same model; clear errors; light package import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from llm_serving.config.serving_config import ServingConfig
from llm_serving.models.default_model import ensure_default_model
from llm_serving.tokenization.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
PROMPTS = ["Hello world", "The sea was calm that morning, and the boats", "Q: why is the sky blue?\nA:",
           "Once upon a time", "A short one", "numbers 1 2 3 4"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    sections = {
        "default_model": {"data_dir": str(root / "models"), "weights": "random", "hidden_size": 64,
                          "intermediate_size": 160, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                          "vocab_size": VOCAB, "seed": 5},
        "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [4]},
        "pa_config": {"num_blocks": 64, "block_size": 8, "decode_seq_length": 64},
    }
    config_file = root / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(sections))
    cfg = ServingConfig.from_yaml(config_file)
    model_dir = ensure_default_model(cfg.default_model, cfg.max_model_len)
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    return {"root": root, "config": config_file, "model": model_dir, "prompts": prompts}


def parse_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_generate_with_standin_agents_prints_json_lines_in_order(setup):
    res = run_cli("generate", "--config", str(setup["config"]), "--prompts", str(setup["prompts"]),
                  "--max-new-tokens", "6", "--ignore-eos", "--standin-agents", "--agents", "2",
                  "--policy", "longest_output_first")
    assert res.returncode == 0, res.stderr
    lines = parse_lines(res.stdout)
    tok = Tokenizer(setup["model"])
    assert [line["prompt"] for line in lines] == PROMPTS
    for line in lines:
        assert set(line) == {"prompt", "prompt_ids", "token_ids", "logprobs", "text"}
        assert line["prompt_ids"] == tok.encode(line["prompt"])
        tokens = list(line["prompt_ids"])
        for _ in range(6):  # the stand-in agent's rule
            tokens.append((tokens[-1] * 31 + len(tokens)) % VOCAB)
        assert line["token_ids"] == tokens[len(line["prompt_ids"]):]
        assert line["logprobs"] == [-1.0] * 6 and line["text"] == tok.decode(line["token_ids"])


def test_generate_stop_strings_end_prompts_and_are_cut_from_the_text(setup):
    args = ["generate", "--config", str(setup["config"]), "--prompts", str(setup["prompts"]), "--max-new-tokens",
            "20", "--ignore-eos", "--standin-agents"]
    full = run_cli(*args)
    assert full.returncode == 0, full.stderr
    full_lines = parse_lines(full.stdout)
    text = full_lines[1]["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    res = run_cli(*args, "--stop", stop, "--stop", "never seen")
    assert res.returncode == 0, res.stderr
    for line, ref in zip(parse_lines(res.stdout), full_lines):
        if stop not in ref["text"]:
            assert line == ref
            continue
        assert line["text"] == ref["text"][: ref["text"].index(stop)]
        n = len(line["token_ids"])
        assert n < 20 and line["token_ids"] == ref["token_ids"][:n] and stop in Tokenizer(
            setup["model"]).decode(line["token_ids"])


def test_generate_matches_agents_generate_on_the_same_model(setup):
    args = ["--prompts", str(setup["prompts"]), "--max-new-tokens", "12"]
    ours = run_cli("generate", "--config", str(setup["config"]), "--model", str(setup["model"]),
                   "--decode-batch-size", "4", "--prefill-batch-size", "2", "--policy", "fcfs", *args)
    assert ours.returncode == 0, ours.stderr
    ref = subprocess.run([sys.executable, "-m", "agents.tools.generate", "--model", str(setup["model"]),
                          "--batch-size", "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert ref.returncode == 0, ref.stderr
    got, want = parse_lines(ours.stdout), parse_lines(ref.stdout)
    assert len(got) == len(want) == len(PROMPTS)
    for g, w in zip(got, want):
        assert (g["prompt"], g["prompt_ids"], g["token_ids"], g["text"]) == (
            w["prompt"], w["prompt_ids"], w["token_ids"], w["text"])
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], atol=1e-4)

    sampled = run_cli("generate", "--config", str(setup["config"]), "--model", str(setup["model"]),
                      "--temperature", "1.0", "--top-k", "50", "--seed", "3", *args)
    assert sampled.returncode == 0, sampled.stderr
    drawn = parse_lines(sampled.stdout)
    assert [d["prompt_ids"] for d in drawn] == [g["prompt_ids"] for g in got]
    assert sum(d["token_ids"] != g["token_ids"] for d, g in zip(drawn, got)) >= 3  # sampled, not greedy
    assert all(lp <= 0 for d in drawn for lp in d["logprobs"])


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "/nonexistent/p.json"], "--prompts: /nonexistent/p.json does not exist"),
    (["--model", "/nonexistent/model"], "model_config.model_path: /nonexistent/model does not exist"),
    (["--max-new-tokens", "100"], r"prompt .* \+ max_new_tokens \(100\) = .* exceeds max_model_len 64"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-3"], "--top-k must be in 0.."),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--stop", ""], "--stop: every stop string must have 1..256 characters"),
    (["--max-new-tokens", "600"], "max_new_tokens 600 exceeds model_config.max_generate_length 512"),
])
def test_generate_errors_are_one_clear_line(setup, extra, message):
    import re

    args = {"--prompts": str(setup["prompts"]), "--max-new-tokens": "4"}
    for key, value in zip(extra[::2], extra[1::2]):
        args[key] = value
    flat = [x for kv in args.items() for x in kv]
    res = run_cli("generate", "--config", str(setup["config"]), "--standin-agents", *flat)
    assert res.returncode == 2
    assert re.search(message, res.stderr), res.stderr
    assert "Traceback" not in res.stderr


def test_bad_config_and_prompts_file(setup):
    bad = setup["root"] / "bad.yaml"
    bad.write_text("model_config:\n  seq_lenght: [32]\n")
    res = run_cli("generate", "--config", str(bad), "--prompts", str(setup["prompts"]),
                  "--max-new-tokens", "2")
    assert res.returncode == 2 and "unknown key 'seq_lenght'" in res.stderr
    assert "did you mean 'seq_length'" in res.stderr
    junk = setup["root"] / "junk.json"
    junk.write_text('{"not": "a list"}')
    res = run_cli("generate", "--config", str(setup["config"]), "--prompts", str(junk),
                  "--max-new-tokens", "2")
    assert res.returncode == 2 and "must hold a non-empty JSON list" in res.stderr


def test_help_and_light_import():
    res = run_cli("--help")
    assert res.returncode == 0 and "generate" in res.stdout
    probe = ("import sys, llm_serving; assert 'llm_serving.engine.loop' not in sys.modules; "
             "from llm_serving import LLM; assert LLM.__module__ == 'llm_serving.engine.llm'; "
             "assert 'mindspore' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=False).returncode == 0
