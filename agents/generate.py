"""Offline greedy generation with one in-process model runner (no server, no agent processes).

    python -m agents.generate --model <HF or converted dir> --prompts prompts.json --max-new-tokens N
                              [--batch-size B] [--dtype float32]

Prints one JSON object per prompt, in order: ``{"prompt", "prompt_ids", "token_ids", "logprobs", "text"}``.
Prompt ids are bos + sentencepiece ids; generation stops at eos (included in ``token_ids``, as Hugging Face
does) or after N tokens. Batching uses the engine's own scheduler and block manager, so results match the
engine's; only the shapes this workload needs are compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agents.model_config import LlamaConfig
from agents.runner import ModelRunner, RunnerConfig
from agents.weights import load_weights
from llm_serving.scheduler import Scheduler, SchedulerConfig
from llm_serving.sequence import SamplingParams, Sequence
from llm_serving.tokenizer import Tokenizer

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


def generate(runner: ModelRunner, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
             eos_token_id: int | None) -> list[Sequence]:
    """Greedy generation for every prompt through the scheduler; returns the finished sequences in order."""
    rc = runner.rc
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=rc.num_blocks, block_size=rc.block_size, max_num_seqs=batch_size,
        max_prefill_batch=batch_size, max_num_batched_tokens=max(batch_size * rc.prefill_seq_lengths[-1],
                                                                   rc.max_model_len),
        max_model_len=rc.max_model_len, eos_token_id=eos_token_id, policy="fcfs", max_wait_s=None,
        max_prompt_len=rc.prefill_seq_lengths[-1]))
    seqs = [Sequence(str(i), ids, SamplingParams(max_new_tokens=max_new_tokens)) for i, ids in enumerate(prompt_ids)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        if step is None:
            raise RuntimeError("scheduler stalled with unfinished requests")
        scheduled, batch = step
        scheduler.postprocess(scheduled, runner.step(batch))
    return seqs


def build_runner(model: Path, config: LlamaConfig, prompt_ids: list[list[int]], max_new_tokens: int,
                 batch_size: int, dtype: str) -> ModelRunner:
    """A runner whose buckets cover exactly this workload (one prefill length, decode widths by powers of 2)."""
    longest = max(len(p) for p in prompt_ids)
    seq_bucket = _pow2_at_least(longest)
    max_model_len = max(seq_bucket, -(-(longest + max_new_tokens) // BLOCK_SIZE) * BLOCK_SIZE)
    blocks_per_seq = max_model_len // BLOCK_SIZE
    rc = RunnerConfig(num_blocks=batch_size * blocks_per_seq + 1, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                      prefill_batch_sizes=(batch_size,), prefill_seq_lengths=(seq_bucket,),
                      decode_batch_sizes=(batch_size,), dtype=dtype)
    runner = ModelRunner(config, load_weights(model, config), rc)
    runner.warmup(lambda line: print(line, file=sys.stderr))
    return runner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agents.generate", description=__doc__,
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
    tokenizer = Tokenizer(args.tokenizer or args.model / "tokenizer.model")
    prompts = read_prompts(args.prompts)
    if not prompts:
        return
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    batch_size = min(args.batch_size, len(prompts))
    runner = build_runner(args.model, config, prompt_ids, args.max_new_tokens, batch_size, args.dtype)
    for prompt, seq in zip(prompts, generate(runner, prompt_ids, args.max_new_tokens, batch_size,
                                             tokenizer.eos_id)):
        print(json.dumps({"prompt": prompt, "prompt_ids": seq.prompt_ids, "token_ids": seq.output_ids,
                          "logprobs": seq.output_logprobs, "text": tokenizer.decode(seq.output_ids)},
                         ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
