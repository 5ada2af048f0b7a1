"""Where llm-serving keeps what it builds and caches, master and agents alike: ``$LLM_SERVING_CACHE_DIR``, by
default ``~/.cache/llm-serving`` (the test suite points it at a temporary directory, so tests never touch a user's
cache: compiled graphs, embedded models, kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LLM_SERVING_CACHE_DIR") or Path.home() / ".cache" / "llm-serving")
