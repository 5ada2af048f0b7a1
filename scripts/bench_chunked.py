"""Chunked prefill and prefix caching benchmarks on the bench model, each pair side by side in one run.

    python scripts/bench_chunked.py [--sections prefix,itl,alpaca] [--requests 256] [--streams 64] [--rounds 2]

1. ``prefix``: a shared-prefix workload (``--requests`` requests, all sent at once, sharing a ``--system``-token
   system prompt, each with its own 10-40-token question and ``--new-tokens`` new tokens): time to first token and
   throughput with prefix caching on vs off (chunked prefill on in both, the serving default).
2. ``itl``: a steady stream of long prompts (``--long-prompt`` tokens, one every ``--interval`` seconds) arriving
   while ``--streams`` streams decode: the running streams' inter-token latency (p50/p99/max of the gaps between
   their tokens while long prompts arrive), chunked prefill (step budget ``--budget`` tokens) vs unchunked (a
   long prompt prefilled whole in its own step), prefix caching off in both (the prompts share nothing).
3. ``alpaca``: the alpaca-shaped workload of ``scripts/benchmark.py`` (256 requests from llm_serving.bench.workload,
   seed 0, at most 64 new tokens, its tuned settings: prefill batches up to 8, decode up to 128, longest_output_first,
   prompt buckets 32..512), all sent at once, with both features off (the scheduler as before them), chunked prefill
   alone, and both on (the default), alternating for ``--rounds`` rounds.

The engine runs in process with real agents (native kernels), as ``scripts/bench_engine.py`` does, on the bench
model (hidden 512, 8 layers, 8/4 heads, ffn 1408, vocab 8000, random weights, cached under ~/.cache/llm-serving);
requests are token ids (random, seeded), every request ignores eos so both runs of a pair do the same work.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import GenerationResult

BENCH_MODEL = {"weights": "random", "hidden_size": 512, "intermediate_size": 1408, "num_layers": 8, "num_heads": 8,
               "num_kv_heads": 4, "vocab_size": 8000, "seed": 0}


def engine_config(max_model_len: int, decode_batch: int, scheduler: dict, data_dir: str | None) -> ServingConfig:
    dm = dict(BENCH_MODEL, **({"data_dir": data_dir} if data_dir else {}))
    blocks = decode_batch * max_model_len // 16 + 64
    return ServingConfig.from_dict({
        "model_config": {"seq_length": [64, 128, 256, 512], "prefill_batch_size": [1, 4, 8],
                         "decode_batch_size": sorted({1, 8, 32, decode_batch}), "max_generate_length": max_model_len},
        "pa_config": {"num_blocks": blocks, "block_size": 16, "decode_seq_length": max_model_len},
        "serving_config": {"max_queue_size": 100000},
        "scheduler": {"policy": "fcfs", **scheduler},
        "default_model": dm,
    })


def start(cfg: ServingConfig, name: str) -> Engine:
    engine = Engine(cfg)
    t0 = time.perf_counter()
    engine.start(progress=None)
    print(f"[bench_chunked] {name}: engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return engine


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ---- 1. shared prefix: prefix caching on vs off ---------------------------------------------------------------
def shared_prefix_requests(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [1] + [rng.randrange(3, 8000) for _ in range(args.system - 1)]
    return [system + [rng.randrange(3, 8000) for _ in range(rng.randint(10, 40))] for _ in range(args.requests)]


def run_prefix(args, caching: bool) -> dict:
    cfg = engine_config(512, args.decode_batch, {"enable_prefix_caching": caching}, args.data_dir)
    engine = start(cfg, f"prefix caching {'on' if caching else 'off'}")
    try:
        prompts = shared_prefix_requests(args)
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        s0, t0 = engine.stats(), time.perf_counter()
        streams = [engine.submit(p, params) for p in prompts]
        results: list[GenerationResult] = [s.result() for s in streams]
        wall, s1 = time.perf_counter() - t0, engine.stats()
    finally:
        engine.shutdown()
    ttft = [r.first_token_time - r.arrival_time for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    prompt_tokens = sum(len(p) for p in prompts)
    hit = s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"]
    return {"name": f"prefix caching {'on' if caching else 'off'}", "wall": wall, "tok_s": tokens / wall,
            "req_s": len(results) / wall, "ttft_mean": statistics.fmean(ttft), "ttft_p50": pct(ttft, 0.5),
            "ttft_p90": pct(ttft, 0.9), "ttft_p99": pct(ttft, 0.99), "prefilled": prompt_tokens - hit,
            "prompt_tokens": prompt_tokens, "steps": s1["steps"] - s0["steps"],
            "tokens": [r.token_ids for r in results]}


def prefix_section(args) -> None:
    rows = [run_prefix(args, caching) for caching in (False, True)]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"### Shared prefix: {args.requests} requests sent at once, a {args.system}-token system prompt + "
          f"10-40 own tokens each, {args.new_tokens} new tokens each (decode batch up to {args.decode_batch}, "
          "chunked prefill on)\n")
    print(table(["prefix caching", "total s", "requests/s", "output tokens/s", "mean TTFT s", "p50 TTFT s",
                 "p90 TTFT s", "p99 TTFT s", "prompt tokens prefilled", "steps"],
                [[r["name"].split()[-1], f"{r['wall']:.2f}", f"{r['req_s']:.1f}", f"{r['tok_s']:.0f}",
                  f"{r['ttft_mean']:.2f}", f"{r['ttft_p50']:.2f}", f"{r['ttft_p90']:.2f}", f"{r['ttft_p99']:.2f}",
                  f"{r['prefilled']} of {r['prompt_tokens']}", str(r["steps"])] for r in rows]))
    print(f"\nSame tokens with and without prefix caching: {same}.\n", flush=True)


# ---- 2. long prompts arriving while streams decode: chunked vs unchunked --------------------------------------
def run_itl(args, chunked: bool) -> dict:
    sched = {"enable_prefix_caching": False, "enable_chunked_prefill": chunked,
             "max_num_batched_tokens": args.budget if chunked else args.max_len}
    # room in the decode batch for the long prompts too: a batch full of streams would keep them waiting
    cfg = engine_config(args.max_len, args.streams + args.long_requests, sched, args.data_dir)
    engine = start(cfg, "chunked" if chunked else "unchunked")
    rng = random.Random(args.seed)
    try:
        decode_params = SamplingParams(max_new_tokens=args.stream_tokens, ignore_eos=True)
        streams = [engine.submit([1] + [rng.randrange(3, 8000) for _ in range(31)], decode_params)
                   for _ in range(args.streams)]
        while engine.stats()["num_running"] < args.streams or engine.stats()["num_waiting"]:
            time.sleep(0.01)
        time.sleep(0.5)  # all decoding
        t0 = time.monotonic()
        long_params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        longs = []
        for i in range(args.long_requests):
            time.sleep(max(0.0, t0 + i * args.interval - time.monotonic()))
            longs.append(engine.submit([1] + [rng.randrange(3, 8000) for _ in range(args.long_prompt - 1)],
                                       long_params))
        long_results = [s.result() for s in longs]
        t1 = max(r.finish_time for r in long_results)
        stream_results = [s.result() for s in streams]
    finally:
        engine.shutdown()
    gaps = [b - a for r in stream_results for a, b in zip(r.token_times, r.token_times[1:]) if t0 <= b <= t1]
    ttft = [r.first_token_time - r.arrival_time for r in long_results]
    done = sum(1 for r in stream_results for t in r.token_times if t0 <= t <= t1)
    return {"name": "chunked" if chunked else "unchunked", "p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99),
            "max": max(gaps), "mean": statistics.fmean(gaps), "ttft_mean": statistics.fmean(ttft),
            "ttft_max": max(ttft), "window": t1 - t0, "stream_tok_s": done / (t1 - t0), "gaps": len(gaps)}


def itl_section(args) -> None:
    rows = [run_itl(args, chunked) for chunked in (False, True)]
    print(f"### Long prompts while {args.streams} streams decode: {args.long_requests} prompts of "
          f"{args.long_prompt} tokens (16 new tokens each), one every {args.interval:g} s; gaps between the "
          f"streams' tokens while they arrive (chunked: step budget {args.budget} tokens)\n")
    print(table(["prefill", "p50 token gap ms", "p99 token gap ms", "max token gap ms", "mean token gap ms",
                 "streams' tokens/s", "long prompts' mean TTFT s", "max TTFT s", "window s", "gaps"],
                [[r["name"], f"{1e3 * r['p50']:.0f}", f"{1e3 * r['p99']:.0f}", f"{1e3 * r['max']:.0f}",
                  f"{1e3 * r['mean']:.1f}", f"{r['stream_tok_s']:.0f}", f"{r['ttft_mean']:.2f}",
                  f"{r['ttft_max']:.2f}", f"{r['window']:.1f}", str(r["gaps"])] for r in rows]))
    print(flush=True)


# ---- 3. the alpaca-shaped benchmark: must not get slower ------------------------------------------------------
ALPACA_MODES = {"both off": (False, False), "chunked prefill": (True, False), "both on (default)": (True, True)}


def alpaca_config(chunked: bool, caching: bool, data_dir: str | None) -> ServingConfig:
    """scripts/benchmark.py's tuned server settings on the bench model."""
    max_len = 512 + 64
    return ServingConfig.from_dict({
        "model_config": {"seq_length": [32, 64, 128, 256, 512], "prefill_batch_size": [1, 4, 8],
                         "decode_batch_size": [1, 8, 16, 32, 64, 128], "max_generate_length": 64},
        "pa_config": {"num_blocks": 128 * max_len // 16 + 2, "block_size": 16, "decode_seq_length": max_len},
        "serving_config": {"max_queue_size": 100000},
        "scheduler": {"policy": "longest_output_first", "enable_chunked_prefill": chunked,
                      "enable_prefix_caching": caching},
        "default_model": dict(BENCH_MODEL, **({"data_dir": data_dir} if data_dir else {})),
    })


def run_alpaca(args, name: str) -> dict:
    from scripts.bench_engine import alpaca_requests

    engine = start(alpaca_config(*ALPACA_MODES[name], args.data_dir), name)
    try:
        requests = [(prompt, SamplingParams(max_new_tokens=min(p.max_new_tokens, 64), ignore_eos=True))
                    for prompt, p in alpaca_requests(engine, 256, args.seed)]
        s0, t0 = engine.stats(), time.perf_counter()
        results = [s.result() for s in [engine.submit(prompt, p) for prompt, p in requests]]
        wall, s1 = time.perf_counter() - t0, engine.stats()
    finally:
        engine.shutdown()
    tokens = sum(len(r.token_ids) for r in results)
    return {"wall": wall, "tok_s": tokens / wall, "steps": s1["steps"] - s0["steps"],
            "tokens": [r.token_ids for r in results]}


def alpaca_section(args) -> None:
    runs: dict[str, list[dict]] = {name: [] for name in ALPACA_MODES}
    for _ in range(args.rounds):
        for name in ALPACA_MODES:
            runs[name].append(run_alpaca(args, name))
    first = runs["both off"][0]["tokens"]
    same = all(r["tokens"] == first for rs in runs.values() for r in rs)
    print(f"### The alpaca-shaped benchmark (scripts/benchmark.py's workload and tuned settings, in process): "
          f"{args.rounds} rounds, modes alternating\n")
    print(table(["chunked prefill / prefix caching", "total s (each round)", "output tokens/s (each round)",
                 "steps"],
                [[name, " / ".join(f"{r['wall']:.2f}" for r in rs), " / ".join(f"{r['tok_s']:.0f}" for r in rs),
                  str(rs[0]["steps"])] for name, rs in runs.items()]))
    print(f"\nSame tokens in every mode and round: {same}.\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="prefix,itl,alpaca")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="model cache (default: ~/.cache/llm-serving)")
    p.add_argument("--decode-batch", type=int, default=128, help="largest decode batch of the prefix section")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--system", type=int, default=200, help="tokens of the shared system prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=1000, help="new tokens of each decoding stream")
    p.add_argument("--long-prompt", type=int, default=1500)
    p.add_argument("--long-requests", type=int, default=8)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=256, help="step token budget of the chunked run")
    p.add_argument("--max-len", type=int, default=2048, help="max_model_len of the itl section")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the alpaca section")
    args = p.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load average before: {os.getloadavg()[0]:.2f}\n", flush=True)
    if "prefix" in sections:
        prefix_section(args)
    if "itl" in sections:
        itl_section(args)
    if "alpaca" in sections:
        alpaca_section(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
