"""LoRA adapters in the step graphs: every slot's low-rank update beside each fused projection, picked per token.

Why this form (measured in ``scripts/bench_lora_ops.py``, docs/model.md "Adapters"): each fused projection holds the
``A`` of all ``max_loras`` slots stacked (``[slots * width, in]``) and their ``B`` side by side (``[out, slots *
width]``); a step computes ``x A^T`` once, zeroes every column outside the token's own slot with a mask, and
multiplies by ``B^T``: three ops whatever the mix of adapters, where gathering each row's own ``A`` and ``B`` grew
with the rows. ``width`` is the projection's parts times ``max_lora_rank`` (q, k, v: 3; gate, up: 2), the layout of
``agents.weights.lora_weights`` (a slot's unused columns stay zero). An empty slot is zeros: it adds nothing.

Which slot a token uses is never a graph input, so every step graph keeps its signature: the model holds
``lora_blocks`` (int32 ``[num_blocks]``, the slot of the sequence owning each KV block, -1 for none), the runner
sets it before each step (``agents.runtime.adapters``), and the graph reads a token's slot at the block it writes
(``slot_mapping``), which only its own sequence owns. The update needs the projection's input: the RMSNorm leaves
the fused QKV and gate/up projections (the normed ``x`` is computed once and read by both the projection and the
update), and SwiGLU follows the update in graph ops. Under tensor parallelism a row-parallel projection's update is
a partial sum (``A`` cut by columns) handed to the projection as its residual on every rank, so the all-reduce that
already follows the projection completes it.

Where the backend's projections take the update themselves (``OpsBackend.lora_projections``: the native CPU
projections), none of that runs in graph ops: each projection is one op given every slot's ``A`` and ``B`` and each
token's slot, which multiplies a token by its own slot's ``A`` and ``B`` only (``LoraCall`` in
``kernels/linear.cc``). The separate products, masks and SwiGLU, measured there beside the native projections,
cost a batch-32 decode step ~1.5x the base step in op launches and helper wake-ups, not FLOPs (docs/model.md
"Adapters"), so the graph-op form below serves only backends whose projections are MindSpore's (portable).
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from agents.model import parallel
from agents.model.backends import OpsBackend
from agents.model.backends.base import LoraProjections
from agents.weights import packed as packed_weights
from agents.weights.packed import PANEL
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan

PARTS = {"w_qkv": 3, "wo": 1, "w_gate_up": 2, "w_down": 1}  # a fused projection's LoRA-able parts


@dataclass(frozen=True)
class LoraShape:
    """The adapter slots the graphs hold (``AgentSpec.lora``): ``max_loras`` slots of rank up to ``max_lora_rank``
    per adapted module."""

    max_loras: int
    max_lora_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"lora max_loras and max_lora_rank must be >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")

    def width(self, projection: str) -> int:
        """A slot's columns in ``projection``'s stacked ``A``."""
        return PARTS[projection] * self.max_lora_rank


class LoraUpdate(nn.Cell):
    """``(x, mask, rows, base) -> base + ((x A^T) * mask) B^T`` over every slot of one fused projection (zeros:
    empty slots; ``base`` None: the update alone), both products by the backend's projections (the second one adding
    ``base`` itself: every op costs a launch, measured to dominate the update's cost on CPU). Backends whose
    projections take the update themselves (``LoraSlotWeights``) never build it."""

    def __init__(self, in_dim: int, out_dim: int, columns: int, dtype: ms.Type, backend: OpsBackend,
                 eps: float | None = None) -> None:
        """``eps``: the update reads the RMSNorm of its input (QKV, gate/up), fused into its first product as the
        base projection's is (so the normed input is never a tensor of its own)."""
        super().__init__()
        self.shapes = (columns, in_dim), (out_dim, columns)  # A's and B's as ``store`` takes them
        self.dtype = dtype
        self.a = Parameter(initializer("zeros", self.shapes[0], dtype), name="lora_a", requires_grad=False)
        self.b = Parameter(initializer("zeros", self.shapes[1], dtype), name="lora_b", requires_grad=False)
        self.down = backend.partial_linear(columns) if eps is None else backend.norm_linear(columns, eps)
        self.up = backend.partial_linear(out_dim)
        self.add_up = backend.residual_linear()

    def store(self, a: np.ndarray, b: np.ndarray) -> None:
        """Set every slot's stacked ``A [columns, in]`` and ``B [out, columns]`` (float32)."""
        for param, value in ((self.a, a), (self.b, b)):
            param.set_data(Tensor(np.ascontiguousarray(value, np.float32)).astype(self.dtype))

    def construct(self, x: Tensor, mask: Tensor, rows: Tensor, base: Tensor | None = None,
                  norm_weight: Tensor | None = None) -> Tensor:
        if norm_weight is None:
            shrunk = self.down(x, self.a, rows) * mask
        else:
            shrunk = self.down(x, norm_weight, self.a, rows) * mask
        if base is None:
            return self.up(shrunk, self.b, rows)
        return self.add_up(shrunk, self.b, base, rows)


