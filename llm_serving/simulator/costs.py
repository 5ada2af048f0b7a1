"""Step-time models: how long the engine takes for one step of a given shape (``core.step_shape.StepShape``).

Two kinds, one interface (``seconds(shape)``):

- ``FittedCost``: a linear model fitted to steps measured on this machine (``llm-serving profile``), each row
  weighted by 1/measured time so short decode steps count as much as long prefills. Non-negative least squares
  (scipy's ``nnls``) keeps every term a cost, so the model never predicts a step cheaper for more work.
- ``DeviceCost``: analytic, for hardware we cannot measure: a step reads the rank's weights (of a MoE model: the
  experts its tokens touch, not all it holds) and the KV it
  attends to (memory bound) and multiplies its tokens by them (compute bound), whichever is slower, plus a fixed
  per-step host and launch time and, with tensor parallelism, two all-reduces per layer. The device numbers are
  published peaks scaled by efficiencies (``DeviceProfile``); every one is a documented, overridable assumption.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Protocol

import numpy as np
from scipy.optimize import nnls

from llm_serving.core.step_shape import StepShape, step_rows, steps_from_rows
from llm_serving.protocol.lora_budget import lora_slot_values
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_shards

FEATURES = ("call", "step", "token", "seq", "context", "prefill call", "prefill seq", "pair")
# the terms of steps with LoRA adapter rows (``features``' ``adapters``), after the buckets'
ADAPTER_FEATURES = ("adapter step", "adapter slot", "adapter token")
REFITS = 4  # reweighting rounds of the fit (see FittedCost.fit)


class CostModelError(ValueError):
    """A cost model that cannot be built or read (the message says which file or parameter)."""


class StepCost(Protocol):
    def seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


def features(shape: StepShape, buckets: tuple[int, ...] = (), adapters: bool = False) -> np.ndarray:
    """The linear model's terms: a round trip's fixed cost, then per decode step run in it its fixed cost, its
    tokens, sequences and cached positions read; a step with prompt tokens pays a fixed cost (another graph) and a
    cost per prompt it starts or continues, and its query x key pairs. With the served decode ``buckets``, also a
    fixed cost per step for the bucket its sequences pad to (the agents run the graph of that batch size), and a
    cost per cached position read in that bucket's graph from a KV block no other sequence of the step reads: one
    slope for every batch size let the many small decode steps of a profile set it, which overstated large batches
    over long contexts by up to 39%, and positions read from a block another sequence reads too (a shared prefix)
    cost only the first, global slope (docs/simulator.md). With ``adapters`` (a profile that ran LoRA adapters), a
    step with adapter rows pays a fixed cost (the update's extra ops: a masked low-rank update is three ops per
    projection whatever the mix, docs/model.md "Adapters"), one per distinct adapter (its A and B read), and one per
    token through them."""
    k = shape.num_steps
    padded = next((b for b in buckets if b >= shape.num_seqs), buckets[-1] if buckets else 0)
    distinct = shape.context_tokens - shape.shared_context_tokens
    return np.array([1.0, k, k * shape.num_tokens, k * shape.num_seqs, k * shape.context_tokens,
                     float(shape.prefill_seqs > 0), shape.prefill_seqs, shape.attention_pairs,
                     *(k * float(b == padded) for b in buckets),
                     *(k * distinct * float(b == padded) for b in buckets),
                     *((k * float(shape.adapter_slots > 0), k * shape.adapter_slots, k * shape.adapter_tokens)
                       if adapters else ())], dtype=np.float64)


@dataclass(frozen=True)
class FittedCost:
    coefficients: tuple[float, ...]  # seconds per unit of each FEATURES term, then of each bucket's two (features)
    source: str = ""  # what it was fitted on (the profile's description)
    buckets: tuple[int, ...] = ()  # the profiled config's decode batch buckets (``features``)
    adapters: bool = False  # the profile ran steps with LoRA adapter rows: the adapter terms were fitted

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]], source: str = "",
            buckets: Sequence[int] = ()) -> FittedCost:
        buckets = tuple(sorted(buckets))
        adapters = any(s.adapter_tokens for s, _ in samples)  # else their columns are zero: nothing to fit
        terms = len(FEATURES) + 2 * len(buckets) + len(ADAPTER_FEATURES) * adapters
        if len(samples) < terms:
            raise CostModelError(f"fitting a step-time model needs at least {terms} measured steps, got "
                                 f"{len(samples)}")
        x = np.stack([features(s, buckets, adapters) for s, _ in samples])
        t = np.array([max(sec, 1e-6) for _, sec in samples])
        # errors relative to each step's time, so short steps weigh as much as long ones; then relative to the fitted
        # time instead, so that the fit is the mean of noisy repeats of a shape (not their harmonic mean)
        scale = t
        for _ in range(REFITS):
            coef, _ = nnls(x / scale[:, None], t / scale)
            scale = np.maximum(x @ coef, 1e-6)
        return cls(tuple(float(c) for c in coef), source, buckets, adapters)

    def seconds(self, shape: StepShape) -> float:
        """A profile without adapter steps prices an adapter step as the base model's (``describe`` says so)."""
        return float(features(shape, self.buckets, self.adapters) @ np.asarray(self.coefficients))

    def describe(self) -> str:
        names = (*FEATURES, *(f"bucket {b}" for b in self.buckets),
                 *(f"bucket {b} unshared context" for b in self.buckets), *(ADAPTER_FEATURES if self.adapters else ()))
        terms = ", ".join(f"{name} {c * 1e6:.3g} us" for name, c in zip(names, self.coefficients))
        unknown = "" if self.adapters else " (no adapter steps profiled: LoRA rows cost as base rows)"
        return f"fitted ({self.source}): {terms}{unknown}"

    def relative_errors(self, samples: Iterable[tuple[StepShape, float]]) -> np.ndarray:
        return np.array([self.seconds(s) / sec - 1.0 for s, sec in samples if sec > 0])


