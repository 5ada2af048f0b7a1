"""The ``calibrate-kv`` subcommand: ``llm-serving calibrate-kv --model DIR [--text FILE] [--out FILE]``.

Writes the static per-channel scales an int8 KV cache on Ascend reads (``model_config.kv_cache_dtype: int8``,
``device_target: Ascend``): the model's keys and values over sample text, their largest magnitude per channel
(docs/quantization.md). The text is tokenized here with the model's tokenizer; ``python -m
agents.tools.calibrate_kv`` runs the float model on this CPU in a child process (the master never imports
MindSpore). Calibrate on text like what will be served: the scales clip anything larger.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from llm_serving.cli.options import CliError, Command
from llm_serving.protocol.model_config import KV_SCALE_HEADROOM

DEFAULT_TEXT_NAME = "corpus.txt"  # the load tool's packaged corpus (llm_serving.bench.workload.DEFAULT_CORPUS)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (config.json, weights, tokenizer)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help=f"sample text to calibrate on (repeatable; default: {DEFAULT_TEXT_NAME}, "
                        "the load tool's corpus)")
    p.add_argument("--windows", type=int, default=32, metavar="N", help="at most N windows of text (default 32)")
    p.add_argument("--window-tokens", type=int, default=256, metavar="T",
                   help="tokens per window, each prefilled on its own (default 256, at most the model's positions)")
    p.add_argument("--out", metavar="FILE", help="scales file (default: MODEL_DIR/kv_cache_scales.safetensors, "
                   "where the agents read it)")
    p.add_argument("--headroom", type=float, default=KV_SCALE_HEADROOM, metavar="H",
                   help=f"each channel's scale is H x its largest calibrated value / 127 (default {KV_SCALE_HEADROOM}: "
                   "room for text unlike the calibration text; 1 when it is like the served text, "
                   "docs/quantization.md)")


def windows(ids: list[int], count: int, length: int, bos: int | None) -> list[list[int]]:
    """Up to ``count`` consecutive windows of ``length`` tokens (a last shorter one kept), each led by ``bos``."""
    body = length - (bos is not None)
    out = [ids[i: i + body] for i in range(0, len(ids), body)][:count]
    return [([bos] if bos is not None else []) + w for w in out if w]


def _run(args: argparse.Namespace) -> int:
    from llm_serving.protocol.config_errors import ModelConfigError
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.tokenization.hf_tokenizer import load_tokenizer

    model = Path(args.model)
    try:
        config = LlamaConfig.from_model_dir(model)
        tokenizer = load_tokenizer(model)
    except (ModelConfigError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    from llm_serving.bench.workload import DEFAULT_CORPUS

    texts = [Path(t) for t in args.text] or [DEFAULT_CORPUS]
    missing = [str(t) for t in texts if not t.is_file()]
    if missing:
        raise CliError(f"--text: no such file {', '.join(missing)}")
    if not args.headroom >= 1:
        raise CliError(f"--headroom {args.headroom}: at least 1 (below it every channel's largest values clip)")
    if not 2 <= args.window_tokens <= config.max_position_embeddings or args.windows < 1:
        raise CliError(f"--window-tokens must be 2..{config.max_position_embeddings} and --windows at least 1")
    ids = [i for t in texts for i in tokenizer.encode(t.read_text(encoding="utf-8"))]
    chunks = windows(ids, args.windows, args.window_tokens, config.bos_token_id)
    if not chunks:
        raise CliError("the text gives no tokens to calibrate on")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ids.json"
        path.write_text(json.dumps(chunks))
        argv = [sys.executable, "-m", "agents.tools.calibrate_kv", "--model", str(model), "--ids", str(path),
                "--headroom", str(args.headroom)]
        if args.out:
            argv += ["--out", args.out]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        raise CliError(f"calibration failed: {last}")
    print(f"{done.stdout.strip()}: int8 KV cache scales from {sum(map(len, chunks))} tokens in {len(chunks)} windows")
    return 0


COMMAND = Command("calibrate-kv", "calibrate an int8 KV cache's per-channel scales (Ascend) on sample text",
                  _add_arguments, _run)