class LoraSlotWeights(nn.Cell):
    """Every slot's ``A`` and ``B`` of one fused projection as projections that add the update themselves read them
    (``OpsBackend.lora_projections``; ``LoraCall`` in ``kernels/linear.cc``): ``a [ceil(slots * w / 32), in, 32]``,
    the stacked ``A`` packed as a weight, and ``b [panels, slots, w, 32]``, ``B`` in the base weight's panel order;
    float32 whatever the base weight's precision. ``store`` takes what ``LoraUpdate.store`` takes."""

    def __init__(self, in_dim: int, out_dim: int, slots: int, width: int) -> None:
        super().__init__()
        self.shapes = (slots * width, in_dim), (out_dim, slots * width)
        a_shape = (-(-slots * width // PANEL), in_dim, PANEL)
        b_shape = (-(-out_dim // PANEL), slots, width, PANEL)
        self.a = Parameter(initializer("zeros", a_shape, ms.float32), name="lora_a", requires_grad=False)
        self.b = Parameter(initializer("zeros", b_shape, ms.float32), name="lora_b", requires_grad=False)

    def store(self, a: np.ndarray, b: np.ndarray) -> None:
        """Set every slot's stacked ``A [slots * w, in]`` and ``B [out, slots * w]`` (float32)."""
        for param, value in ((self.a, a), (self.b, b)):
            held = packed_weights.pack(np.asarray(value, np.float32)).reshape(param.shape)
            param.set_data(Tensor(np.ascontiguousarray(held)))


class LoraRowParallel(nn.Cell):
    """``(x, weight, residual, rows, a, b, slots) -> residual + x @ W^T + update`` over all ranks (a row-parallel
    projection that adds its LoRA update itself): rank 0 adds the residual, the others give their partial sums,
    and the all-reduce completes both."""

    def __init__(self, shard: ShardPlan, fused: LoraProjections, out_dim: int) -> None:
        super().__init__()
        self.adds_residual, self.reduces = shard.rank == 0, shard.tp > 1
        self.op = fused.residual_linear() if self.adds_residual else fused.partial_linear(out_dim)
        self.reduce = parallel.AllReduceSum() if self.reduces else None

    def construct(self, x: Tensor, weight: Tensor, residual: Tensor, rows: Tensor, a: Tensor, b: Tensor,
                  slots: Tensor) -> Tensor:
        if self.adds_residual:
            y = self.op(x, weight, residual, rows, a, b, slots)
        else:
            y = self.op(x, weight, rows, a, b, slots)
        if self.reduces:
            return self.reduce(y)
        return y


class LoraMasks(nn.Cell):
    """``slot_mapping [tokens] -> (mask of width r, 2r, 3r)``: 1 in the columns of the token's slot, else 0; or
    ``(slots,)``, each token's slot (int32, -1 none), where ``slots_only`` (projections that add the update
    themselves)."""

    def __init__(self, shape: LoraShape, num_blocks: int, block_size: int, dtype: ms.Type,
                 slots_only: bool = False) -> None:
        super().__init__()
        self.blocks = Parameter(Tensor(np.full(num_blocks, -1, np.int32)), name="lora_blocks", requires_grad=False)
        self.block_size, self.dtype, self.slots_only = block_size, dtype, slots_only
        self.column_slots = tuple(Tensor(np.repeat(np.arange(shape.max_loras, dtype=np.int32),
                                                   parts * shape.max_lora_rank).reshape(1, -1)) for parts in (1, 2, 3))

    def construct(self, slot_mapping: Tensor) -> tuple[Tensor, ...]:
        # padding rows may carry any slot index: clamped into the table, their rows are never read
        blocks = ops.minimum(ops.maximum(slot_mapping, 0) // self.block_size, self.blocks.shape[0] - 1)
        token_slots = ops.gather(self.blocks, blocks, 0).reshape(-1, 1)
        if self.slots_only:
            return (token_slots.reshape(-1),)
        return tuple((columns == token_slots).astype(self.dtype) for columns in self.column_slots)


class LoraLayerCells(nn.Cell):
    """One decoder layer's LoRA updates and the projections that take them (see the module doc)."""

    def __init__(self, shape: LoraShape, config: LlamaConfig, shard: ShardPlan, backend: OpsBackend,
                 dtype: ms.Type) -> None:
        super().__init__()
        n, hidden, heads = shape.max_loras, config.hidden_size, shard.attention_config
        eps = config.rms_norm_eps
        fused = backend.lora_projections()
        self.fused = fused is not None
        self.adds_residual = shard.rank == 0  # the other ranks' row-parallel "residual" is their partial update
        self.lora_qkv: LoraUpdate | LoraSlotWeights
        self.lora_wo: LoraUpdate | LoraSlotWeights
        self.lora_gate_up: LoraUpdate | LoraSlotWeights
        self.lora_down: LoraUpdate | LoraSlotWeights
        if fused is not None:  # one op per projection, the update inside it
            self.lora_qkv = LoraSlotWeights(hidden, heads.qkv_dim, n, shape.width("w_qkv"))
            self.lora_wo = LoraSlotWeights(heads.hidden_size, hidden, n, shape.width("wo"))
            # panel weights compute gate/up interleaved by 16 (agents.weights.packed.swiglu_rows), padded to whole
            # panels: the update's B rows are held in that order
            gate_up = PANEL * -(-shard.ffn // (PANEL // 2))
            self.lora_gate_up = LoraSlotWeights(hidden, gate_up, n, shape.width("w_gate_up"))
            self.lora_down = LoraSlotWeights(shard.ffn, hidden, n, shape.width("w_down"))
            self.norm_qkv = fused.norm_linear(heads.qkv_dim, eps)
            self.norm_gate_up = fused.norm_swiglu(shard.ffn, eps)
            self.output_projection = LoraRowParallel(shard, fused, hidden)
            self.down_projection = LoraRowParallel(shard, fused, hidden)
            return
        self.lora_qkv = LoraUpdate(hidden, heads.qkv_dim, n * shape.width("w_qkv"), dtype, backend, eps)
        self.lora_wo = LoraUpdate(heads.hidden_size, hidden, n * shape.width("wo"), dtype, backend)
        self.lora_gate_up = LoraUpdate(hidden, 2 * shard.ffn, n * shape.width("w_gate_up"), dtype, backend, eps)
        self.lora_down = LoraUpdate(shard.ffn, hidden, n * shape.width("w_down"), dtype, backend)
        self.norm_qkv = backend.norm_linear(heads.qkv_dim, eps)
        self.norm_gate_up = backend.norm_linear(2 * shard.ffn, eps)  # before SwiGLU: the update adds to gate and up
        self.swiglu = backend.swiglu(shard.ffn)
        residual_linear = backend.residual_linear()
        self.output_projection = parallel.row_parallel(shard, backend, residual_linear, hidden, lora=True)
        self.down_projection = parallel.row_parallel(shard, backend, residual_linear, hidden, lora=True)

    def updates(self) -> dict[str, LoraUpdate | LoraSlotWeights]:
        """The layer's updates by the fused projection they belong to."""
        return {"w_qkv": self.lora_qkv, "wo": self.lora_wo, "w_gate_up": self.lora_gate_up, "w_down": self.lora_down}

    def qkv(self, x: Tensor, norm_weight: Tensor, weight: Tensor, rows: Tensor, masks: tuple) -> Tensor:
        if self.fused:
            return self.norm_qkv(x, norm_weight, weight, rows, self.lora_qkv.a, self.lora_qkv.b, masks[0])
        return self.lora_qkv(x, masks[2], rows, self.norm_qkv(x, norm_weight, weight, rows), norm_weight)

    def output(self, attn: Tensor, weight: Tensor, x: Tensor, rows: Tensor, masks: tuple) -> Tensor:
        if self.fused:
            return self.output_projection(attn, weight, x, rows, self.lora_wo.a, self.lora_wo.b, masks[0])
        return self.output_projection(attn, weight, self._residual(self.lora_wo, attn, x, rows, masks), rows)

    def mlp(self, x: Tensor, norm_weight: Tensor, gate_up_weight: Tensor, down_weight: Tensor, rows: Tensor,
            masks: tuple) -> Tensor:
        if self.fused:
            act = self.norm_gate_up(x, norm_weight, gate_up_weight, rows, self.lora_gate_up.a, self.lora_gate_up.b,
                                    masks[0])
            return self.down_projection(act, down_weight, x, rows, self.lora_down.a, self.lora_down.b, masks[0])
        act = self.swiglu(self.lora_gate_up(x, masks[1], rows, self.norm_gate_up(x, norm_weight, gate_up_weight, rows),
                                            norm_weight))
        return self.down_projection(act, down_weight, self._residual(self.lora_down, act, x, rows, masks), rows)

    def _residual(self, update: LoraUpdate | LoraSlotWeights, inputs: Tensor, x: Tensor, rows: Tensor,
                  masks: tuple) -> Tensor:
        """A row-parallel projection's residual: ``x`` + the update (the other ranks: their partial update)."""
        if self.adds_residual:
            return update(inputs, masks[0], rows, x)
        return update(inputs, masks[0], rows)
