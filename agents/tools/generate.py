"""Offline greedy generation with one in-process model runner (no server, no agent processes, no scheduler).

    python -m agents.tools.generate --model <HF or converted dir> --prompts prompts.json --max-new-tokens N
                              [--batch-size B] [--dtype float32]

Prints one JSON object per prompt, in order: ``{"prompt", "prompt_ids", "token_ids", "logprobs", "text"}``.
Prompt ids are bos + sentencepiece ids; generation stops at eos (included in ``token_ids``, as Hugging Face
does) or after N tokens. Prompts run in static batches of B: one prefill, then decode steps until each is
done, every sequence in its own contiguous blocks. It builds the step batches itself rather than using the
master's scheduler, so it is an independent reference for the engine's results; only the shapes this
workload needs are compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.sharded import load_rank_weights
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig, blocks_needed
from llm_serving.protocol.parallel import ShardPlan

BLOCK_SIZE = 16


def _pow2_at_least(n: int, floor: int = 16) -> int:
    v = floor
    while v < n:
        v *= 2
    return v


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: prompts file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {path} is not valid JSON: {exc}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"error: {path} must hold a JSON list of strings")
    return prompts


@dataclass
class _Sequence:
    prompt_ids: list[int]
    blocks: list[int]  # contiguous, never shared
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def _step_batch(seqs: list[_Sequence], prefill: bool, width: int) -> StepBatch:
    """The prefill (whole prompts) or decode (last token) step of ``seqs``."""
    ids, positions, slots, query_lens = [], [], [], []
    for seq in seqs:
        start = 0 if prefill else len(seq.ids) - 1
        pos = np.arange(start, len(seq.ids))
        ids.append(np.asarray(seq.ids[start:], np.int32))
        positions.append(pos)
        slots.append(np.asarray(seq.blocks, np.int64)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_lens.append(len(pos))
    tables = np.zeros((len(seqs), width), np.int32)
    for i, seq in enumerate(seqs):
        tables[i, :len(seq.blocks)] = seq.blocks
    return StepBatch(np.concatenate(ids), np.concatenate(positions).astype(np.int32),
                     np.concatenate(slots).astype(np.int32), np.asarray(query_lens, np.int32),
                     np.asarray([len(s.ids) for s in seqs], np.int32), tables)


def generate(runner: ModelRunner, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
             eos_token_id: int | None) -> list[_Sequence]:
    """Greedy generation for every prompt, ``batch_size`` prompts at a time; the sequences in prompt order."""
    width = blocks_needed(runner.rc.max_model_len, BLOCK_SIZE)
    done: list[_Sequence] = []
    for first in range(0, len(prompt_ids), batch_size):
        # block 0 is the runner's padding block: sequence i of the batch owns blocks 1 + i*width ...
        batch = [_Sequence(list(ids), list(range(1 + i * width, 1 + i * width + width)))
                 for i, ids in enumerate(prompt_ids[first:first + batch_size])]
        running, prefill = batch, True
        while running:
            out = runner.step(_step_batch(running, prefill, width))
            prefill = False
            for seq, token, logprob in zip(running, out.token_ids.tolist(), out.logprobs.tolist()):
                seq.output_ids.append(int(token))
                seq.logprobs.append(float(logprob))
            running = [s for s in running if len(s.output_ids) < max_new_tokens
                       and s.output_ids[-1] != eos_token_id]
        done.extend(batch)
    return done


def build_runner(model: Path, config: LlamaConfig, prompt_ids: list[list[int]], max_new_tokens: int,
                 batch_size: int, dtype: str) -> ModelRunner:
    """A runner whose buckets cover exactly this workload (one prefill length, decode widths by powers of 2)."""
    longest = max(len(p) for p in prompt_ids)
    seq_bucket = _pow2_at_least(longest)
    max_model_len = max(seq_bucket, blocks_needed(longest + max_new_tokens, BLOCK_SIZE) * BLOCK_SIZE)
    blocks_per_seq = max_model_len // BLOCK_SIZE
    rc = RunnerConfig(num_blocks=batch_size * blocks_per_seq + 1, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                      prefill_batch_sizes=(batch_size,), prefill_seq_lengths=(seq_bucket,),
                      decode_batch_sizes=(batch_size,), dtype=dtype)
    runner = ModelRunner(config, load_rank_weights(model, config, ShardPlan(config)), rc)
    runner.warmup(lambda line: print(line, file=sys.stderr))
    return runner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agents.tools.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF Llama directory or converted directory")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON file: a list of prompt strings")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.model (default: in --model)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1:
        parser.error("--max-new-tokens and --batch-size must be positive")

    config = LlamaConfig.from_model_dir(args.model)
    sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer or args.model / "tokenizer.model"))
    prompts = read_prompts(args.prompts)
    if not prompts:
        return
    prompt_ids = [[sp.bos_id(), *sp.encode(p)] for p in prompts]
    batch_size = min(args.batch_size, len(prompts))
    runner = build_runner(args.model, config, prompt_ids, args.max_new_tokens, batch_size, args.dtype)
    for prompt, seq in zip(prompts, generate(runner, prompt_ids, args.max_new_tokens, batch_size, sp.eos_id())):
        text_ids = [i for i in seq.output_ids if not (sp.is_control(i) or sp.is_unknown(i))]  # as HF skips them
        print(json.dumps({"prompt": prompt, "prompt_ids": seq.prompt_ids, "token_ids": seq.output_ids,
                          "logprobs": seq.logprobs, "text": sp.decode(text_ids)}, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
