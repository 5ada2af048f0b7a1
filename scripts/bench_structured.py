"""What structured output and parallel sampling cost (issue 30), side by side in one run.

    python scripts/bench_structured.py [--rounds 3] [--tokens 96] [--skip-libraries]

1. Grammar libraries on a 32k byte-level BPE vocabulary (trained here on Python's own sources, as Llama-3-sized
   vocabularies are byte-level BPE): compile time of a JSON schema and time to compute one token mask, along a
   random walk through the grammar (a random model's answer). llguidance (ours) and, when installed,
   outlines-core; xgrammar needs torch, transformers and triton, so it is left out of the master's dependencies.
2. Served on the bench model (scripts/bench_engine.py's, random weights), 8 requests at once: decode time per token
   of greedy, sampled (temperature 0.7: the logits come to the host), and sampled under a JSON schema (the same
   host path plus the mask). The schema's strings are long enough that answers run to the token budget.
3. OpenAI's ``n=4`` (the choices share the prompt's KV blocks) against four separate requests with the same seeds,
   on a 384-token prompt: wall time, prompt tokens computed, and the most KV blocks held at once.
Medians of ``--rounds`` alternating rounds; prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm_serving.core.sequence import OutputConstraint, SamplingParams
from llm_serving.engine.loop import Engine
from scripts.bench_engine import config

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 400, "maxLength": 800},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["title", "year", "tags"], "additionalProperties": False}


# ---- 1. the libraries -------------------------------------------------------------------------------------------
def byte_level_vocabulary(size: int = 32000) -> tuple[list[bytes], object]:
    """Token bytes of a byte-level BPE trained on the standard library's sources, and the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = [line for p in sorted(stdlib.glob("*.py"))[:200]
             for line in p.read_text(encoding="utf-8", errors="ignore").splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=size, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from llm_serving.tokenization.hf_tokenizer import _byte_decoder

    table = _byte_decoder()
    tokens = [bytes(table[c] for c in tok.id_to_token(i)) for i in range(tok.get_vocab_size())]
    return tokens, tok


def walk(fill, advance, vocab: int, rng: np.random.Generator, steps: int = 300) -> list[float]:
    """Seconds per mask along a uniformly random walk over the allowed tokens (ending at EOS, id 0): ``fill(row)``
    writes the library's bitmask (only that is timed)."""
    costs = []
    row = np.zeros((vocab + 31) // 32, np.int32)
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(row)
        costs.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
        token = int(rng.choice(allowed))
        if token == 0 or advance(token):
            break
    return costs


def bench_libraries(rounds: int) -> list[dict]:
    import llguidance

    from llm_serving.core.grammar import GrammarCompiler

    tokens, tok = byte_level_vocabulary()
    vocab = len(tokens)
    schema = dict(SCHEMA, properties={**SCHEMA["properties"], "title": {"type": "string", "maxLength": 40}})
    rows = []
    ll_tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=[0])
    compiler = GrammarCompiler(ll_tok, vocab)

    def ours(rng: np.random.Generator) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        compiler._grammar.cache_clear()  # time the compile, not the cache
        matcher = compiler.matcher(OutputConstraint("json", json.dumps(schema)))
        compile_s = time.perf_counter() - t0
        return compile_s, walk(matcher.fill_mask, matcher.advance, vocab, rng)

    libraries = {"llguidance (ours)": ours}
    try:
        import outlines_core

        def outlines(rng: np.random.Generator) -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            by_bytes: dict[bytes, list[int]] = {}
            for i, b in enumerate(tokens[1:], start=1):
                by_bytes.setdefault(b, []).append(i)
            index = outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(json.dumps(schema)),
                                        outlines_core.Vocabulary(0, by_bytes))
            guide = outlines_core.Guide(index)
            compile_s = time.perf_counter() - t0

            def advance(token: int) -> bool:
                guide.advance(token)
                return guide.is_finished()
            def fill(row: np.ndarray) -> None:
                guide.write_mask_into(row.ctypes.data, row.size, row.itemsize)
            return compile_s, walk(fill, advance, vocab, rng)
        libraries["outlines-core"] = outlines
    except ImportError:
        print("outlines-core is not installed (pip install outlines-core to compare it)", file=sys.stderr)
    for name, run in libraries.items():
        compiles, costs = [], []
        for r in range(rounds):
            c, per_mask = run(np.random.default_rng(r))
            compiles.append(c)
            costs += per_mask
        rows.append({"library": name, "compile ms": statistics.median(compiles) * 1e3,
                     "mask us median": np.median(costs) * 1e6, "mask us p90": np.percentile(costs, 90) * 1e6,
                     "masks": len(costs)})
    return rows


