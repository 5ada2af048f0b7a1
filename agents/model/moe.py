"""The sparse MoE block as graph ops (issue 54): router, top-k with the family's normalisation, then each token's
chosen experts' weights gathered (``[tokens*k, 2f, h]``) and applied as one batched matmul pair, and the k
outputs summed with their routing weights. Static shapes throughout (the graph buckets of
/work/shared/notes/mindspore-cpu.md); a step reads ``tokens x k`` experts' weights, never the experts no token
chose, which is what makes decode cost follow active parameters. The maths is held to ``moe_routing`` (itself held
to transformers' blocks) in tests/test_moe_block.py. On the native CPU backend one C++ op (``MoeExperts``,
agents/model/kernels/moe_experts.cc) takes both paths' place: the picks grouped by expert, the weights read in
place, no gathered copy; and where the backend has it, one op (``MoeLayer``, same file) is the MLP slot's norm,
router, top-k, routed experts and residual (``MoeMlp``). Under ``model_config.quantization`` w8a16 the experts are
held int8 with a float32 scale per output row (``ExpertsHeld``), as the dense projections are: the native ops form
each row as float(q) * scale, the graph paths dequantize in-graph the experts they read, so all compute what the
float32 block computes on the dequantized experts. Qwen2-MoE's shared expert is a dense SwiGLU MLP and is held and
run as the dense MLP is (``SharedExpert``), beside ``MoeLayer`` too."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from agents.model.backends.ascend_moe import ExpertSlice
from agents.model.backends.base import OpsBackend, RoutedExperts
from agents.model.projection import ProjectionWeight
from agents.weights import packed as packed_weights
from llm_serving.protocol.moe_config import MoeSpec
from llm_serving.protocol.parallel import ShardPlan


class MoeBlock(nn.Cell):
    """One layer's experts (canonical names of ``agents.weights.moe_weights``) and the op sequence over them.
    One rank's block (``shard``) holds experts ``[start, start + count)`` over ``f`` of each one's rows and its
    share of the shared expert's rows, and gives its partial sum of the output (the router is every rank's)."""

    def __init__(self, spec: MoeSpec, hidden: int, dtype: ms.Type, shard: ShardPlan | None = None,
                 experts_op: nn.Cell | None = None, routed: RoutedExperts | None = None,
                 quantization: str = "none", projections: OpsBackend | None = None,
                 layer_op: nn.Cell | None = None) -> None:
        """``projections``: the backend whose projection ops and weight layout the shared expert uses (None: the
        graph ops, float weights). ``layer_op``: the backend's op over the slot's routed part (``MoeMlp``)."""
        super().__init__()
        # the backend's op over the whole block (``layer``), else over the picked experts (native CPU, float32):
        # either replaces both graph paths below
        native = dtype == ms.float32 and routed is None
        self.experts_op = experts_op if native and layer_op is None else None
        (start, end), (f0, f1), (s0, s1) = ((shard.expert_range(), shard.expert_ffn_range(), shard.shared_ffn_range())
                                            if shard is not None else ((0, spec.num_experts),
                                                                       (0, spec.moe_intermediate_size),
                                                                       (0, spec.shared_expert_intermediate_size)))
        e, f, s = end - start, f1 - f0, s1 - s0
        self.num_experts, self.start, self.local, self.dtype = spec.num_experts, start, e, dtype
        self.k, self.f, self.normalise = spec.top_k, f, spec.norm_topk_prob
        self.router = Parameter(initializer("zeros", (spec.num_experts, hidden), dtype), name="router")
        # the backend's kernels over the router logits and the experts held [in, out] (Ascend's grouped matmul,
        # agents.model.backends.ascend_moe): they replace routing and every path below
        self.routed = routed.cell(spec, ExpertSlice(start, e, spec.num_experts)) if routed is not None else None
        transposed, self.quantized = self.routed is not None, quantization != "none"
        # int8 experts' scales: float32 for our ops, in the model's dtype for the grouped matmul's antiquant_scale
        scale_dtype = dtype if transposed else ms.float32
        self.held = {"experts_gate_up": ExpertsHeld("experts_gate_up", (e, 2 * f, hidden), dtype, transposed,
                                                    self.quantized, scale_dtype),
                     "experts_down": ExpertsHeld("experts_down", (e, hidden, f), dtype, transposed, self.quantized,
                                                 scale_dtype)}
        self.experts_gate_up = self.held["experts_gate_up"].weight
        self.experts_down = self.held["experts_down"].weight
        self.experts_gate_up_scale = self.held["experts_gate_up"].scale
        self.experts_down_scale = self.held["experts_down"].scale
        # present only where the family has a shared expert
        self.shared = SharedExpert(hidden, s, dtype, quantization, projections) if s else None
        self.layer_op = layer_op if native else None
        # weights as stored, [out, in]: the transposed operand read in place, never a transposed copy per call
        self.linear = ops.MatMul(transpose_b=True)
        self.batched = ops.BatchMatMul(transpose_b=True)

    def named_weights(self) -> dict[str, tuple[Parameter, ExpertsHeld | ProjectionWeight | None]]:
        """The block's weights by canonical kind (``agents.weights.moe_weights.MOE_KINDS``), each with what holds
        it in a layout of its own (None: the Parameter holds the weight as loaded)."""
        out: dict[str, tuple[Parameter, ExpertsHeld | ProjectionWeight | None]] = {"router": (self.router, None)}
        out.update({name: (held.weight, held) for name, held in self.held.items()})
        if self.shared is not None:
            out.update({"shared_gate_up": (self.shared.gate_up.weight, self.shared.gate_up),
                        "shared_down": (self.shared.down.weight, self.shared.down),
                        "shared_gate": (self.shared.gate, None)})
        return out

    def load(self, weights: dict[str, np.ndarray], layer: int) -> None:
        for name, (param, held) in self.named_weights().items():
            value = weights[f"layers.{layer}.{name}"]
            expected = held.shape if held is not None else tuple(param.shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"layers.{layer}.{name}: expected shape {expected}, got {value.shape}")
            if held is not None:
                held.load(value, weights.get(f"layers.{layer}.{name}.scale"))
            else:
                param.set_data(Tensor(np.ascontiguousarray(value), param.dtype))

    def construct(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """``x [tokens, hidden]`` (token-flat, as every projection here) -> the block's output, same shape.
        ``rows`` [1] int32: the real leading rows (the native op leaves the padding after them as zeros)."""
        tokens = x.shape[0]
        if rows is None:
            rows = ops.full((1,), tokens, dtype=ms.int32)
        if self.routed is not None:
            if self.quantized:
                out = self.routed(x, self.linear(x, self.router), self.experts_gate_up, self.experts_down,
                                  self.experts_gate_up_scale, self.experts_down_scale)
            else:
                out = self.routed(x, self.linear(x, self.router), self.experts_gate_up, self.experts_down)
            return self._with_shared(x, out, rows)
        probs = ops.softmax(self.linear(x, self.router).astype(ms.float32), -1)
        weights, ids = ops.topk(probs, self.k)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdims=True)
        if self.experts_op is not None:
            if self.local < self.num_experts:  # another rank's expert: an id the op skips
                mine = ops.logical_and(ids >= self.start, ids < self.start + self.local)
                ids = ops.select(mine, ids - self.start, ops.full_like(ids, -1))
            if self.quantized:
                out = self.experts_op(x, ids.astype(ms.int32), weights, self.experts_gate_up,
                                      self.experts_gate_up_scale, self.experts_down, self.experts_down_scale, rows)
            else:
                out = self.experts_op(x, ids.astype(ms.int32), weights, self.experts_gate_up, self.experts_down,
                                      rows)
        elif tokens * self.k < self.local:  # a graph constant: each bucket compiles one of the two
            out = self._gathered(x, weights, ids)
        else:
            out = self._every_expert(x, weights, ids)
        return self._with_shared(x, out, rows)

    def layer(self, x: Tensor, norm_weight: Tensor, eps: Tensor, routing: Tensor, rows: Tensor) -> Tensor:
        """The routed part of the MLP slot in ``layer_op``: ``x`` before the norm; ``routing`` [4] int32 (top k,
        normalise, this rank's first expert, whether the residual is added: kernels/moe_experts.cc)."""
        if self.quantized:
            return self.layer_op(x, norm_weight, eps, self.router, routing, self.experts_gate_up,
                                 self.experts_gate_up_scale, self.experts_down, self.experts_down_scale, rows)
        return self.layer_op(x, norm_weight, eps, self.router, routing, self.experts_gate_up, self.experts_down,
                             rows)

    def _with_shared(self, x: Tensor, out: Tensor, rows: Tensor) -> Tensor:
        """Qwen2-MoE's shared expert added, behind its sigmoid gate."""
        if self.shared is None:
            return out
        return out + self.shared(x, rows)

    def _gathered(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Fewer picks than experts (decode at small batch): the chosen experts' weights gathered, ``tokens x k``
        of them, one batched matmul pair; the experts no token chose are never read."""
        tokens, hidden = x.shape[0], x.shape[1]
        flat = ids.reshape(-1)
        if self.local < self.num_experts:  # picks of another rank's experts: read expert 0, weighted 0
            mine = ops.logical_and(flat >= self.start, flat < self.start + self.local)
            flat = ops.select(mine, flat - self.start, ops.zeros_like(flat))
            weights = weights * mine.reshape(tokens, self.k).astype(weights.dtype)
        rows = ops.broadcast_to(x.reshape(tokens, 1, 1, hidden), (tokens, self.k, 1, hidden))
        rows = rows.reshape(tokens * self.k, 1, hidden)
        gate_up = self.batched(rows, self._picked(self.experts_gate_up, self.experts_gate_up_scale, flat))
        act = ops.silu(gate_up[:, :, :self.f]) * gate_up[:, :, self.f:]
        y = self.batched(act, self._picked(self.experts_down, self.experts_down_scale, flat))
        y = y.reshape(tokens, self.k, hidden)
        return (y * weights.astype(y.dtype).reshape(tokens, self.k, 1)).sum(1)

    def _every_expert(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """At least as many picks as experts (prefill, large decode batches): each expert's weights read once, in
        place, over every token, and combined by a ``[tokens, E]`` weight matrix that is zero where a token did not
        choose the expert; gathering would copy more weight rows than the layer holds."""
        tokens, hidden = x.shape[0], x.shape[1]
        combine = (ops.one_hot(ids, self.num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
                   * weights.reshape(tokens, self.k, 1)).sum(1)  # [tokens, E]
        if self.local < self.num_experts:
            combine = combine[:, self.start:self.start + self.local]
        rows = ops.broadcast_to(x.reshape(1, tokens, hidden), (self.local, tokens, hidden))
        gate_up = self.batched(rows, self._float(self.experts_gate_up, self.experts_gate_up_scale))
        act = ops.silu(gate_up[:, :, :self.f]) * gate_up[:, :, self.f:]
        y = self.batched(act, self._float(self.experts_down, self.experts_down_scale))  # [E, tokens, hidden]
        return (y * combine.T.astype(y.dtype).reshape(self.local, tokens, 1)).sum(0)

    def _picked(self, weight: Tensor, scale: Tensor | None, flat: Tensor) -> Tensor:
        """The picked experts' stacked weights ``[picks, out, in]``, dequantized after the gather where int8."""
        if scale is None:
            return ops.gather(weight, flat, 0)
        return self._float(ops.gather(weight, flat, 0), ops.gather(scale, flat, 0))

    def _float(self, weight: Tensor, scale: Tensor | None) -> Tensor:
        """Stacked expert weights ``[n, out, in]`` as float: as held, or int8 times each row's float32 scale
        ``[n, out]`` (one float32 product per weight, ``agents.weights.packed.dequantize_rows``'s)."""
        if scale is None:
            return weight
        return (weight.astype(ms.float32) * scale.reshape(scale.shape[0], scale.shape[1], 1)).astype(self.dtype)


class ExpertsHeld:
    """How a block holds a stacked expert weight (its Parameter ``weight``): as loaded (``[e, out, in]``,
    ``shape``), or transposed to ``[e, in, out]`` for a grouped matmul that reads it so (``transposed``); or
    (``quantized``, w8a16) int8 in either layout beside a ``scale [e, out]`` (float32, or the model's dtype for
    the grouped matmul), each expert quantized per output row as a dense projection is
    (``agents.weights.packed.quantize_rows``). ``llama.load_weights_into`` and
    ``model_weights`` convert through it, as through a projection's panels."""

    panels = True  # held in a layout of its own: loaded through ``load``, never as raw bfloat16 bits

    def __init__(self, name: str, shape: tuple[int, int, int], dtype: ms.Type, transposed: bool,
                 quantized: bool = False, scale_dtype: ms.Type = ms.float32) -> None:
        self.shape, self.transposed, self.quantized = shape, transposed, quantized
        e, out, inp = shape
        held, held_dtype = ((e, inp, out) if transposed else shape), (ms.int8 if quantized else dtype)
        self.weight = Parameter(initializer("zeros", held, held_dtype), name=name)
        self.scale = Parameter(initializer("zeros", (e, out), scale_dtype), name=f"{name}_scale") \
            if quantized else None

    def load(self, value: np.ndarray, scale: np.ndarray | None = None) -> None:
        """Set the ``[e, out, in]`` weight: float (quantized here where held int8), or int8 with its
        ``scale [e, out]`` (quantized already)."""
        if scale is not None and not self.quantized:
            raise ValueError("int8 experts with scales (a quantized checkpoint) need model_config.quantization "
                             "w8a16; these experts are held float")
        if self.scale is not None:
            e, out, inp = self.shape
            if scale is None:
                q, scale = packed_weights.quantize_rows(np.asarray(value).reshape(e * out, inp))
                value = q.reshape(self.shape)
            if tuple(np.shape(scale)) not in ((e, out), (e * out,)):
                raise ValueError(f"expert scales: expected shape {(e, out)}, got {np.shape(scale)}")
            value = np.asarray(value, np.int8)
            self.weight.set_data(Tensor(np.ascontiguousarray(value.transpose(0, 2, 1) if self.transposed else value)))
            self.scale.set_data(Tensor(np.asarray(scale, np.float32).reshape(e, out)).astype(self.scale.dtype))
            return
        self.weight.set_data(Tensor(np.ascontiguousarray(value.transpose(0, 2, 1) if self.transposed else value),
                                    self.weight.dtype))

    def unstored(self, held: np.ndarray) -> np.ndarray:
        """The ``[e, out, in]`` weight back from what ``weight`` holds (int8: dequantized, as the ops form it)."""
        if self.scale is not None:
            e, out, inp = self.shape
            q = held.transpose(0, 2, 1) if self.transposed else held
            scale = self.scale.astype(ms.float32).asnumpy().reshape(e * out)
            return packed_weights.dequantize_rows(np.ascontiguousarray(q).reshape(e * out, inp), scale).reshape(
                self.shape)
        return held.transpose(0, 2, 1) if self.transposed else held


class SharedExpert(nn.Cell):
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP every token reads, behind a sigmoid gate. Its ``[gate; up]``
    and down projections are held and multiplied as the dense MLP's are (``ProjectionWeight`` in the backend's
    layout, the backend's ``partial_linear`` and ``swiglu``), so under ``model_config.quantization`` w8a16 they are
    int8 with a float32 scale per output row read by the same int8 matmuls, and a rank's slice (``width`` of the
    rows) is scaled as the dense MLP's: gate/up rows by themselves, down columns by their whole rows (the loader's
    scales). The gate ``[1, h]`` stays float, as the router does: each gives a handful of logits read directly by a
    sigmoid or a softmax and top-k, where int8's error can swap which experts a token picks (or rescale the whole
    shared expert's output), to save ``h`` bytes a row (docs/quantization.md "Mixture-of-experts models")."""

    def __init__(self, hidden: int, width: int, dtype: ms.Type, quantization: str = "none",
                 backend: OpsBackend | None = None) -> None:
        super().__init__()
        backend = backend if backend is not None else OpsBackend()  # the graph ops over float [out, in] weights
        if quantization != backend.layer_quantization:
            raise ValueError(f"a shared expert under model_config.quantization {quantization} needs a backend whose "
                             f"projections are {quantization}, got {backend.name}'s ({backend.layer_quantization})")
        held = {"panels": backend.panel_weights, "panel_dtype": backend.panel_dtype, "quantization": quantization}
        self.gate_up = ProjectionWeight(hidden, 2 * width, dtype, **held)
        self.down = ProjectionWeight(width, hidden, dtype, **held)
        self.gate = Parameter(initializer("zeros", (1, hidden), dtype), name="shared_gate")
        self.project_gate_up = backend.partial_linear(2 * width)
        self.swiglu = backend.swiglu(width)
        self.project_down = backend.partial_linear(hidden)
        self.linear = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor, rows: Tensor) -> Tensor:
        act = self.swiglu(self.project_gate_up(x, self.gate_up.operands(), rows))
        return ops.sigmoid(self.linear(x, self.gate)) * self.project_down(act, self.down.operands(), rows)


