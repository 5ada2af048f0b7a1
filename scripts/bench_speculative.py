"""Speculative decoding and early exit on the shipped trained pair (llm_serving/models/pydoc), side by side in one run.

    python scripts/bench_speculative.py [--methods plain,ngram,draft,self1,self2,draft-policies,draft-loop]
                                        [--levels 1,8,32] [--rounds 2] [--num-prompts 32] [--max-output-tokens 64]
                                        [--exit-layers 1,2,3] [--round-costs]

Workloads: ``continue``, the first ``--prompt-tokens`` tokens of held-out standard-library docstrings (text the model
never trained on); ``copy``, the same followed by their first half again (the output can copy the input, what prompt
lookup is for, for about a third of its tokens); with ``--quote``, ``quote``: a docstring of prompt + output tokens
followed by its first 8 (the output can copy the prompt throughout, if the model copies). Greedy, EOS ignored,
``--max-output-tokens`` each; one stream runs the first 8 prompts. For every method, in alternating rounds, the engine
in process (``Engine.submit``) with at most N requests in flight: output tokens/s, median time per output token, the
acceptance rate (accepted / proposed) and mean acceptance length (tokens a sequence gets per verified draft, the
model's own pick included); every method's tokens are checked equal to
plain greedy's. Early exit: teacher-forced agreement of the first N layers' greedy pick with the whole model's on
the held-out text (and their perplexities), and one stream's tokens/s served with ``early_exit_layer`` N.

``--round-costs``: the graph calls of one stream's draft round timed hot in process (no engine): the target's decode
and verify calls, the draft's decode call and its looped call of ``--num-tokens`` steps, and a whole round
(``SpeculativeRunner``) with the looped draft and with one draft call per proposal.

``--openvino-python PY`` (``bash scripts/peer_env.sh openvino``) also runs OpenVINO GenAI f32 on the same token
ids at one stream: plain, prompt lookup and the same draft (scripts/peers/run_openvino.py), after ours.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from agents.training.corpus import stdlib_corpus
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import NO_TOKEN
from llm_serving.tokenization.tokenizer import Tokenizer

PAIR = ROOT / "llm_serving" / "models" / "pydoc"


def method_section(name: str) -> dict:
    """plain, ngram, draft (the shipped draft) or selfN (the target's first N layers draft), with the method's
    default policies; a ``+policies`` suffix turns them on (``min_accepted`` 0.5: pauses, ``adaptive``: the
    measured choice), ``-policies`` off; ``-loop``: the draft's proposals one call each (``draft_loop`` false)."""
    if "@" in name:  # verify rounds in the agent per step; for plain, decode steps per step (multi-step)
        base, rounds = name.split("@")
        return {**method_section(base), "rounds": int(rounds)}
    if name.endswith("-loop"):
        return {**method_section(name[: -len("-loop")]), "draft_loop": False}
    if name.endswith(("+policies", "-policies")):
        on = name.endswith("+policies")
        return {**method_section(name[: -len("+policies")]), "min_accepted": 0.5 if on else 0.0, "adaptive": on}
    if name.startswith("self"):
        return {"method": "self", "draft_layers": int(name[4:] or 1)}
    return {"plain": {}, "ngram": {"method": "ngram"},
            "draft": {"method": "draft", "draft_model_path": str(PAIR / "draft")}}[name]


def engine_config(args: argparse.Namespace, speculative: dict, exit_layer: int | None = None) -> ServingConfig:
    max_len = 256
    speculative = dict(speculative)
    decode_steps = speculative.pop("rounds", 1) if not speculative.get("method") else 1
    return ServingConfig.from_dict({
        "model_config": {"model_path": str(PAIR / "target"), "seq_length": [64, 128], "prefill_batch_size": [1, 4, 8],
                         "decode_batch_size": [1, 8, 32], "max_generate_length": args.max_output_tokens,
                         "early_exit_layer": exit_layer},
        "pa_config": {"num_blocks": 32 * max_len // 16 + 2, "block_size": 16, "decode_seq_length": max_len},
        "scheduler": {"policy": "fcfs", "decode_steps": decode_steps},
        "speculative": {**speculative, "num_tokens": args.num_tokens, "max_step_tokens": args.max_step_tokens}
        if speculative else {},
        "serving_config": {"compile_cache": False},
    })


def workloads(args: argparse.Namespace, tok: Tokenizer) -> dict[str, list[list[int]]]:
    docs = [tok.encode(doc) for doc in stdlib_corpus().held_out]
    long = [ids[: args.prompt_tokens] for ids in docs if len(ids) >= args.prompt_tokens]
    if len(long) < args.num_prompts:
        raise SystemExit(f"only {len(long)} held-out docstrings have {args.prompt_tokens} tokens")
    chosen = long[: args.num_prompts]
    loads = {"continue": chosen, "copy": [ids + ids[1: len(ids) // 2] for ids in chosen]}
    if args.quote:  # a longer docstring, then its start again: the whole output can copy the prompt
        span = args.prompt_tokens + args.max_output_tokens
        quoted = [ids[:span] + ids[:8] for ids in docs if len(ids) >= span][: args.num_prompts]
        if len(quoted) < 8:
            raise SystemExit(f"only {len(quoted)} held-out docstrings have {span} tokens for --quote")
        loads["quote"] = quoted
    return loads


async def run_level(engine: Engine, prompts: list[list[int]], n: int, level: int) -> tuple[float, float, list]:
    """(output tokens/s, median ms per output token after the first, every request's tokens)."""
    slots = asyncio.Semaphore(level)
    per_token: list[float] = []

    async def one(ids: list[int]) -> list[int]:
        async with slots:
            stream = engine.submit(ids, SamplingParams(n, ignore_eos=True))
            times, tokens = [], []
            async for event in stream:
                if event.token_id != NO_TOKEN:
                    times.append(time.perf_counter())
                    tokens.append(event.token_id)
            if len(times) > 1:
                per_token.append((times[-1] - times[0]) / (len(times) - 1))
            return tokens

    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(one(ids) for ids in prompts))
    rate = sum(map(len, outputs)) / (time.perf_counter() - t0)
    return rate, statistics.median(per_token) * 1e3, outputs


def early_exit_agreement(layers: list[int], windows: int = 24, seq_len: int = 256) -> list[tuple]:
    """(layer, agreement with the whole model's greedy pick, perplexity) on held-out text, teacher-forced."""
    import numpy as np
    from mindspore import Tensor, ops

    from agents.training.llama_train import TrainLlama, load_hf_tensors, set_graph_mode
    from agents.training.trainer import token_stream
    from agents.weights.checkpoints import SafetensorsFile
    from llm_serving.protocol.model_config import LlamaConfig

    set_graph_mode()
    target = LlamaConfig.from_model_dir(PAIR / "target")
    tensors = dict(SafetensorsFile(PAIR / "target" / "model.safetensors").items())
    tok = Tokenizer(PAIR / "target" / "tokenizer.model")
    stream = token_stream([tok.encode(d) for d in stdlib_corpus().held_out], 1, 2)
    n = min(windows, (len(stream) - 1) // seq_len)
    ids = stream[: n * seq_len].reshape(n, seq_len)
    labels = stream[1: n * seq_len + 1].reshape(n, seq_len).reshape(-1)
    picks, rows = {}, []
    for layer in sorted(set(layers) | {target.num_hidden_layers}, reverse=True):
        from dataclasses import replace
        net = TrainLlama(replace(target, num_hidden_layers=layer), seq_len, 0)
        load_hf_tensors(net, tensors)
        logits = np.concatenate([net.logits(Tensor(ids[i:i + 4])).asnumpy() for i in range(0, n, 4)])
        logp = ops.log_softmax(Tensor(logits), -1).asnumpy()
        picks[layer] = logits.argmax(-1)
        ppl = math.exp(-float(logp[np.arange(len(labels)), labels].mean()))
        rows.append((layer, float((picks[layer] == picks[target.num_hidden_layers]).mean()), ppl))
    return sorted(rows)


def round_costs(args: argparse.Namespace, calls: int = 200) -> list[tuple[str, float, float]]:
    """(what, median wall ms, median process CPU ms) of one stream's draft-round calls on the pair: a prompt of
    ``--prompt-tokens`` tokens prefilled, then each call ``calls`` times on the same positions (rewriting the same
    K/V). Process CPU time, which a loaded machine's preemptions leave out, is the steadier figure there."""
    from dataclasses import replace

    import numpy as np

    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.runtime.speculative_runner import SpeculativeRunner, draft_loops
    from agents.weights.checkpoints import load_weights
    from llm_serving.protocol.batch import StepBatch, verify_batch
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.step import StepKind

    k, n, block = args.num_tokens, args.prompt_tokens, 16
    rc = RunnerConfig(num_blocks=32, block_size=block, max_model_len=256, prefill_batch_sizes=(1,),
                      prefill_seq_lengths=(64,), decode_batch_sizes=(1,), kernels="native", verify_tokens=k,
                      verify_step_tokens=args.max_step_tokens)
    runners = []
    for name, loops in (("target", ()), ("draft", draft_loops(k, args.max_step_tokens, (1,)))):
        config = LlamaConfig.from_model_dir(PAIR / name)
        runner = ModelRunner(config, load_weights(PAIR / name, config),
                             replace(rc, verify_tokens=0, draft_loops=loops) if name == "draft" else rc)
        runner.warmup()
        runners.append(runner)
    target, draft = runners
    spec = SpeculativeRunner(target, draft)
    table = np.arange(1, 1 + rc.max_blocks_per_seq, dtype=np.int32)[None]
    ids = np.array(workloads(args, Tokenizer(PAIR / "target" / "tokenizer.model"))["continue"][0], np.int32)
    positions = np.arange(n, dtype=np.int32)
    last = spec.step(StepBatch(ids, positions, positions + block, np.array([n], np.int32), np.array([n], np.int32),
                               table)).token_ids
    verify = verify_batch(last.tolist(), [[0] * k], np.array([n + 1]), table, block)
    decode = StepBatch(last, np.array([n], np.int32), np.array([n + block], np.int32), np.ones(1, np.int32),
                       np.array([n + 1], np.int32), table, kind=StepKind.DECODE)
    filled = replace(verify, input_ids=spec.propose(verify)[0])
    accepted = int(target.step(filled).num_more[0])  # 4 of 4: the round includes the draft's catch-up call

    def looped_round() -> None:
        spec.looped = True
        spec.step(verify)

    def per_step_round() -> None:
        spec.looped = False
        spec.step(verify)

    probes = [("target decode call", lambda: target.step(decode)),
              (f"target verify call ({k + 1} tokens)", lambda: target.step(filled)),
              ("draft decode call", lambda: draft.step(decode)),
              (f"draft looped call ({k} steps)", lambda: draft.draft_steps(decode, k)),
              (f"draft round, looped ({accepted} of {k} proposals accepted)", looped_round),
              (f"draft round, one draft call per proposal ({accepted} of {k})", per_step_round)]
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for _ in range(calls):  # interleaved, so the machine's load shifts hit every probe alike
        for what, call in probes:
            t0, c0 = time.perf_counter(), time.process_time()
            call()
            cpu.setdefault(what, []).append(time.process_time() - c0)
            wall.setdefault(what, []).append(time.perf_counter() - t0)
    return [(what, statistics.median(wall[what]) * 1e3, statistics.median(cpu[what]) * 1e3) for what in wall]


def openvino_rows(python: str, loads: dict[str, list[list[int]]], args: argparse.Namespace,
                  reference: dict[tuple[str, int], list]) -> list[str]:
    """One stream of each workload on OpenVINO GenAI f32: plain, prompt lookup, the draft; tokens/s, ms per output
    token and whether its ids equal our plain greedy ones."""
    import subprocess
    import tempfile

    from peers.peer_io import PeerRequest, RequestFile, compare_ids, read_results, summarize, write_requests

    work = Path(tempfile.mkdtemp(prefix="bench-speculative-ov-"))
    runner = ROOT / "scripts" / "peers" / "run_openvino.py"
    lines = []
    for load, prompts in loads.items():
        requests = [PeerRequest(i, ids, args.max_output_tokens) for i, ids in enumerate(prompts[:8])]
        rf = RequestFile(str(PAIR / "target"), 2, [1], 8, requests)
        write_requests(work / f"{load}.json", rf)
        for mode in ("none", "prompt_lookup", "draft"):
            out = work / f"{load}-{mode}.out.json"
            cmd = [python, str(runner), "--requests", str(work / f"{load}.json"), "--out", str(out),
                   "--ir-dir", str(work / "ir-target"), "--speculative", mode, "--assistant-tokens",
                   str(args.num_tokens), "--draft-model", str(PAIR / "draft"), "--draft-ir-dir", str(work / "ir-draft")]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                lines.append(f"| {load} | openvino {mode} | failed: {res.stderr.strip().splitlines()[-1][:200]} |")
                continue
            run = read_results(out).runs[0]
            stats = summarize(run)
            equal, compared, _ = compare_ids(reference[(load, 1)], run.timings)
            lines.append(f"| {load} | openvino f32 {mode} | {stats['tokens_per_s']:.1f} | "
                         f"{stats['mean_tpot_s'] * 1e3:.2f} | {equal}/{compared} equal to our plain greedy ids |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="plain,ngram,draft,self1,self2")
    ap.add_argument("--levels", default="1,8,32", help="requests in flight")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens")
    ap.add_argument("--max-step-tokens", type=int, default=8, help="speculative.max_step_tokens")
    ap.add_argument("--exit-layers", default="1,2,3")
    ap.add_argument("--quote", action="store_true", help="also the quote workload: a docstring of prompt + output "
                    "tokens followed by its first 8 (the output can copy the prompt throughout)")
    ap.add_argument("--openvino-python", help="the OpenVINO peer's python (bash scripts/peer_env.sh openvino)")
    ap.add_argument("--round-costs", action="store_true", help="only time one stream's draft-round calls in process")
    args = ap.parse_args()
    if args.round_costs:
        costs = round_costs(args)
        print("| call | median wall ms | vs a target decode call | median process CPU ms | vs a target decode call |"
              "\n|---|---|---|---|---|")
        for what, ms, cpu_ms in costs:
            print(f"| {what} | {ms:.3f} | {ms / costs[0][1]:.2f}x | {cpu_ms:.3f} | {cpu_ms / costs[0][2]:.2f}x |")
        return
    methods = args.methods.split(",")
    levels = [int(n) for n in args.levels.split(",")]
    exits = [int(n) for n in args.exit_layers.split(",") if n]
    loads = workloads(args, Tokenizer(PAIR / "target" / "tokenizer.model"))
    rows: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    spec: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    reference: dict[tuple[str, int], list] = {}
    mismatches: dict[str, int] = {}
    for rnd in range(args.rounds):
        for method in methods if rnd % 2 == 0 else methods[::-1]:
            with Engine(engine_config(args, method_section(method))) as engine:
                engine.start(progress=None)
                engine.submit(loads["continue"][0], SamplingParams(4)).result(timeout=600)  # warm
                for load, prompts in loads.items():
                    for level in levels:
                        before = engine.stats()
                        batch = prompts[:8] if level == 1 else prompts
                        rate, tpot, outputs = asyncio.run(run_level(engine, batch, args.max_output_tokens, level))
                        after = engine.stats()
                        rows.setdefault((load, method, level), []).append((rate, tpot))
                        spec.setdefault((load, method), []).append(tuple(after[k] - before[k] for k in (
                            "spec_verify_steps", "spec_drafts", "spec_proposed_tokens", "spec_accepted_tokens")))
                        if method == "plain":
                            reference.setdefault((load, level), outputs)
                        elif (load, level) in reference:
                            mismatches[method] = mismatches.get(method, 0) + sum(
                                a != b for a, b in zip(outputs, reference[(load, level)]))
            print(f"round {rnd + 1}: {method} done", file=sys.stderr, flush=True)
    print("| workload | method | in flight | output tokens/s | ms per output token | vs plain |")
    print("|---|---|---|---|---|---|")
    for load in loads:
        for level in levels:
            base = statistics.median(r for r, _ in rows.get((load, "plain", level), [(math.nan, 0)]))
            for method in methods:
                runs = rows[(load, method, level)]
                rate = statistics.median(r for r, _ in runs)
                print(f"| {load} | {method} | {level} | {rate:.1f} | {statistics.median(t for _, t in runs):.2f} | "
                      f"{rate / base:.2f}x |")
    print("\n| workload | method | verify steps | drafts | proposed | accepted | acceptance | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|")
    for (load, method), counts in spec.items():
        steps, drafts, proposed, accepted = (sum(x[i] for x in counts) for i in range(4))
        if steps:
            print(f"| {load} | {method} | {steps} | {drafts} | {proposed} | {accepted} | "
                  f"{accepted / max(proposed, 1):.2f} | {1 + accepted / max(drafts, 1):.2f} |")
    print(f"\noutputs different from plain greedy's: {mismatches or 'none'}")
    if args.openvino_python and 1 in levels and "plain" in methods:
        print("\n| workload | system | one stream tokens/s | ms per output token | ids |")
        print("|---|---|---|---|---|")
        for load in loads:
            for method in methods:
                runs = rows[(load, method, 1)]
                print(f"| {load} | ours {method} | {statistics.median(r for r, _ in runs):.1f} | "
                      f"{statistics.median(t for _, t in runs):.2f} | |")
        print("\n".join(openvino_rows(args.openvino_python, loads, args, reference)))
    if exits:
        print("\n| early exit layer | greedy agreement with all layers (held-out, teacher-forced) | perplexity |"
              " one stream tokens/s |")
        print("|---|---|---|---|")
        speeds: dict[int | None, list[float]] = {}
        for rnd in range(args.rounds):
            for layer in (exits + [None]) if rnd % 2 == 0 else ([None] + exits[::-1]):
                with Engine(engine_config(args, {}, layer)) as engine:
                    engine.start(progress=None)
                    engine.submit(loads["continue"][0], SamplingParams(4)).result(timeout=600)  # warm
                    speeds.setdefault(layer, []).append(
                        asyncio.run(run_level(engine, loads["continue"], args.max_output_tokens, 1))[0])
        for layer, agree, ppl in early_exit_agreement(exits):
            speed = statistics.median(speeds.get(layer, speeds[None]))
            print(f"| {layer} | {agree:.3f} | {ppl:.1f} | {speed:.1f} |")


if __name__ == "__main__":
    main()
