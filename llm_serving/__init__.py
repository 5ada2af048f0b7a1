"""llm-serving: the master process (HTTP, tokenizer, scheduler, engine). Never imports MindSpore.

``LLM`` (the offline API) is imported lazily, so ``import llm_serving.config.serving_config`` and the CLI stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM"]

if TYPE_CHECKING:
    from llm_serving.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llm_serving.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'llm_serving' has no attribute {name!r}")
