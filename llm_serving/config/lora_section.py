"""The ``lora`` section: LoRA adapters served per request (``llm_serving.core.adapters``), chosen by the request's
``model``. The agents hold ``max_loras`` adapter slots of rank up to ``max_lora_rank`` in device memory
(``protocol.lora_budget`` counts them against the KV cache); ``modules`` are the adapters served from the start,
``allow_runtime_updates`` opens ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (off by default, as vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: loading reads any directory the server can see). Kept free of MindSpore."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llm_serving.config.yaml_sections import bad_value, need, setting
from llm_serving.core.adapters import ADAPTER_NAME

MAX_LORA_RANK = 512  # vLLM's largest supported rank; our slots are sized by it, so a bound keeps them sane
MAX_LORAS = 64  # slots in device memory (each step's rows index them)


def split_module(item: str) -> tuple[str, str]:
    """``NAME=DIR`` -> (name, dir); ValueError when there is no ``=``."""
    name, sep, path = item.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=DIR, got {item!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class LoraSection:
    """``lora``: adapters per request; off unless ``enable``."""

    enable: bool = setting(False, "bool")
    max_loras: int = setting(1, "int")  # adapter slots: the most distinct adapters one step computes
    max_lora_rank: int = setting(16, "int")  # the largest rank (per projection) a slot holds
    # NAME=DIR each (a YAML mapping NAME: DIR is read as the same); DIR a PEFT adapter directory
    modules: tuple[str, ...] = setting((), "named_paths")
    allow_runtime_updates: bool = setting(False, "bool")  # the load/unload routes

    @property
    def adapters(self) -> dict[str, str]:
        """Name -> directory of ``modules``, in their order."""
        return dict(split_module(item) for item in self.modules)

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        need(1 <= self.max_loras <= MAX_LORAS, source, "lora.max_loras",
             f"must be in 1..{MAX_LORAS}, got {self.max_loras}")
        need(1 <= self.max_lora_rank <= MAX_LORA_RANK, source, "lora.max_lora_rank",
             f"must be in 1..{MAX_LORA_RANK}, got {self.max_lora_rank}")
        for key in ("modules", "allow_runtime_updates"):
            need(self.enable or not getattr(self, key), source, f"lora.{key}",
                 "adapters are served only with lora.enable: true (--enable-lora)")
        seen: set[str] = set()
        for item in self.modules:
            try:
                name, path = split_module(item)
            except ValueError as exc:
                raise bad_value(source, "lora.modules", str(exc)) from None
            need(ADAPTER_NAME.fullmatch(name) is not None, source, f"lora.modules.{name}",
                 "an adapter name is 1-128 letters, digits and ._:/@+- (it is a model id in the API)")
            need(name not in seen, source, f"lora.modules.{name}", "named twice")
            seen.add(name)
            need(os.path.isdir(path), source, f"lora.modules.{name}", f"{path} is not a directory")
