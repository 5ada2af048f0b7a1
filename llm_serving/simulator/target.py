"""What a simulation runs on: the scheduler configuration of a launch config and a step-time model for it.

``--cost PROFILE.json[,MORE.json]`` (profiles measured here) serves the config's own model; ``--cost
ascend-910b`` (a device preset, parameters overridable) needs the model's shape: the config's model directory
when it exists here, else ``--model-shape`` (a config.json or a preset name below: the contest's Llama-2-7B needs
no download). The KV block count is the profile's (what the agents had), the device's memory left after the
weights (analytic), or ``pa_config.num_blocks`` when the config fixes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.engine.wiring import ModelFiles, kv_cache_blocks, resolve_model, scheduler_config
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.moe_config import MoeSpec
from llm_serving.simulator.costs import (
    DEVICES,
    CostModelError,
    DeviceCost,
    StepCost,
    fitted_from_profile,
    request_overhead,
)
from llm_serving.simulator.workload import Encode, word_encoder
from llm_serving.tokenization.hf_tokenizer import load_tokenizer

# Published shapes (each model's config.json on the Hugging Face hub) of the models contest entries serve.
MODEL_SHAPES = {
    "llama-2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32),
    "llama-2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40),
    "llama-2-70b": LlamaConfig(32000, 8192, 28672, 80, 64, 8),
    "llama-3.1-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, eos_token_id=128001),
    # 128 experts, 8 a token, every layer sparse: 30.5B parameters held, 3.3B read by one token
    "qwen3-30b-a3b": LlamaConfig(151936, 2048, 6144, 48, 32, 4, architecture="Qwen3MoeForCausalLM",
                                 explicit_head_dim=128, moe=MoeSpec(128, 8, 768, True, 0, tuple(range(48)))),
}


@dataclass
class Target:
    scheduler: SchedulerConfig
    cost: StepCost
    encode: Encode
    tokenizer: str  # how prompts became ids (reported)
    request_overhead_s: float = 0.0  # measured by the profile (``costs.request_overhead``); 0 for a device
    profiled_batch: int | None = None  # the largest batch the profile ran (a fitted model extrapolates past it)


def model_shape(spec: str) -> LlamaConfig:
    if spec in MODEL_SHAPES:
        return MODEL_SHAPES[spec]
    path = Path(spec)
    try:
        return LlamaConfig.from_model_dir(path if path.is_dir() else path.parent)
    except (ModelConfigError, ValueError, OSError) as exc:
        raise CostModelError(f"--model-shape {spec}: neither a preset ({', '.join(MODEL_SHAPES)}) nor a model "
                             f"directory with a config.json ({exc})") from None


def build_target(config: ServingConfig, cost: str, device_params: dict[str, str] | None = None,
                 shape: str | None = None, num_blocks: int | None = None, tokens_per_word: float = 1.3,
                 progress: Callable[[str], None] | None = None) -> Target:
    """``cost``: a device preset name or a profile file (see the module docstring)."""
    step_cost: StepCost
    if cost in DEVICES:
        llama = model_shape(shape) if shape else _config_model(config, progress).llama_config
        device = DEVICES[cost].with_values(device_params or {})
        dtype_bytes = 4 if config.model_config.dtype == "float32" else 2
        step_cost = analytic = DeviceCost(device, llama, config.num_agents, dtype_bytes,
                                          config.model_config.quantization == "w8a16")
        blocks = num_blocks or kv_cache_blocks(config, llama)
        if config.pa_config.auto_blocks and not num_blocks:
            blocks = analytic.kv_blocks(config.pa_config.block_size, config.pa_config.utilization) + 1
        encode, how = word_encoder(llama.vocab_size, tokens_per_word), f"estimate: words x {tokens_per_word}"
        overhead, profiled = 0.0, None  # a device has no HTTP front end to measure, nor a profile
    else:
        if device_params:
            raise CostModelError("--device-param applies to a device preset (--cost "
                                 f"{' | '.join(DEVICES)}), not to a measured profile")
        step_cost, meta, profiled = fitted_from_profile(cost)
        model = _config_model(config, progress)
        llama = model.llama_config
        blocks = num_blocks or (kv_cache_blocks(config, llama) if not config.pa_config.auto_blocks
                                else int(meta.get("num_blocks", 0)) or None)
        if blocks is None:
            raise CostModelError(f"{cost}: no KV block count recorded; give --num-blocks")
        encode, how = load_tokenizer(model.tokenizer_file).encode, str(model.tokenizer_path)
        overhead = request_overhead(step_cost, meta.get("first_token_probes", []))
    end = config.model_config.end_token
    sched = scheduler_config(config, end if end is not None else llama.eos_token_id, llama, num_blocks=blocks)
    return Target(sched, step_cost, encode, how, overhead, profiled)


def _config_model(config: ServingConfig, progress: Callable[[str], None] | None) -> ModelFiles:
    try:
        return resolve_model(config, progress)
    except ConfigError as exc:
        raise CostModelError(f"{exc} (for a model that is not here, give --model-shape with a device preset)") from None
