"""Choose a launch configuration for a workload: coordinate descent over the scheduling keys, each candidate
simulated (``run.simulate``) with the same cost model and requests.

From the given config, each round tries every value of one key at a time (the largest decode batch, the
largest prefill batch, the chunk budget, chunked prefill on or off, the admission policy, and the KV block count
where the config fixes it), keeps the best candidate that meets the latency constraints, and stops when a round
changes nothing. The objective is the contest's: total time. A fitted cost model extrapolates past the batch
sizes its profile measured; such candidates are marked.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.simulator.run import simulate
from llm_serving.simulator.target import Target
from llm_serving.simulator.workload import SimRequest, clip_to_context

DECODE_BATCHES = (8, 16, 32, 64, 128, 256)
PREFILL_BATCHES = (1, 2, 4, 8, 16)
CHUNK_BUDGETS = (256, 512, 1024, 2048, 4096)
MAX_ROUNDS = 4
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


class TuneError(ValueError):
    """A constraint or search that cannot be run (the message says which)."""


@dataclass(frozen=True)
class Constraint:
    metric: str
    op: str
    bound: float

    @classmethod
    def parse(cls, text: str, known: set[str]) -> Constraint:
        m = re.fullmatch(r"\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([0-9.eE+-]+)\s*", text)
        if not m:
            raise TuneError(f"constraint {text!r}: expected METRIC<=VALUE, e.g. p90_ttft_ms<=2000")
        if m.group(1) not in known:
            raise TuneError(f"constraint {text!r}: unknown metric {m.group(1)!r}; known: {', '.join(sorted(known))}")
        return cls(m.group(1), m.group(2), float(m.group(3)))

    def holds(self, metrics: dict) -> bool:
        value = metrics.get(self.metric)
        return value is not None and _OPS[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"


@dataclass
class Trial:
    values: dict[str, Any]  # dotted config keys changed from the base config
    metrics: dict
    feasible: bool
    extrapolated: bool = False

    @property
    def total_s(self) -> float:
        return self.metrics["total_time_s"]


@dataclass
class TuneResult:
    base: Trial
    best: Trial
    trials: list[Trial] = field(default_factory=list)


def candidate_values(config: ServingConfig) -> dict[str, list[Any]]:
    """The values tried per key (the base config's own value among them)."""
    m = config.model_config
    space: dict[str, list[Any]] = {
        "model_config.decode_batch_size": sorted({*DECODE_BATCHES, m.decode_batch_size[-1]}),
        "model_config.prefill_batch_size": sorted({*PREFILL_BATCHES, m.prefill_batch_size[-1]}),
        "scheduler.enable_chunked_prefill": [True, False],
        "scheduler.policy": ["fcfs", "longest_output_first"],
    }
    if config.chunked_prefill:
        space["scheduler.max_num_batched_tokens"] = sorted({*CHUNK_BUDGETS, config.max_num_batched_tokens})
    n = config.pa_config.fixed_blocks
    if n is not None:
        space["pa_config.num_blocks"] = sorted({max(n // 2, 2), n, n * 2})
    return space


def _config_with(base: ServingConfig, values: dict[str, Any]) -> ServingConfig:
    """``base`` with ``values``; a largest batch ``b`` becomes the bucket list of the base's buckets below it + b."""
    concrete = {}
    for key, value in values.items():
        if key in ("model_config.decode_batch_size", "model_config.prefill_batch_size"):
            section, name = key.split(".")
            buckets = getattr(getattr(base, section), name)
            value = sorted({b for b in buckets if b < value} | {value})
        concrete[key] = value
    if values.get("scheduler.enable_chunked_prefill") is False:  # without chunks a step's budget is a whole prompt
        concrete["scheduler.max_num_batched_tokens"] = None
    return base.with_values(concrete)


def tune(base: ServingConfig, target_for: Callable[[ServingConfig], Target], requests: list[SimRequest],
         constraints: list[Constraint], max_concurrency: int | None = None, measured_batch: int | None = None,
         progress: Callable[[str], None] | None = None) -> TuneResult:
    """Coordinate descent from ``base`` (see the module docstring). ``target_for`` builds a candidate's target
    (its scheduler config and cost model); ``measured_batch``: the largest batch the cost model's profile ran."""
    cache: dict[tuple, Trial] = {}

    def trial(values: dict[str, Any]) -> Trial | None:
        key = tuple(sorted(values.items(), key=lambda kv: kv[0]))
        if key in cache:
            return cache[key]
        try:
            config = _config_with(base, values)
        except ConfigError:
            return None  # a combination the config refuses (e.g. a chunk budget below the decode batch)
        return measure(key, values, config)

    def measure(key: tuple, values: dict[str, Any], config: ServingConfig) -> Trial:
        target = target_for(config)
        run = simulate(target.scheduler, clip_to_context(requests, target.scheduler.max_model_len), target.cost,
                       target.request_overhead_s, max_concurrency)
        metrics = run.metrics
        t = Trial(dict(values), metrics, all(c.holds(metrics) for c in constraints),
                  measured_batch is not None and config.model_config.decode_batch_size[-1] > measured_batch)
        cache[key] = t
        if progress:
            progress(f"{_describe(values) or 'base config'}: {metrics['total_time_s']:.2f} s"
                     f"{'' if t.feasible else ' (breaks a constraint)'}")
        return t

    base_trial = measure((), {}, base)  # the base config as loaded (never refused as a candidate could be)
    best = base_trial
    space = candidate_values(base)
    for _ in range(MAX_ROUNDS):
        improved = False
        for key, options in space.items():
            for option in options:
                t = trial({**best.values, key: option})
                if t is not None and _better(t, best):
                    best, improved = t, True
        if not improved:
            break
    best.values = _changed(base, best.values)
    return TuneResult(base_trial, best, list(cache.values()))


def _changed(base: ServingConfig, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` less the keys whose value the base config has already."""
    before = base.to_dict()
    out = {}
    for key, value in values.items():
        section, name = key.split(".")
        if _config_with(base, {key: value}).to_dict()[section][name] != before[section][name]:
            out[key] = value
    return out


def _better(a: Trial, b: Trial) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    return a.total_s < b.total_s * 0.999  # ties keep the earlier (fewer changes)


def _describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in values.items())


def tuned_yaml(base: ServingConfig, raw: dict | None, best: Trial) -> dict:
    """The YAML of the choice: ``raw`` (the base config file's own mapping, or None for the built-in defaults) with
    the changed keys set to the tuned config's values."""
    tuned = _config_with(base, best.values).to_dict()
    if raw is None:
        return tuned
    out = {section: dict(body or {}) for section, body in raw.items()}
    changed = set(best.values) | ({"scheduler.max_num_batched_tokens"}
                                  if best.values.get("scheduler.enable_chunked_prefill") is False else set())
    for key in changed:
        section, name = key.split(".")
        out.setdefault(section, {})[name] = tuned[section][name]
    return out
