"""The launch configuration: an llm-serving-compatible YAML file, validated into frozen dataclasses.

Contest users bring MindSpore llm-serving YAML files, so its sections and keys are kept (``model_config``,
``serving_config``, ``pa_config``, ``tokenizer``); llm-serving keys that have no meaning here are accepted,
type-checked and ignored with a note in ``ServingConfig.notes``. Our own sections are ``scheduler`` and
``default_model``. Every mistake is a ``ConfigError`` naming the file, the key and what was expected, so a bad
file fails at start-up rather than deep inside an agent. See ``configs/example.yaml`` for every key.

Relative paths are resolved against the directory of the YAML file (the current directory for dicts and
overrides) and ``~`` is expanded; a key left empty (null) takes its default. Kept free of MindSpore.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm_serving.config.sections import (
    CACHED_CONTEXT_DEVICES,
    DEFAULT_WEIGHTS,
    MAX_DECODE_STEPS,
    MAX_VERIFY_ROUNDS,
    MODEL_BACKENDS,
    RANDOM_RECIPE_KEYS,
    SECTIONS,
    TOKENIZER_TYPES,
    DefaultModelSection,
    ModelSection,
    PagedAttentionSection,
    SchedulerSection,
    ServingSection,
    SpeculativeSection,
    TokenizerSection,
)
from llm_serving.config.yaml_sections import (
    COMPAT_SECTIONS,
    ConfigError,
    bad_value,
    parse_section,
    show_value,
    suggest,
)
from llm_serving.core.scheduler import POLICIES
from llm_serving.core.speculative import METHODS as SPECULATIVE_METHODS
from llm_serving.protocol.model_config import (
    ASCEND_DTYPES,
    DEVICE_TARGETS,
    DTYPES,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    PRECISIONS,
    QUANTIZATIONS,
    ModelConfigError,
    blocks_needed,
)
from llm_serving.protocol.wire import split_address

__all__ = ["ConfigError", "ServingConfig"]

_CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors", ".bin")


@dataclass(frozen=True)
class ServingConfig:
    """The whole launch configuration; construction validates it (see ``_validate``)."""

    model_config: ModelSection = field(default_factory=ModelSection)
    serving_config: ServingSection = field(default_factory=ServingSection)
    pa_config: PagedAttentionSection = field(default_factory=PagedAttentionSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    default_model: DefaultModelSection = field(default_factory=DefaultModelSection)
    source: str = field(default="<defaults>", compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)  # ignored compatibility keys, for the log

    def __post_init__(self) -> None:
        _validate(self)

    # ----- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ServingConfig:
        path = Path(os.path.expanduser(os.fspath(path)))
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {path} {what}", source=str(path))
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}", source=str(path)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}", source=str(path)) from None
        return cls.from_dict(raw, source=str(path), base_dir=path.parent.absolute())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, source: str = "<dict>",
                  base_dir: str | os.PathLike | None = None) -> ServingConfig:
        """Build from parsed YAML; relative paths resolve against ``base_dir`` (default: the current dir)."""
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: the top level must be a mapping of sections, got "
                              f"{show_value(d)}", source=source)
        base = Path(base_dir).absolute() if base_dir is not None else Path.cwd()
        notes: list[str] = []
        for name, body in d.items():
            if name in COMPAT_SECTIONS:
                if body is not None and not isinstance(body, Mapping):
                    raise ConfigError(f"{source}: section {name!r} must be a mapping, got {show_value(body)}",
                                      key=str(name), source=source)
                notes.append(f"section {name!r} ignored: {COMPAT_SECTIONS[name]}")
            elif name not in SECTIONS:
                raise ConfigError(f"{source}: unknown section {name!r}{suggest(name, SECTIONS)}; known "
                                  f"sections: {', '.join(SECTIONS)}", key=str(name), source=source)
        sections = {name: parse_section(name, SECTIONS[name], d.get(name), source, base, notes) for name in SECTIONS}
        return cls(**sections, source=source, notes=tuple(notes))

    # ----- derived copies and views ----------------------------------------------------------------------
    def with_values(self, values: Mapping[str, Any]) -> ServingConfig:
        """A copy with ``{"section.key": value}`` replaced, validated like a file."""
        d = self.to_dict()
        for dotted, value in values.items():
            section, _, key = dotted.partition(".")
            if section not in d or not key:
                raise ConfigError(f"override {dotted!r}: expected 'section.key' with a section from "
                                  f"{', '.join(SECTIONS)}", key=dotted, source=self.source)
            d[section][key] = value
        new = ServingConfig.from_dict(d, source=f"{self.source} (with overrides {', '.join(values)})")
        return dataclasses.replace(new, notes=tuple(dict.fromkeys(self.notes + new.notes)))

    def with_overrides(self, model_path: str | None = None, host: str | None = None, port: int | None = None,
                       policy: str | None = None, decode_batch_size: int | list[int] | None = None,
                       prefill_batch_size: int | list[int] | None = None,
                       num_agents: int | None = None) -> ServingConfig:
        """A copy with command-line overrides applied (None leaves a value alone); paths resolve vs. cwd."""
        wanted = {
            "model_config.model_path": model_path, "serving_config.server_ip": host,
            "serving_config.server_port": port, "scheduler.policy": policy,
            "model_config.decode_batch_size": _as_list(decode_batch_size),
            "model_config.prefill_batch_size": _as_list(prefill_batch_size),
            "serving_config.num_agents": num_agents,
        }
        values = {k: v for k, v in wanted.items() if v is not None}
        return self.with_values(values) if values else self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain YAML-dumpable sections; ``from_dict(to_dict())`` gives an equal config."""
        return {name: {k: list(v) if isinstance(v, tuple) else v
                       for k, v in dataclasses.asdict(getattr(self, name)).items()}
                for name in SECTIONS}

    @property
    def uses_default_model(self) -> bool:
        return self.model_config.model_path is None

    @property
    def max_model_len(self) -> int:
        return self.pa_config.decode_seq_length

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: the blocks of one sequence of ``max_model_len`` tokens."""
        return blocks_needed(self.max_model_len, self.pa_config.block_size)

    @property
    def max_prompt_len(self) -> int:
        return self.model_config.seq_length[-1]

    @property
    def uses_mindformers(self) -> bool:
        """``model_config.backend: mindformers``: MindFormers' Llama in the agents, not ours."""
        return self.model_config.backend == "mindformers"

    @property
    def attends_cached_context(self) -> bool:
        """Whether the agents can run queries over cached context (our graph on CPU; not MindFormers' prefill)."""
        return self.model_config.device_target in CACHED_CONTEXT_DEVICES and not self.uses_mindformers

    @property
    def chunked_prefill(self) -> bool:
        """``scheduler.enable_chunked_prefill``, by default on where the agents can run it."""
        value = self.scheduler.enable_chunked_prefill
        return value if value is not None else self.attends_cached_context

    @property
    def async_scheduling(self) -> bool:
        """``scheduler.async_scheduling``, by default on unless speculative decoding is."""
        value = self.scheduler.async_scheduling
        return value if value is not None else not self.speculative.method

    @property
    def prefix_caching(self) -> bool:
        """``scheduler.enable_prefix_caching``, by default on where the agents can run it."""
        value = self.scheduler.enable_prefix_caching
        return value if value is not None else self.attends_cached_context

    @property
    def max_num_batched_tokens(self) -> int:
        """Token budget of one step (of one prefill step without chunked prefill); default max(largest prefill
        batch x longest bucket, max_model_len)."""
        explicit = self.scheduler.max_num_batched_tokens
        derived = self.model_config.prefill_batch_size[-1] * self.model_config.seq_length[-1]
        return explicit if explicit is not None else max(derived, self.max_model_len)

    @property
    def num_agents(self) -> int:
        return self.serving_config.effective_num_agents

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names the API answers to: model_name first, then the aliases."""
        return tuple(dict.fromkeys((self.model_config.model_name, *self.serving_config.model_aliases)))

    @property
    def vocab_file(self) -> str | None:
        """tokenizer.vocab_file, else ``tokenizer.model`` beside model_path; None for the embedded model."""
        if self.tokenizer.vocab_file is not None:
            return self.tokenizer.vocab_file
        path = self.model_config.model_path
        if path is None:
            return None
        folder = os.path.dirname(path) if path.endswith(_CHECKPOINT_SUFFIXES) else path
        return os.path.join(folder, "tokenizer.model")


# ----- validation -----------------------------------------------------------------------------------------
def _validate(cfg: ServingConfig) -> None:
    src, m, s, pa = cfg.source, cfg.model_config, cfg.serving_config, cfg.pa_config

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise bad_value(src, key, msg)

    need(bool(m.model_name.strip()), "model_config.model_name", "must not be empty")
    need(not isinstance(s.compile_cache, str) or not os.path.exists(s.compile_cache)
         or os.path.isdir(s.compile_cache), "serving_config.compile_cache",
         f"{s.compile_cache} exists and is not a directory (expected true, false or a directory path)")
    need(m.dtype in DTYPES, "model_config.dtype", f"expected one of {', '.join(DTYPES)}, got {m.dtype!r}")
    need(m.device_target in DEVICE_TARGETS, "model_config.device_target",
         f"expected one of {', '.join(DEVICE_TARGETS)}, got {m.device_target!r}")
    need(m.device_target != "Ascend" or m.dtype in ASCEND_DTYPES, "model_config.dtype",
         f"{m.dtype} is not served on Ascend (model_config.device_target): the fused NPU kernels take "
         f"{' or '.join(ASCEND_DTYPES)}")
    need(m.backend in MODEL_BACKENDS, "model_config.backend",
         f"expected one of {', '.join(MODEL_BACKENDS)}, got {m.backend!r}")
    if m.backend == "mindformers":
        need(m.model_cfg_path is not None, "model_config.model_cfg_path",
             "backend mindformers builds MindFormers' Llama from a MindFormers predict YAML (e.g. "
             "predict_llama2_7b.yaml): set model_config.model_cfg_path to it")
        need(m.device_target == "Ascend", "model_config.device_target",
             f"backend mindformers serves on Ascend only (MindFormers' Llama kernels, e.g. RmsNorm, FlashAttention "
             f"and PagedAttention, have no CPU kernels), got {m.device_target}; `llm-serving export` builds its "
             "Ascend graphs on this machine's CPU")
        need(s.effective_num_agents == 1, "serving_config.num_agents",
             f"backend mindformers runs one agent (no tensor parallelism through it), got {s.effective_num_agents}")
    need(m.max_generate_length > 0, "model_config.max_generate_length",
         f"must be positive, got {m.max_generate_length}")
    need(m.vocab_size is None or m.vocab_size > 0, "model_config.vocab_size", f"must be positive, got {m.vocab_size}")
    for key in ("end_token", "pad_token_id"):
        v = getattr(m, key)
        need(v is None or v >= 0, f"model_config.{key}", f"must be a token id >= 0, got {v}")
    for key in ("seq_length", "prefill_batch_size", "decode_batch_size"):
        b = getattr(m, key)
        need(len(b) > 0, f"model_config.{key}", "needs at least one bucket")
        need(all(x > 0 for x in b), f"model_config.{key}", f"buckets must be positive, got {list(b)}")
        need(list(b) == sorted(set(b)), f"model_config.{key}", f"buckets must be sorted and unique: {list(b)}")

    need(s.num_agents is not None or len(s.agent_ports) > 0, "serving_config.agent_ports",
         "needs at least one entry (one per agent rank) when serving_config.num_agents is not set")
    need(s.num_agents is None or s.num_agents >= 1, "serving_config.num_agents",
         f"must be at least 1, got {s.num_agents}")
    need(s.local_agents is None or 1 <= s.local_agents <= s.effective_num_agents, "serving_config.local_agents",
         f"must be in 1..num_agents ({s.effective_num_agents}), got {s.local_agents}")
    if s.local_agents is not None and s.local_agents < s.effective_num_agents:
        need(s.join_address is not None, "serving_config.join_address",
             f"is needed when only {s.local_agents} of the {s.effective_num_agents} ranks run here: the address of "
             "this host (HOST:PORT) where the others join with `llm-serving agent --join`")
        need(not cfg.uses_mindformers, "serving_config.local_agents",
             "ranks on other hosts run our Llama graphs (backend ms, ge or kbk), not backend mindformers")
    if s.join_address is not None:
        try:
            split_address(s.join_address)
        except ValueError as exc:
            need(False, "serving_config.join_address", str(exc))
    if s.kv_transfer:
        need(m.device_target == "CPU" and not cfg.uses_mindformers, "serving_config.kv_transfer",
             "KV blocks are copied on the host, where the cache is host memory: the CPU agents of our Llama only "
             "(Ascend would need gather/scatter graphs, docs/deployment.md)")
        need(cfg.prefix_caching, "serving_config.kv_transfer",
             "blocks move as prefix-cache blocks: leave scheduler.enable_prefix_caching on")
        need(s.local_agents is None or s.local_agents >= s.effective_num_agents, "serving_config.kv_transfer",
             "every rank must run on this host (the KV segment is shared memory)")
        need(not cfg.speculative.method and m.early_exit_layer is None, "serving_config.kv_transfer",
             "a draft model's or an early exit's cache is not transferred: not with speculative.method or "
             "model_config.early_exit_layer")
    need(0 <= s.server_port < 65536, "serving_config.server_port",
         f"must be 0..65535 (0: any free port), got {s.server_port}")
    need(bool(s.server_ip.strip()), "serving_config.server_ip", "must not be empty")
    need(s.start_device_id >= 0, "serving_config.start_device_id", f"must be >= 0, got {s.start_device_id}")
    need(s.max_queue_size >= 1, "serving_config.max_queue_size", f"must be >= 1, got {s.max_queue_size}")
    need(all(a.strip() for a in s.model_aliases), "serving_config.model_aliases",
         f"aliases must be non-empty: {list(s.model_aliases)}")
    need(s.drain_timeout_s >= 0, "serving_config.drain_timeout_s", f"must be >= 0, got {s.drain_timeout_s}")
    for key in ("step_timeout_factor", "step_timeout_min_s", "agent_restart_limit", "agent_restart_backoff_s"):
        need(getattr(s, key) >= 0, f"serving_config.{key}", f"must be >= 0, got {getattr(s, key)}")
    need(s.dump_logits_tokens is None or s.dump_logits_tokens >= 1, "serving_config.dump_logits_tokens",
         f"must be >= 1 (empty: every generated position), got {s.dump_logits_tokens}")

    for key in ("block_size", "decode_seq_length") + (() if pa.auto_blocks else ("num_blocks",)):
        need(getattr(pa, key) > 0, f"pa_config.{key}", f"must be positive, got {getattr(pa, key)}")
    need(pa.memory_utilization is None or pa.auto_blocks, "pa_config.memory_utilization",
         f"sizes the cache only with pa_config.num_blocks: auto (num_blocks is {pa.num_blocks})")
    need(pa.memory_utilization is None or 0 < pa.memory_utilization <= 1, "pa_config.memory_utilization",
         f"must be in (0, 1], got {pa.memory_utilization}")
    need(not (pa.auto_blocks and cfg.uses_mindformers), "pa_config.num_blocks",
         "auto is not served by backend mindformers (MindFormers sizes its own cache): set a number")
    need(m.kernels in KERNEL_CHOICES, "model_config.kernels",
         f"expected one of {', '.join(KERNEL_CHOICES)}, got {m.kernels!r}")
    need(m.precision in PRECISIONS, "model_config.precision",
         f"expected one of {', '.join(PRECISIONS)}, got {m.precision!r}")
    need(m.precision == "exact" or (m.device_target == "CPU" and m.kernels != "portable" and m.dtype == "float32"),
         "model_config.precision", f"{m.precision} runs on the native CPU kernels only: it needs "
         "model_config.device_target CPU, dtype float32 and kernels auto or native (got "
         f"{m.device_target}, {m.dtype}, {m.kernels})")
    need(m.quantization in QUANTIZATIONS, "model_config.quantization",
         f"expected one of {', '.join(QUANTIZATIONS)}, got {m.quantization!r}")
    need(m.quantization == "none" or m.device_target == "Ascend"
         or (m.kernels != "portable" and m.dtype == "float32" and m.precision == "exact"),
         "model_config.quantization", f"{m.quantization} runs on Ascend (WeightQuantBatchMatmul) or on the native "
         "CPU projections with float32 activations: on CPU it needs dtype float32, kernels auto or native and "
         f"precision exact (got {m.dtype}, {m.kernels}, {m.precision})")
    need(m.quantization == "none" or not cfg.uses_mindformers, "model_config.quantization",
         "is not served by backend mindformers")
    need(m.kv_cache_dtype in KV_CACHE_DTYPES, "model_config.kv_cache_dtype",
         f"expected one of {', '.join(KV_CACHE_DTYPES)}, got {m.kv_cache_dtype!r}")
    need(m.kv_cache_dtype == "auto" or not cfg.uses_mindformers, "model_config.kv_cache_dtype",
         f"{m.kv_cache_dtype} is not served by backend mindformers")
    need(m.kv_cache_dtype == "auto" or m.device_target == "Ascend"
         or (m.kernels != "portable" and m.dtype == "float32"),
         "model_config.kv_cache_dtype", f"{m.kv_cache_dtype} is held and read by the native CPU attention (scales per "
         "row) or on Ascend by PagedAttention (static scales per channel from `llm-serving calibrate-kv`): on CPU it "
         f"needs dtype float32 and kernels auto or native (got {m.dtype}, {m.kernels}); docs/quantization.md")
    usable = (pa.num_blocks - 1) * pa.block_size if not pa.auto_blocks else pa.decode_seq_length  # block 0: padding
    need(pa.decode_seq_length <= usable, "pa_config.decode_seq_length",
         f"{pa.decode_seq_length} tokens do not fit in the cache of (num_blocks - 1) * block_size = "
         f"({pa.num_blocks} - 1) * {pa.block_size} = {usable} tokens (block 0 is reserved for padding)")
    need(m.seq_length[-1] <= pa.decode_seq_length, "model_config.seq_length",
         f"longest prefill bucket {m.seq_length[-1]} exceeds pa_config.decode_seq_length {pa.decode_seq_length}")

    need(cfg.tokenizer.type in TOKENIZER_TYPES, "tokenizer.type",
         f"expected one of {', '.join(TOKENIZER_TYPES)}, got {cfg.tokenizer.type!r}")

    sc = cfg.scheduler
    need(sc.policy in POLICIES, "scheduler.policy", f"expected one of {', '.join(POLICIES)}, got {sc.policy!r}")
    need(sc.max_wait_s >= 0, "scheduler.max_wait_s", f"must be >= 0, got {sc.max_wait_s}")
    need(sc.min_decode_steps_between_prefills >= 0, "scheduler.min_decode_steps_between_prefills",
         f"must be >= 0, got {sc.min_decode_steps_between_prefills}")
    need(1 <= sc.decode_steps <= MAX_DECODE_STEPS, "scheduler.decode_steps",
         f"must be in 1..{MAX_DECODE_STEPS}, got {sc.decode_steps}")
    sp = cfg.speculative
    need(sp.method in SPECULATIVE_METHODS, "speculative.method",
         f"expected one of {', '.join(map(repr, SPECULATIVE_METHODS))}, got {sp.method!r}")
    need(1 <= sp.num_tokens < MAX_DECODE_STEPS, "speculative.num_tokens",
         f"must be in 1..{MAX_DECODE_STEPS - 1}, got {sp.num_tokens}")
    need(sp.min_accepted is None or sp.min_accepted >= 0, "speculative.min_accepted",
         f"must be >= 0, got {sp.min_accepted}")
    need(sp.rounds is None or 1 <= sp.rounds <= MAX_VERIFY_ROUNDS, "speculative.rounds",
         f"must be in 1..{MAX_VERIFY_ROUNDS}, got {sp.rounds}")
    need(sp.max_step_tokens >= 2, "speculative.max_step_tokens",
         f"must be >= 2 (a sequence's last token and one proposal), got {sp.max_step_tokens}")
    need(1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max, "speculative.prompt_lookup_min",
         f"must be >= 1 and <= prompt_lookup_max ({sp.prompt_lookup_max}), got {sp.prompt_lookup_min}")
    need((sp.method == "draft") == (sp.draft_model_path is not None), "speculative.draft_model_path",
         "is the draft model of method draft, and only of it")
    need((sp.method == "self") == (sp.draft_layers is not None), "speculative.draft_layers",
         "is the number of the model's own layers that draft for method self, and only for it")
    need(not sp.method or sc.decode_steps == 1, "speculative.method",
         "speculative decoding and scheduler.decode_steps > 1 both run several tokens per step: choose one")
    need(not sp.method or not sc.async_scheduling, "scheduler.async_scheduling",
         "speculative decoding proposes tokens between steps, which steps sent ahead cannot wait for: set it false "
         "or leave it empty")
    need(not sp.method or (m.device_target in CACHED_CONTEXT_DEVICES and not cfg.uses_mindformers),
         "speculative.method", "proposals are verified as queries over cached context, which backend mindformers "
         "lacks")
    for key in ("enable_chunked_prefill", "enable_prefix_caching"):
        need(not getattr(sc, key) or m.device_target in CACHED_CONTEXT_DEVICES, f"scheduler.{key}",
             f"the {m.device_target} agents cannot attend over cached context yet: set it false or leave it "
             "empty")
        need(not getattr(sc, key) or not cfg.uses_mindformers, f"scheduler.{key}",
             "backend mindformers prefills whole prompts from position 0 (MindFormers' prefill has no cached "
             "context): set it false or leave it empty")
    need(sc.max_num_batched_tokens is None or cfg.chunked_prefill
         or sc.max_num_batched_tokens >= pa.decode_seq_length, "scheduler.max_num_batched_tokens",
         f"{sc.max_num_batched_tokens} is below pa_config.decode_seq_length {pa.decode_seq_length}: without "
         "chunked prefill a preempted sequence is recomputed in one prefill step of up to that many tokens")
    need(sc.max_num_batched_tokens is None or not cfg.chunked_prefill
         or sc.max_num_batched_tokens >= m.decode_batch_size[-1], "scheduler.max_num_batched_tokens",
         f"{sc.max_num_batched_tokens} is below the largest decode batch {m.decode_batch_size[-1]}: a step "
         "carries every running sequence's decode token")

    dm = cfg.default_model
    need(dm.weights in DEFAULT_WEIGHTS, "default_model.weights",
         f"expected one of {', '.join(DEFAULT_WEIGHTS)}, got {dm.weights!r}")
    if dm.weights == "trained":
        for key in RANDOM_RECIPE_KEYS:
            default = DefaultModelSection.__dataclass_fields__[key].default
            need(getattr(dm, key) == default, f"default_model.{key}",
                 f"describes the random model (default_model.weights: random); the shipped trained model has its "
                 f"own sizes (leave it at {default})")
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
        need(getattr(dm, key) > 0, f"default_model.{key}", f"must be positive, got {getattr(dm, key)}")
    need(dm.seed >= 0, "default_model.seed", f"must be >= 0, got {dm.seed}")
    if dm.num_heads > 0 and dm.hidden_size % dm.num_heads == 0:
        need(dm.hidden_size // dm.num_heads % 2 == 0, "default_model.hidden_size",
             f"head_dim {dm.hidden_size // dm.num_heads} must be even for RoPE")
    try:
        dm.llama_config(pa.decode_seq_length)  # its own checks
    except ModelConfigError as exc:
        raise bad_value(src, "default_model", str(exc)) from None


def _as_list(value: int | list[int] | tuple[int, ...] | None) -> list[int] | None:
    if value is None:
        return None
    return [value] if isinstance(value, int) else list(value)
