"""Peer rows of scripts/benchmark.py (``--peers openvino,ctranslate2,llamacpp``): us against other CPU engines.

Every system gets the same token-id prompts, greedy, EOS ignored (each request generates exactly its
max_new_tokens, so all produce the same number of tokens), at several concurrency levels: saturation (every
request at once), 1 and 8 in flight (closed loop: a new request starts when one ends). Reference ids come from
Hugging Face transformers, one request at a time (the baseline). Our tuned server is served over HTTP
(/v1/completions, streamed, the load client's --max-concurrency); its answer is text, so ours is compared with
the HF ids' text, the peers' ids with the HF ids. Each peer runs in its own venv (scripts/peer_env.sh) through
its runner (run_<peer>.py: request file in, per-request ids and times out, peer_io's formats). A peer that
serves one sequence at a time (llama-cpp-python) runs only the level 1 in flight; its rows at other levels say
why they are empty. Rounds alternate the systems, so a slow minute of this shared machine does not land on one
system only. Conversion, model load and warm-up are outside the timed part and reported apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from peers.peer_io import (
    SATURATION,
    LevelRun,
    PeerRequest,
    RequestFile,
    Timing,
    compare_ids,
    first_difference,
    read_results,
    summarize,
    write_requests,
)

from llm_serving.bench.local_server import ServerStartError, running_server
from loadtest.client import benchmark
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EOS = 2
# torch on 1 thread: on this shared 2-core machine, under other jobs' load, its OpenMP threads spin against
# them; one greedy request took 1.4 s on 1 thread and 7.9 s on 2 (load average ~7). The same holds for
# CTranslate2 (its runner's --threads). On a quiet machine give them every core: LLM_SERVING_PEER_THREADS=2.
HF_THREADS = int(os.environ.get("LLM_SERVING_PEER_THREADS", "1"))
# name -> (peer_env.sh name or None for ours, runner, extra runner arguments given the work dir and the
# served row's config)
PEERS = {
    "openvino": ("openvino", "run_openvino.py", lambda w, _: ["--ir-dir", str(w / "peer-openvino-ir"),
                                                              "--precision", "f32"]),
    "openvino-int8": ("openvino", "run_openvino.py", lambda w, _: ["--ir-dir", str(w / "peer-openvino-int8-ir"),
                                                                   "--precision", "f32", "--weight-format", "int8"]),
    "openvino-default": ("openvino", "run_openvino.py", lambda w, _: ["--ir-dir", str(w / "peer-openvino-ir"),
                                                                      "--precision", "default"]),
    "ctranslate2": ("ctranslate2", "run_ctranslate2.py", lambda w, _: ["--ct2-dir", str(w / "peer-ctranslate2"),
                                                                       "--threads", str(HF_THREADS)]),
    "llamacpp": ("llamacpp", "run_llamacpp.py", lambda w, _: ["--gguf-dir", str(w / "peer-llamacpp-gguf"),
                                                              "--threads", str(HF_THREADS)]),
    # our engine through its offline API, in this project's environment (no venv to make): like for like with
    # the peers, which run in process too, on the served row's config
    "ours-in-process": (None, "run_ours.py", lambda _, ours_config: ["--config", str(ours_config)]),
    # the same in process with int8 weights (model_config.quantization w8a16), beside float32 in one run
    "ours-w8a16": (None, "run_ours.py", lambda w, ours_config: ["--config", str(with_model_config(
        ours_config, w / "config_peers_w8a16.yaml", quantization="w8a16"))]),
    "ours-w8a16-kv8": (None, "run_ours.py", lambda w, ours_config: ["--config", str(with_model_config(
        ours_config, w / "config_peers_w8a16_kv8.yaml", quantization="w8a16", kv_cache_dtype="int8"))]),
}
LABELS = {"openvino": "OpenVINO GenAI, f32", "openvino-default": "OpenVINO GenAI, CPU defaults",
          "openvino-int8": "OpenVINO GenAI, int8 weights, f32", "ours-w8a16": "ours, in process, w8a16",
          "ours-w8a16-kv8": "ours, in process, w8a16, int8 KV cache",
          "ctranslate2": "CTranslate2, float32", "llamacpp": "llama.cpp, F32", "ours-in-process": "ours, in process"}


def with_model_config(config: Path, out: Path, **values: str) -> Path:
    """A copy of a served row's config (JSON, as scripts/benchmark.py writes it) with model_config keys set."""
    cfg = json.loads(config.read_text())
    cfg["model_config"].update(values)
    out.write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    """benchmark.py's peer options."""
    p.add_argument("--peers", default="", help=f"comma-separated peers to add ({', '.join(PEERS)}): a section "
                   "against them, each installed in its own venv on first use (scripts/peer_env.sh)")
    p.add_argument("--concurrency", default="all,1,8",
                   help="levels for --peers: 'all' = every request at once, N = N in flight (default all,1,8; "
                   "llamacpp runs only 1)")
    p.add_argument("--low-load-requests", type=int, default=64,
                   help="levels other than 'all' run only the first this many requests (default 64)")
    p.add_argument("--peer-rounds", type=int, default=1, help="rounds, alternating the systems (default 1)")
    p.add_argument("--peers-only", action="store_true",
                   help="with --peers: only that section (--write-doc then appends it to the file as it is)")
    p.add_argument("--ours-precision", default="exact", choices=["exact", "half", "fast"],
                   help="model_config.precision of our server in that section (default exact)")
    p.add_argument("--ours-quantization", default="none", choices=["none", "w8a16"],
                   help="model_config.quantization of our server in that section (default none)")


