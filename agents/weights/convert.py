"""Convert a Hugging Face Llama directory (or MindFormers ``.ckpt``) to our fused MindSpore checkpoint layout.

    python -m agents.weights.convert --model <HF dir | .ckpt> --config-from <dir with config.json> --out <dir>

The output directory holds ``config.json``, ``model.ckpt`` (fused q/k/v and gate/up, canonical names) and the
tokenizer files the source has (``tokenizer.model`` or ``tokenizer.json``, and ``tokenizer_config.json``/
``chat_template.jinja``, which carry the chat template) and ``generation_config.json`` (its end-of-sequence
ids); every loader in this project accepts it as ``--model``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from agents.weights.checkpoints import CKPT_FILE, save_mindspore_checkpoint
from agents.weights.sharded import load_rank_weights
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def convert(model: Path, out: Path, config_dir: Path | None = None) -> Path:
    """Write the converted directory and return it."""
    config_dir = config_dir or (model if model.is_dir() else model.parent)
    config = LlamaConfig.from_model_dir(config_dir)
    weights = load_rank_weights(model, config, ShardPlan(config))  # an int8 checkpoint dequantized
    out.mkdir(parents=True, exist_ok=True)
    save_mindspore_checkpoint(weights, out / CKPT_FILE)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    copy_tokenizer_files(config_dir, out)
    return out


def copy_tokenizer_files(model_dir: Path, out: Path) -> None:
    """The tokenizer and generation files ``model_dir`` has (``TOKENIZER_FILES``), copied into ``out``."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agents.weights.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config-from", type=Path, default=None,
                        help="directory with config.json (default: the model directory)")
    args = parser.parse_args(argv)
    print(convert(args.model, args.out, args.config_from))


if __name__ == "__main__":
    main()
