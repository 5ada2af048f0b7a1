"""The ``quantize`` subcommand: ``llm-serving quantize --model DIR --out DIR``.

Writes the model's int8 checkpoint (the decoder layers' projections, a mixture-of-experts model's routed and shared
experts included, as int8 with a scale per output channel, in compressed-tensors' W8A16 layout), which
``model_config.quantization: w8a16`` serves without quantizing at load.
The master imports no agents module: ``python -m agents.weights.quantize_checkpoint`` writes it in a child process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from llm_serving.cli.options import CliError, Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory (safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the int8 checkpoint (created)")


def _run(args: argparse.Namespace) -> int:
    done = subprocess.run([sys.executable, "-m", "agents.weights.quantize_checkpoint", "--model", args.model,
                           "--out", args.out], capture_output=True, text=True, check=False)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise CliError(lines[-1].removeprefix("error: ") if lines else f"exit status {done.returncode}")
    print(done.stdout.strip())
    return 0


COMMAND = Command("quantize", "write a model's int8 checkpoint (W8A16, compressed-tensors layout)", _add_arguments,
                  _run)
