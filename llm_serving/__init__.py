"""llm-serving: the master process (HTTP, tokenizer, scheduler, engine). Never imports MindSpore nor ``agents``.

Sub-packages by concern, lowest first: ``protocol`` (shared with the agents), ``core`` (scheduler, block
manager, prefix cache), ``bench`` (a load test's workloads, results and metrics, shared with ``loadtest``),
``config``, ``tokenization``, ``models``, ``executor`` (the agent pool), ``engine``, ``api`` (HTTP),
``simulator``, ``router`` and ``cli``; each one's docstring says what it may import (docs/architecture.md,
"Packages").
``LLM`` (the offline API) is imported lazily, so ``import llm_serving.config`` and the CLI stay light.
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
