"""Train the shipped model pair (a target and a draft sharing one tokenizer) with MindSpore on this CPU.

    python scripts/train_model_pair.py                      # both, into llm_serving/models/pydoc/
    python scripts/train_model_pair.py --only draft --draft-steps 50 --out /tmp/pair   # a quick check

The text is the standard library's docstrings and reference topics (agents.training.corpus). The tokenizer
(sentencepiece, Llama-2 conventions) is trained first; each model's directory gets TRAINING.json with its
settings, held-out perplexity over training and the unigram baseline.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.training.corpus import stdlib_corpus
from agents.training.export import write_model_dir
from agents.training.llama_train import set_graph_mode
from agents.training.trainer import TrainSettings, token_stream, train, unigram_perplexity
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.tokenization.training import train_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "llm_serving" / "models" / "pydoc"
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096


def pair_configs(vocab_size: int) -> dict[str, LlamaConfig]:
    common = {"vocab_size": vocab_size, "tie_word_embeddings": True, "max_position_embeddings": MAX_POSITIONS}
    return {
        "target": LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, **common),
        "draft": LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, **common),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", choices=["target", "draft"])
    ap.add_argument("--target-steps", type=int, default=800)
    ap.add_argument("--draft-steps", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    set_graph_mode()

    corpus = stdlib_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("\n".join(corpus.train) + "\n", encoding="utf-8")
        tokenizer = train_tokenizer(Path(tmp) / "tokenizer", vocab_size=VOCAB_SIZE, corpus=text)
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
        train_ids = token_stream(sp.encode(corpus.train), sp.bos_id(), sp.eos_id())
        held_ids = token_stream(sp.encode(corpus.held_out), sp.bos_id(), sp.eos_id())
        baseline = unigram_perplexity(train_ids, held_ids, VOCAB_SIZE)
        data = {"source": corpus.source, "python": platform.python_version(), "train_chars": corpus.chars[0],
                "held_out_chars": corpus.chars[1], "train_tokens": len(train_ids), "held_out_tokens": len(held_ids),
                "unigram_held_out_perplexity": round(baseline, 3)}
        print(json.dumps(data))
        steps = {"target": args.target_steps, "draft": args.draft_steps}
        for name, config in pair_configs(VOCAB_SIZE).items():
            if args.only and name != args.only:
                continue
            settings = replace(TrainSettings(steps=steps[name], seed=args.seed),
                               eval_every=max(1, min(200, steps[name])))
            print(f"training {name}: {config}")
            net, report = train(config, settings, train_ids, held_ids)
            report["corpus"] = data
            out = write_model_dir(args.out / name, config, net.hf_tensors(), tokenizer, report)
            print(f"{name}: held-out perplexity {report['held_out_perplexity']} (unigram {baseline:.1f}) -> {out}")


if __name__ == "__main__":
    main()
