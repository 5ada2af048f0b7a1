"""Measure step times on this machine: the served engine (real agents, this config) run on a sweep of shapes.

Each point of the sweep submits ``batch`` requests of ``prompt_len`` random token ids (distinct, so no prefix
is shared) asking for ``new_tokens`` tokens with EOS ignored, all at once: its prefill (chunked or whole) and
decode steps at that batch size and context are recorded by the engine (``Engine.step_trace``: each step from
being sent to the next step's scheduling, the loop's whole turn). A last phase sends requests one by one while
others decode, for the steps that mix decode tokens and prompt chunks. The result (``costs.save_profile``)
feeds ``FittedCost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.core.step_shape import StepShape
from llm_serving.engine.llm import LLM


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    prompt_len: int
    new_tokens: int


def default_sweep(max_batch: int, max_model_len: int, new_tokens: int = 16) -> list[SweepPoint]:
    """Batch sizes 1, 2, 4, ... up to the largest decode batch, by prompt lengths 16, 64, 256, ... up to half
    the context (at most 8192 prompt tokens a point, so a sweep stays a minute or two on a small model)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
    lengths = [n for n in (16, 64, 256, 1024, 4096) if n + new_tokens <= max_model_len // 2] or [8]
    return [SweepPoint(b, n, new_tokens) for b in batches for n in lengths if b * n <= 8192]


def run_sweep(config: ServingConfig, points: list[SweepPoint], staggered: int = 16, seed: int = 0,
              progress: Callable[[str], None] | None = None) -> tuple[list[tuple[StepShape, float]], dict]:
    """Measured steps of every point (and the staggered phase) and what they were measured on."""
    rng = np.random.default_rng(seed)
    with LLM(config, progress=progress) as llm:
        vocab = llm.engine.model.llama_config.vocab_size
        ends = {llm.engine.eos_token_id, *llm.engine.other_eos_token_ids}
        ids = np.array([t for t in range(3, vocab) if t not in ends])

        def prompts(count: int, length: int) -> list[list[int]]:
            return [rng.choice(ids, length).tolist() for _ in range(count)]

        llm.generate(prompts(2, 16), max_new_tokens=4, ignore_eos=True)  # first calls outside the record
        trace = llm.engine.step_trace = []
        t0 = time.perf_counter()
        for i, p in enumerate(points):
            if progress:
                progress(f"profile {i + 1}/{len(points)}: {p.batch} x {p.prompt_len} prompt tokens, "
                         f"{p.new_tokens} new")
            llm.generate(prompts(p.batch, p.prompt_len), max_new_tokens=p.new_tokens, ignore_eos=True)
        if staggered:
            length = points[len(points) // 2].prompt_len
            params = SamplingParams(2 * points[0].new_tokens, ignore_eos=True)
            streams = []
            for prompt in prompts(staggered, length):  # each arrives while the earlier ones decode
                streams.append(llm.engine.submit(prompt, params))
                time.sleep(0.005)
            for s in streams:
                s.result()
        llm.engine.step_trace = None
        stats = llm.engine.stats()
        meta = {"model": str(llm.engine.model.model_path), "config": config.source,
                "num_blocks": int(stats["kv_blocks_total"]) + 1, "tensor_parallel": config.num_agents,
                "sweep_s": round(time.perf_counter() - t0, 1)}
    return list(trace), meta
