"""Decode step time with LoRA adapters in the graphs (``agents.model.lora``), on the bench model.

    python scripts/bench_lora.py [--rounds 3] [--repeats 30] [--context 256] [--rank 16] [--kernels auto]

Two runners in one process on the same weights: one built without adapter slots (today's graphs) and one with 3
slots of rank ``--rank`` holding three random adapters on all seven projections. Per decode batch (1 and 32) and
round, in turn: the base runner; the adapter runner with no adapter in the step (``lora_slots`` None: its masks are
all zero); every row on one adapter; rows spread over the three adapters and the base model. Median ms per step
(``runner.step``: the host's batch preparation and the mask table included) and the ratio to the base runner,
printed as a markdown table. The machine may be shared: compare ratios within one run, not absolute ms across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors.numpy import save_file

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import fuse_hf_tensors
from llm_serving.models.random_model import random_hf_weights
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGETS, module_name
from llm_serving.protocol.model_config import LlamaConfig
from scripts.bench_model import BENCH_MODEL, BLOCK

BATCHES = (1, 32)


def write_adapter(directory: Path, config: LlamaConfig, rank: int, seed: int) -> str:
    """A PEFT directory with random A and B on every decoder projection."""
    rng = np.random.default_rng(seed)
    q, kv, h, f = config.q_dim, config.kv_dim, config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (f, h),
              "up_proj": (f, h), "down_proj": (h, f)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in TARGETS:
            out, inp = shapes[target]
            name = "base_model.model." + module_name(layer, target)
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, inp)) / inp ** 0.5).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                        "target_modules": list(TARGETS)}))
    return str(directory)


def decode_batch(batch: int, context: int, slots: np.ndarray | None) -> StepBatch:
    width = -(-(context + 1) // BLOCK)
    tables = np.arange(1, 1 + batch * width, dtype=np.int32).reshape(batch, width)
    pos = np.full(batch, context, np.int32)
    slot_mapping = tables[np.arange(batch), pos // BLOCK] * BLOCK + pos % BLOCK
    return StepBatch(np.full(batch, 5, np.int32), pos, slot_mapping.astype(np.int32), np.ones(batch, np.int32),
                     pos + 1, tables, lora_slots=slots)


def step_ms(runner: ModelRunner, batch: StepBatch, repeats: int) -> float:
    runner.step(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kernels", default="auto")
    args = parser.parse_args()
    config = BENCH_MODEL
    weights = fuse_hf_tensors(random_hf_weights(config, seed=0, std=0.05), config)
    width = -(-(args.context + 1) // BLOCK)
    rc = RunnerConfig(num_blocks=max(BATCHES) * width + 1, block_size=BLOCK, max_model_len=max(512, args.context + 1),
                      prefill_batch_sizes=(1,), prefill_seq_lengths=(16,), decode_batch_sizes=BATCHES,
                      decode_block_widths=(width,), kernels=args.kernels)
    slots = {"max_loras": 3, "max_lora_rank": args.rank}
    base = ModelRunner(config, weights, rc)
    lora = ModelRunner(config, weights, rc, lora=slots)
    cases = {"base graphs": (base, None), "adapter graphs, no adapter": (lora, None),
             "one adapter, every row": (lora, "one"), "three adapters and base rows mixed": (lora, "mixed")}
    for runner in (base, lora):
        runner.warmup()
    with tempfile.TemporaryDirectory() as tmp:
        for slot in range(3):
            directory = write_adapter(Path(tmp) / f"a{slot}", config, args.rank, slot)
            lora.load_adapter(slot, directory)
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in BATCHES:
            for name, (runner, mix) in cases.items():
                slots = None if mix is None else (np.zeros(batch, np.int32) if mix == "one"
                                                  else (np.arange(batch) % 4 - 1).astype(np.int32))
                ms_ = step_ms(runner, decode_batch(batch, args.context, slots), args.repeats)
                results.setdefault((name, batch), []).append(ms_)
    print(f"backend {base.backend.name}, rank {args.rank}, 3 slots, context {args.context}, {args.rounds} rounds x "
          f"{args.repeats} steps (median of round medians)\n")
    print("| step | " + " | ".join(f"batch {b}: ms | x base" for b in BATCHES) + " |")
    print("|---|" + "---|---|" * len(BATCHES))
    for name in cases:
        cells = []
        for batch in BATCHES:
            value = statistics.median(results[(name, batch)])
            cells.append(f"{value:.2f} | {value / statistics.median(results[('base graphs', batch)]):.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
