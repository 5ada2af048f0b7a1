"""A minimal stand-in for the scheduler: drives a ModelRunner over shuffled, non-contiguous KV blocks."""

from __future__ import annotations

import numpy as np

from llm_serving.protocol.batch import SamplingBatch, StepBatch


def sampling_batch(params: list[dict], histories: list[list[int]], draw_index: list[int]) -> SamplingBatch:
    """SamplingBatch from per-sequence dicts (temperature, top_k, top_p, repetition_penalty, seed)."""
    def col(key: str, default, dtype) -> np.ndarray:
        return np.array([p.get(key, default) for p in params], dtype)

    penalised = [h if p.get("repetition_penalty", 1.0) != 1.0 else [] for p, h in zip(params, histories)]
    offsets = np.concatenate([[0], np.cumsum([len(h) for h in penalised])]).astype(np.int32)
    flat = np.array([t for h in penalised for t in h], np.int32)
    return SamplingBatch(col("temperature", 0.0, np.float32), col("top_k", 0, np.int32), col("top_p", 1.0, np.float32),
                         col("repetition_penalty", 1.0, np.float32), col("seed", 0, np.int64),
                         np.array(draw_index, np.int32), offsets, flat)


def contiguous_prefill(prompts: list[list[int]], first_slot: int) -> StepBatch:
    """A prefill of ``prompts`` written to consecutive slots from ``first_slot`` (past the dummy block)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    return StepBatch(np.concatenate(prompts).astype(np.int32),
                     np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
                     np.arange(first_slot, first_slot + lens.sum(), dtype=np.int32), lens, lens.copy(),
                     np.zeros((len(prompts), 1), np.int32))


class PagedDriver:
    """Gives each prompt its own randomly chosen blocks (never block 0) and runs greedy decoding."""

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.rc.block_size
        self.rng = np.random.default_rng(seed)

    def _tables(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        free = list(range(1, self.runner.rc.num_blocks))
        self.rng.shuffle(free)
        need = [-(-(len(p) + steps) // self.block_size) for p in prompts]
        if sum(need) > len(free):
            raise ValueError("not enough KV blocks for the test workload")
        return [[free.pop() for _ in range(n)] for n in need]

    def generate(self, prompts: list[list[int]], steps: int, params: list[dict] | None = None,
                 lora_slots: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy (or, with per-prompt ``params``, sampled) tokens and logprobs for every prompt; ``lora_slots``:
        each prompt's adapter slot (-1: none)."""
        adapters = None if lora_slots is None else np.array(lora_slots, np.int32)
        tables = self._tables(prompts, steps)
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)

        def slot(i: int, pos: int) -> int:
            return tables[i][pos // self.block_size] * self.block_size + pos % self.block_size

        def sampling(generated: list[list[int]]) -> SamplingBatch | None:
            if params is None:
                return None
            return sampling_batch(params, [p + g for p, g in zip(prompts, generated)], [len(g) for g in generated])

        lens = np.array([len(p) for p in prompts], np.int32)
        out = self.runner.step(StepBatch(
            np.concatenate(prompts).astype(np.int32),
            np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
            np.array([slot(i, j) for i, n in enumerate(lens) for j in range(n)], np.int32),
            lens, lens.copy(), block_tables, sampling([[] for _ in prompts]), lora_slots=adapters))
        tokens = [[int(t)] for t in out.token_ids]
        logprobs = [[float(lp)] for lp in out.logprobs]
        for _ in range(steps - 1):
            ctx = np.array([len(p) + len(g) for p, g in zip(prompts, tokens)], np.int32)
            pos = ctx - 1
            out = self.runner.step(StepBatch(
                np.array([g[-1] for g in tokens], np.int32), pos,
                np.array([slot(i, int(p)) for i, p in enumerate(pos)], np.int32),
                np.ones(len(prompts), np.int32), ctx, block_tables, sampling(tokens), lora_slots=adapters))
            for g, lp, t, l in zip(tokens, logprobs, out.token_ids, out.logprobs):
                g.append(int(t))
                lp.append(float(l))
        return tokens, logprobs
