"""Wiring: turns a validated ``ServingConfig`` into the engine's parts.

The model files to serve (the embedded default model is built here when none is configured), the scheduler's
limits and the ``AgentSpec`` the agent processes start from. Each derived figure (block-table width,
shared-memory capacities) is computed here once.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_serving.config.sections import TOKENIZER_TYPES
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.engine.ascend_settings import ascend_settings
from llm_serving.models.default_model import ensure_default_model
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import kv_shards, tensor_parallel_problems
from llm_serving.protocol.paths import cache_root
from llm_serving.protocol.wire import AgentSpec


@dataclass(frozen=True)
class ModelFiles:
    """What the agents load and the master tokenizes with."""

    model_path: Path  # HF/converted model directory or checkpoint file
    llama_config: LlamaConfig
    tokenizer_path: Path | None  # None where the caller needs no tokenizer (export)

    @property
    def tokenizer_file(self) -> Path:
        """``tokenizer_path`` of a model resolved with its tokenizer (``resolve_model``'s default)."""
        if self.tokenizer_path is None:
            raise ValueError(f"{self.model_path} was resolved without its tokenizer (resolve_model(tokenizer=False))")
        return self.tokenizer_path


# ---- configuration mapping --------------------------------------------------------------------------------
def resolve_model(config: ServingConfig, progress: Callable[[str], None] | None = None,
                  tokenizer: bool = True) -> ModelFiles:
    """The model to serve: ``model_config.model_path``, or the embedded default model (built if needed); its
    tokenizer is checked only when ``tokenizer``."""
    src = config.source
    model_path = config.model_config.model_path
    if model_path is None:  # config.uses_default_model
        path = ensure_default_model(config.default_model, config.max_model_len, progress)
        config_dir = path
    else:
        path = Path(model_path)
        if not path.exists():
            raise ConfigError(f"{src}: model_config.model_path: {path} does not exist",
                              key="model_config.model_path", source=src)
        config_dir = path if path.is_dir() else path.parent
    try:
        llama = LlamaConfig.from_model_dir(config_dir)
    except (ModelConfigError, ValueError) as exc:
        raise ConfigError(f"{src}: model_config.model_path: {exc}", key="model_config.model_path",
                          source=src) from None
    want_vocab = config.model_config.vocab_size
    if want_vocab is not None and want_vocab != llama.vocab_size:
        raise ConfigError(f"{src}: model_config.vocab_size: {want_vocab} does not match the model's "
                          f"vocab_size {llama.vocab_size} ({config_dir / 'config.json'})",
                          key="model_config.vocab_size", source=src)
    if config.uses_mindformers:  # what MindFormers' Llama cannot be first: no installation makes it servable
        if llama.qkv_bias or llama.qk_norm or llama.q_dim != llama.hidden_size or llama.moe is not None:
            raise ConfigError(f"{src}: model_config.backend: mindformers builds its Llama from its own YAML, without "
                              f"{llama.architecture}'s q/k/v biases, q/k norms, experts or a head_dim of its own "
                              f"({config_dir / 'config.json'}): serve this model with our graph (backend ms)",
                              key="model_config.backend", source=src)
        if llama.rope_scaling is not None:  # MindFormers builds its rope from its YAML, never from config.json
            raise ConfigError(f"{src}: model_config.backend: mindformers does not read config.json's rope_scaling "
                              f"({llama.rope_scaling['rope_type']}) of {config_dir / 'config.json'}, so its model "
                              "would differ: serve this model with our graph (backend ms)",
                              key="model_config.backend", source=src)
        check_mindformers_route(config)
    limit = llama.rope_position_limit
    if limit is not None and config.max_model_len > limit:
        raise ConfigError(f"{src}: pa_config.decode_seq_length: {config.max_model_len} tokens exceed the "
                          f"{limit} positions a rope_scaling dynamic model is served for ({config_dir / 'config.json'}"
                          ": beyond max_position_embeddings transformers rescales every position by the sequence's "
                          "length, which a KV cache cannot follow); serve at most that many",
                          key="pa_config.decode_seq_length", source=src)
    problems = tensor_parallel_problems(llama, config.num_agents, config.model_config.expert_parallel)
    if problems:
        raise ConfigError(f"{src}: serving_config.num_agents: {config.num_agents} agents are the tensor-parallel "
                          f"size, which this model cannot be split into: {'; '.join(problems)}",
                          key="serving_config.num_agents", source=src)
    if config.lora.enable and llama.moe is not None:
        raise ConfigError(f"{src}: lora.enable: {llama.architecture} is a mixture-of-experts model, whose sparse "
                          "layers' experts take no adapter slots: adapters are served on dense models only",
                          key="lora.enable", source=src)
    check_host_memory(config, llama)
    check_layers(config, llama)
    if not tokenizer:
        return ModelFiles(path, llama, None)
    vocab_file = config.tokenizer.vocab_file
    model_dir = path if path.is_dir() else path.parent
    # tokenizer.type's file; auto: a sentencepiece tokenizer.model (Llama 2) first, else a Hugging Face
    # tokenizer.json (Llama 3, Qwen)
    wanted = TOKENIZER_TYPES[config.tokenizer.type]
    names = (wanted,) if wanted else ("tokenizer.model", "tokenizer.json")
    found = [model_dir / name for name in names if (model_dir / name).is_file()]
    tokenizer_path = Path(vocab_file) if vocab_file is not None else (found[0] if found else model_dir / names[0])
    if not tokenizer_path.is_file():
        raise ConfigError(f"{src}: tokenizer.vocab_file: no tokenizer at {tokenizer_path} (a sentencepiece "
                          "tokenizer.model or a Hugging Face tokenizer.json)", key="tokenizer.vocab_file", source=src)
    return ModelFiles(path, llama, tokenizer_path)


def check_layers(config: ServingConfig, llama: LlamaConfig) -> None:
    """Early exit and self-speculation name layers of the served model, which must have them."""
    src, layers = config.source, llama.num_hidden_layers
    exit_layer, draft_layers = config.model_config.early_exit_layer, config.speculative.draft_layers
    if exit_layer is not None and not 1 <= exit_layer <= layers:
        raise ConfigError(f"{src}: model_config.early_exit_layer: {exit_layer} is not one of the model's layers "
                          f"1..{layers}", key="model_config.early_exit_layer", source=src)
    served = exit_layer or layers
    if draft_layers is not None and not 1 <= draft_layers < served:
        raise ConfigError(f"{src}: speculative.draft_layers: {draft_layers} must be fewer than the {served} layers "
                          f"served (1..{served - 1})", key="speculative.draft_layers", source=src)
    if config.uses_mindformers and exit_layer is not None:
        raise ConfigError(f"{src}: model_config.early_exit_layer: backend mindformers builds every layer of its "
                          "YAML; serve early exit with our graph (backend ms)", key="model_config.early_exit_layer",
                          source=src)


def draft_spec(config: ServingConfig, llama: LlamaConfig) -> dict | None:
    """The agents' draft (``AgentSpec.draft``) of speculative decoding, checked against the served model."""
    sp, src = config.speculative, config.source
    if sp.method == "self":
        return {"layers": sp.draft_layers, "looped": sp.draft_loop}
    if sp.method != "draft" or sp.draft_model_path is None:  # validate(): a draft names its path
        return None
    path = Path(sp.draft_model_path)
    try:
        draft = LlamaConfig.from_model_dir(path if path.is_dir() else path.parent)
    except (ModelConfigError, ValueError, OSError) as exc:
        raise ConfigError(f"{src}: speculative.draft_model_path: {exc}", key="speculative.draft_model_path",
                          source=src) from None
    if draft.vocab_size != llama.vocab_size:
        raise ConfigError(f"{src}: speculative.draft_model_path: the draft's vocabulary ({draft.vocab_size}) is not "
                          f"the served model's ({llama.vocab_size}): a draft shares the target's tokenizer",
                          key="speculative.draft_model_path", source=src)
    problems = tensor_parallel_problems(draft, config.num_agents)
    if problems:
        raise ConfigError(f"{src}: speculative.draft_model_path: each of the {config.num_agents} ranks runs its slice "
                          f"of the draft, which cannot be split so: {'; '.join(problems)}",
                          key="speculative.draft_model_path", source=src)
    return {"model_path": str(path), "llama_config": draft.as_dict(), "looped": sp.draft_loop}


def check_mindformers_route(config: ServingConfig) -> None:
    """Backend mindformers: its YAML exists and MindFormers is installed where the agents will run (this python),
    found without importing it (the master never imports MindSpore)."""
    src, yaml_path = config.source, config.model_config.model_cfg_path
    if yaml_path is None or not Path(yaml_path).is_file():
        raise ConfigError(f"{src}: model_config.model_cfg_path: MindFormers predict YAML {yaml_path} does not exist",
                          key="model_config.model_cfg_path", source=src)
    if importlib.util.find_spec("mindformers") is None:
        raise ConfigError(f"{src}: model_config.backend: mindformers, but MindFormers is not installed for "
                          f"{sys.executable}: create its environment with `bash scripts/mindformers_env.sh` and run "
                          "llm-serving with the python it prints (docs/mindformers.md)",
                          key="model_config.backend", source=src)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(config: ServingConfig, llama: LlamaConfig) -> None:
    """On CPU the agents' KV caches are host memory, mapped at start-up but backed only as tokens fill them; a
    cache larger than the host's free memory would have an agent killed for memory mid-serving, so refuse it
    here, naming the key."""
    m, pa, src = config.model_config, config.pa_config, config.source
    blocks = pa.fixed_blocks
    if m.device_target != "CPU" or blocks is None:  # auto: each agent sizes its cache from what is available
        return
    itemsize = 4 if m.dtype == "float32" else 2
    per_agent = (blocks * pa.block_size * 2 * llama.num_key_value_heads * llama.head_dim
                 * llama.num_hidden_layers * itemsize)
    total, available = per_agent * config.num_agents, available_memory_bytes()
    if available is not None and total > available:
        gib = 1 << 30
        raise ConfigError(f"{src}: pa_config.num_blocks: {pa.num_blocks} blocks of {pa.block_size} tokens make "
                          f"{total / gib:.1f} GiB of KV cache ({config.num_agents} agent(s) x {per_agent / gib:.1f} "
                          f"GiB), more than this host's {available / gib:.1f} GiB of available memory: lower it",
                          key="pa_config.num_blocks", source=src)


def kv_cache_blocks(config: ServingConfig, llama: LlamaConfig | None) -> int | None:
    """KV-cache blocks of the served model: ``pa_config.num_blocks`` is what one device's cache holds with the
    whole model's kv heads; tensor-parallel ranks hold only their share of the kv heads per block, so the same
    memory on each rank holds ``kv_shards`` times as many blocks (``llm_serving.protocol.parallel``). None with
    ``num_blocks: auto``: the agents size their caches and report the count when ready."""
    blocks = config.pa_config.fixed_blocks
    if blocks is None:
        return None
    shards = kv_shards(llama, config.num_agents) if llama is not None else 1
    return blocks * shards


def scheduler_config(config: ServingConfig, eos_token_id: int | None, llama: LlamaConfig | None = None,
                     num_blocks: int | None = None, other_eos_token_ids: tuple[int, ...] = ()) -> SchedulerConfig:
    """``llama``: the served model, whose kv heads size the cache under tensor parallelism (``kv_cache_blocks``);
    ``num_blocks``: the agents' reported count, with ``num_blocks: auto``."""
    m, pa, sc, sp = config.model_config, config.pa_config, config.scheduler, config.speculative
    blocks = num_blocks if num_blocks is not None else kv_cache_blocks(config, llama)
    if blocks is None:
        raise ValueError("pa_config.num_blocks auto: the scheduler needs the count the agents reported")
    return SchedulerConfig(
        num_blocks=blocks, block_size=pa.block_size,
        max_num_seqs=m.decode_batch_size[-1], max_prefill_batch=m.prefill_batch_size[-1],
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
        eos_token_id=eos_token_id, other_eos_token_ids=other_eos_token_ids, policy=sc.policy, max_wait_s=sc.max_wait_s,
        min_decode_steps_between_prefills=sc.min_decode_steps_between_prefills, decode_steps=sc.decode_steps,
        async_scheduling=config.async_scheduling,
        max_prompt_len=config.max_prompt_len, chunked_prefill=config.chunked_prefill,
        prefix_caching=config.prefix_caching, speculative=sp.method, num_speculative_tokens=sp.num_tokens,
        prompt_lookup_min=sp.prompt_lookup_min, prompt_lookup_max=sp.prompt_lookup_max,
        speculative_step_tokens=sp.max_step_tokens, speculative_min_accepted=sp.policies()[0],
        speculative_adaptive=sp.policies()[1], speculative_rounds=sp.verify_rounds(),
        max_loras=config.lora.max_loras if config.lora.enable else 0,
    )


def runner_config_dict(config: ServingConfig) -> dict[str, Any]:
    """``agents.runtime.runner.RunnerConfig`` fields (JSON-able); the runner adds a 1 x max_model_len recompute
    shape itself."""
    m, pa = config.model_config, config.pa_config
    ascend = ascend_settings(config)  # the preflight verdict's steering, where one is named
    return {
        "num_blocks": None if pa.auto_blocks else pa.num_blocks, "block_size": pa.block_size,
        "max_model_len": config.max_model_len,
        "prefill_batch_sizes": list(m.prefill_batch_size), "prefill_seq_lengths": list(m.seq_length),
        "decode_batch_sizes": list(m.decode_batch_size), "dtype": m.dtype, "kernels": m.kernels,
        "precision": m.precision, "quantization": m.quantization, "kv_cache_dtype": m.kv_cache_dtype,
        "int8_kv_direction": ascend.int8_kv_direction if ascend else None,
        # chunks and prefix-cache hits are queries over cached context: the agents warm those graphs too
        "mixed_steps": config.chunked_prefill or config.prefix_caching,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "verify_tokens": config.speculative.num_tokens if config.speculative.method else 0,
        "verify_step_tokens": config.speculative.max_step_tokens,
        "decode_steps": config.scheduler.decode_steps,  # looped decode graphs (agents.runtime.looped_decode)
        "device_target": m.device_target, "dynamic_shapes": m.dynamic_graphs,
        "device_environment": ascend.environment if ascend else {},
        "max_device_memory": ascend.max_device_memory if ascend else None,
        **({"memory_utilization": pa.utilization} if pa.auto_blocks else {}),
    }


def compile_cache_dir(config: ServingConfig) -> str | None:
    """The agents' compile-cache root from ``serving_config.compile_cache`` (None: off)."""
    value = config.serving_config.compile_cache
    if value is False:
        return None
    return str(cache_root() / "compile-cache") if value is True else os.path.expanduser(value)


def agent_spec(config: ServingConfig, model: ModelFiles, standin: bool = False) -> AgentSpec:
    """The agents' start-up spec for this configuration (shared-memory capacities included)."""
    m, pa = config.model_config, config.pa_config
    max_batch = max(m.prefill_batch_size[-1], m.decode_batch_size[-1])
    blocks = kv_cache_blocks(config, model.llama_config)
    return AgentSpec(
        kind="standin" if standin else "llama",
        model_path=str(model.model_path),
        llama_config=model.llama_config.as_dict(),
        runner_config={**runner_config_dict(config), "num_blocks": blocks},
        max_tokens=max(config.max_num_batched_tokens, m.decode_batch_size[-1]),
        max_batch=max_batch,
        max_blocks_per_seq=config.max_blocks_per_seq,
        # every penalty id of a step is a token whose KV is cached: bounded by the cache and the batch
        max_penalty_tokens=min((blocks - 1) * pa.block_size if blocks else max_batch * config.max_model_len,
                               max_batch * config.max_model_len),
        # logits dumps: every sequence of a step may ask (float32 x vocab each; 16 MiB for 128 x 32000)
        max_logits_rows=max_batch,
        # tokens one sequence may get back from a step: multi-step's, or a verify step's rounds of proposals + 1
        max_decode_steps=max(config.scheduler.decode_steps, config.speculative.verify_rounds()
                             * (config.speculative.num_tokens + 1) if config.speculative.method else 1),
        tensor_parallel_size=config.num_agents,
        expert_parallel=config.model_config.expert_parallel,
        start_device_id=config.serving_config.start_device_id,
        backend="mindformers" if config.uses_mindformers else "ms",
        model_cfg_path=config.model_config.model_cfg_path if config.uses_mindformers else None,
        compile_cache_dir=None if standin else compile_cache_dir(config),
        exit_layer=config.model_config.early_exit_layer,
        draft=draft_spec(config, model.llama_config),
        prompt_lookup=([config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max]
                       if config.speculative.method == "ngram" else None),
        steps_in_flight=2 if config.async_scheduling else 1,
        local_ranks=config.serving_config.local_agents,
        join_address=config.serving_config.join_address,
        kv_transfer=config.serving_config.kv_transfer and not standin,
        lora={"max_loras": config.lora.max_loras, "max_lora_rank": config.lora.max_lora_rank}
        if config.lora.enable else None,
    )
