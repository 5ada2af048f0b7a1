"""The precision modes (model_config.precision exact / half / fast), int8 weights (model_config.quantization
w8a16) and the int8 KV cache (model_config.kv_cache_dtype int8: modes kv8, w8a16-kv8) on the bench model or the trained
model: the contest's logits rule, greedy-id agreement with Hugging Face,
and served speed, all from one run.

    python scripts/bench_fast_precision.py [--model bench|trained] [--modes exact w8a16 ...]
                                           [--num-prompts 256] [--max-output-tokens 64] [--rounds 2]

Model and workload as scripts/benchmark.py (``--model bench``: the bench model of scripts/bench_model.py, random
weights std 0.05, its own tokenizer; ``trained``: the shipped trained target, llm_serving/models/pydoc/target;
alpaca-shaped requests of llm_serving.bench.workload, seed 0; max_new_tokens = min(reference output, 64)).
1. Reference: Hugging Face transformers float32, greedy, EOS ignored, keeping the logits of every generated
   position (prompts of equal length batched, without padding).
2. Each mode through the whole engine: ``llm-serving generate --ignore-eos --dump-logits DIR`` (token-id prompts,
   the tuned config of scripts/benchmark.py), cut to each request's length. Reported per mode: requests whose
   ids equal HF's; the rule (per position max|ours - ref| / max|ref| <= 5 per mille, scripts/check_precision.py)
   over the positions generated on HF's context (a request's positions up to and including its first token that
   differs from HF's: past it the contexts differ and the rows compare different distributions), its pass rate
   and worst error; and how many requests pass the rule on every position, as a contest comparing dumps
   position by position would see it.
3. Speed: one server per mode (the tuned config), the modes alternated for ``--rounds`` rounds, all requests at
   once on the streaming endpoint (EOS stops, as scripts/benchmark.py), output tokens/s and the ratio to exact
   in the same round.

    python scripts/bench_fast_precision.py --steps [--context 256]

instead times single graph calls of the model per mode in one process (prefill 8 x 128, decode at batch 1,
8, 32 and 128; each call's modes alternated, medians of 15), after each mode's weight bytes.

    python scripts/bench_fast_precision.py --quality [--model trained] [--modes exact ascend ascend-kv8 ...]

instead measures each mode on held-out text (standard-library docstrings the trained model never saw), teacher-
forced through the serving runner: perplexity, how often its greedy pick equals exact mode's, and the contest
rule's error per position against exact mode. ``ascend`` and ``ascend-kv8``: the Ascend graphs with the fused
ops' CPU stand-ins, float caches or the int8 cache with static scales calibrated on the load tool's corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchmark  # scripts/benchmark.py: model, workload, servers
from check_precision import TOLERANCE

from llm_serving.protocol.model_config import KV_SCALE_HEADROOM

MODES = ("exact", "half", "fast", "w8a16", "kv8", "w8a16-kv8")
# --quality only: the Ascend graphs with the CPU stand-ins of the fused ops in float32, with float caches or the
# int8 cache of static per-channel scales calibrated on the load tool's corpus (llm-serving calibrate-kv's default)
ASCEND_MODES = ("ascend", "ascend-kv8")
# mode -> (model_config.precision, model_config.quantization, model_config.kv_cache_dtype)
SETTINGS = {"exact": ("exact", "none", "auto"), "half": ("half", "none", "auto"), "fast": ("fast", "none", "auto"),
            "w8a16": ("exact", "w8a16", "auto"), "kv8": ("exact", "none", "int8"),
            "w8a16-kv8": ("exact", "w8a16", "int8"), "ascend": ("exact", "none", "auto"),
            "ascend-kv8": ("exact", "none", "int8")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="server rounds per mode, alternated (0: no speed part)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + ASCEND_MODES,
                   help=f"{', '.join(ASCEND_MODES)}: with --quality only")
    p.add_argument("--work-dir", default="/tmp/llm-serving-precision")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--steps", action="store_true", help="time graph calls per mode instead (no HF, no servers)")
    p.add_argument("--speed-only", action="store_true",
                   help="only the served rounds: no HF reference, no dumps, texts not compared")
    p.add_argument("--context", type=int, default=256, help="decode context of --steps")
    p.add_argument("--model", choices=("bench", "trained", "draft"), default="bench",
                   help="bench (random weights), trained (the shipped target) or draft (the shipped draft)")
    p.add_argument("--quality", action="store_true",
                   help="held-out perplexity and agreement per mode instead (no HF, no servers)")
    p.add_argument("--windows", type=int, default=32, help="held-out windows of --quality")
    p.add_argument("--window-tokens", type=int, default=128, help="tokens per window of --quality")
    p.add_argument("--kv-calibration", choices=("corpus", "train"), default="corpus",
                   help="ascend-kv8's calibration text: the load tool's corpus (calibrate-kv's default) or the "
                   "model's training text")
    p.add_argument("--kv-headroom", type=float, default=KV_SCALE_HEADROOM, help="ascend-kv8's scale headroom")
    return p.parse_args(argv)


def trained_dir(model: str) -> Path:
    """The shipped trained target or draft (llm_serving/models/pydoc)."""
    from llm_serving.models.default_model import TRAINED_MODEL

    return TRAINED_MODEL if model == "trained" else TRAINED_MODEL.parent / "draft"


def model_weights(model: str):
    """(config, canonical float32 weights) of the bench model (random, as scripts/benchmark.py builds it) or the
    shipped trained target or draft."""
    from agents.weights.checkpoints import fuse_hf_tensors, load_weights
    from llm_serving.protocol.model_config import LlamaConfig

    if model != "bench":
        model_dir = trained_dir(model)
        config = LlamaConfig.from_model_dir(model_dir)
        return config, load_weights(model_dir, config)
    from bench_model import BENCH_MODEL

    from llm_serving.models.random_model import random_hf_weights

    return BENCH_MODEL, fuse_hf_tensors(random_hf_weights(BENCH_MODEL, seed=0, std=0.05), BENCH_MODEL)


def held_bytes(runner) -> int:
    """Bytes of the model's Parameters other than the KV cache (the weights as the runner holds them)."""
    return sum(p.nbytes for p in runner.model.get_parameters() if "cache" not in p.name)  # kv_cache, key_cache, ...


