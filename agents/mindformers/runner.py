"""``MindFormersRunner``: MindFormers' Llama behind the ``agents.runtime.runner.ModelRunner`` interface (warm-up shapes,
``warmup``, ``step`` -> ids + logprobs), for ``model_config.backend: mindformers``.

Same static-bucket discipline as ``ModelRunner`` (every graph shape compiled and timed in ``warmup``, nothing
compiled while serving): ragged prefill graphs ``("ragged", S, T)`` and decode graphs ``("decode", B, W)``. One
MindFormers network serves both: its ``is_first_iteration`` flags pick the prefill (FlashAttention) or decode
(PagedAttention) path, so they are set before every call, as MindFormers' own generator does; each kind is its
own wrapper cell, so each compiles its own graphs. The patched ``construct`` returns (int32 ids, float32
logprobs, float32 logits); logits are read back only for sampled requests and logits dumps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from agents.mindformers.inputs import check_whole_prompts, shape_arrays, warmup_batch
from agents.mindformers.model import build_network, load_weights_into
from agents.runtime.bucket_plan import plan_groups, powers_of_two_up_to
from agents.runtime.device import apply_jit_config, setup_device
from agents.runtime.ragged_prefill import plan_ragged, token_buckets
from agents.runtime.sampler import step_output
from llm_serving.protocol.batch import StepBatch, StepOutput
from llm_serving.protocol.model_config import ASCEND_DTYPES, LlamaConfig, blocks_needed
from llm_serving.protocol.step import StepKind


@dataclass(frozen=True)
class MindFormersRunnerConfig:
    """The ``RunnerConfig`` fields this backend uses (``wiring.runner_config_dict`` sends them all)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    prefill_batch_sizes: tuple[int, ...]
    prefill_seq_lengths: tuple[int, ...]
    decode_batch_sizes: tuple[int, ...]
    dtype: str = "float16"
    device_target: str = "CPU"
    device_id: int = 0
    mixed_steps: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ASCEND_DTYPES:
            raise ValueError(f"model_config.dtype {self.dtype}: MindFormers' Llama runs {' or '.join(ASCEND_DTYPES)}")
        if self.mixed_steps:
            raise ValueError("the mindformers backend prefills whole prompts: set scheduler.enable_chunked_prefill "
                             "and enable_prefix_caching to false")
        for name in ("prefill_batch_sizes", "prefill_seq_lengths", "decode_batch_sizes"):
            object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MindFormersRunnerConfig:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_needed(self.max_model_len, self.block_size)

    @property
    def decode_block_widths(self) -> tuple[int, ...]:
        """Powers of two from 4 up to the blocks of one ``max_model_len`` sequence (as ``RunnerConfig``'s default
        where wider tables cost more)."""
        return powers_of_two_up_to(self.max_blocks_per_seq, 4)

    def shapes(self) -> list[tuple]:
        """Every graph shape: ragged prefill token buckets, then decode batch x block-table width."""
        tokens = token_buckets(self.prefill_batch_sizes, self.prefill_seq_lengths, self.max_model_len)
        return [("ragged", self.prefill_batch_sizes[-1], t) for t in tokens] + [
            ("decode", b, w) for b in self.decode_batch_sizes for w in self.decode_block_widths]


class MindFormersStep(nn.Cell):
    """One kind of step of the MindFormers network: our four inputs to the real ``construct``'s keywords."""

    def __init__(self, net: nn.Cell) -> None:
        super().__init__()
        self.net = net

    def construct(self, input_ids, batch_valid_length, block_tables, slot_mapping):
        return self.net(input_ids, batch_valid_length=batch_valid_length, block_tables=block_tables,
                        slot_mapping=slot_mapping)


