"""A stand-in for the scheduler's mixed steps: prompts prefilled in chunks over cached context, decode tokens of
the sequences already past their prompt in the same steps, on shuffled non-contiguous KV blocks."""

from __future__ import annotations

import numpy as np

from llm_serving.protocol.batch import StepBatch


class ChunkDriver:
    """Greedy generation where every step carries each sequence's next chunk (at most ``chunk`` tokens of its
    prompt) or its decode token, so prefill chunks and decodes mix. ``starts`` delays sequences by some steps
    (they join while others decode)."""

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.bs = runner.rc.block_size
        self.rng = np.random.default_rng(seed)

    def generate(self, prompts: list[list[int]], steps: int, chunk: int, starts: list[int] | None = None,
                 lora_slots: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """``lora_slots``: each prompt's adapter slot (-1: none), None: no adapters."""
        starts = starts or [0] * len(prompts)
        free = list(range(1, self.runner.rc.num_blocks))
        self.rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-(len(p) + steps) // self.bs))] for p in prompts]
        done = [0] * len(prompts)  # tokens whose K/V is cached
        out: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        step = 0
        while any(len(o) < steps for o in out):
            rows = [i for i, o in enumerate(out) if starts[i] <= step and len(o) < steps]
            step += 1
            if not rows:
                continue
            ids, pos, slots, q, ctx = [], [], [], [], []
            for i in rows:
                tokens = prompts[i] + out[i]
                n = min(chunk, len(tokens) - done[i])
                for p in range(done[i], done[i] + n):
                    ids.append(tokens[p])
                    pos.append(p)
                    slots.append(tables[i][p // self.bs] * self.bs + p % self.bs)
                q.append(n)
                ctx.append(done[i] + n)
            width = max(len(tables[i]) for i in rows)
            block_tables = np.array([tables[i] + [0] * (width - len(tables[i])) for i in rows], np.int32)
            q_arr, ctx_arr = np.array(q, np.int32), np.array(ctx, np.int32)
            adapters = None if lora_slots is None else np.array([lora_slots[i] for i in rows], np.int32)
            result = self.runner.step(StepBatch(np.array(ids, np.int32), np.array(pos, np.int32),
                                                np.array(slots, np.int32), q_arr, ctx_arr, block_tables,
                                                lora_slots=adapters))
            for row, i in enumerate(rows):
                done[i] += q[row]
                if done[i] == len(prompts[i]) + len(out[i]):  # the chunk reached the end: a real next token
                    out[i].append(int(result.token_ids[row]))
                    lps[i].append(float(result.logprobs[row]))
        return out, lps
