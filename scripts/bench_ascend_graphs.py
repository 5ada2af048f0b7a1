"""CPU export time of the Ascend step graphs per graph family, bucketed (one graph per shape) and dynamic (one
graph per family, ``model_config.dynamic_shapes``), with the buckets of configs/llama2_7b_ascend.yaml and the
Llama-2-7B layer count on a narrow model (export time follows the graph's node count, not the weights' size).

    python scripts/bench_ascend_graphs.py [--layers 32] [--per-family 2]

Export runs MindSpore's front end (type and shape inference) as the NPU's compile does before its kernels are
built, so these seconds bound from below what warm-up spends per graph on a 910B (docs/ascend.md, "Graphs").
``--per-family``: bucketed shapes timed per family (its smallest and largest first); the family's total is
estimated as their mean x its shape count.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.model.backends.ascend import AscendBackend
from agents.runtime.runner import RunnerConfig
from agents.tools.export import export_graphs, export_runner
from agents.weights.checkpoints import load_weights
from llm_serving.config.serving_config import ServingConfig
from llm_serving.engine.wiring import runner_config_dict
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--per-family", type=int, default=2)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    cfg = ServingConfig.from_yaml(ROOT / "configs" / "llama2_7b_ascend.yaml")
    fields = {**runner_config_dict(cfg), "num_blocks": 300}
    fields.pop("memory_utilization", None)
    rc = RunnerConfig(**fields).with_decode_widths(full_width=AscendBackend.skips_padding)
    with tempfile.TemporaryDirectory() as tmp:
        weights = load_weights(build_random_model(Path(tmp) / "m", config, seed=0, std=0.1), config)
        for dynamic in (True, False):
            runner = export_runner(config, replace(rc, dynamic_shapes=dynamic), weights)
            shapes = runner.graph_shapes()
            families = list(dict.fromkeys(s[0] for s in shapes))
            print(f"{'dynamic' if dynamic else 'bucketed'} ({args.layers} layers):", flush=True)
            for kind in families:
                own = [s for s in shapes if s[0] == kind]
                picked = own[:1] if dynamic else list(dict.fromkeys([own[0], own[-1], *own]))[:args.per_family]
                times = []
                for shape in picked:
                    t0 = time.perf_counter()
                    export_graphs(runner, Path(tmp) / f"{kind}{dynamic}", [shape])
                    times.append(time.perf_counter() - t0)
                count = 1 if dynamic else len(own)
                mean = sum(times) / len(times)
                print(f"  {kind}: {count} graph(s), {mean:.1f} s each (timed {len(times)}: "
                      f"{', '.join(f'{t:.1f}' for t in times)}), ~{mean * count:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
