"""Tensor parallelism on this host: each agent's resident memory and the step times, by tensor-parallel size.

    python scripts/bench_tp.py [--tp 1 2] [--num-blocks 2049] [--repeats 20] [--rounds 2] [--pin] [--no-steps] [--large]
                               [--joined K]

Writes the bench model (``scripts/bench_model.BENCH_MODEL``, seeded random weights) as a Hugging Face
directory, then for each size starts the real agent processes (``AgentPool``: the collectives' scheduler,
shared memory, pipes) with the KV cache the wiring gives ``--num-blocks`` (one device's blocks of all kv
heads; ranks holding half the kv heads get twice as many, see ``llm_serving.engine.wiring.kv_cache_blocks``) and
prints per agent: resident memory after warm-up (VmRSS, of it anonymous and file-backed) next to the bytes of
its weight slice and KV cache; then the median time of whole steps through the pool (``run_step``, as the
engine sends them): prefill 1x128 and 8x128 prompts, decode batch 1/32/128 at context 256 (``--no-steps``:
memory only, e.g. with ``--num-blocks 2`` to see the runtime and weights without a KV cache). ``--rounds``
repeats the sizes in turn, since this machine's load drifts. ``--large``: a 1.2 GB model instead (hidden 2048, 4 layers,
16/8 heads, ffn 5504, vocab 32000), whose weights outweigh the runtime's own memory. ``--joined K``: each size
above 1 also with its last K ranks joined as from other hosts (``llm-serving agent --join`` over the loopback,
their steps broadcast by rank 0 through the collective instead of read from shared memory): what the step
broadcast costs, network aside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataclasses import replace

from agents.weights.sharded import shard_shapes
from llm_serving.executor.agent_pool import AgentPool
from llm_serving.executor.collective_launch import free_port
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_shards
from llm_serving.protocol.wire import AgentSpec
from scripts.bench_model import BENCH_MODEL, BLOCK, decode_batch, prefill_batch

CONTEXT, SEQ = 256, 128
LARGE_MODEL = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)


def memory(pid: int) -> dict[str, float]:
    """MiB of VmRSS, RssAnon, RssFile (+ RssShmem: the step segment) of a process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def spec_for(model: Path, tp: int, num_blocks: int, kernels: str, pin: bool = False,
             cfg: LlamaConfig = BENCH_MODEL) -> AgentSpec:
    width = CONTEXT // BLOCK
    runner = {"num_blocks": num_blocks * kv_shards(cfg, tp), "block_size": BLOCK, "max_model_len": 512,
              "prefill_batch_sizes": [1, 8], "prefill_seq_lengths": [SEQ], "decode_batch_sizes": [1, 32, 128],
              "decode_block_widths": [width], "kernels": kernels, "device_target": "CPU"}
    return AgentSpec("llama", str(model), cfg.__dict__.copy(), runner, max_tokens=8 * SEQ, max_batch=128,
                     max_blocks_per_seq=512 // BLOCK, tensor_parallel_size=tp,
                     extra_env={"LLM_SERVING_PIN_RANKS": "1"} if pin else {})


def shard_bytes(cfg: LlamaConfig, tp: int, rank: int, blocks: int) -> tuple[float, float]:
    """MiB of a rank's float32 weight slice and of its KV cache (K and V, every layer)."""
    plan = ShardPlan(cfg, tp, rank)
    weights = sum(int(np.prod(s)) for s in shard_shapes(cfg, plan).values()) * 4
    kv = blocks * BLOCK * plan.kv_heads * cfg.head_dim * 2 * cfg.num_hidden_layers * 4
    return weights / 2**20, kv / 2**20


def measure(model: Path, cfg: LlamaConfig, tp: int, args: argparse.Namespace, joined: int = 0) -> dict[str, float]:
    spec = spec_for(model, tp, args.num_blocks, args.kernels, args.pin, cfg)
    joiners = []
    if joined:
        spec = replace(spec, local_ranks=tp - joined, join_address=f"127.0.0.1:{free_port()}")
        root = Path(__file__).resolve().parent.parent
        joiners = [subprocess.Popen([sys.executable, "-m", "llm_serving", "agent", "--join", spec.join_address,
                                     "--rank", str(rank), "--once"], cwd=root, stderr=subprocess.DEVNULL)
                   for rank in range(tp - joined, tp)]
    pool = AgentPool(spec)
    t0 = time.monotonic()
    try:
        pool.start()
        print(f"\n### {label(tp, joined)}: {tp} agent(s) ready in {time.monotonic() - t0:.1f} s, "
              f"{spec.runner_config['num_blocks']} KV blocks each\n")
        return steps(pool, cfg, tp, spec, args)
    finally:
        pool.close()
        for proc in joiners:
            proc.wait(30)


def label(tp: int, joined: int) -> str:
    return f"tp={tp}" + (f", {joined} joined" if joined else "")


def steps(pool: AgentPool, cfg: LlamaConfig, tp: int, spec: AgentSpec, args: argparse.Namespace) -> dict[str, float]:
    """Each local rank's memory, then the median step times (milliseconds) through the pool."""
    print("| rank | VmRSS MiB | RssAnon | RssFile | weights slice MiB | KV cache MiB |")
    print("|---|---|---|---|---|---|")
    for rank, pid in enumerate(pool.pids):
        mem = memory(pid)
        w, kv = shard_bytes(cfg, tp, rank, spec.runner_config["num_blocks"])
        print(f"| {rank} | {mem['VmRSS']:.0f} | {mem['RssAnon']:.0f} | {mem['RssFile']:.0f} | {w:.1f} | {kv:.1f} |")
    if args.no_steps:
        return {}
    calls = {f"prefill {b}x{SEQ}": prefill_batch(b, SEQ) for b in (1, 8)}
    calls.update({f"decode B={b} ctx={CONTEXT}": decode_batch(b, CONTEXT) for b in (1, 32, 128)})
    out = {}
    for name, batch in calls.items():
        pool.run_step(batch)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            pool.run_step(batch)
            times.append((time.perf_counter() - t) * 1e3)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-blocks", type=int, default=128 * CONTEXT // BLOCK + 1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kernels", default="native", choices=["native", "portable"])
    parser.add_argument("--pin", action="store_true", help="pin each rank to its share of the cores")
    parser.add_argument("--no-steps", action="store_true", help="memory only (e.g. with a tiny --num-blocks)")
    parser.add_argument("--large", action="store_true", help="the 1.2 GB model instead of the bench model")
    parser.add_argument("--joined", type=int, default=0, metavar="K", help="also each size > K with its last K "
                        "ranks joined as from other hosts (steps broadcast by rank 0)")
    args = parser.parse_args()
    cfg = LARGE_MODEL if args.large else BENCH_MODEL
    if args.large and not args.no_steps:
        parser.error("--large measures memory only: add --no-steps")
    print(f"host: {os.cpu_count()} cores; kernels {args.kernels}; pa_config.num_blocks {args.num_blocks}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(Path(tmp) / "bench", cfg, seed=0, std=0.05)
        variants = [(tp, 0) for tp in args.tp] + [(tp, args.joined) for tp in args.tp if tp > args.joined > 0]
        rows: dict[tuple[int, int], list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for tp, joined in variants:
                rows[tp, joined].append(measure(model, cfg, tp, args, joined))
    names = list(rows[variants[0]][0])
    if not names:
        return
    print("\n| step (ms, median of " + f"{args.repeats}; one column per round) | "
          + " | ".join(label(*v) for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name in names:
        cells = [" / ".join(f"{r[name]:.1f}" for r in rows[v]) for v in variants]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
