"""Served speed of two or more git revisions of this project, measured side by side in alternating rounds.

    python scripts/bench_revisions.py --revs cb2049a HEAD [--rounds 3] [--single-seconds 12] [--work-dir DIR]

Why: a change to the fixed cost of a step moves a decode step by a millisecond, less than this shared machine's
drift between runs a few minutes apart. Each revision gets its own git worktree; in every round each revision's
server (the tuned settings of scripts/benchmark.py, on its bench model) is started, measured and stopped in turn,
so that the drift moves all of them. Per round and revision it prints:
- one stream: ms per output token of requests sent one after another (non-streamed /v1/completions), for
  ``--single-seconds``;
- saturation: output tokens/s with every request of the workload at once, twice; the second run finds the
  workload's shared prompt prefixes in the prefix cache.
Token-id prompts, greedy, EOS ignored: every revision generates the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmark import TUNED, bench_model_dir, make_requests, write_config

from llm_serving.bench.local_server import ServerStartError, running_server
from llm_serving.tokenization.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, work: Path) -> Path:
    """A detached worktree of ``rev`` under ``work`` (made once; a moving name like HEAD is resolved now)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = work / f"tree-{sha}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return tree


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        return (await resp.json())["usage"]["completion_tokens"]


async def _measure(port: int, prompts: list[tuple[list[int], int]], single_s: float,
                   saturated_runs: int) -> tuple[float, list[float]]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tokens, t0, i = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < single_s:
            tokens += await _complete(session, url, *prompts[i % len(prompts)])
            i += 1
        single_ms = (time.perf_counter() - t0) / tokens * 1e3
        rates = []
        for _ in range(saturated_runs):
            t1 = time.perf_counter()
            done = await asyncio.gather(*[_complete(session, url, p, n) for p, n in prompts])
            rates.append(sum(done) / (time.perf_counter() - t1))
    return single_ms, rates


def serve_and_measure(tree: Path, config: Path, prompts: list[tuple[list[int], int]], single_s: float,
                      log: Path, saturated_runs: int = 2) -> tuple[float, list[float]]:
    """One stream's ms per output token, then ``saturated_runs`` tokens/s rates with every prompt at once."""
    try:
        with running_server(config, log, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree))) as (port, _):
            return asyncio.run(_measure(port, prompts, single_s, saturated_runs))
    except ServerStartError as why:
        raise SystemExit(f"the server did not get ready ({why}; log {log})") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revs", nargs="+", required=True, help="git revisions to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-seconds", type=float, default=12.0)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default="/tmp/llm-serving-bench-revisions")
    args = parser.parse_args()
    work = Path(args.work_dir)
    model_dir = bench_model_dir(work)
    reqs = make_requests(args, model_dir)
    tok = Tokenizer(model_dir / "tokenizer.model")
    prompts = [(tok.encode(r.prompt), r.max_new_tokens) for r in reqs]
    config = write_config(work / "config.yaml", model_dir, TUNED["prefill"], TUNED["decode"], "longest_output_first",
                          args.max_output_tokens)
    trees = {rev: worktree(rev, work) for rev in args.revs}
    print("| round | revision | one stream (ms/token) | saturated, 1st (tok/s) | saturated, 2nd (tok/s) | load |")
    print("|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for rev, tree in trees.items():
            single_ms, rates = serve_and_measure(tree, config, prompts, args.single_seconds, work / "server.log")
            load = os.getloadavg()[0]
            print(f"| {rnd + 1} | {rev} ({tree.name[5:]}) | {single_ms:.2f} | {rates[0]:.0f} | {rates[1]:.0f} | "
                  f"{load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
