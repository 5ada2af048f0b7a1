"""Calibrate an int8 KV cache's static per-channel scales (``agents.weights.kv_scales``) on this CPU.

    python -m agents.tools.calibrate_kv --model DIR --ids IDS.json [--out FILE]

``IDS.json``: a list of token-id windows (``llm-serving calibrate-kv`` tokenizes sample text into them). Each window
is prefilled by the float32 model (portable ops: a cache per kv head) into blocks of its own; the keys (after the
rotary embedding) and values it wrote are read back from the cache (``Attention.cache_blocks``: on CPU the cache
itself) and each channel's largest magnitude kept, per layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from agents.weights.kv_scales import HEADROOM, kv_scales_path, save_kv_scales
from agents.weights.sharded import load_rank_weights
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig, blocks_needed
from llm_serving.protocol.parallel import ShardPlan

BLOCK = 16


def calibrate(config: LlamaConfig, weights: dict[str, np.ndarray], windows: list[list[int]]) -> np.ndarray:
    """``[layers, 2, kv_dim]``: the largest magnitude of every key and value channel the windows produce."""
    from agents.runtime.runner import ModelRunner, RunnerConfig

    longest = max(len(w) for w in windows)
    blocks = blocks_needed(longest, BLOCK)
    rc = RunnerConfig(num_blocks=blocks + 1, block_size=BLOCK, max_model_len=blocks * BLOCK,
                      prefill_batch_sizes=(1,), prefill_seq_lengths=(blocks * BLOCK,), decode_batch_sizes=(1,),
                      kernels="portable")
    runner = ModelRunner(config, weights, rc)
    runner.warmup()
    absmax = np.zeros((config.num_hidden_layers, 2, config.kv_dim), np.float32)
    table = np.arange(1, blocks + 1, dtype=np.int32).reshape(1, blocks)  # block 0 is the padding's
    for window in windows:
        n = len(window)
        slots = BLOCK + np.arange(n, dtype=np.int32)
        runner.step(StepBatch(np.asarray(window, np.int32), np.arange(n, dtype=np.int32), slots,
                              np.array([n], np.int32), np.array([n], np.int32), table))
        for i, layer in enumerate(runner.model.layers):
            heads = layer.attention.cache_blocks(BLOCK)  # [blocks, BLOCK, head_dim] a kv head: keys, then values
            for j, part in enumerate((heads[: config.num_key_value_heads], heads[config.num_key_value_heads:])):
                rows = np.concatenate(part, axis=-1)[1:].reshape(-1, config.kv_dim)[:n]
                absmax[i, j] = np.maximum(absmax[i, j], np.abs(rows).max(0))
    return absmax


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agents.tools.calibrate_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ids", type=Path, required=True, help="JSON list of token-id windows")
    parser.add_argument("--out", type=Path, default=None, help=f"default: the model's {kv_scales_path('.').name}")
    parser.add_argument("--headroom", type=float, default=HEADROOM, help="scale = headroom x largest / 127")
    args = parser.parse_args(argv)
    windows = json.loads(args.ids.read_text())
    config = LlamaConfig.from_model_dir(args.model if args.model.is_dir() else args.model.parent)
    absmax = calibrate(config, load_rank_weights(args.model, config, ShardPlan(config)), windows)  # int8: dequantized
    out = save_kv_scales(absmax, args.out or kv_scales_path(args.model), sum(len(w) for w in windows), args.headroom)
    print(out)


if __name__ == "__main__":
    main()
