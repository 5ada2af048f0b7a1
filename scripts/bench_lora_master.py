"""What serving adapters costs the master per step: scheduling, building the batch (its ``lora_slots``) and applying
the answer, for a decode batch with no adapter, one, and three mixed with base rows.

    python scripts/bench_lora_master.py [--batch 32] [--steps 400] [--rounds 5]

The scheduler runs as the engine runs it (``core.Scheduler``), its steps answered in process by the stand-in runner
(``agents.runtime.standin``; its cost, a few numpy ops, is measured apart and taken off). Each round runs the three
mixes in turn; the medians of the rounds are the figures (the machine is shared: absolute microseconds move).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from agents.runtime.standin import StandinRunner
from llm_serving.core.adapters import AdapterRegistry
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence

MIXES = {"base": [None], "one adapter": ["a"], "three mixed with base": [None, "a", "b", "c"]}


def registry(root: Path) -> AdapterRegistry:
    reg = AdapterRegistry(2, 16)
    for name, rank in (("a", 4), ("b", 8), ("c", 16)):
        path = root / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj", "v_proj"]}))
        (path / "adapter_model.safetensors").write_bytes(b"")
        reg.add(name, path)
    return reg


def decode_seconds(reg: AdapterRegistry, names: list[str | None], batch: int, steps: int) -> tuple[float, float]:
    """Mean master seconds and stand-in seconds per decode step of ``batch`` sequences cycling through ``names``."""
    sched = Scheduler(SchedulerConfig(num_blocks=batch * 40, block_size=16, max_num_seqs=batch, max_prefill_batch=batch,
                                      max_num_batched_tokens=batch * 16, max_model_len=steps + 32,
                                      chunked_prefill=True, prefix_caching=True, max_loras=3, eos_token_id=None))
    runner = StandinRunner(1000, lora={"max_loras": 3, "max_lora_rank": 16}, num_layers=2)
    for i in range(batch):
        seq = Sequence(f"r{i}", [5, i % 97, 7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=steps + 8))
        name = names[i % len(names)]
        seq.adapter = reg.get(name) if name else None
        sched.add(seq)
    for _ in range(2):  # the prefill, then one decode step: every sequence running
        seqs, step = sched.schedule()
        for load in sched.adapters.take_loads() if sched.adapters else []:
            runner.load_adapter(load.slot, load.path)
        sched.postprocess(seqs, runner.step(step))
    master = agent = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        seqs, step = sched.schedule()
        t1 = time.perf_counter()
        out = runner.step(step)
        t2 = time.perf_counter()
        sched.postprocess(seqs, out)
        t3 = time.perf_counter()
        master += (t1 - t0) + (t3 - t2)
        agent += t2 - t1
    return master / steps, agent / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reg = registry(Path(tmp))
        times: dict[str, list[float]] = {mix: [] for mix in MIXES}
        for _ in range(args.rounds):
            for mix, names in MIXES.items():
                times[mix].append(decode_seconds(reg, names, args.batch, args.steps)[0])
    base = statistics.median(times["base"])
    print(f"master time per decode step, batch {args.batch}, median of {args.rounds} rounds of {args.steps} steps:")
    for mix, values in times.items():
        med = statistics.median(values)
        print(f"  {mix:24s} {med * 1e6:8.1f} us  {med / base:5.2f}x base")


if __name__ == "__main__":
    main()