# ---- 2 and 3. served ----------------------------------------------------------------------------------------------
def peak_blocks(engine: Engine, done: threading.Event) -> list[int]:
    """Samples the blocks in use until ``done``; returns [peak]."""
    peak = [0]

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], engine.stats()["kv_blocks_used"])
            time.sleep(0.002)
    threading.Thread(target=watch, daemon=True).start()
    return peak


def bench_served(rounds: int, tokens: int) -> tuple[list[dict], list[dict]]:
    cfg = config(decode_batch=8, prefill_batch=4, seq_lengths=[128, 512], num_blocks=512, policy="fcfs",
                 data_dir=None)
    prompt = [1] + [17 + (i * 37) % 7000 for i in range(383)]
    short = prompt[:40]
    modes = {
        "greedy": SamplingParams(tokens, ignore_eos=True),
        "sampled (temperature 0.7)": SamplingParams(tokens, ignore_eos=True, temperature=0.7, seed=1),
        "sampled + JSON schema": SamplingParams(tokens, ignore_eos=True, temperature=0.7, seed=1,
                                                constraint=OutputConstraint("json", json.dumps(SCHEMA))),
    }
    per_token: dict[str, list[float]] = {m: [] for m in modes}
    sharing: dict[str, list[tuple[float, int, int]]] = {"n=4 (shared prompt blocks)": [], "4 requests": []}
    with Engine(cfg) as engine:
        engine.start(progress=None)
        engine.submit(short, SamplingParams(4)).result(timeout=600)  # warm
        for r in range(rounds):
            names = list(modes)
            for mode in names[r % 3:] + names[:r % 3]:  # alternate which mode goes first
                params = modes[mode]
                t0 = time.perf_counter()
                streams = [engine.submit([1, 100 + i, *short[2:]], params) for i in range(8)]
                results = [s.result(timeout=600) for s in streams]
                generated = sum(len(x.token_ids) for x in results)
                per_token[mode].append((time.perf_counter() - t0) / generated * 8)  # one stream's time per token
            for k, (mode, runs) in enumerate(sharing.items()):
                first = [1, 7 + 10 * k + r, *prompt[2:]]  # a prompt of its own: no blocks cached from before
                before = engine.stats()
                done = threading.Event()
                peak = peak_blocks(engine, done)
                t0 = time.perf_counter()
                base = SamplingParams(32, ignore_eos=True, temperature=0.8)
                shared = mode.startswith("n=")
                streams = [engine.submit(first, dataclasses.replace(base, seed=10 + j), f"{k}-{r}-{j}",
                                         follows=f"{k}-{r}-0" if j and shared else None) for j in range(4)]
                for s in streams:
                    s.result(timeout=600)
                wall = time.perf_counter() - t0
                done.set()
                hits = engine.stats()["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
                runs.append((wall, 4 * len(prompt) - hits, peak[0]))
    serve_rows = [{"mode": m, "ms per token (one stream of 8)": statistics.median(v) * 1e3,
                   "vs greedy": statistics.median(v) / statistics.median(per_token["greedy"])}
                  for m, v in per_token.items()]
    n_rows = [{"mode": m, "wall s": statistics.median(w for w, _, _ in v),
               "prompt tokens computed": statistics.median(c for _, c, _ in v),
               "peak KV blocks": max(p for _, _, p in v)} for m, v in sharing.items()]
    return serve_rows, n_rows


def table(rows: list[dict]) -> str:
    head = list(rows[0])
    fmt = [f"{v:.3g}" if isinstance(v, float) else str(v) for r in rows for v in r.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i in range(len(rows)):
        lines.append("| " + " | ".join(fmt[i * len(head):(i + 1) * len(head)]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request in part 2")
    ap.add_argument("--skip-libraries", action="store_true")
    ap.add_argument("--skip-served", action="store_true")
    args = ap.parse_args()
    if not args.skip_libraries:
        print("### Grammar libraries: a JSON schema on a 32k byte-level BPE vocabulary\n")
        print(table(bench_libraries(args.rounds)) + "\n")
    if args.skip_served:
        return
    serve_rows, n_rows = bench_served(args.rounds, args.tokens)
    print("### Served, 8 requests at once on the bench model\n")
    print(table(serve_rows) + "\n")
    print("### n=4 against four requests (384-token prompt, 32 tokens each, temperature 0.8)\n")
    print(table(n_rows))


if __name__ == "__main__":
    main()
