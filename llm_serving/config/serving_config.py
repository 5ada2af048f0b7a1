"""The launch configuration: an llm-serving-compatible YAML file, validated into frozen dataclasses.

Contest users bring MindSpore llm-serving YAML files, so its sections and keys are kept (``model_config``,
``serving_config``, ``pa_config``, ``tokenizer``); llm-serving keys that have no meaning here are accepted,
type-checked and ignored with a note in ``ServingConfig.notes``. Our own sections are ``scheduler`` and
``default_model``. Every mistake is a ``ConfigError`` naming the file, the key and what was expected, so a bad
file fails at start-up rather than deep inside an agent. See ``configs/example.yaml`` for every key. Each
section (``llm_serving.config.sections``) checks its own keys in its ``validate``; ``_validate`` here holds only
the checks that relate keys of several sections.

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
    SECTIONS,
    DefaultModelSection,
    LoraSection,
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
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import blocks_needed

__all__ = ["ConfigError", "ServingConfig"]

_CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors", ".bin")


@dataclass(frozen=True)
class ServingConfig:
    """The whole launch configuration; construction validates it: each section its own keys (its ``validate``),
    then the checks across sections (``_validate``)."""

    model_config: ModelSection = field(default_factory=ModelSection)
    serving_config: ServingSection = field(default_factory=ServingSection)
    pa_config: PagedAttentionSection = field(default_factory=PagedAttentionSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    default_model: DefaultModelSection = field(default_factory=DefaultModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    source: str = field(default="<defaults>", compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)  # ignored compatibility keys, for the log

    def __post_init__(self) -> None:
        for name in SECTIONS:
            getattr(self, name).validate(self.source)
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
        batch x longest bucket, max_model_len), and with chunked prefill at least the largest decode batch (a step
        carries every running sequence's decode token: the check an explicit value gets at load)."""
        explicit = self.scheduler.max_num_batched_tokens
        if explicit is not None:
            return explicit
        m = self.model_config
        derived = max(m.prefill_batch_size[-1] * m.seq_length[-1], self.max_model_len)
        return max(derived, m.decode_batch_size[-1]) if self.chunked_prefill else derived

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
    """The checks that relate keys of several sections; each section has checked its own keys (``validate``)
    before. Each check spans sections because of what it reads:

    - backend mindformers (model_config) runs one agent (serving_config; so no ranks on other hosts either) with a
      cache of a set size (pa_config);
    - standby_agents (serving_config) holds a second copy of the agents' memory: host memory only (model_config);
    - kv_transfer (serving_config) copies host memory and prefix-cache blocks: CPU agents of our Llama
      (model_config), prefix caching on (scheduler, whose default follows model_config), no draft's or early exit's
      cache (speculative, model_config);
    - the longest prefill bucket (model_config) within a sequence's length (pa_config);
    - speculative decoding (speculative) excludes multi-step and steps sent ahead (scheduler), and needs queries over
      cached context (model_config's device and backend), as do chunked prefill and prefix caching (scheduler);
    - the step's token budget (scheduler) holds a whole sequence without chunked prefill (pa_config) or every
      running sequence's decode token with it (model_config's largest decode batch);
    - the default model's LlamaConfig (default_model) is checked at the served length (pa_config);
    - adapters (lora) run in our Llama graphs (not backend mindformers), in model and mixed steps (not speculative
      verify steps), under names the base model does not answer to (model_config, serving_config)."""
    src, m, s, pa = cfg.source, cfg.model_config, cfg.serving_config, cfg.pa_config
    sc, sp = cfg.scheduler, cfg.speculative

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise bad_value(src, key, msg)

    if cfg.uses_mindformers:
        need(s.effective_num_agents == 1, "serving_config.num_agents",
             f"backend mindformers runs one agent (no tensor parallelism through it), got {s.effective_num_agents}")
        need(not pa.auto_blocks, "pa_config.num_blocks",
             "auto is not served by backend mindformers (MindFormers sizes its own cache): set a number")
    need(not s.standby_agents or m.device_target == "CPU", "serving_config.standby_agents",
         "a standby pool would hold a second copy of the model and KV cache in each NPU's memory (each agent "
         "reserves model_config.max_device_memory): CPU agents only")
    if s.kv_transfer:
        need(m.device_target == "CPU" and not cfg.uses_mindformers, "serving_config.kv_transfer",
             "KV blocks are copied on the host, where the cache is host memory: the CPU agents of our Llama only "
             "(Ascend would need gather/scatter graphs, docs/deployment.md)")
        need(cfg.prefix_caching, "serving_config.kv_transfer",
             "blocks move as prefix-cache blocks: leave scheduler.enable_prefix_caching on")
        need(not sp.method and m.early_exit_layer is None, "serving_config.kv_transfer",
             "a draft model's or an early exit's cache is not transferred: not with speculative.method or "
             "model_config.early_exit_layer")
    need(m.seq_length[-1] <= pa.decode_seq_length, "model_config.seq_length",
         f"longest prefill bucket {m.seq_length[-1]} exceeds pa_config.decode_seq_length {pa.decode_seq_length}")

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

    if cfg.lora.enable:
        need(not cfg.uses_mindformers, "lora.enable", "backend mindformers runs MindFormers' Llama, which has no "
             "adapter slots: adapters are served by our Llama graphs")
        need(not sp.method, "lora.enable", "speculative decoding's verify steps do not carry adapters: choose one")
        for name in cfg.lora.adapters:
            need(name not in cfg.model_names, f"lora.modules.{name}",
                 "is a name the base model answers to (model_config.model_name, serving_config.model_aliases)")

    try:
        cfg.default_model.llama_config(pa.decode_seq_length)  # its own checks
    except ModelConfigError as exc:
        raise bad_value(src, "default_model", str(exc)) from None


def _as_list(value: int | list[int] | tuple[int, ...] | None) -> list[int] | None:
    if value is None:
        return None
    return [value] if isinstance(value, int) else list(value)
