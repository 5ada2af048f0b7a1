"""Child process of tests/test_ascend_npu.py: the Ascend backend on a real NPU (MindSpore's fused kernels), its
greedy tokens, logprobs and prefill logits as JSON, whole prompts and in chunks over the cached context. Run only
where ``ms.set_device("Ascend")`` works.

Usage (from the repository root): python -m tests.ascend_npu_check MODEL_DIR DTYPE PROMPTS_JSON STEPS OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.paged_driver import PagedDriver, contiguous_prefill


def main() -> None:
    model_dir, dtype, prompts_json, steps, out = sys.argv[1:]
    prompts = json.loads(prompts_json)
    config = LlamaConfig.from_model_dir(model_dir)
    rc = RunnerConfig(num_blocks=80, block_size=16, max_model_len=128, prefill_batch_sizes=(4,),
                      prefill_seq_lengths=(64,), decode_batch_sizes=(8,), decode_block_widths=(8,), dtype=dtype,
                      device_target="Ascend", kernels="native", mixed_steps=True, max_num_batched_tokens=64)
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    logits = runner.step_logits(contiguous_prefill(prompts[:2], rc.block_size))
    tokens, logprobs = PagedDriver(runner, seed=1).generate(prompts, int(steps))
    chunked, chunked_logprobs = ChunkDriver(runner, seed=2).generate(prompts, int(steps), 24)
    Path(out).write_text(json.dumps({"backend": runner.backend.name, "tokens": tokens, "logprobs": logprobs,
                                     "logits": logits.tolist(), "chunked": chunked,
                                     "chunked_logprobs": chunked_logprobs}))


if __name__ == "__main__":
    main()
