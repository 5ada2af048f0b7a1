"""One agent start-up as ``agents.agent_main`` does it (compile cache opened, runner built, warmed, cache
published), then greedy generation; prints a JSON line. Run as a script: the compile cache and the device are
per process, so every start needs its own.

    python tests/compile_cache_driver.py '{"model": DIR, "cache": ROOT or null, "runner": {...}, "prompts": [[...]],
                                           "steps": N}'
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.agent_main import build_runner, warm_up
from agents.runtime.compile_cache import open_cache
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.wire import AgentSpec
from tests.paged_driver import PagedDriver


def main() -> None:
    args = json.loads(sys.argv[1])
    config = LlamaConfig.from_model_dir(Path(args["model"]))
    runner_config = args["runner"]
    spec = AgentSpec(kind="llama", model_path=args["model"], llama_config=asdict(config),
                     runner_config=runner_config, max_tokens=256, max_batch=8, max_blocks_per_seq=32,
                     compile_cache_dir=args["cache"])
    lines: list[str] = []
    cache = open_cache(spec, 0, lines.append)
    runner = build_runner(spec, 0, lines.append)
    warm_up(runner, cache, spec, lines.append)
    tokens, logprobs = PagedDriver(runner, seed=1).generate(args["prompts"], args["steps"])
    print(json.dumps({
        "hit": None if cache is None else cache.hit, "path": None if cache is None else str(cache.path),
        "shapes": [list(s) for s in runner.graph_shapes()],
        "costs": [[list(k), v] for k, v in runner.step_costs.items()],
        "tokens": tokens, "logprobs": logprobs, "progress": lines}))


if __name__ == "__main__":
    main()
