"""PEFT adapter directories for the master's adapter tests: ``adapter_config.json`` as PEFT writes it and a
placeholder weights file (the stand-in agents read only the configuration; the real layout is the agent side's,
``tests/test_lora_adapters.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def adapter_dir(root: Path, name: str, rank: int, **extra: Any) -> Path:
    """``root/name``: a LoRA adapter of ``rank`` on q_proj and v_proj, with ``extra`` config keys."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
              "bias": "none", "task_type": "CAUSAL_LM", **extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path
