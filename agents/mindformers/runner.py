"""``MindFormersRunner``: MindFormers' Llama behind the ``agents.runtime.runner.ModelRunner`` interface (warm-up shapes,
``warmup``, ``step`` -> ids + logprobs), for ``model_config.backend: mindformers``.

Same static-bucket discipline as ``ModelRunner`` (every graph shape compiled and timed in ``warmup``, nothing
compiled while serving): ragged prefill graphs ``("ragged", S, T)`` and decode graphs ``("decode", B, W)``. One
MindFormers network serves both: its ``is_first_iteration`` flags pick the prefill (FlashAttention) or decode
(PagedAttention) path, so they are set before every call, as MindFormers' own generator does; each kind is its
own wrapper cell, so each compiles its own graphs. The patched ``construct`` returns (int32 ids, float32
logprobs, float32 logits); logits are read back only for sampled requests and logits dumps. The shapes, plans
and inputs are its two graph families' (``agents.mindformers.families``); warm-up, the cache-index check and the
step loop are the shared runner's (``agents.runtime.graph_runner.FamilyRunner``): this runner adds only
MindFormers' network, its step cells and their flags.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from agents.mindformers.families import mindformers_families
from agents.mindformers.model import build_network, load_weights_into
from agents.runtime.bucket_plan import bucket_ladder
from agents.runtime.device import apply_jit_config, setup_device
from agents.runtime.graph_runner import FamilyRunner
from llm_serving.protocol.model_config import ASCEND_DTYPES, LlamaConfig, blocks_needed


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
    # as build_context sets it in predict mode
    device_environment: dict[str, str] = field(default_factory=dict, hash=False)
    max_device_memory: str | None = None

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
        return bucket_ladder(self.max_blocks_per_seq, 4)


class MindFormersStep(nn.Cell):
    """One kind of step of the MindFormers network: our four inputs to the real ``construct``'s keywords."""

    def __init__(self, net: nn.Cell) -> None:
        super().__init__()
        self.net = net

    def construct(self, input_ids, batch_valid_length, block_tables, slot_mapping):
        return self.net(input_ids, batch_valid_length=batch_valid_length, block_tables=block_tables,
                        slot_mapping=slot_mapping)


class MindFormersRunner(FamilyRunner):
    """Owns MindFormers' network (weights, KV caches) and its compiled prefill and decode graphs on one device."""

    label = "mindformers"

    def __init__(self, llama: LlamaConfig, weights: Mapping[str, np.ndarray], rc: MindFormersRunnerConfig,
                 model_cfg_path: str, model_path: str = "", progress: Callable[[str], None] | None = None) -> None:
        setup_device(rc.device_target, rc.device_id, rc.device_environment, rc.max_device_memory)
        if rc.device_target == "Ascend":  # MindFormers' predict context: kernel by kernel, its inference kernels
            ms.set_context(jit_config={"jit_level": "O0", "infer_boost": "on"})
        self.config = llama
        self.net = build_network(model_cfg_path, llama, {f.name: getattr(rc, f.name) for f in fields(rc)},
                                 model_path, progress)
        load_weights_into(self.net, weights, llama)
        graphs = {"ragged": MindFormersStep(self.net), "decode": MindFormersStep(self.net)}
        for graph in graphs.values():
            apply_jit_config(graph, rc.device_target)
        super().__init__(rc, graphs, lambda costs: mindformers_families(rc, costs))

    def graph(self, kind: str) -> nn.Cell:
        """The step cell of ``kind`` with MindFormers' prefill/decode flags set for it (one network serves both)."""
        self.net.add_flags_custom(is_first_iteration=kind == "ragged")
        return self.graphs[kind]

    def warmup(self, progress: Callable[[str], None] | None = None,
               known_costs: dict[tuple, float] | None = None) -> dict[tuple, float]:
        """``FamilyRunner.warmup``; no compile cache serves this backend (``compile_cache.usable``), so there are
        never ``known_costs``."""
        if known_costs:
            raise ValueError("the mindformers backend has no compile cache to load known costs from")
        return super().warmup(progress)


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
