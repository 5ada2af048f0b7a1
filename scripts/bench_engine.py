"""Engine benchmarks: master-loop speed, master overhead on a real model, and the admission policies.

    python scripts/bench_engine.py [--requests 96] [--decode-batch 32] [--skip-model]

1. Master loop with the stand-in agent (a real agent process on the same shared-memory path, answering
   instantly): steps/s while 128 sequences decode, for an offline consumer (woken once per request) and for
   asyncio consumers that read every token (detokenizing it, as the server does), plus the per-step split
   between master work and the ``run_step`` round trip.
2. A saturated offline run on the bench model (hidden 512, 8 layers, 8/4 heads, ffn 1408, vocab 8000, random
   weights): the share of wall time the master spends outside ``AgentPool.run_step``. ``run_step`` also
   holds the shared-memory/pipe round trip and the agent's own input padding besides graph execution; the
   round trip measured in (1) is reported next to it, so "outside graph execution" is about master + IPC.
3. ``fcfs`` vs ``longest_output_first`` on the same alpaca-shaped workload (llm_serving.bench.workload;
   max_new_tokens = tokens of the reference output, ignore_eos so both policies generate the same tokens).
4. Prefill/decode interleaving (``scheduler.min_decode_steps_between_prefills``) under Poisson arrivals of
   the same kind of workload: time to first token against inter-token latency of the running streams.

Prints markdown tables. Models are cached under ~/.cache/llm-serving (built on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_serving.bench.dataset import contest_prompt
from llm_serving.bench.workload import WorkloadSpec, make_workload
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import GenerationResult

BENCH_MODEL = {"weights": "random", "hidden_size": 512, "intermediate_size": 1408, "num_layers": 8, "num_heads": 8,
               "num_kv_heads": 4, "vocab_size": 8000, "seed": 0}
MAX_MODEL_LEN = 512


def config(decode_batch: int, prefill_batch: int, seq_lengths: list[int], num_blocks: int, policy: str,
           data_dir: str | None, max_model_len: int = MAX_MODEL_LEN) -> ServingConfig:
    dm = dict(BENCH_MODEL)
    if data_dir:
        dm["data_dir"] = data_dir
    return ServingConfig.from_dict({
        "model_config": {"seq_length": seq_lengths, "prefill_batch_size": [prefill_batch],
                         "decode_batch_size": [decode_batch], "max_generate_length": max_model_len},
        "pa_config": {"num_blocks": num_blocks, "block_size": 16, "decode_seq_length": max_model_len},
        "serving_config": {"max_queue_size": 100000},
        "scheduler": {"policy": policy, "max_wait_s": 30.0},
        "default_model": dm,
    })


def delta(a: dict, b: dict, key: str) -> float:
    return b[key] - a[key]


# ---- 1. master loop with the stand-in agent ----------------------------------------------------------------
def bench_master_loop(batch: int, window_s: float, data_dir: str | None, asyncio_consumers: bool) -> dict:
    """Decode steps/s over ``window_s`` with every sequence running; the requests are aborted afterwards."""
    max_len = 16 * 1024  # never reached within the window: no request finishes while it is measured
    cfg = config(batch, 8, [64], batch * max_len // 16 + 1, "fcfs", data_dir, max_model_len=max_len)
    engine = Engine(cfg, standin_agents=True)
    engine.start(progress=None)
    try:
        params = SamplingParams(max_new_tokens=max_len - 8, ignore_eos=True)
        window: dict = {}

        def measure() -> None:  # the full-batch decode window: all running, none finished
            while engine.stats()["num_running"] < batch:
                time.sleep(0.0005)
            ramp_decodes = engine.stats()["decode_steps"]  # the last prefill may still be in flight here
            while engine.stats()["decode_steps"] < ramp_decodes + 2:
                time.sleep(0.0005)
            s0, t0 = engine.stats(), time.perf_counter()
            time.sleep(window_s)
            window.update(s0=s0, t0=t0, s1=engine.stats(), t1=time.perf_counter())

        streams = [engine.submit([1, 100 + i, 200 + i, 300 + i], params) for i in range(batch)]
        if asyncio_consumers:
            async def consume_all() -> None:
                async def consume(stream) -> None:
                    async for _ in stream:
                        pass
                tasks = [asyncio.create_task(consume(s)) for s in streams]
                await asyncio.to_thread(measure)
                for s in streams:
                    s.abort()
                await asyncio.gather(*tasks)
            asyncio.run(consume_all())
        else:
            measure()
        s0, s1, span = window["s0"], window["s1"], window["t1"] - window["t0"]
        steps = delta(s0, s1, "steps")
        assert delta(s0, s1, "prefill_steps") == 0 and s1["requests_finished"] == 0, "window left full decode"
        return {"consumer": "asyncio, every token" if asyncio_consumers else "offline (woken at the end)",
                "steps_per_s": steps / span, "us_per_step": span / steps * 1e6,
                "master_us": (delta(s0, s1, "busy_s") - delta(s0, s1, "run_step_s")) / steps * 1e6,
                "run_step_us": delta(s0, s1, "run_step_s") / steps * 1e6,
                "idle_us": (span - delta(s0, s1, "busy_s")) / steps * 1e6,
                "context": f"{s0['tokens_generated'] // batch + 4}-{s1['tokens_generated'] // batch + 4}"}
    finally:
        engine.shutdown()


# ---- 2/3. the bench model ----------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    wall_s: float
    results: list[GenerationResult]
    stats0: dict
    stats1: dict

    def row(self, ipc_us: float) -> dict:
        s0, s1 = self.stats0, self.stats1
        steps = delta(s0, s1, "steps")
        run_step = delta(s0, s1, "run_step_s")
        latencies = sorted(r.finish_time - r.arrival_time for r in self.results)
        ttft = [r.first_token_time - r.arrival_time for r in self.results]
        tokens = sum(len(r.token_ids) for r in self.results)
        decode_steps = delta(s0, s1, "decode_steps")
        return {
            "name": self.name, "wall_s": self.wall_s, "tokens": tokens, "tok_per_s": tokens / self.wall_s,
            "steps": steps, "prefill_steps": delta(s0, s1, "prefill_steps"), "decode_steps": decode_steps,
            "mean_decode_batch": (tokens - len(self.results)) / max(decode_steps, 1),
            "preemptions": delta(s0, s1, "num_preemptions"),
            "outside_run_step": (self.wall_s - run_step) / self.wall_s,
            "ipc_share": steps * ipc_us * 1e-6 / self.wall_s,
            "ms_per_step": run_step / steps * 1e3,
            "mean_latency_s": statistics.fmean(latencies),
            "p99_latency_s": latencies[int(0.99 * (len(latencies) - 1))],
            "mean_ttft_s": statistics.fmean(ttft),
        }


def offline_run(engine: Engine, name: str, requests: list[tuple[str | list[int], SamplingParams]]) -> Run:
    s0, t0 = engine.stats(), time.perf_counter()
    streams = [engine.submit(p, params) for p, params in requests]
    results = [s.result() for s in streams]
    wall = time.perf_counter() - t0
    return Run(name, wall, results, s0, engine.stats())


def alpaca_requests(engine: Engine, n: int, seed: int) -> list[tuple[str, SamplingParams]]:
    tok, max_prompt = engine.tokenizer, engine.config.max_prompt_len
    out = []
    for rec in make_workload(WorkloadSpec(num=4 * n, seed=seed)):
        prompt = contest_prompt(rec)
        n_prompt = len(tok.encode(prompt))
        if n_prompt > max_prompt:
            continue
        want = max(1, len(tok.encode(rec["output"], add_bos=False)))
        out.append((prompt, SamplingParams(max_new_tokens=min(want, engine.config.max_model_len - n_prompt),
                                           ignore_eos=True)))
        if len(out) == n:
            return out
    raise SystemExit(f"the workload has fewer than {n} prompts of at most {max_prompt} tokens")


def start_model_engine(args, policy: str, interleave: int = 0) -> Engine:
    blocks = args.decode_batch * MAX_MODEL_LEN // 16 + 1
    cfg = config(args.decode_batch, 4, [args.max_prompt], blocks, policy, args.data_dir)
    cfg = cfg.with_values({"scheduler.min_decode_steps_between_prefills": interleave})
    engine = Engine(cfg)
    t0 = time.perf_counter()
    show = (lambda line: print(f"  [{policy}] {line}", file=sys.stderr)) if args.verbose else None
    engine.start(progress=show)
    print(f"engine ({policy}) ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return engine


# ---- output ------------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop-batch", type=int, default=128, help="decode batch of the master-loop bench (1)")
    p.add_argument("--loop-window", type=float, default=0.25, help="seconds measured in (1)")
    p.add_argument("--requests", type=int, default=96, help="alpaca-shaped requests per policy in (3)")
    p.add_argument("--saturated-requests", type=int, default=64, help="equal-length requests in (2)")
    p.add_argument("--saturated-tokens", type=int, default=96, help="new tokens per request in (2)")
    p.add_argument("--decode-batch", type=int, default=32, help="decode batch of the bench-model engine")
    p.add_argument("--max-prompt", type=int, default=128, help="prefill length bucket (longest prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="model cache (default: ~/.cache/llm-serving)")
    p.add_argument("--sections", default="1,2,3,4", help="comma-separated sections to run (default: all)")
    p.add_argument("--interleave", default="0,8", help="min_decode_steps_between_prefills values for (4)")
    p.add_argument("--qps", type=float, default=2.0, help="Poisson arrival rate of (4)")
    p.add_argument("--verbose", action="store_true", help="show agent start-up progress")
    args = p.parse_args(argv)
    sections = {int(x) for x in args.sections.split(",") if x.strip()}

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load average before: {os.getloadavg()[0]:.2f}\n")
    ipc_us = None
    if 1 in sections or 2 in sections:
        loop_rows = [bench_master_loop(args.loop_batch, args.loop_window, args.data_dir, asyncio_consumers=a)
                     for a in (False, True)]
        ipc_us = loop_rows[0]["run_step_us"]
    if 1 in sections:
        print(f"### 1. Master loop, stand-in agent, decode batch {args.loop_batch} "
              "(target >= 2,000 steps/s)\n")
        print(table(["consumer", "steps/s", "us/step", "master us/step", "run_step (IPC) us/step",
                     "idle us/step", "context (tokens)"],
                    [[r["consumer"], f"{r['steps_per_s']:,.0f}", f"{r['us_per_step']:.0f}",
                      f"{r['master_us']:.0f}", f"{r['run_step_us']:.0f}", f"{r['idle_us']:.0f}",
                      r["context"]] for r in loop_rows]))
        print(flush=True)
    if 2 in sections or 3 in sections:
        run_model_sections(args, sections, ipc_us)
    if 4 in sections:
        run_interleave_section(args)
    return 0


def run_model_sections(args, sections: set[int], ipc_us: float | None) -> None:
    runs: list[Run] = []
    for policy in ("longest_output_first", "fcfs") if 3 in sections else ("longest_output_first",):
        engine = start_model_engine(args, policy)
        try:
            if policy == "longest_output_first" and 2 in sections:
                sat = [([1] + [100 + (7 * i + j) % 5000 for j in range(31)],
                        SamplingParams(max_new_tokens=args.saturated_tokens, ignore_eos=True))
                       for i in range(args.saturated_requests)]
                runs.append(offline_run(engine, "saturated (equal lengths)", sat))
            if 3 in sections:
                runs.append(offline_run(engine, policy, alpaca_requests(engine, args.requests, args.seed)))
        finally:
            engine.shutdown()
    rows = [r.row(ipc_us or 0.0) for r in runs]
    if 2 in sections:
        print(f"### 2. Offline runs on the bench model, decode batch {args.decode_batch}: time outside graph "
              "execution (target <= 3%)\n")
        print(table(["run", "wall s", "tokens/s", "steps", "ms/step in run_step", "outside run_step (master)",
                     "IPC round trips (from 1)", "master + IPC"],
                    [[r["name"], f"{r['wall_s']:.2f}", f"{r['tok_per_s']:.1f}", str(r["steps"]),
                      f"{r['ms_per_step']:.1f}", f"{100 * r['outside_run_step']:.2f}%",
                      f"{100 * r['ipc_share']:.2f}%",
                      f"{100 * (r['outside_run_step'] + r['ipc_share']):.2f}%"]
                     for r in rows]))
        print(flush=True)
    if 3 in sections:
        policies = [r for r in rows if r["name"] in ("longest_output_first", "fcfs")]
        print(f"### 3. Policies on the same alpaca-shaped workload ({args.requests} requests, all at once, "
              f"decode batch {args.decode_batch})\n")
        metrics = [("total time s", "wall_s", "{:.2f}"), ("tokens/s", "tok_per_s", "{:.1f}"),
                   ("generated tokens", "tokens", "{}"), ("decode steps", "decode_steps", "{}"),
                   ("prefill steps", "prefill_steps", "{}"),
                   ("mean decode batch", "mean_decode_batch", "{:.1f}"),
                   ("preemptions", "preemptions", "{}"), ("mean latency s", "mean_latency_s", "{:.2f}"),
                   ("p99 latency s", "p99_latency_s", "{:.2f}"), ("mean TTFT s", "mean_ttft_s", "{:.2f}")]
        print(table(["metric"] + [r["name"] for r in policies],
                    [[label] + [fmt.format(r[key]) for r in policies] for label, key, fmt in metrics]))
        lof, fcfs = policies
        change = 100 * (lof["wall_s"] / fcfs["wall_s"] - 1)
        print(f"\nlongest_output_first total time vs fcfs: {change:+.1f}%\n", flush=True)


def run_interleave_section(args) -> None:
    import random

    rows = []
    for k in [int(x) for x in args.interleave.split(",")]:
        engine = start_model_engine(args, "longest_output_first", interleave=k)
        try:
            requests = alpaca_requests(engine, args.requests, args.seed + 1)
            rng = random.Random(args.seed)
            offsets, t = [], 0.0
            for _ in requests:
                offsets.append(t)
                t += rng.expovariate(args.qps)
            s0, t0 = engine.stats(), time.perf_counter()
            streams = []
            for (prompt, params), offset in zip(requests, offsets):
                time.sleep(max(0.0, t0 + offset - time.perf_counter()))
                streams.append(engine.submit(prompt, params))
            results = [s.result() for s in streams]
            wall = time.perf_counter() - t0
            s1 = engine.stats()
        finally:
            engine.shutdown()
        ttft = sorted(r.first_token_time - r.arrival_time for r in results)
        gaps = sorted(b - a for r in results for a, b in zip(r.token_times, r.token_times[1:]))
        tpot = [(r.finish_time - r.first_token_time) / (len(r.token_ids) - 1)
                for r in results if len(r.token_ids) > 1]
        rows.append([str(k), f"{wall:.2f}", f"{statistics.fmean(ttft):.2f}",
                     f"{ttft[int(0.9 * (len(ttft) - 1))]:.2f}",
                     f"{1e3 * statistics.fmean(tpot):.0f}", f"{1e3 * gaps[int(0.99 * (len(gaps) - 1))]:.0f}",
                     f"{1e3 * gaps[-1]:.0f}", str(delta(s0, s1, "prefill_steps"))])
    print(f"### 4. Prefill/decode interleaving under Poisson arrivals ({args.requests} requests at "
          f"{args.qps:g}/s, decode batch {args.decode_batch})\n")
    print(table(["min_decode_steps_between_prefills", "total s", "mean TTFT s", "p90 TTFT s", "mean TPOT ms",
                 "p99 token gap ms", "max token gap ms", "prefill steps"], rows))
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