class MindFormersRunner:
    """Owns MindFormers' network (weights, KV caches) and its compiled prefill and decode graphs on one device."""

    def __init__(self, llama: LlamaConfig, weights: Mapping[str, np.ndarray], rc: MindFormersRunnerConfig,
                 model_cfg_path: str, model_path: str = "", progress: Callable[[str], None] | None = None) -> None:
        setup_device(rc.device_target, rc.device_id)
        if rc.device_target == "Ascend":  # MindFormers' predict context: kernel by kernel, its inference kernels
            ms.set_context(jit_config={"jit_level": "O0", "infer_boost": "on"})
        self.config, self.rc = llama, rc
        self.net = build_network(model_cfg_path, llama, {f.name: getattr(rc, f.name) for f in fields(rc)},
                                 model_path, progress)
        load_weights_into(self.net, weights, llama)
        self.graphs = {"ragged": MindFormersStep(self.net), "decode": MindFormersStep(self.net)}
        for graph in self.graphs.values():
            apply_jit_config(graph, rc.device_target)
        self.token_buckets = token_buckets(rc.prefill_batch_sizes, rc.prefill_seq_lengths, rc.max_model_len)
        self.warmed: set[tuple] = set()
        self.compile_times: dict[tuple, float] = {}
        self.step_costs: dict[tuple, float] = {}

    # ---- shapes and warm-up ----------------------------------------------------------------------------------
    def graph_shapes(self) -> list[tuple]:
        return self.rc.shapes()

    def warmup_inputs(self, shape: tuple) -> list[np.ndarray]:
        """The inputs ``warmup()`` runs ``shape`` with (``agents.mindformers.export`` exports with them)."""
        return shape_arrays(shape, warmup_batch(*shape))

    def select(self, kind: str) -> nn.Cell:
        """The step cell of ``kind`` with MindFormers' prefill/decode flags set for it."""
        self.net.add_flags_custom(is_first_iteration=kind == "ragged")
        return self.graphs[kind]

    def _run(self, shape: tuple, arrays: list[np.ndarray]):
        if shape not in self.warmed:
            raise RuntimeError(f"graph shape {shape} was not warmed up (the runner never compiles while serving)")
        return self.select(shape[0])(*[Tensor(a) for a in arrays])

    def warmup(self, progress: Callable[[str], None] | None = None) -> dict[tuple, float]:
        """Compile every shape, then time one more call of it (the costs the batch plans use)."""
        for shape in self.graph_shapes():
            arrays = self.warmup_inputs(shape)
            self.warmed.add(shape)
            t0 = time.perf_counter()
            self._run(shape, arrays)[0].asnumpy()
            self.compile_times[shape] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self._run(shape, arrays)[0].asnumpy()
            self.step_costs[shape] = time.perf_counter() - t1
            if progress:
                progress(f"warmed mindformers {shape[0]} batch={shape[1]} "
                         f"{'tokens' if shape[0] == 'ragged' else 'blocks'}={shape[2]} in "
                         f"{self.compile_times[shape]:.2f}s")
        return self.compile_times

    # ---- planning ----------------------------------------------------------------------------------------
    def _prefill_shape(self, tokens: int) -> tuple | None:
        t = next((b for b in self.token_buckets if b >= tokens), None)
        return None if t is None else ("ragged", self.rc.prefill_batch_sizes[-1], t)

    def _decode_shape(self, count: int, longest: int) -> tuple | None:
        b = next((s for s in self.rc.decode_batch_sizes if s >= count), None)
        w = next((s for s in self.rc.decode_block_widths if s >= blocks_needed(longest, self.rc.block_size)), None)
        return ("decode", b, w) if b and w else None

    def _cost(self, shape: tuple | None) -> float:
        return float("inf") if shape is None else self.step_costs.get(shape, 1.0)

    def plan(self, batch: StepBatch) -> list[tuple[np.ndarray, tuple]]:
        """(sequence indices, graph shape) of each call."""
        if batch.kind is not StepKind.DECODE:
            check_whole_prompts(batch)
            groups = plan_ragged(batch.query_lens, self.rc.prefill_batch_sizes[-1],
                                 lambda tokens: self._cost(self._prefill_shape(tokens)))
            return [(g, self._prefill_shape(int(batch.query_lens[g].sum()))) for g in groups]
        try:
            groups = plan_groups(batch.context_lens, self.rc.decode_batch_sizes,
                                 lambda n, longest: self._cost(self._decode_shape(n, longest)))
        except ValueError:
            raise ValueError(f"context length {int(batch.context_lens.max())} exceeds the widest block table "
                             f"{self.rc.decode_block_widths[-1] * self.rc.block_size}") from None
        return [(g, self._decode_shape(len(g), int(batch.context_lens[g].max()))) for g in groups]

    def _check_cache_indices(self, batch: StepBatch) -> None:
        """Slots and blocks outside the cache are refused before any graph runs (inside one they corrupt KV)."""
        slots, blocks = self.rc.num_blocks * self.rc.block_size, self.rc.num_blocks
        if batch.slot_mapping.size and (batch.slot_mapping.min() < 0 or batch.slot_mapping.max() >= slots):
            raise ValueError(f"slot_mapping has slots outside the KV cache [0, {slots})")
        if batch.kind is StepKind.DECODE:
            used = np.arange(batch.block_tables.shape[1]) < blocks_needed(batch.context_lens, self.rc.block_size)[:, None]
            ids = batch.block_tables[used]
            if ids.size and (ids.min() < 0 or ids.max() >= blocks):
                raise ValueError(f"block tables reference blocks outside the KV cache [0, {blocks})")

    # ---- steps -------------------------------------------------------------------------------------------
    def step(self, batch: StepBatch) -> StepOutput:
        """One prefill or decode step as planned calls; sampled parts and ``want_logits`` rows read the logits."""
        planned = self.plan(batch)
        self._check_cache_indices(batch)
        parts = ((group, part, self._run(shape, shape_arrays(shape, part)))
                 for group, shape in planned for part in (batch.take(group),))
        return step_output(batch.batch_size, parts)


def build_runner(spec: Any, rank: int, progress: Callable[[str], None]) -> MindFormersRunner:
    """The agent's runner for an ``AgentSpec`` with backend mindformers (one rank: no tensor parallelism)."""
    from agents.weights.checkpoints import load_weights

    if spec.tensor_parallel_size != 1:
        raise ValueError("the mindformers backend runs one agent (serving_config.num_agents 1)")
    llama = LlamaConfig(**spec.llama_config)
    rc = MindFormersRunnerConfig.from_dict({**spec.runner_config, "device_id": spec.start_device_id + rank})
    progress(f"loading weights from {spec.model_path}")
    weights = load_weights(spec.model_path, llama)
    progress(f"building MindFormers' Llama from {spec.model_cfg_path} on {rc.device_target} device {rc.device_id}")
    return MindFormersRunner(llama, weights, rc, spec.model_cfg_path, spec.model_path, progress)