class MoeMlp(nn.Cell):
    """A sparse layer's MLP slot: ``residual + block(rms_norm(x))``, the ranks' partial sums all-reduced first
    (the one collective the dense MLP's row-parallel down projection ends in). The norm is graph ops in float32,
    as transformers computes it, where the dense slot fuses it into its gate/up projection; with the backend's
    ``layer_op`` (native CPU) the slot is that one op, the residual added in it at one rank, but for Qwen2-MoE's
    shared expert: held as the dense MLP (int8 under w8a16), it runs as its own cell on the graph-normed input."""

    def __init__(self, spec: MoeSpec, hidden: int, eps: float, dtype: ms.Type, shard: ShardPlan | None = None,
                 reduce: nn.Cell | None = None, experts_op: nn.Cell | None = None,
                 routed: RoutedExperts | None = None, quantization: str = "none",
                 projections: OpsBackend | None = None, layer_op: nn.Cell | None = None) -> None:
        super().__init__()
        self.block = MoeBlock(spec, hidden, dtype, shard, experts_op, routed, quantization, projections, layer_op)
        self.eps, self.reduce = eps, reduce
        self.fused = self.block.layer_op is not None
        b = self.block
        self.eps_tensor = Tensor(np.array([eps], np.float32))
        self.routing = Tensor(np.array([b.k, b.normalise, b.start, reduce is None], np.int32))

    def construct(self, x: Tensor, norm_weight: Tensor, rows: Tensor) -> Tensor:
        if self.fused:
            y = self.block.layer(x, norm_weight, self.eps_tensor, self.routing, rows)
            if self.block.shared is not None:  # the op leaves the shared expert (its ProjectionWeights) to the cell
                y = y + self.block.shared(self._norm(x, norm_weight), rows)
            return y if self.reduce is None else x + self.reduce(y)
        y = self.block(self._norm(x, norm_weight), rows)
        if self.reduce is not None:
            y = self.reduce(y)
        return x + y

    def _norm(self, x: Tensor, norm_weight: Tensor) -> Tensor:
        h = x.astype(ms.float32)
        h = h * ops.rsqrt((h * h).mean(-1, keep_dims=True) + self.eps)
        return norm_weight * h.astype(x.dtype)
