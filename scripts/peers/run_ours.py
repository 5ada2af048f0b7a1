"""Our engine in process, driven like the in-process peers: runs in the project's own environment.

    python run_ours.py --requests REQ.json --out OUT.json --config SERVING.yaml

Why: OpenVINO GenAI, CTranslate2 and llama.cpp run inside their benchmark process, while the "ours, served" row
also pays for HTTP: streaming every token as an SSE event and a Python load client parsing it, on the same two
cores. This row runs the same engine and config through the offline API (``LLM``, ``Engine.submit``), so the
comparison with the in-process peers is like for like. For each concurrency level of the request file it keeps
at most that many requests in flight (the peers' closed loop), timing each request's first token and end.
Start-up (weights, warm-up, one request) is outside the timed part. EOS is ignored and decoding is greedy.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from peer_io import LevelRun, PeerResult, RequestFile, Timing, read_requests, runner_parser, write_results

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.llm import LLM
from llm_serving.engine.request_stream import NO_TOKEN


async def run_level(llm: LLM, rf: RequestFile, level: int) -> LevelRun:
    """At most ``level`` requests in flight (all at 0), each started, in order, as soon as a slot is free."""
    reqs = rf.level_requests(level)
    slots = asyncio.Semaphore(level or len(reqs))  # wakes its waiters in order: requests start in file order
    t0 = time.perf_counter()

    async def one(pos: int) -> Timing:
        r = reqs[pos]
        async with slots:
            start = time.perf_counter() - t0
            stream = llm.engine.submit(list(r.prompt_ids), SamplingParams(r.max_new_tokens, ignore_eos=True))
            ids: list[int] = []
            first = None
            async for event in stream:
                if first is None:
                    first = time.perf_counter() - t0
                if event.token_id != NO_TOKEN:
                    ids.append(event.token_id)
            return Timing(r.index, ids, start, time.perf_counter() - t0, first)

    timings = await asyncio.gather(*(one(pos) for pos in range(len(reqs))))
    return LevelRun(level, time.perf_counter() - t0, list(timings))


def main() -> int:
    p = runner_parser(__doc__, "--config", "the serving YAML the served row uses")
    args = p.parse_args()
    rf = read_requests(args.requests)
    t0 = time.perf_counter()
    with LLM(args.config, progress=None) as llm:
        llm.generate([list(rf.requests[0].prompt_ids)], max_new_tokens=2, ignore_eos=True)  # warm-up
        load_s = time.perf_counter() - t0
        runs = []
        for level in rf.levels:
            runs.append(asyncio.run(run_level(llm, rf, level)))
            print(f"[ours in process] level {level or 'all'}: {runs[-1].wall_s:.2f}s, {runs[-1].output_tokens} "
                  "tokens", file=sys.stderr, flush=True)
        cfg = llm.config
    settings = (f"offline API (LLM, Engine.submit) in process, config {Path(args.config).name}: policy "
                f"{cfg.scheduler.policy}, precision {cfg.model_config.precision}, quantization "
                f"{cfg.model_config.quantization}, kv cache {cfg.model_config.kv_cache_dtype}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    write_results(args.out, PeerResult("ours-in-process", f"commit {commit}", settings, None, load_s, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