@dataclass(frozen=True)
class DeviceProfile:
    """A device as the analytic model sees it. Defaults are an Ascend 910B (64 GB HBM2e, as in Atlas 800T A2)."""

    name: str = "ascend-910b"
    peak_tflops: float = 320.0  # dense float16 matmul peak, as published (~313-320 TFLOPS by SKU)
    memory_bandwidth_gbs: float = 1600.0  # HBM bandwidth as published (~1.6 TB/s)
    memory_gib: float = 64.0
    compute_efficiency: float = 0.5  # share of the peak a prefill's matmuls reach
    memory_efficiency: float = 0.6  # share of the bandwidth decode's weight and KV reads reach
    step_overhead_s: float = 0.004  # per step: host scheduling, graph launch, sampling, copies
    seq_overhead_s: float = 0.00002  # per sequence of a step: its input and output rows on the host
    interconnect_gbs: float = 56.0  # HCCS per link between two NPUs (all-reduce over tensor-parallel ranks)
    allreduce_latency_s: float = 0.00002  # fixed cost of one all-reduce

    def with_values(self, overrides: dict[str, str]) -> DeviceProfile:
        """A copy with ``--device-param`` overrides (strings, as typed) applied; a bad key or value names itself."""
        known = {f.name for f in fields(self)}
        name, values = self.name, {}
        for key, raw in overrides.items():
            if key not in known:
                raise CostModelError(f"device parameter {key!r} is not one of {sorted(known)}")
            if key == "name":
                name = raw
                continue
            try:
                value = float(raw)
            except ValueError:
                raise CostModelError(f"device parameter {key}: {raw!r} is not a number") from None
            if not value >= 0:
                raise CostModelError(f"device parameter {key}: must be >= 0, got {raw}")
            values[key] = value
        return replace(self, name=name, **values)


DEVICES = {"ascend-910b": DeviceProfile()}