def parse_levels(text: str) -> list[int]:
    """'all,1,8' -> [SATURATION, 1, 8]."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            levels.append(SATURATION)
        elif part.isdigit() and int(part) >= 1:
            levels.append(int(part))
        else:
            raise SystemExit(f"--concurrency: {part!r} is neither 'all' nor a count >= 1")
    return levels


def level_name(level: int) -> str:
    return "all at once" if level == SATURATION else f"{level} in flight"


@dataclass
class System:
    """One row: every round's run of each level, and what its start cost."""

    name: str
    settings: str
    startup: str = ""
    runs: dict[int, list[LevelRun]] = field(default_factory=dict)
    matched: dict[int, tuple[int, int]] = field(default_factory=dict)  # level -> (equal, compared), all rounds
    error: str = ""
    not_run: str = ""  # why some levels have no run (the runner says)

    def add(self, run: LevelRun, equal: int, compared: int) -> None:
        self.runs.setdefault(run.level, []).append(run)
        e, c = self.matched.get(run.level, (0, 0))
        self.matched[run.level] = (e + equal, c + compared)


# ------------------------------------------------------------------------------------------ the reference
def hf_reference(model_dir: Path, reqs: Sequence[PeerRequest]) -> tuple[LevelRun, float]:
    """HF transformers greedy, one request at a time, EOS ignored: the reference ids and the baseline's
    timings (no first-token time: generate returns at the end); also the model load's seconds."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(HF_THREADS)
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: generate runs to max_new_tokens
    load_s = time.perf_counter() - t0
    timings = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for r in reqs:
            start = time.perf_counter() - t0
            seq = model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            out = seq[0, len(r.prompt_ids):].tolist()
            if len(out) != r.max_new_tokens:
                raise SystemExit(f"HF request {r.index}: {len(out)} tokens, not {r.max_new_tokens}: EOS not ignored")
            timings.append(Timing(r.index, out, start, time.perf_counter() - t0))
    return LevelRun(1, time.perf_counter() - t0, timings), load_s


def continuation_texts(tokenizer, reqs: Sequence[PeerRequest], outs: Sequence[Sequence[int]]) -> list[str]:
    """The text each reference output adds to its prompt (special tokens, e.g. an ignored EOS, render as
    nothing, as in our server's stream)."""
    texts = []
    for r, out in zip(reqs, outs):
        prompt, full = tokenizer.decode(r.prompt_ids), tokenizer.decode(list(r.prompt_ids) + list(out))
        texts.append(full.removeprefix(prompt))
    return texts


# ------------------------------------------------------------------------------------------ our server
@contextmanager
def served(config: Path, log_path: Path, timeout: float) -> Iterator[tuple[int, float]]:
    """Our server on a free port: yields (port, seconds from process start to /health answering)."""
    try:
        with running_server(config, log_path, timeout, cwd=ROOT,
                            announce=lambda cmd: print(f"[peers] ours: {cmd} (log {log_path})", flush=True)) as up:
            yield up
    except ServerStartError as e:
        raise SystemExit(f"our server did not start ({e}); log tail:\n{log_path.read_text()[-1500:]}") from None


def ours_level(port: int, reqs: Sequence[PeerRequest], level: int, expected: Sequence[str]) -> tuple[LevelRun,
                                                                                                      int, int]:
    """One level against our server through the load client: (run, texts equal to HF's, requests)."""
    bench = [BenchRequest(r.index, "", r.max_new_tokens, len(r.prompt_ids), prompt_ids=list(r.prompt_ids))
             for r in reqs]
    cfg = BenchConfig(port=port, endpoint="openai", qps=float("inf"), ignore_eos=True, metrics_interval=0,
                      max_concurrency=level or None)
    run = asyncio.run(benchmark(bench, cfg, progress=False))
    timings, equal = [], 0
    for res in run.results:
        if not res.success:
            print(f"[peers] ours: request {res.index} failed: {res.error}", flush=True)
            continue
        equal += res.text == expected[res.index]
        first = res.send_time + res.ttft if res.ttft is not None else None
        timings.append(Timing(res.index, None, res.send_time, res.end_time, first, res.output_tokens))
    return LevelRun(level, run.duration, timings), equal, len(reqs)


# ------------------------------------------------------------------------------------------ peers
def peer_python(env: str | None) -> str:
    """The peer venv's python, created on first use (None: this project's own python)."""
    if env is None:
        return sys.executable
    out = subprocess.run(["bash", str(ROOT / "scripts" / "peer_env.sh"), env], cwd=ROOT, check=False,
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/peer_env.sh {env} failed (exit {out.returncode})")
    return out.stdout.strip().splitlines()[-1]


def peer_model_dir(model_dir: Path, work: Path) -> Path:
    """The model as the peers' converters want it: our HF directory (linked, not copied) plus the
    tokenizer_config.json that transformers needs to read a bare tokenizer.model (both converters load the
    tokenizer; the runs themselves use token ids only)."""
    view = work / f"peer-model-{model_dir.name}"
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = view / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    (view / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", '
        '"add_bos_token": true, "add_eos_token": false, "legacy": true}\n')
    return view


def run_peer(name: str, python: str, req_file: Path, work: Path, tag: str,
             ours_config: Path) -> tuple[str, str, list[LevelRun], str]:
    """One runner process: (settings with version, start-up text, level runs, why levels were not run)."""
    _env, runner, extra = PEERS[name]
    out = work / f"peer-{name}-{tag}.json"
    log = work / f"peer-{name}-{tag}.log"
    cmd = [python, str(HERE / runner), "--requests", str(req_file), "--out", str(out), *extra(work, ours_config)]
    print(f"[peers] {name}: {' '.join(cmd)} (log {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=HERE, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = log.read_text().strip().splitlines() or ["(empty log)"]
        print(f"[peers] {name} log tail:\n" + "\n".join(tail[-25:]), flush=True)
        raise RuntimeError(f"{runner} exited {rc}: {tail[-1]}")
    res = read_results(out)
    conv = "" if res.convert_s is None else f"conversion {res.convert_s:.1f} s, "
    return f"{res.version}: {res.settings}", f"{conv}load + warm-up {res.load_s:.1f} s", res.runs, res.not_run


# ------------------------------------------------------------------------------------------ the section
def run_section(args: argparse.Namespace, model_dir: Path, prompts: Sequence[str], max_new: Sequence[int],
                ours_config: Path, ours_settings: str, work: Path) -> str:
    """Run every system at every level (args.peer_rounds rounds, alternating) and return the markdown.
    ``prompts`` are encoded as HF's baseline encodes them (our tokenizer, with BOS); ids go to every system."""
    from llm_serving.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir / "tokenizer.model")
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown} (known: {', '.join(PEERS)})")
    levels = parse_levels(args.concurrency)
    reqs = [PeerRequest(i, list(ids), n) for i, (ids, n) in enumerate(zip(prompt_ids, max_new))]
    rf = RequestFile(str(peer_model_dir(model_dir, work)), EOS, levels, args.low_load_requests, reqs)
    req_file = work / "peer-requests.json"
    write_requests(req_file, rf)
    load_before = os.getloadavg()
    pythons = {}
    for n in names:  # installs before anything is timed
        try:
            pythons[n] = peer_python(PEERS[n][0])
        except RuntimeError as e:
            pythons[n] = e

    print(f"[peers] HF reference, {len(reqs)} requests one at a time, EOS ignored", flush=True)
    hf_run, hf_load = hf_reference(model_dir, reqs)
    reference = [t.output_ids for t in hf_run.timings]
    expected = continuation_texts(tokenizer, reqs, reference)
    hf = System("HF transformers, 1 at a time", f"generate, greedy, float32, torch threads {HF_THREADS} (the baseline)",
                f"load {hf_load:.1f} s")
    hf.add(hf_run, len(reqs), len(reqs))
    ours = System("ours, served", ours_settings)
    peers = {n: System(LABELS[n], "") for n in names}
    with served(ours_config, work / "server_peers.log", args.startup_timeout) as (port, ready_s):
        ours.startup = f"process start to ready {ready_s:.1f} s"
        for rnd in range(args.peer_rounds):
            for level in levels:
                run, equal, n = ours_level(port, rf.level_requests(level), level, expected)
                ours.add(run, equal, n)
                print(f"[peers] round {rnd + 1} ours {level_name(level)}: {run.wall_s:.2f}s, "
                      f"{run.output_tokens} tokens, {equal}/{n} = HF", flush=True)
            for n, system in peers.items():
                if isinstance(pythons[n], Exception):
                    system.error = str(pythons[n])
                    continue
                try:
                    system.settings, system.startup, runs, system.not_run = run_peer(n, pythons[n], req_file,
                                                                                     work, f"r{rnd}", ours_config)
                except RuntimeError as e:
                    system.error = str(e)
                    print(f"[peers] {n} failed: {e}", flush=True)
                    continue
                for run in runs:
                    equal, compared, differ = compare_ids(reference, run.timings)
                    system.add(run, equal, compared)
                    print(f"[peers] round {rnd + 1} {n} {level_name(run.level)}: {run.wall_s:.2f}s, "
                          f"{run.output_tokens} tokens, {equal}/{compared} = HF", flush=True)
                    for i in differ[:3]:
                        got = next(t.output_ids for t in run.timings if t.index == i)
                        print(f"[peers]   {n} request {i} differs from HF at output position "
                              f"{first_difference(got, reference[i])}", flush=True)
    load_after = os.getloadavg()
    return markdown([hf, ours, *peers.values()], ours, levels, args, load_before, load_after)


def _median(runs: list[LevelRun], key: str) -> float | None:
    values = [v for v in (summarize(r)[key] for r in runs) if v is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def markdown(systems: list[System], ours: System, levels: list[int], args: argparse.Namespace,
             load_before: tuple[float, ...], load_after: tuple[float, ...]) -> str:
    """Tables per level: medians over the rounds; per-round totals in the notes."""
    hf_all = systems[0].runs[1][0]
    rounds = (f"medians of {args.peer_rounds} rounds alternating the systems" if args.peer_rounds > 1
              else "one round")
    out = [(f"{len(hf_all.timings)} requests, the same token-id prompts for every system, greedy, EOS ignored "
           f"(max_new_tokens = min(reference output tokens, {args.max_output_tokens})): {hf_all.output_tokens} "
           f"output tokens at saturation. greedy = HF: output ids equal to HF's (ours: its text equal to the HF "
           f"ids' text, the HTTP answer being text). TTFT/TPOT are empty where the API gives a request's tokens "
           f"only at its end. x ours: output tokens/s over ours at the same level; {rounds}. Conversion, model "
           f"load and warm-up are outside the timed part (listed below).\n")]
    for level in levels:
        ours_tps = _median(ours.runs.get(level, []), "tokens_per_s")
        hf_runs = systems[0].runs[1]
        if level == SATURATION:
            title = "All requests at once (saturation)"
        else:
            title = f"{level} in flight, the first {args.low_load_requests} requests"
        out.append(f"#### {title}\n")
        out.append("| system | greedy = HF | output tokens | total time (s) | output tokens/s | x ours (tokens/s) "
                   "| mean latency (s) | mean TTFT (ms) | mean TPOT (ms) |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for s in systems:
            if s is systems[0] and level not in (SATURATION, 1):
                continue  # HF runs one request at a time only
            if s is systems[0]:  # HF ran once, one at a time: the same timings serve every level
                n = len(hf_runs[0].timings) if level == SATURATION else args.low_load_requests
                runs = [LevelRun(1, 0.0, hf_runs[0].timings[:n])]
                runs[0].wall_s = sum(t.latency for t in runs[0].timings)
                eq = f"{n}/{n} (reference)"
            else:
                runs = s.runs.get(level, [])
                e, c = s.matched.get(level, (0, 0))
                eq = f"{e}/{c}" + (" (text)" if s is ours else "")
            if not runs:
                why = s.error.splitlines()[0] if s.error else f"not run: {s.not_run}" if s.not_run else "not run"
                out.append(f"| {s.name} | {why} | | | | | | | |")
                continue
            tps = _median(runs, "tokens_per_s")
            ratio = f"{tps / ours_tps:.2f}x" if ours_tps and tps else ""
            out.append(f"| {s.name} | {eq} | {runs[0].output_tokens} | {_fmt(_median(runs, 'wall_s'))} "
                       f"| {_fmt(tps, digits=1)} | {ratio} | {_fmt(_median(runs, 'mean_latency_s'), digits=3)} "
                       f"| {_fmt(_median(runs, 'mean_ttft_s'), 1e3, 1)} "
                       f"| {_fmt(_median(runs, 'mean_tpot_s'), 1e3, 1)} |")
        out.append("")
    out.append("Settings and start-up (outside the timed part):\n")
    for s in systems:
        out.append(f"- {s.name}: {s.settings or '?'}" + (f"; {s.startup}" if s.startup else "")
                   + (f"; FAILED: {s.error.splitlines()[0]}" if s.error else ""))
    if args.peer_rounds > 1:
        out.append("\nTotal time of each round (s):\n")
        for s in systems[1:]:
            parts = [f"{level_name(lv)} " + ", ".join(f"{r.wall_s:.2f}" for r in s.runs[lv])
                     for lv in levels if s.runs.get(lv)]
            out.append(f"- {s.name}: " + "; ".join(parts))
    out.append(f"\nLoad average (1, 5, 15 min) before the section: {', '.join(f'{x:.2f}' for x in load_before)}; "
               f"after: {', '.join(f'{x:.2f}' for x in load_after)}.")
    return "\n".join(out) + "\n"
