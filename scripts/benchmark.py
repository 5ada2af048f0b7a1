"""End-to-end benchmark: HF transformers vs our server (baseline and tuned settings) on one workload.

    python scripts/benchmark.py [--num-prompts 48] [--max-output-tokens 64] [--write-doc docs/benchmarks.md]

In one run, on the bench model of scripts/bench_model.py (random weights, std 0.05, own 8000-piece tokenizer)
and one alpaca-shaped workload (llm_serving.bench.workload), it measures:
  1. Hugging Face transformers, greedy, one request at a time (the contest's baseline.py way), same weights;
  2. our server with the contest's baseline settings (prefill batch 1, decode batch 1, fcfs);
  3. our server tuned (prefill batches up to 4, decode batches up to 128, longest_output_first), and
  4. the tuned server with fcfs.
Servers are started as ``python -m llm_serving serve`` subprocesses and get every request at once on the
contest's streaming endpoint. Every request must succeed and its greedy text must equal the HF text (the run
fails otherwise). The compute-roofline lower bound is the model FLOPs of all prefill and decode tokens divided
by the best matmul rate measured in the same run, before and after the runs, of a plain MindSpore matmul and of
our own packed-weight GEMM on the same sizes (in a subprocess, so torch and MindSpore never share a process).
Prints a markdown table; ``--write-doc`` also writes it with the command. ``--peers openvino,ctranslate2,llamacpp``
adds a section against CPU peers at several concurrency levels (scripts/peers/compare.py; llama.cpp serves one
sequence at a time and runs only 1 in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # peers; bench_model (imported only in the --prepare child)

from peers.compare import add_args as add_peer_args
from peers.compare import run_section as peer_section

from llm_serving.bench.local_server import ServerStartError, running_server
from llm_serving.bench.workload import WorkloadSpec, make_workload
from llm_serving.models.default_model import TRAINED_MODEL
from llm_serving.protocol.model_config import LlamaConfig
from loadtest.client import benchmark
from loadtest.dataset import BenchRequest, TokenCounter, build_requests
from loadtest.protocol import BenchConfig

EOS = 2
SEQ_BUCKETS = (32, 64, 128, 256, 512)  # prefill length buckets (the longest prompt accepted is the largest)
BASELINE = {"prefill": (1,), "decode": (1,), "policy": "fcfs"}
TUNED = {"prefill": (1, 4, 8), "decode": (1, 8, 16, 32, 64, 128)}


@dataclass
class Row:
    name: str
    total_s: float
    requests: int
    ok: int
    output_tokens: int
    matched: int
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=48, help="requests in the workload (default 48)")
    p.add_argument("--max-output-tokens", type=int, default=64,
                   help="cap on each request's max_new_tokens (its alpaca output length; default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--work-dir", default="/tmp/llm-serving-benchmark", help="model, configs and server logs")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to warm up")
    p.add_argument("--write-doc", metavar="MD", help="also write the table and the command to this file")
    p.add_argument("--model", choices=("bench", "trained"), default="bench",
                   help="bench: the random-weight bench model (built in the work dir); trained: the shipped "
                   "trained target (llm_serving/models/pydoc/target)")
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # child-process modes
    p.add_argument("--matmul-rate", action="store_true", help=argparse.SUPPRESS)
    add_peer_args(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ set-up
def build_model(work: Path) -> Path:
    """The bench model as an HF directory with its own sentencepiece tokenizer (8000 pieces, as the model)."""
    from bench_model import BENCH_MODEL

    from llm_serving.models.random_model import build_random_model
    from llm_serving.tokenization.training import train_tokenizer

    tok = train_tokenizer(work / "tokenizer", vocab_size=BENCH_MODEL.vocab_size)
    return build_random_model(work / "model", BENCH_MODEL, seed=0, std=0.05, tokenizer_model=tok)


def bench_model_dir(work: Path) -> Path:
    """The bench model's directory under ``work``, built there on first use (later runs reuse it)."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(work)
    return model_dir


def make_requests(args: argparse.Namespace, model_dir: Path) -> list[BenchRequest]:
    records = make_workload(WorkloadSpec(num=args.num_prompts, seed=args.seed))
    reqs = build_requests(records, args.num_prompts, TokenCounter(model_dir / "tokenizer.model"))
    for r in reqs:
        r.max_new_tokens = min(r.max_new_tokens, args.max_output_tokens)
    too_long = [r.index for r in reqs if r.prompt_tokens > SEQ_BUCKETS[-1]]
    if too_long:
        raise SystemExit(f"prompts {too_long[:5]} exceed the largest prefill bucket {SEQ_BUCKETS[-1]}")
    return reqs


