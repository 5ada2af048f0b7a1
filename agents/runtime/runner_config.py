"""The runner's configuration: the KV cache's geometry, the shape buckets of its graphs and the model's numerics
(``agents.runtime.runner``; the graph families read their shapes from it, ``agents.runtime.graph_family``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from agents.runtime.bucket_plan import bucket_ladder
from agents.runtime.mixed_steps import mixed_shapes
from agents.runtime.ragged_prefill import token_buckets
from llm_serving.protocol.model_config import (
    ASCEND_DTYPES,
    DEVICE_TARGETS,
    DTYPES,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    PRECISIONS,
    QUANTIZATIONS,
    blocks_needed,
)


@dataclass(frozen=True)
class RunnerConfig:
    """Cache geometry and shape buckets. ``decode_block_widths`` left empty is the runner's choice
    (``with_decode_widths``)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    prefill_batch_sizes: tuple[int, ...] = (1, 4, 8)
    prefill_seq_lengths: tuple[int, ...] = (64, 128, 256)
    decode_batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    decode_block_widths: tuple[int, ...] = field(default=())
    dtype: str = "float32"
    device_target: str = "CPU"
    device_id: int = 0
    kernels: str = "auto"  # the device's native ops (agents.model.backends; CPU float32: C++ ops), portable, or auto
    precision: str = "exact"  # half / fast: float16 / bfloat16 projection weights (OpsBackend.with_precision)
    quantization: str = "none"  # w8a16: int8 weights of the layers' projections (OpsBackend.with_quantization)
    kv_cache_dtype: str = "auto"  # int8: per token and kv head scales (native CPU), per channel (Ascend, static)
    int8_kv_direction: str | None = None  # int8 on Ascend: how PagedAttention applies its antiquant scale
    # Steps with queries over cached context (chunked prefill, prefix caching; agents.runtime.mixed_steps), and the
    # token budget of one step they are bucketed up to (None: the ragged prefill's largest call)
    mixed_steps: bool = False
    max_num_batched_tokens: int | None = None
    # speculative decoding: the most proposals one sequence has verified in a step (agents.runtime.verify_steps);
    # 0: no verify graphs
    verify_tokens: int = 0
    decode_steps: int = 1  # scheduler.decode_steps: > 1 compiles the looped decode graphs (``looped_decode``)
    # a draft runner's looped decode graphs: (steps, most sequences) of each draft round size speculation uses
    # (``speculative_runner.draft_loops``); a round's k proposals then cost one graph call, not k
    draft_loops: tuple[tuple[int, int], ...] = ()
    verify_step_tokens: int | None = None  # the tokens one verify step carries at most (None: a full decode batch's)
    # one compiled graph per family, its inputs' dimensions left open (``Cell.set_inputs`` with None dims, as
    # MindFormers and vllm-mindspore compile theirs); the buckets still pad and plan the calls (docs/ascend.md)
    dynamic_shapes: bool = False
    # set up before MindSpore selects kernels (agents.runtime.device; llm_serving.protocol.ascend_env)
    device_environment: dict[str, str] = field(default_factory=dict, hash=False)
    max_device_memory: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels {self.kernels!r} is not one of {list(KERNEL_CHOICES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"model_config.precision {self.precision!r} is not one of {list(PRECISIONS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model_config.quantization {self.quantization!r} is not one of {list(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"model_config.kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{list(KV_CACHE_DTYPES)}")
        if self.device_target not in DEVICE_TARGETS:
            raise ValueError(f"device_target {self.device_target!r} is not one of {list(DEVICE_TARGETS)}")
        if self.device_target == "Ascend" and self.dtype not in ASCEND_DTYPES:
            raise ValueError(f"model_config.dtype {self.dtype} is not served on Ascend: its fused kernels take "
                             f"{' or '.join(ASCEND_DTYPES)}")
        for name in ("prefill_batch_sizes", "prefill_seq_lengths", "decode_batch_sizes"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive sizes, got {values}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if self.prefill_seq_lengths[-1] > self.max_model_len:
            raise ValueError(f"prefill seq length {self.prefill_seq_lengths[-1]} exceeds max_model_len "
                             f"{self.max_model_len}")

    def with_decode_widths(self, full_width: bool) -> RunnerConfig:
        """This config with ``decode_block_widths`` set where left empty: one full-width block table where a wider
        table costs nothing (native attention reads each row's own context: measured equal), so fewer shapes to
        compile; else powers of two up to the most blocks one sequence can hold (``max_model_len / block_size``)."""
        if self.decode_block_widths:
            return self
        top = self.max_blocks_per_seq
        return replace(self, decode_block_widths=(top,) if full_width else bucket_ladder(top, 4))

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_needed(self.max_model_len, self.block_size)

    @property
    def mixed_max_seqs(self) -> int:
        """Sequences of one ragged mixed call: a full decode batch or prefill batch."""
        return max(self.decode_batch_sizes[-1], self.prefill_batch_sizes[-1])

    def mixed_shapes(self, ragged: bool) -> list[tuple]:
        """The mixed-step graph shapes (``agents.runtime.mixed_steps``), none unless ``mixed_steps``."""
        if not self.mixed_steps:
            return []
        top = self.max_num_batched_tokens or token_buckets(self.prefill_batch_sizes, self.prefill_seq_lengths,
                                                           self.max_model_len)[-1]
        return mixed_shapes(self.mixed_max_seqs, top, self.prefill_batch_sizes, self.prefill_seq_lengths,
                            min(top, self.max_model_len), ragged)
