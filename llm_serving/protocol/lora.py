"""A PEFT LoRA adapter as served: which projections of which layers it changes, with what rank and scale, read from
its ``adapter_config.json``. Every key that changes the maths is implemented or refused by name; the master refuses
an adapter with this before any agent sees it, and the agents lay its weights out with it
(``agents.weights.lora_weights``). No MindSpore here.

A LoRA on a linear layer ``y = x W^T`` serves ``y = x W^T + scaling * (x A^T) B^T`` with ``A`` ``[r, in]`` and ``B``
``[out, r]``; ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Which modules it
covers follows PEFT's own matching (``peft.tuners.tuners_utils.check_target_module_exists``, read for 0.21):
``target_modules`` a regular expression matched against the whole module name, or names that end a module name
(``"all-linear"``: every linear layer but the output head), ``exclude_modules`` first, ``layers_to_transform`` /
``layers_pattern`` restricting a list to some layers; ``rank_pattern`` / ``alpha_pattern`` give a module its own rank
or alpha (the first key that ends its name, ``peft.utils.other.get_pattern_key``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# a decoder layer's linear modules (HF names) -> (our fused projection, which of its parts); order = fused row order
TARGETS = {"q_proj": ("w_qkv", 0), "k_proj": ("w_qkv", 1), "v_proj": ("w_qkv", 2), "o_proj": ("wo", 0),
           "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0)}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# modules of a Llama-family model that are not decoder-layer projections: a LoRA on them is refused
_OTHER_MODULES = ("model.embed_tokens", "lm_head", "model.norm")
_LAYER_OTHER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
# keys that do not change a served adapter's maths: training (dropout), initialisation (the weights are loaded),
# bookkeeping; and keys whose values are implemented below
_NO_EFFECT = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
              "lora_dropout", "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
              "runtime_config", "peft_version", "megatron_core", "qalora_group_size", "ensure_weight_tying"}
_IMPLEMENTED = {"r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "layers_to_transform",
                "layers_pattern", "rank_pattern", "alpha_pattern"}
# keys that change the maths in ways the graphs do not serve: refused when set to anything but their default
_REFUSED = {"use_dora": "DoRA (a magnitude vector rescaling each output column) is not served",
            "modules_to_save": "whole trained copies of modules are not served, only low-rank updates",
            "bias": "trained biases are not served (only bias 'none')",
            "lora_bias": "a bias on lora_B is not served",
            "fan_in_fan_out": "transposed (Conv1D) weights are not served",
            "target_parameters": "LoRA on parameters (not modules) is not served",
            "trainable_token_indices": "trained token embeddings are not served",
            "layer_replication": "replicated layers are not served",
            "megatron_config": "Megatron layers are not served",
            "alora_invocation_tokens": "activated LoRA (aLoRA) is not served", "use_qalora": "QALoRA is not served",
            "arrow_config": "Arrow routing is not served", "velora_config": "VeLoRA is not served",
            "monteclora_config": "MonteCLoRA is not served", "use_bdlora": "block-diagonal LoRA is not served",
            "kasa_config": "KaSA is not served"}
_DEFAULTS = {"bias": "none"}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file and the key."""


