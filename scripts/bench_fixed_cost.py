"""The fixed cost of a decode step: the bench model next to a model of the same structure with almost no weights.

    python scripts/bench_fixed_cost.py [--rounds 3] [--single-seconds 12]

Why: a batch-1 decode step of the bench model reads 111 MB of float32 weights, which takes this machine ~4 ms at
its memory bandwidth whatever system runs it. What a system adds on top is its fixed cost per step. The "hollow"
model here has the bench model's structure (8 layers, 64-wide heads, 2:1 grouped KV heads, vocab 8000: the same
graphs, the same number of ops and graph inputs) with hidden size 128 and ffn 128, so its ~11 MB of weights
cost ~0.1 ms and its step time is the fixed cost. Per round and model, measured in turn:
- in process: ``ModelRunner.step`` of a batch-1 and a batch-8 decode step at context 64 (median ms);
- served: ms per output token of one stream (non-streamed /v1/completions, requests one after another), the
  tuned config of scripts/benchmark.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_model import BENCH_MODEL, BLOCK, decode_batch
from bench_revisions import serve_and_measure
from benchmark import TUNED, make_requests, write_config

from llm_serving.models.random_model import build_random_model
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
HOLLOW = dataclasses.replace(BENCH_MODEL, hidden_size=128, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1)


MODELS = {"bench": BENCH_MODEL, "hollow": HOLLOW}


def in_process_ms(model: str, batches: list[int], calls: int) -> list[float]:
    """Median ms of ``calls`` decode steps per batch size, in a child process (one MindSpore per process)."""
    out = subprocess.run([sys.executable, __file__, "--child", model, ",".join(map(str, batches)), str(calls)],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return [float(x) for x in out.split()[-len(batches):]]


def _child(model: str, batches: str, calls: str) -> None:
    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.weights.checkpoints import fuse_hf_tensors
    from llm_serving.models.random_model import random_hf_weights

    config = MODELS[model]
    sizes = [int(b) for b in batches.split(",")]
    rc = RunnerConfig(num_blocks=max(sizes) * 4 + 1, block_size=BLOCK, max_model_len=512, prefill_batch_sizes=(1,),
                      prefill_seq_lengths=(32,), decode_batch_sizes=tuple(sizes), decode_block_widths=(4,),
                      kernels="native")
    runner = ModelRunner(config, fuse_hf_tensors(random_hf_weights(config, seed=0, std=0.05), config), rc)
    runner.warmup()
    medians = []
    for b in sizes:
        batch = decode_batch(b, 64)
        times = []
        for _ in range(int(calls)):
            t0 = time.perf_counter()
            runner.step(batch)
            times.append((time.perf_counter() - t0) * 1e3)
        medians.append(statistics.median(times[10:]))
    print(" ".join(f"{m:.3f}" for m in medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-seconds", type=float, default=12.0)
    parser.add_argument("--calls", type=int, default=300, help="in-process decode steps per batch size")
    parser.add_argument("--work-dir", default="/tmp/llm-serving-bench-fixed-cost")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(*args.child)
    work = Path(args.work_dir)
    tok = train_tokenizer(work / "tokenizer", vocab_size=BENCH_MODEL.vocab_size)
    dirs = {name: build_random_model(work / name, cfg, seed=0, std=0.05, tokenizer_model=tok)
            for name, cfg in MODELS.items()}
    reqs = make_requests(argparse.Namespace(num_prompts=64, seed=0, max_output_tokens=64), dirs["bench"])
    encode = Tokenizer(dirs["bench"] / "tokenizer.model").encode
    prompts = [(encode(r.prompt), r.max_new_tokens) for r in reqs]
    print("| round | model | weights (MB) | step B=1 (ms) | step B=8 (ms) | served, one stream (ms/token) | load |")
    print("|---|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for name in MODELS:
            config = write_config(work / f"{name}.yaml", dirs[name], TUNED["prefill"], TUNED["decode"],
                                  "longest_output_first", 64)
            step_ms = in_process_ms(name, [1, 8], args.calls)
            single_ms, _ = serve_and_measure(ROOT, config, prompts, args.single_seconds, work / "server.log",
                                             saturated_runs=0)
            mb = sum(f.stat().st_size for f in dirs[name].glob("*.safetensors")) / 1e6
            print(f"| {rnd + 1} | {name} | {mb:.0f} | {step_ms[0]:.2f} | {step_ms[1]:.2f} | {single_ms:.2f} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
