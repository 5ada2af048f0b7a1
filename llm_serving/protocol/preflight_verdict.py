"""The verdict file ``llm-serving preflight`` writes and the master follows (``model_config.ascend_preflight``):
what the NPU itself found in its first minutes, since no source settles it (docs/ascend.md). Which kernel
selection (``MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST``) computed every fused op, a layer and a model right, which
way PagedAttention applies an int8 cache's antiquant scale, and the first compile of each graph family.

Free of MindSpore: the preflight's children write their part of it (``agents.tools.preflight``), the master
reads and resolves it (``llm_serving.engine.wiring``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llm_serving.protocol.ascend_env import INT8_KV_DIRECTIONS, paged_attention_kernel
from llm_serving.protocol.model_config import LlamaConfig

__all__ = ["FEATURE_CHECKS", "SELECTIONS", "VERDICT_VERSION", "CheckResult", "Selection", "Verdict", "VerdictError",
           "preflight_llama", "read_verdict", "selection_passed"]

VERDICT_VERSION = 1
# checks of a feature a config may leave off: their failure refuses that feature, not the kernel selection
FEATURE_CHECKS = {"WeightQuantBatchMatmul": "model_config.quantization",
                  "MoE routed experts": "model_config.model_path",  # a mixture-of-experts model
                  "MoE routed experts, expert-parallel rank": "parallel.expert_parallel",
                  "MoE routed experts, int8": "model_config.quantization"}  # w8a16 on a MoE model


@dataclass(frozen=True)
class Selection:
    """One kernel selection: the value of ``MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST`` a process starts with (it
    must be set before MindSpore selects kernels, so each runs in a process of its own)."""

    name: str
    disable_custom_kernels: str
    source: str

    @property
    def paged_attention(self) -> str:
        """The PagedAttention kernel it selects: "atb" or "custom" (``ascend_env.paged_attention_kernel``)."""
        return paged_attention_kernel({"MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST": self.disable_custom_kernels})

    @property
    def flash_attention(self) -> str:
        """The FlashAttentionScore kernel: "custom", or "other" (the custom one disabled: MindSpore's other path)."""
        disabled = (name.strip() for name in self.disable_custom_kernels.split(","))
        return "other" if "FlashAttentionScore" in disabled else "custom"


# in the order the master prefers them when more than one passed: the stacks' first
SELECTIONS: tuple[Selection, ...] = (
    Selection("atb", "PagedAttention", "MindFormers 1.8 predict mode (build_context.py); the agents' default"),
    Selection("custom", "", "MindSpore 2.10's default: both custom kernels"),
    Selection("atb-fa-other", "FlashAttentionScore,PagedAttention", "vllm-mindspore (init_env)"),
)


def preflight_llama(layers: int) -> LlamaConfig:
    """The seeded random Llama the model checks serve (the master writes it, the children load it): GQA (two
    query heads per kv head), head_dim 64, a shape every Ascend kernel takes."""
    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@dataclass(frozen=True)
class CheckResult:
    """One check: passed, its largest error (None where it produced nothing to compare) and the tolerance."""

    name: str
    passed: bool
    max_error: float | None
    tolerance: str
    detail: str = ""

    def line(self, scope: str) -> str:
        """The line ``llm-serving preflight`` prints (docs/ascend.md explains each)."""
        error = "-" if self.max_error is None or math.isnan(self.max_error) else f"{self.max_error:.3g}"
        tail = f"  ({self.detail})" if self.detail else ""
        return (f"{'PASS' if self.passed else 'FAIL'}  {scope:<12} {self.name:<42} max error {error:<9} "
                f"tolerance {self.tolerance}{tail}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckResult:
        error = d.get("max_error")
        return cls(str(d["name"]), bool(d["passed"]), None if error is None else float(error),
                   str(d.get("tolerance", "")), str(d.get("detail", "")))


@dataclass
class Verdict:
    """The file's content. ``selections``: name -> {"disable_custom_kernels", "passed", "int8_kv_direction",
    "checks"}; ``paged_attention``: the names of the selections that passed, in ``SELECTIONS`` order;
    ``int8_kv_direction``: the one the first passing selection's PagedAttention applies (None: neither matched);
    ``compile_seconds``: graph family -> seconds of its first compile."""

    mindspore: str
    device: str
    date: str
    model_reference: str
    selections: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)  # not per selection (the graph compile times)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    version: int = VERDICT_VERSION

    @property
    def paged_attention(self) -> list[str]:
        return [s.name for s in SELECTIONS if self.selections.get(s.name, {}).get("passed")]

    @property
    def int8_kv_direction(self) -> str | None:
        passed = self.paged_attention
        return self.selections[passed[0]].get("int8_kv_direction") if passed else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paged_attention": self.paged_attention, "int8_kv_direction": self.int8_kv_direction}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def selection_passed(checks: list[CheckResult]) -> bool:
    """Whether a selection serves: every check passed but those of optional features (``FEATURE_CHECKS``)."""
    return all(c.passed for c in checks if c.name not in FEATURE_CHECKS)


class VerdictError(ValueError):
    """A verdict file that cannot be followed (missing, not JSON, another version, malformed)."""


def read_verdict(path: str | Path) -> Verdict:
    """The verdict at ``path``; ``VerdictError`` saying why it cannot be followed."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise VerdictError("no such file (write it with `llm-serving preflight --out FILE` on the NPU)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerdictError(f"not a preflight verdict (unreadable JSON: {exc})") from None
    if not isinstance(data, dict):
        raise VerdictError("not a preflight verdict (a JSON object expected)")
    if data.get("version") != VERDICT_VERSION:
        raise VerdictError(f"verdict version {data.get('version')!r}, this llm-serving reads version "
                           f"{VERDICT_VERSION}: run `llm-serving preflight` again")
    try:
        verdict = Verdict(mindspore=str(data["mindspore"]), device=str(data["device"]), date=str(data["date"]),
                          model_reference=str(data["model_reference"]), selections=dict(data["selections"]),
                          checks=list(data.get("checks", [])),
                          compile_seconds={str(k): float(v) for k, v in data.get("compile_seconds", {}).items()})
        for name, selection in verdict.selections.items():
            if name not in {s.name for s in SELECTIONS} or not isinstance(selection["passed"], bool):
                raise VerdictError(f"selection {name!r} is not one of {[s.name for s in SELECTIONS]} with a "
                                   "passed flag")
            direction = selection.get("int8_kv_direction")
            if direction is not None and direction not in INT8_KV_DIRECTIONS:
                raise VerdictError(f"selection {name}: int8_kv_direction {direction!r} is not one of "
                                   f"{', '.join(INT8_KV_DIRECTIONS)}")
            for check in selection.get("checks", []):
                CheckResult.from_dict(check)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, VerdictError):
            raise
        raise VerdictError(f"malformed verdict ({type(exc).__name__}: {exc})") from None
    return verdict