def cache_bytes(runner) -> int:
    """Bytes of the KV cache's Parameters."""
    return sum(p.nbytes for p in runner.model.get_parameters() if "kv_cache" in p.name)


def teacher_forced(runner, ids) -> np.ndarray:
    """Logits ``[windows, positions - 1, vocab]``: each window's first token prefilled, then one decode step per
    following token, every step fed the text's own token (so every mode sees the same context)."""
    from llm_serving.protocol.batch import StepBatch

    b, n = ids.shape
    block = runner.rc.block_size
    width = -(-n // block)
    tables = (1 + np.arange(b * width, dtype=np.int32)).reshape(b, width)
    rows = [runner.step_logits(StepBatch(ids[:, 0].copy(), np.zeros(b, np.int32), tables[:, 0] * block,
                                         np.ones(b, np.int32), np.ones(b, np.int32), tables))]
    for t in range(1, n - 1):
        rows.append(runner.step_logits(StepBatch(ids[:, t].copy(), np.full(b, t, np.int32),
                                                 (tables[:, t // block] * block + t % block).astype(np.int32),
                                                 np.ones(b, np.int32), np.full(b, t + 1, np.int32), tables)))
    return np.stack(rows, 1)


def quality(args: argparse.Namespace) -> None:
    """Per mode on held-out text: perplexity, greedy agreement with exact mode, the rule's error against it."""
    import mindspore as ms

    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.training.corpus import stdlib_corpus
    from agents.training.trainer import token_stream
    from llm_serving.tokenization.tokenizer import Tokenizer

    ms.set_context(mode=ms.GRAPH_MODE)
    config, weights = model_weights(args.model)
    from llm_serving.models.default_model import TRAINED_MODEL

    tok = Tokenizer(TRAINED_MODEL / "tokenizer.model")  # the bench model's vocabulary is larger: ids stay valid
    stream = token_stream([tok.encode(d) for d in stdlib_corpus().held_out], 1, 2)
    n, length = args.windows, args.window_tokens
    if len(stream) < n * length + 1:
        raise SystemExit(f"held-out text has {len(stream)} tokens, fewer than {n} x {length}")
    ids = stream[: n * length].reshape(n, length).astype(np.int32)
    labels = ids[:, 1:]
    width = -(-length // 16)
    results = {}
    for mode in args.modes:
        precision, quantization, kv_cache = SETTINGS[mode]
        rc = RunnerConfig(num_blocks=n * width + 1, block_size=16, max_model_len=max(length, 64),
                          prefill_batch_sizes=(n,), prefill_seq_lengths=(min(64, length),), decode_batch_sizes=(n,),
                          decode_block_widths=(width,), precision=precision, quantization=quantization,
                          kv_cache_dtype=kv_cache)
        backend, mode_weights = None, weights
        if mode in ASCEND_MODES:
            backend, mode_weights = ascend_stand_ins(config, weights, tok, kv_cache == "int8", args)
        runner = ModelRunner(config, mode_weights, rc, backend)
        runner.warmup()
        logits = teacher_forced(runner, ids).astype(np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, labels[..., None], -1).mean()
        results[mode] = (logits, float(np.exp(nll)), held_bytes(runner))
        del runner
    exact = results[args.modes[0]][0]
    print(f"\n{args.model} model, {n} held-out windows of {length} tokens ({n * (length - 1)} positions), "
          f"teacher-forced; against {args.modes[0]}:")
    print(f"| mode | weights held (MiB) | perplexity | greedy pick = {args.modes[0]} | rule error median "
          "| rule error worst | positions within 5 per mille |")
    print("|---|---|---|---|---|---|---|")
    for mode, (logits, ppl, nbytes) in results.items():
        errors = rule(logits, exact)
        agree = (logits.argmax(-1) == exact.argmax(-1)).mean()
        print(f"| {mode} | {nbytes / 2 ** 20:.1f} | {ppl:.2f} | {agree:.2%} | {np.median(errors) * 1e3:.2f} per mille "
              f"| {errors.max() * 1e3:.2f} per mille | {(errors <= TOLERANCE).mean():.2%} |")


def ascend_stand_ins(config, weights: dict, tok, int8_cache: bool, args: argparse.Namespace):
    """The Ascend backend over the fused ops' CPU stand-ins, and the weights with static KV scales calibrated (32
    windows of 256 tokens) on the load tool's corpus (``--kv-calibration corpus``, calibrate-kv's default) or on 400
    documents of the model's training text (``train``), with ``--kv-headroom``, where the cache is int8."""
    import random

    from agents.model.backends.ascend import AscendBackend
    from agents.model.backends.ascend_reference import ReferenceOps
    from agents.tools.calibrate_kv import calibrate
    from agents.training.corpus import stdlib_corpus
    from agents.weights.kv_scales import scales_of
    from llm_serving.bench.workload import DEFAULT_CORPUS
    from llm_serving.cli.commands.calibrate_kv import windows

    backend = AscendBackend(ReferenceOps(config.head_dim))
    if not int8_cache:
        return backend, weights
    if args.kv_calibration == "train":
        text = "\n".join(random.Random(0).sample(stdlib_corpus().train, 400))
    else:
        text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    chunks = windows(tok.encode(text), 32, 256, config.bos_token_id)
    scales = scales_of(calibrate(config, weights, chunks), args.kv_headroom)
    return backend, {**weights, **{f"layers.{i}.kv_scale": s for i, s in enumerate(scales)}}


def step_times(modes: list[str], context: int, model: str) -> None:
    """Graph-call medians per mode, alternated (MindSpore in this process: never together with torch)."""
    import mindspore as ms
    from bench_model import BLOCK, alternating_ms, decode_batch, prefill_batch

    from agents.runtime.runner import ModelRunner, RunnerConfig

    ms.set_context(mode=ms.GRAPH_MODE)
    config, weights = model_weights(model)
    width = -(-context // BLOCK)
    runners = []
    for mode in modes:
        precision, quantization, kv_cache = SETTINGS[mode]
        rc = RunnerConfig(num_blocks=128 * width + 1, block_size=BLOCK, max_model_len=max(512, context),
                          prefill_batch_sizes=(1, 8), prefill_seq_lengths=(128,), decode_batch_sizes=(1, 8, 32, 128),
                          decode_block_widths=(width,), precision=precision, quantization=quantization,
                          kv_cache_dtype=kv_cache)
        runners.append(ModelRunner(config, weights, rc))
        runners[-1].warmup()
        print(f"[precision] {mode}: weights held {held_bytes(runners[-1]) / 2 ** 20:.1f} MiB, KV cache "
              f"{cache_bytes(runners[-1]) / 2 ** 20:.1f} MiB", flush=True)
    calls = [("prefill 8x128", prefill_batch(8, 128))] + [
        (f"decode B={b} ctx={context}", decode_batch(b, context)) for b in (1, 8, 32, 128)]
    print("| call | " + " | ".join(f"{m} ms" for m in modes) + " | "
          + " | ".join(f"{m} / {modes[0]}" for m in modes[1:]) + " |")
    print("|---|" + "---|" * (2 * len(modes) - 1))
    for name, batch in calls:
        times = alternating_ms([lambda r=r, batch=batch: r.step(batch) for r in runners], 15)
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " | "
              + " | ".join(f"{times[0] / t:.2f}x" for t in times[1:]) + " |")


def hf_reference(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> tuple[list, list]:
    """HF float32 greedy ids and logits ``[n, vocab]`` of each prompt's ``n`` generated positions, EOS ignored.
    Prompts of equal length run as one batch (no padding, so no mask: each row computes what it would alone, up
    to float32 summation order), for time: one request at a time took ~100 ms a position on the loaded machine."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    all_ids: list = [None] * len(prompts)
    all_logits: list = [None] * len(prompts)
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        groups.setdefault(len(ids), []).append(i)
    with torch.no_grad():
        for members in groups.values():
            n = max(lengths[i] for i in members)
            out = model(torch.tensor([prompts[i] for i in members]), use_cache=True)
            rows, generated = [], []
            for step in range(n):
                logits = out.logits[:, -1].float()
                rows.append(logits.numpy().copy())
                generated.append(logits.argmax(-1))
                if step + 1 < n:
                    out = model(generated[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
            tokens, table = torch.stack(generated, 1).tolist(), np.stack(rows, 1)
            for row, i in enumerate(members):
                all_ids[i], all_logits[i] = tokens[row][: lengths[i]], table[row, : lengths[i]]
    return all_ids, all_logits


def run_generate(config: Path, prompts_file: Path, dump: Path, max_new: int) -> tuple[list[list[int]], float]:
    """Token ids of every prompt (and the command's wall time) through ``llm-serving generate``."""
    cmd = [sys.executable, "-m", "llm_serving", "generate", "--config", str(config), "--prompts", str(prompts_file),
           "--max-new-tokens", str(max_new), "--ignore-eos", "--dump-logits", str(dump)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line)["token_ids"] for line in out.stdout.splitlines() if line.startswith("{")], \
        time.perf_counter() - t0


def rule(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position max|ours - ref| / max|ref| (scripts/check_precision.py)."""
    return np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)


def precision_report(mode: str, ids: list[list[int]], dump: Path, hf_ids: list, hf_logits: list) -> dict:
    same_context, all_positions, identical, files_pass = [], [], 0, 0
    for i, (ref_ids, ref) in enumerate(zip(hf_ids, hf_logits)):
        n = len(ref_ids)
        ours_ids, ours = ids[i][:n], np.load(dump / f"{i}.npy")[:n]
        errors = rule(ours, ref)
        differ = next((k for k, (a, b) in enumerate(zip(ours_ids, ref_ids)) if a != b), None)
        identical += differ is None
        same_context.append(errors[: n if differ is None else differ + 1])
        all_positions.append(errors)
        files_pass += bool((errors <= TOLERANCE).all())
    same = np.concatenate(same_context)
    every = np.concatenate(all_positions)
    return {"mode": mode, "identical": identical, "requests": len(hf_ids), "positions": int(same.size),
            "pass_rate": float((same <= TOLERANCE).mean()), "worst": float(same.max()),
            "median": float(np.median(same)), "files_pass": files_pass, "worst_all": float(every.max())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    print(f"[precision] start; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if set(args.modes) & set(ASCEND_MODES) and not args.quality:
        raise SystemExit(f"modes {', '.join(ASCEND_MODES)} are measured with --quality only (no NPU to serve them)")
    if args.steps or args.quality:
        if args.steps:
            step_times(args.modes, args.context, args.model)
        else:
            quality(args)
        load = os.getloadavg()
        print(f"[precision] end; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = benchmark.build_model(work) if args.model == "bench" else trained_dir(args.model)
    reqs = benchmark.make_requests(argparse.Namespace(num_prompts=args.num_prompts, seed=args.seed,
                                                      max_output_tokens=args.max_output_tokens), model_dir)
    from llm_serving.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    prompts = [tok.encode(r.prompt) for r in reqs]
    lengths = [r.max_new_tokens for r in reqs]
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    configs = {m: benchmark.write_config(work / f"config_{m}.yaml", model_dir, benchmark.TUNED["prefill"],
                                         benchmark.TUNED["decode"], "longest_output_first", args.max_output_tokens,
                                         *SETTINGS[m]) for m in args.modes}
    hf_ids: list = []
    if not args.speed_only:
        t0 = time.perf_counter()
        hf_ids, hf_logits = hf_reference(model_dir, prompts, lengths)
        print(f"[precision] HF reference: {len(reqs)} requests, {sum(lengths)} positions in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    reports = []
    for mode in [] if args.speed_only else args.modes:
        dump = work / f"dump_{mode}"
        ids, seconds = run_generate(configs[mode], prompts_file, dump, max(lengths))
        reports.append(precision_report(mode, ids, dump, hf_ids, hf_logits))
        print(f"[precision] {mode}: generate took {seconds:.0f}s; {reports[-1]}", flush=True)

    if reports:
        print("\n| mode | requests with ids = HF | positions on HF's context | within 5 per mille | worst error "
              "| median error | requests within 5 per mille at every position | worst error, every position |")
        print("|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(f"| {r['mode']} | {r['identical']}/{r['requests']} | {r['positions']} | {r['pass_rate']:.2%} "
              f"| {r['worst'] * 1e3:.2f} per mille | {r['median'] * 1e3:.2f} per mille "
              f"| {r['files_pass']}/{r['requests']} | {r['worst_all'] * 1e3:.1f} per mille |")

    if args.rounds:
        # the servers stop at EOS: the HF text is its ids up to the first EOS (generation is causal)
        expected = [""] * len(reqs) if args.speed_only else benchmark.expected_texts(model_dir, reqs, [
            ids[: next((k for k, t in enumerate(ids) if t == benchmark.EOS), len(ids))] for ids in hf_ids])
        rows: dict[str, list] = {m: [] for m in args.modes}
        server_args = argparse.Namespace(startup_timeout=args.startup_timeout)
        for rnd in range(args.rounds):
            for mode in args.modes:
                row = benchmark.run_server(f"{mode} round {rnd + 1}", f"{mode}{rnd}", configs[mode], reqs, expected,
                                           server_args, work, show_differences=False)
                rows[mode].append(row)
                tps = row.output_tokens / row.total_s if row.ok else float("nan")
                print(f"[precision] {mode} round {rnd + 1}: {row.ok}/{row.requests} ok, text = HF "
                      f"{row.matched}/{row.requests}, {row.output_tokens} tokens in {row.total_s:.2f}s = "
                      f"{tps:.1f} tokens/s; load {os.getloadavg()[0]:.2f}", flush=True)
        print("\n| round | " + " | ".join(f"{m} tokens/s (text = HF)" for m in args.modes) + " | "
              + " | ".join(f"{m} / exact" for m in args.modes if m != "exact") + " |")
        print("|---|" + "---|" * (2 * len(args.modes) - 1))
        for rnd in range(args.rounds):
            tps = {m: rows[m][rnd].output_tokens / rows[m][rnd].total_s for m in args.modes}
            ratios = [f"{tps[m] / tps['exact']:.2f}x" for m in args.modes if m != "exact" and "exact" in tps]
            print(f"| {rnd + 1} | " + " | ".join(f"{tps[m]:.1f} ({rows[m][rnd].matched}/{rows[m][rnd].requests})"
                                               for m in args.modes) + " | " + " | ".join(ratios) + " |")
    load = os.getloadavg()
    print(f"\n[precision] end; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