@dataclass(frozen=True)
class LoraModule:
    """One LoRA-adapted projection: its layer, HF module name (``q_proj``...), rank and scale."""

    layer: int
    target: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class LoraConfig:
    """An adapter's modules (in layer, then ``TARGETS`` order) and the largest rank among them."""

    modules: tuple[LoraModule, ...]
    base_model: str | None = None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], num_layers: int, source: str = ADAPTER_CONFIG) -> LoraConfig:
        """The served adapter ``raw`` (an ``adapter_config.json``) describes for a model of ``num_layers``."""
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{source}: peft_type {raw.get('peft_type')!r}: only LORA adapters are served")
        for key, value in raw.items():
            if key in _REFUSED and value not in (None, False, [], {}, "", _DEFAULTS.get(key)):
                raise AdapterError(f"{source}: {key} {value!r}: {_REFUSED[key]}")
            if key not in _REFUSED and key not in _NO_EFFECT and key not in _IMPLEMENTED \
                    and value not in (None, False, [], {}, ""):
                raise AdapterError(f"{source}: unknown key {key!r} (set to {value!r}): it may change the maths, so "
                                   "the adapter is not served")
        rank, alpha = _positive(raw, "r", 8, source), raw.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise AdapterError(f"{source}: lora_alpha must be a number, got {alpha!r}")
        rslora = raw.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise AdapterError(f"{source}: use_rslora must be true or false, got {rslora!r}")
        ranks, alphas = _pattern(raw, "rank_pattern", source), _pattern(raw, "alpha_pattern", source)
        matcher = _Matcher(raw, source)
        modules = []
        for layer in range(num_layers):
            for target in TARGETS:
                name = module_name(layer, target)
                if matcher.matches(name):
                    r, a = int(_pattern_value(ranks, name, rank)), _pattern_value(alphas, name, alpha)
                    if r < 1:
                        raise AdapterError(f"{source}: rank_pattern gives {name} rank {r}; ranks are >= 1")
                    modules.append(LoraModule(layer, target, r, a / math.sqrt(r) if rslora else a / r))
        others = [n for n in _other_names(num_layers) if matcher.matches(n)]
        if others:
            raise AdapterError(f"{source}: target_modules {raw.get('target_modules')!r} adapts {others[0]}: only the "
                               f"decoder layers' projections ({', '.join(TARGETS)}) are served")
        if not modules:
            raise AdapterError(f"{source}: target_modules {raw.get('target_modules')!r} adapts none of this model's "
                               f"projections ({', '.join(TARGETS)})")
        base = raw.get("base_model_name_or_path")
        return cls(tuple(modules), base if isinstance(base, str) else None)

    @classmethod
    def from_dir(cls, adapter_dir: str | Path, num_layers: int) -> LoraConfig:
        path = Path(adapter_dir) / ADAPTER_CONFIG
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise AdapterError(f"{adapter_dir}: no {ADAPTER_CONFIG} (a PEFT LoRA adapter directory has it)") from None
        except (OSError, ValueError) as exc:
            raise AdapterError(f"{path}: not readable JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise AdapterError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, num_layers, str(path))


def module_name(layer: int, target: str) -> str:
    """The HF module name of ``target`` (``q_proj``...) in decoder layer ``layer``, as PEFT matches it."""
    return f"model.layers.{layer}.{_BLOCK[target]}.{target}"


def _other_names(num_layers: int) -> list[str]:
    return [*_OTHER_MODULES, *(f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_OTHER)]


def _positive(raw: Mapping[str, Any], key: str, default: int, source: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{source}: {key} must be an integer >= 1, got {value!r}")
    return value


def _pattern(raw: Mapping[str, Any], key: str, source: str) -> dict[str, float]:
    value = raw.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in value.values()):
        raise AdapterError(f"{source}: {key} must map module names to numbers, got {value!r}")
    return value


def _pattern_value(patterns: Mapping[str, float], name: str, default: float) -> float:
    """The value of the first pattern that ends ``name`` (PEFT's ``get_pattern_key``), else ``default``."""
    return next((float(v) for key, v in patterns.items() if re.match(rf"(.*\.)?({key})$", name)), float(default))


class _Matcher:
    """PEFT's rule for whether a module is adapted (see the module docstring)."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        targets = raw.get("target_modules")
        if isinstance(targets, str) and raw.get("layers_to_transform") is not None:
            raise AdapterError(f"{source}: layers_to_transform with a regular expression target_modules "
                               f"({targets!r}): PEFT refuses the pair, the expression names the layers itself")
        if not (isinstance(targets, str) or _str_list(targets)):
            raise AdapterError(f"{source}: target_modules must be a regular expression or a list of module names, "
                               f"got {targets!r}")
        self.targets: str | list[str] = list(TARGETS) if targets == "all-linear" else targets
        self.exclude: str | list[str] | None = raw.get("exclude_modules")
        if self.exclude is not None and not (isinstance(self.exclude, str) or _str_list(self.exclude)):
            raise AdapterError(f"{source}: exclude_modules must be a regular expression or a list, "
                               f"got {self.exclude!r}")
        layers = raw.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
            raise AdapterError(f"{source}: layers_to_transform must be an integer or a list of them, got {layers!r}")
        self.layers = layers or None
        pattern = raw.get("layers_pattern")
        self.layer_patterns = [pattern] if isinstance(pattern, str) and pattern else (pattern or None)
        for text in ([self.targets] if isinstance(self.targets, str) else []) + (
                [self.exclude] if isinstance(self.exclude, str) else []):
            try:
                re.compile(text)
            except re.error as exc:
                raise AdapterError(f"{source}: {text!r} is not a regular expression: {exc}") from None

    def matches(self, name: str) -> bool:
        if self.exclude and (re.fullmatch(self.exclude, name) if isinstance(self.exclude, str)
                             else _ends(name, self.exclude)):
            return False
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, name) is not None
        if not _ends(name, self.targets):
            return False
        if self.layers is None:
            return True
        if self.layer_patterns is None:
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            found = next((m for p in self.layer_patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name))),
                         None)
        return found is not None and int(found["idx"]) in self.layers


def _ends(name: str, keys: list[str]) -> bool:
    return name in keys or any(name.endswith("." + key) for key in keys)


def _str_list(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