@dataclass(frozen=True)
class DeviceCost:
    device: DeviceProfile
    model: LlamaConfig
    tensor_parallel: int = 1
    dtype_bytes: int = 2  # float16 / bfloat16 weights and KV
    int8_projections: bool = False  # model_config.quantization w8a16: a byte a weight, a scale a row
    max_lora_rank: int = 16  # the adapter slots' rank (lora.max_lora_rank): what one adapter's A and B hold

    @property
    def weight_bytes_per_rank(self) -> float:
        """The weights a rank holds (every expert of a MoE model: its memory, ``kv_blocks``)."""
        moe = self.model.moe
        return self._weight_bytes(moe.num_experts if moe is not None else None)

    def weight_bytes_read(self, tokens: int) -> float:
        """The weights a rank reads in a step of ``tokens`` tokens: a MoE layer's router and shared expert, and the
        experts its tokens touch, ``E (1 - (1 - k/E)^tokens)`` of them as expected under balanced routing (each
        token's k picks uniform); under expert parallelism a rank holds E/N experts whole, under tensor parallelism
        1/N of each, so either way a rank reads 1/N of the touched experts' bytes."""
        moe = self.model.moe
        if moe is None:
            return self.weight_bytes_per_rank
        touched = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** max(tokens, 1))
        return self._weight_bytes(touched)

    def _weight_bytes(self, experts: float | None) -> float:
        """A rank's bytes of the projections, with ``experts`` routed experts' per sparse layer. w8a16 holds the
        dense projections, the routed experts and the shared expert as a byte a weight and a scale a row (an
        expert's rows: ``2f`` of gate/up, ``h`` of down); the router and the shared expert's gate stay float."""
        m, h = self.model, self.model.hidden_size
        weight = 1 if self.int8_projections else self.dtype_bytes
        total = 0.0
        for layer in range(m.num_hidden_layers):
            sparse = m.moe is not None and layer in m.moe.sparse_layers
            rows = m.qkv_dim + m.q_dim + (0 if sparse else m.mlp_rows(layer))  # output rows of the projections
            total += h * rows * weight + (rows * self.dtype_bytes if self.int8_projections else 0)
            if sparse and m.moe is not None:
                picked, f, s = (m.moe.top_k if experts is None else experts, m.moe.moe_intermediate_size,
                                m.moe.shared_expert_intermediate_size)
                int8_rows = 3 * (picked * f + s)  # the routed and shared experts' rows of h weights
                total += h * (m.mlp_rows(layer, experts) - int8_rows) * self.dtype_bytes + h * int8_rows * weight
                if self.int8_projections:
                    total += (picked * (2 * f + h) + (2 * s + h if s else 0)) * self.dtype_bytes
        embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) * self.dtype_bytes
        return (total + embeddings) / self.tensor_parallel

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        m, tp = self.model, self.tensor_parallel
        heads = m.num_key_value_heads // kv_shards(m, tp) if tp > 1 else m.num_key_value_heads
        return 2 * heads * m.head_dim * m.num_hidden_layers * self.dtype_bytes

    def kv_blocks(self, block_size: int, utilization: float = 0.9) -> int:
        """KV blocks one rank's memory holds after its weights when the agents use ``utilization`` of it (what
        ``num_blocks: auto`` would find)."""
        free = self.device.memory_gib * (1 << 30) * utilization - self.weight_bytes_per_rank
        blocks = int(free // (self.kv_bytes_per_token_per_rank * block_size))
        if blocks < 2:
            raise CostModelError(f"{self.device.name}: the weights ({self.weight_bytes_per_rank / 2**30:.1f} GiB a "
                                 f"rank) leave no room for a KV cache in {self.device.memory_gib:g} GiB: use more "
                                 "ranks (--tensor-parallel)")
        return blocks

    def seconds(self, shape: StepShape) -> float:
        d, m, tp = self.device, self.model, self.tensor_parallel
        matmul_flops = (m.flops_per_token() - 2 * m.hidden_size * m.vocab_size) * shape.num_tokens
        flops = (matmul_flops + 2 * m.hidden_size * m.vocab_size * shape.num_seqs
                 + 4 * m.q_dim * m.num_hidden_layers * shape.attention_pairs) / tp
        read = self.weight_bytes_read(shape.num_tokens) + self.kv_bytes_per_token_per_rank * shape.context_tokens
        if shape.adapter_slots:  # the masked update: every token through each used adapter's A and B, read once
            values = lora_slot_values(ShardPlan(m, tp), self.max_lora_rank) * shape.adapter_slots
            flops += 2 * values * shape.num_tokens
            read += values * self.dtype_bytes
        device_s = max(flops / (d.peak_tflops * 1e12 * d.compute_efficiency),
                       read / (d.memory_bandwidth_gbs * 1e9 * d.memory_efficiency))
        comm_s = 0.0
        if tp > 1:  # a ring all-reduce of the step's activations after attention and after the MLP of every layer
            payload = shape.num_tokens * m.hidden_size * self.dtype_bytes * 2 * (tp - 1) / tp
            comm_s = 2 * m.num_hidden_layers * (d.allreduce_latency_s + payload / (d.interconnect_gbs * 1e9))
        per_step = d.step_overhead_s + d.seq_overhead_s * shape.num_seqs + device_s + comm_s
        return shape.num_steps * per_step

    def describe(self) -> str:
        d = self.device
        return (f"analytic {d.name} x{self.tensor_parallel}: {d.peak_tflops:g} TFLOPS x {d.compute_efficiency:g}, "
                f"{d.memory_bandwidth_gbs:g} GB/s x {d.memory_efficiency:g}, {d.step_overhead_s * 1e3:g} ms a step, "
                f"weights {self.weight_bytes_per_rank / 2**30:.2f} GiB a rank")


# ---- profiles on disk -------------------------------------------------------------------------------------
def save_profile(path: str | Path, samples: Sequence[tuple[StepShape, float]], meta: dict) -> Path:
    """The measured steps and what they were measured on, as JSON (``llm-serving profile`` writes it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**meta, "steps": step_rows(list(samples))}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def load_profile(path: str | Path) -> tuple[list[tuple[StepShape, float]], dict]:
    path = Path(path)
    try:
        body = json.loads(path.read_text())
        steps = steps_from_rows(body.pop("steps"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CostModelError(f"cannot read step profile {path}: {exc} (write one with `llm-serving profile`)") from None
    return steps, body


def merged_profiles(paths: Sequence[str | Path]) -> tuple[list[tuple[StepShape, float]], dict]:
    """Several profiles of one config (sessions on separate servers, at different times) as one: their steps and
    first-token probes together, ``round_steps`` one entry per session (``round_spread`` then compares sessions).
    Step times on a shared machine drift for minutes at a time; a fit to sessions apart averages the drift."""
    loaded = [load_profile(path) for path in paths]
    steps = [step for part, _ in loaded for step in part]
    meta = {**loaded[0][1], "first_token_probes": [p for _, m in loaded for p in m.get("first_token_probes", [])]}
    if len(loaded) > 1:
        meta.update(round_steps=[len(part) for part, _ in loaded], sessions=[str(path) for path in paths])
    return steps, meta


def fitted_from_profile(path: str | Path) -> tuple[FittedCost, dict, int]:
    """The model fitted to a profile (or to comma-separated profiles of the same config, ``merged_profiles``), the
    profile's description, and the largest batch it ran."""
    paths = [path] if Path(path).exists() else [part for part in str(path).split(",") if part]  # names may hold commas
    steps, meta = merged_profiles(paths)
    source = f"{len(steps)} steps of " + ", ".join(Path(part).name for part in paths)
    buckets = meta.get("decode_buckets", ())
    if len(paths) > 1:
        source += f", whose fits differ by {round_spread(steps, meta['round_steps'], buckets):.0%}"
    fit = FittedCost.fit(steps, source, buckets)
    return fit, meta, max(s.num_seqs for s, _ in steps)


def round_spread(steps: Sequence[tuple[StepShape, float]], round_steps: Sequence[int],
                 buckets: Sequence[int] = ()) -> float | None:
    """How far the profile's rounds disagree: a model fitted to each round alone predicts all the steps; the
    slowest prediction over the fastest, less 1 (None with fewer than two rounds). Large on a machine that was
    busy with something else for part of the profile."""
    bounds = np.cumsum([0, *round_steps])
    if len(round_steps) < 2 or bounds[-1] > len(steps):
        return None
    fits = [FittedCost.fit(steps[a:b], buckets=buckets) for a, b in itertools.pairwise(bounds)]
    totals = [sum(fit.seconds(s) for s, _ in steps) for fit in fits]
    return max(totals) / min(totals) - 1


def request_overhead(cost: StepCost, probes: Sequence[tuple[int, float]]) -> float:
    """Seconds a request spends outside the engine on each side (HTTP, tokenizing, streaming), from requests
    sent alone to an idle server: their time to first token less the prefill step the model predicts, halved (the
    simulator adds it before the engine sees a request and after each token leaves it)."""
    if not probes:
        return 0.0
    outside = [ttft - cost.seconds(StepShape(1, n, n, 1, n, n * n)) for n, ttft in probes]
    return max(float(np.median(outside)) / 2, 0.0)


def shape_summary(errors: np.ndarray) -> str:
    """Median and p90 of absolute relative errors, in per cent."""
    if errors.size == 0:
        return "no steps"
    a = np.abs(errors) * 100
    return f"median {np.median(a):.1f}%, p90 {np.percentile(a, 90):.1f}% over {a.size} steps"