# ------------------------------------------------------------------------------------------ HF baseline
def run_hf(model_dir: Path, reqs: list[BenchRequest]) -> tuple[float, list[list[int]]]:
    """Greedy generation one request at a time; returns (total seconds, output ids per request)."""
    import torch
    from transformers import LlamaForCausalLM

    from llm_serving.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prompts = [tok.encode(r.prompt) for r in reqs]
    outs = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for ids, r in zip(prompts, reqs):
            seq = model.generate(torch.tensor([ids]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=0)
            out = seq[0, len(ids):].tolist()
            outs.append(out)
    return time.perf_counter() - t0, outs


def expected_texts(model_dir: Path, reqs: list[BenchRequest], outs: list[list[int]]) -> list[str]:
    """The text each HF output adds to its prompt (a leading "▁" of the first piece is a real space there)."""
    from llm_serving.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    texts = []
    for r, out in zip(reqs, outs):
        ids = tok.encode(r.prompt)
        prompt, full = tok.decode(ids), tok.decode(ids + out)
        if not full.startswith(prompt):
            raise SystemExit(f"request {r.index}: decoding prompt + output does not extend the prompt's text")
        texts.append(full[len(prompt):])
    return texts


# ------------------------------------------------------------------------------------------ our server
def write_config(path: Path, model_dir: Path, prefill: tuple[int, ...], decode: tuple[int, ...],
                 policy: str, max_out: int, precision: str = "exact", quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> Path:
    """A serving YAML for the bench model; the cache holds every sequence at full length. ``precision``,
    ``quantization``, ``kv_cache_dtype``: model_config's (scripts/bench_fast_precision.py compares the modes)."""
    max_len = SEQ_BUCKETS[-1] + max_out
    blocks = (max(decode) * max_len) // 16 + 2
    cfg = {
        "model_config": {"model_name": "llama2", "model_path": str(model_dir), "dtype": "float32",
                         "max_generate_length": max_out, "seq_length": list(SEQ_BUCKETS),
                         "prefill_batch_size": list(prefill), "decode_batch_size": list(decode),
                         "precision": precision, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype},
        "pa_config": {"num_blocks": max(blocks, max_len // 16 + 2), "block_size": 16, "decode_seq_length": max_len},
        "scheduler": {"policy": policy},
    }
    path.write_text(json.dumps(cfg, indent=1) + "\n")  # JSON is YAML
    return path


def run_server(name: str, tag: str, config: Path, reqs: list[BenchRequest], expected: list[str],
               args: argparse.Namespace, work: Path, show_differences: bool = True) -> Row:
    log_path = work / f"server_{tag}.log"
    try:
        with running_server(config, log_path, args.startup_timeout, cwd=ROOT,
                            announce=lambda cmd: print(f"[benchmark] {name}: {cmd} (log {log_path})", flush=True),
                            ) as (port, ready_s):
            print(f"[benchmark] {name}: ready after {ready_s:.1f}s", flush=True)
            cfg = BenchConfig(port=port, endpoint="stream", qps=float("inf"), metrics_interval=0.5)
            run = asyncio.run(benchmark(reqs, cfg, progress=False))
    except ServerStartError as why:
        print(f"[benchmark] {name}: server did not start ({why}); log tail:\n{log_path.read_text()[-1500:]}",
              flush=True)
        return Row(name, float("nan"), len(reqs), 0, 0, 0, f"server did not start ({why})")
    ok = [r for r in run.results if r.success]
    matched = sum(r.success and r.text == expected[r.index] for r in run.results)
    for r in run.results:
        if not r.success:
            print(f"[benchmark] {name}: request {r.index} failed: {r.error}", flush=True)
        elif r.text != expected[r.index] and show_differences:
            print(f"[benchmark] {name}: request {r.index} differs from HF:\n  ours {r.text[:120]!r}\n"
                  f"  hf   {expected[r.index][:120]!r}", flush=True)
    return Row(name, run.duration, len(reqs), len(ok), sum(r.output_tokens for r in ok), matched,
               f"max server batch {run.metrics.get('max_server_running_batch')}")


# ------------------------------------------------------------------------------------------ roofline
def workload_flops(config: LlamaConfig, reqs: list[BenchRequest], outs: list[list[int]]) -> float:
    """FLOPs of every prefill token and every decode step, each over its causal context."""
    total = 0.0
    for r, out in zip(reqs, outs):
        n_prompt = r.prompt_tokens
        total += sum(config.flops_per_token(i + 1) for i in range(n_prompt))
        # The first output comes from the prefill; each later one is one decode step over the context so far.
        total += sum(config.flops_per_token(n_prompt + j + 1) for j in range(max(len(out) - 1, 0)))
    return total


def _child(mode: str, work: Path) -> str:
    """Run this script in ``mode`` in a child process (MindSpore, imported by scripts/bench_model.py, never
    shares a process with torch); returns its stdout."""
    out = subprocess.run([sys.executable, __file__, mode, "--work-dir", str(work)], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"benchmark {mode} step failed:\n{out.stderr[-2000:]}")
    return out.stdout


def matmul_rates(work: Path) -> tuple[float, float]:
    """GFLOP/s of the best plain MindSpore matmul and of our native GEMM on the model's sizes (0 when the native
    kernels cannot be built), in a child process."""
    mindspore_rate, native_rate = _child("--matmul-rate", work).strip().splitlines()[-1].split()
    return float(mindspore_rate), float(native_rate)


def _matmul_rate_main() -> None:
    """Child process: print the best GFLOP/s of plain MindSpore matmuls of the model's sizes (graph mode, as the
    served model runs) and of our packed-weight GEMM (``agents/model/kernels/linear.cc``) on the same sizes."""
    from bench_model import BENCH_MODEL, median_ms, reference_matmul

    from agents.model.native_kernels import KernelBuildError, native_ops
    from agents.runtime.device import setup_device

    setup_device("CPU")
    try:
        native = native_ops(BENCH_MODEL.hidden_size)
    except KernelBuildError:
        native = None
    h = BENCH_MODEL.hidden_size
    shapes = [(128, 2 * 128 * h * 4096), (512, 2 * 512 * h * 4096), (128, 2 * 128 * h * BENCH_MODEL.vocab_size)]
    rates: dict[str, list[float]] = {"mindspore": [], "native": [0.0]}
    for tokens, flops in shapes:
        for kind, ops_ in (("mindspore", None), ("native", native)):
            if kind == "native" and native is None:
                continue
            call, done = reference_matmul(tokens, flops, ops_)
            rates[kind].append(done / median_ms(call, 10) / 1e6)
    print(max(rates["mindspore"]), max(rates["native"]))


# ------------------------------------------------------------------------------------------ report
def table(rows: list[Row], hf_row: Row, roofline_s: float) -> str:
    hf_tps = hf_row.output_tokens / hf_row.total_s
    lines = [("| system | ok / requests | greedy = HF | requests/s | output tokens/s | total time (s) "
              "| speedup vs HF (tokens/s) | x roofline |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.ok:
            lines.append(f"| {r.name} | 0/{r.requests} | | | | | | {r.note} |")
            continue
        tps = r.output_tokens / r.total_s
        lines.append(f"| {r.name} | {r.ok}/{r.requests} | {r.matched}/{r.requests} | {r.ok / r.total_s:.2f} "
                     f"| {tps:.1f} | {r.total_s:.2f} | {tps / hf_tps:.2f}x | {r.total_s / roofline_s:.2f} |")
    lines.append(f"| compute roofline (lower bound) | | | | | {roofline_s:.2f} | | 1.00 |")
    return "\n".join(lines)


def write_doc(path: Path, argv: list[str], summary: str, tbl: str, notes: list[str]) -> None:
    cmd = "python scripts/benchmark.py " + " ".join(argv)
    text = ("# Benchmarks\n\nEnd-to-end serving benchmark (scripts/benchmark.py): Hugging Face transformers "
            "greedy one request at a time vs our server with baseline and tuned settings, on the bench model "
            "(scripts/bench_model.py `BENCH_MODEL`, random weights) and one alpaca-shaped workload, all "
            "requests sent at once to the streaming endpoint.\n\n"
            f"Command (from the repository root):\n\n```\n{cmd.strip()}\n```\n\n{summary}\n\n{tbl}\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.prepare:
        build_model(work)
        return 0
    if args.matmul_rate:
        _matmul_rate_main()
        return 0
    if args.model == "bench":
        _child("--prepare", work)
    model_dir = work / "model" if args.model == "bench" else TRAINED_MODEL
    rates = [matmul_rates(work)]
    print(f"[benchmark] model in {model_dir}; matmul rates (MindSpore, native) {rates[0]} GFLOP/s", flush=True)
    config = LlamaConfig.from_model_dir(model_dir)
    reqs = make_requests(args, model_dir)
    n_in = sum(r.prompt_tokens for r in reqs)
    print(f"[benchmark] {len(reqs)} requests, {n_in} prompt tokens, max_new_tokens sum "
          f"{sum(r.max_new_tokens for r in reqs)}", flush=True)
    if args.peers_only:
        run_peers(args, work, model_dir, reqs)
        return 0
    hf_s, outs = run_hf(model_dir, reqs)
    expected = expected_texts(model_dir, reqs, outs)
    hf_row = Row("HF transformers, 1 at a time", hf_s, len(reqs), len(reqs), sum(len(o) for o in outs), len(reqs))
    print(f"[benchmark] HF: {hf_s:.1f}s, {hf_row.output_tokens} output tokens", flush=True)
    flops = workload_flops(config, reqs, outs)

    rows = [hf_row]
    max_out = args.max_output_tokens
    runs = [("ours baseline (prefill 1, decode 1, fcfs)", BASELINE["prefill"], BASELINE["decode"], "fcfs"),
            ("ours tuned (prefill <=8, decode <=128, longest_output_first)", TUNED["prefill"], TUNED["decode"],
             "longest_output_first"),
            ("ours tuned, fcfs", TUNED["prefill"], TUNED["decode"], "fcfs")]
    for i, (name, prefill, decode, policy) in enumerate(runs):
        cfg_path = write_config(work / f"config_{i}.yaml", model_dir, prefill, decode, policy, max_out)
        rows.append(run_server(name, f"run{i}", cfg_path, reqs, expected, args, work))
    # Measured again at the end: a shared machine slows down for minutes at a time, and a rate taken in a slow
    # minute would make the lower bound too easy. The best of the two is the bound's rate.
    rates.append(matmul_rates(work))
    rate = max(max(pair) for pair in rates)
    roofline_s = flops / (rate * 1e9)
    print(f"[benchmark] matmul rates at the end {rates[-1]} GFLOP/s; the roofline uses {rate:.1f}", flush=True)

    measured = "; ".join(f"{kind} {', '.join(f'{pair[i]:.0f}' for pair in rates)}"
                         for i, kind in enumerate(("MindSpore MatMul", "our native GEMM")))
    summary = (f"Workload: {len(reqs)} requests (llm_serving.bench.workload seed {args.seed}), {n_in} prompt tokens, "
               f"outputs capped at {max_out} tokens, {hf_row.output_tokens} output tokens generated (greedy, "
               f"EOS stops). Roofline: {flops / 1e9:.1f} GFLOP of model matmuls / {rate:.1f} GFLOP/s, the best "
               f"matmul rate measured on the model's sizes before and after the runs ({measured} GFLOP/s). "
               f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or '?'}, "
               f"Python {platform.python_version()}.")
    tbl = table(rows, hf_row, roofline_s)
    print("\n" + summary + "\n\n" + tbl, flush=True)
    failures = [r.name for r in rows if r.ok != r.requests or r.matched != r.requests]
    notes = ["speedup = output tokens/s over the HF row's; x roofline = total time / the compute lower bound.",
             ("Server total time is first request sent to last response done; start-up and warm-up excluded. "
              "HF time is the generate loop only (model load excluded).")]
    if failures:
        notes.append(f"FAILED checks (requests failed or differ from HF): {failures}")
    if args.write_doc:
        write_doc(ROOT / args.write_doc, argv, summary, tbl, notes)
    if args.peers:  # last, so that the peers' installs and runs disturb none of the rows above
        run_peers(args, work, model_dir, reqs)
    return 1 if failures else 0


def run_peers(args: argparse.Namespace, work: Path, model_dir: Path, reqs: list[BenchRequest]) -> None:
    """The section against CPU peers (scripts/peers/compare.py), appended to --write-doc's file."""
    cfg_path = write_config(work / "config_peers.yaml", model_dir, TUNED["prefill"], TUNED["decode"],
                            "longest_output_first", args.max_output_tokens, args.ours_precision,
                            args.ours_quantization)
    peer_md = peer_section(args, model_dir, [r.prompt for r in reqs], [r.max_new_tokens for r in reqs], cfg_path,
                           "/v1/completions streamed, prefill <=8, decode <=128, longest_output_first, "
                           f"precision {args.ours_precision}, quantization {args.ours_quantization}", work)
    print("\n" + peer_md, flush=True)
    if args.write_doc:
        with open(ROOT / args.write_doc, "a") as f:
            f.write("\n## Against CPU peers\n\n" + peer_md)


if __name__ == "__main__":
    sys.exit(main())
