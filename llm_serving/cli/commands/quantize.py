"""The ``quantize`` subcommand: ``llm-serving quantize --model DIR --out DIR``.

Writes the model's int8 checkpoint (the decoder layers' projections as int8 with a scale per output channel, in
compressed-tensors' W8A16 layout; ``agents.weights.quantize_checkpoint``), which ``model_config.quantization:
w8a16`` serves without quantizing at load. numpy and safetensors only: no MindSpore here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_serving.cli.options import CliError, Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory (safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the int8 checkpoint (created)")


def _run(args: argparse.Namespace) -> int:
    from agents.weights.checkpoints import WeightLoadError
    from agents.weights.quantize_checkpoint import quantize_checkpoint
    from llm_serving.protocol.model_config import ModelConfigError

    try:
        out = quantize_checkpoint(Path(args.model), Path(args.out))
    except (WeightLoadError, ModelConfigError, OSError) as exc:
        raise CliError(str(exc)) from None
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"{out}: int8 checkpoint, {size / 2**20:.1f} MiB of safetensors; serve it with "
          "model_config.quantization: w8a16")
    return 0


COMMAND = Command("quantize", "write a model's int8 checkpoint (W8A16, compressed-tensors layout)", _add_arguments,
                  _run)
