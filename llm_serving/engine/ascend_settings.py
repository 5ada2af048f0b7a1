"""What an Ascend config's agents are set up with: the stacks' environment (``llm_serving.protocol.ascend_env``), the
memory pool cap and the int8 KV direction, steered by the preflight verdict (``model_config.ascend_preflight``)
where one is named.

Why a verdict steers: which PagedAttention kernel computes right, and which way it applies an int8 cache's scale,
no source settles; the NPU's own preflight does. The verdict picks the first kernel selection that passed (the
stacks' ATB one first), the int8 direction that selection's kernel applied, and refuses what failed, naming it.
A key set in the config wins over the verdict (logged). Without a verdict: the table's defaults (ATB), and int8 KV
only with ``ascend_int8_kv_direction`` (``ModelSection`` refuses it otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.protocol.ascend_env import ascend_environment, max_device_memory
from llm_serving.protocol.preflight_verdict import (
    FEATURE_CHECKS,
    SELECTIONS,
    Selection,
    Verdict,
    VerdictError,
    read_verdict,
)

log = logging.getLogger(__name__)
KERNELS_KEY = "model_config.ascend_disable_custom_kernels"
VERDICT_KEY = "model_config.ascend_preflight"
DIRECTION_KEY = "model_config.ascend_int8_kv_direction"


@dataclass(frozen=True)
class AscendSettings:
    environment: dict[str, str]
    max_device_memory: str
    int8_kv_direction: str | None  # None unless kv_cache_dtype int8
    notes: tuple[str, ...] = ()  # where the verdict steered or was overridden (also logged)


def load_verdict(config: ServingConfig) -> Verdict | None:
    """The verdict ``model_config.ascend_preflight`` names (None: none named); a ``ConfigError`` naming the key and
    the file when it cannot be followed."""
    path = config.model_config.ascend_preflight
    if path is None:
        return None
    try:
        return read_verdict(path)
    except VerdictError as exc:
        raise ConfigError(f"{config.source}: {VERDICT_KEY}: {path}: {exc}", key=VERDICT_KEY,
                          source=config.source) from None


def selection_of(disable_custom_kernels: str) -> Selection | None:
    """The preflight selection that picks the same PagedAttention and FlashAttention kernels as this value."""
    probe = Selection("", disable_custom_kernels, "")
    return next((s for s in SELECTIONS if (s.paged_attention, s.flash_attention)
                 == (probe.paged_attention, probe.flash_attention)), None)


def failures(verdict: Verdict, name: str) -> str:
    """The failed checks of one selection, for an error message."""
    selection = verdict.selections.get(name)
    if selection is None:
        return f"{name}: not run"
    failed = [c["name"] for c in selection.get("checks", []) if not c.get("passed")]
    return f"{name}: " + (", ".join(failed[:4]) + (" ..." if len(failed) > 4 else "") if failed else "failed")


def check_features(config: ServingConfig, verdict: Verdict, chosen: Selection | None) -> None:
    """Refuse a feature the config uses whose own check failed under the selection served (``FEATURE_CHECKS``)."""
    checks = verdict.selections.get(chosen.name, {}).get("checks", []) if chosen else []
    m = config.model_config
    for check in checks:
        key = FEATURE_CHECKS.get(check["name"])
        if key == "model_config.quantization" and m.quantization != "none" and not check["passed"]:
            raise ConfigError(f"{config.source}: {key}: {m.quantization} on Ascend is refused: its kernel "
                              f"({check['name']}) failed its preflight under selection "
                              f"{chosen.name if chosen else ''} in {m.ascend_preflight} ({VERDICT_KEY}); serve "
                              "quantization none", key=key, source=config.source)


def chosen_selection(config: ServingConfig, verdict: Verdict, notes: list[str]) -> Selection | None:
    """The selection served: the kernel list the config sets (it wins, noted where it did not pass), else the
    verdict's first that passed; refused when none did. None: a list the preflight has no selection for."""
    m, path, passed = config.model_config, config.model_config.ascend_preflight, verdict.paged_attention
    explicit = m.ascend_disable_custom_kernels
    if explicit is not None:
        chosen = selection_of(explicit)
        if chosen is None or chosen.name not in passed:
            notes.append(f"{KERNELS_KEY} {explicit!r} wins over the preflight verdict {path}, where that "
                         f"selection did not pass ({failures(verdict, chosen.name) if chosen else 'not run'})")
        return chosen
    if not passed:
        raise ConfigError(
            f"{config.source}: {VERDICT_KEY}: {path}: no kernel selection passed its preflight ("
            f"{'; '.join(failures(verdict, s.name) for s in SELECTIONS)}): serving on Ascend is refused. Send the "
            f"failing lines of `llm-serving preflight`, or set {KERNELS_KEY} to serve on a selection anyway",
            key=VERDICT_KEY, source=config.source)
    chosen = next(s for s in SELECTIONS if s.name == passed[0])
    notes.append(f"kernel selection {chosen.name} (MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST="
                 f"{chosen.disable_custom_kernels!r}) from the preflight verdict {path}")
    return chosen


def int8_direction(config: ServingConfig, verdict: Verdict, chosen: Selection | None, notes: list[str]) -> str:
    """An int8 cache's antiquant direction: the config's (it wins, noted where the verdict differs), else the
    one the served selection's kernel applied; refused when it matched neither."""
    m, path = config.model_config, config.model_config.ascend_preflight
    found = verdict.selections.get(chosen.name, {}).get("int8_kv_direction") if chosen else None
    if m.ascend_int8_kv_direction is not None:
        if m.ascend_int8_kv_direction != found:
            notes.append(f"{DIRECTION_KEY} {m.ascend_int8_kv_direction} wins over the preflight verdict {path}, "
                         f"which found {found or 'neither direction'}")
        return m.ascend_int8_kv_direction
    if found is None:
        raise ConfigError(
            f"{config.source}: model_config.kv_cache_dtype: int8 on Ascend is refused: in the preflight verdict "
            f"{path} ({VERDICT_KEY}) the int8 PagedAttention of selection "
            f"{chosen.name if chosen else m.ascend_disable_custom_kernels!r} matched neither antiquant direction "
            f"(multiply, reciprocal); serve kv_cache_dtype auto, or set {DIRECTION_KEY} to override",
            key="model_config.kv_cache_dtype", source=config.source)
    notes.append(f"int8 KV direction {found} from the preflight verdict {path}")
    return str(found)


def ascend_settings(config: ServingConfig) -> AscendSettings | None:
    """The agents' device settings for an Ascend config (None on CPU: MindSpore's defaults)."""
    m = config.model_config
    if m.device_target != "Ascend":
        return None
    overrides = m.environment_overrides()
    verdict, notes = load_verdict(config), list[str]()
    direction = m.ascend_int8_kv_direction
    if verdict is not None:
        chosen = chosen_selection(config, verdict, notes)
        if chosen is not None and m.ascend_disable_custom_kernels is None:  # a key set is in overrides already
            overrides[KERNELS_KEY] = chosen.disable_custom_kernels
        check_features(config, verdict, chosen)
        if m.kv_cache_dtype == "int8":
            direction = int8_direction(config, verdict, chosen, notes)
    for note in notes:
        (log.warning if "wins over" in note else log.info)("%s", note)
    return AscendSettings(ascend_environment(config.num_agents, overrides),
                          max_device_memory(config.pa_config.utilization, m.max_device_memory),
                          direction if m.kv_cache_dtype == "int8" else None, tuple(notes))
