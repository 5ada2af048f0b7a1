"""The Llama family as MindSpore Cells for serving: fused projections, paged KV cache, in-graph greedy argmax.

The layer's maths is written once here; the ops that run it come from the runner's ops backend
(``agents.model.backends``): the projections (each fused with the RMSNorm before it, the SwiGLU or the residual add
after it), the attention with the KV cache it owns, and the greedy pick. The layer holds the weights, in the
layout the backend asks for; it never branches on which backend it has.

Choices made for every backend (measured on CPU, see docs/model.md and the shared notes):
- Activations stay token-flat ``[tokens, hidden]`` for every projection (3-D activations hit a slow matmul path).
- Q, K, V are one fused projection and gate/up another; the rotary tables are gathered once per step.
- The families differ by switches of this one layer (``LlamaConfig.family``): Qwen2's q/k/v biases are added to
  the fused QKV output, Qwen3's per-head q/k norms applied to it before the attention cell ropes it.
- The graph ends in a greedy argmax and the chosen token's log-probability, so an all-greedy step reads only
  ``2 x batch`` numbers back. The logits are a third output, read only for sampled batches and logits checks.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from agents.model import moe, parallel
from agents.model.backends import OpsBackend, PortableBackend
from agents.model.lora import LoraLayerCells, LoraMasks, LoraShape
from agents.model.projection import ProjectionWeight
from agents.model.rope import rotary_tables
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan


def norm_weight(hidden: int, dtype: ms.Type, name: str) -> Parameter:
    """An RMSNorm's weight (ones until loaded); the backend's ops apply it."""
    return Parameter(Tensor(np.ones(hidden), dtype), name=name)


class LlamaLayer(nn.Cell):
    """One decoder layer: its weights, and the backend's cells that run it (the attention cell owns the
    layer's slice of the paged KV cache). Under tensor parallelism (``shard``) it holds one rank's heads and
    FFN slice, and its two row-parallel projections end in an all-reduce (``agents.model.parallel``)."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: ms.Type,
                 backend: OpsBackend, shard: ShardPlan | None = None, index: int = 0,
                 lora: LoraShape | None = None) -> None:
        super().__init__()
        hidden, eps, panels = config.hidden_size, config.rms_norm_eps, backend.panel_weights
        fmt, quant = backend.panel_dtype, backend.layer_quantization
        shard = shard if shard is not None else ShardPlan(config)
        heads = shard.attention_config  # this rank's heads; its hidden_size is their width
        self.attention_norm = norm_weight(hidden, dtype, "attention_norm")
        self.ffn_norm = norm_weight(hidden, dtype, "ffn_norm")
        self.w_qkv = ProjectionWeight(hidden, heads.qkv_dim, dtype, panels, panel_dtype=fmt, quantization=quant)
        self.wo = ProjectionWeight(heads.hidden_size, hidden, dtype, panels, panel_dtype=fmt, quantization=quant)
        # the MLP slot: a sparse layer's experts (agents.model.moe), else the dense SwiGLU MLP
        sparse = config.moe is not None and index in config.moe.sparse_layers
        layer_op = backend.moe_layer() if sparse else None  # the whole slot as one op, else the experts as one
        self.moe = moe.MoeMlp(config.moe, hidden, eps, dtype, shard, parallel.AllReduceSum() if shard.tp > 1
                              else None, backend.moe_experts() if layer_op is None else None,
                              backend.routed_experts(), quant, backend, layer_op) \
            if sparse and config.moe is not None else None
        self.w_gate_up = None if sparse else ProjectionWeight(hidden, 2 * shard.ffn, dtype, panels, swiglu=True,
                                                              panel_dtype=fmt, quantization=quant)
        self.w_down = None if sparse else ProjectionWeight(shard.ffn, hidden, dtype, panels, panel_dtype=fmt,
                                                           quantization=quant)
        self.has_qkv_bias, self.has_qk_norm = config.qkv_bias, config.qk_norm
        # this rank's q/k/v bias rows, cut as w_qkv's; the head norms' weights are per head_dim, so every rank's
        self.qkv_bias = Parameter(initializer("zeros", (heads.qkv_dim,), dtype), name="qkv_bias") \
            if config.qkv_bias else None
        self.q_norm = norm_weight(config.head_dim, dtype, "q_norm") if config.qk_norm else None
        self.k_norm = norm_weight(config.head_dim, dtype, "k_norm") if config.qk_norm else None
        self.head_norm = backend.head_norm(heads, eps) if config.qk_norm else None
        self.norm_qkv = backend.norm_linear(heads.qkv_dim, eps)
        self.attention = backend.attention(heads, num_blocks, block_size, dtype)
        self.norm_gate_up = backend.norm_swiglu(shard.ffn, eps)
        self.residual_linear = backend.residual_linear()  # the output and the down projection
        # that same cell at tp 1; else this rank's share of each projection, then an all-reduce
        self.output_projection = parallel.row_parallel(shard, backend, self.residual_linear, hidden)
        self.down_projection = parallel.row_parallel(shard, backend, self.residual_linear, hidden)
        # LoRA adapter slots (agents.model.lora): the adapter graphs' projections take each token's update
        if lora is not None and config.moe is not None:  # the master refuses it first (lora.enable)
            raise ValueError("LoRA adapters on a mixture-of-experts model are not served")
        self.lora = LoraLayerCells(lora, config, shard, backend, dtype) if lora is not None else None

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, lens: Tensor,
                  block_tables: Tensor, rows: Tensor, is_prefill: bool, context_lens: Tensor | None = None,
                  positions: Tensor | None = None, lora_masks: tuple | None = None) -> Tensor:
        """``rows`` [1]: the real (leading) token rows of ``x``, for backends that skip the padding after them.
        ``context_lens``: given in steps whose queries attend to cached context (``agents.runtime.mixed_steps``;
        ``lens`` then holds the query lengths, and ``positions`` the tokens' or what the attention's ``chunk_input``
        made of them once for all layers); None, a graph constant, in the prefill
        and decode graphs. ``lora_masks``: each token's adapter slot as ``LoraMasks`` gives it (the adapter graphs);
        None, a graph constant, elsewhere."""
        if lora_masks is not None:
            qkv = self.lora.qkv(x, self.attention_norm, self.w_qkv.operands(), rows, lora_masks)
        else:
            qkv = self.norm_qkv(x, self.attention_norm, self.w_qkv.operands(), rows)
        if self.has_qkv_bias:
            qkv = qkv + self.qkv_bias
        if self.has_qk_norm:
            qkv = self.head_norm(qkv, self.q_norm, self.k_norm)
        if context_lens is None:
            attn = self.attention(qkv, cos, sin, slot_mapping, lens, block_tables, is_prefill)
        else:
            attn = self.attention.chunked(qkv, cos, sin, slot_mapping, lens, context_lens, block_tables, positions)
        if lora_masks is not None:
            x = self.lora.output(attn, self.wo.operands(), x, rows, lora_masks)
            return self.lora.mlp(x, self.ffn_norm, self.w_gate_up.operands(), self.w_down.operands(), rows,
                                 lora_masks)
        x = self.output_projection(attn, self.wo.operands(), x, rows)
        if self.moe is not None:
            return self.moe(x, self.ffn_norm, rows)
        act = self.norm_gate_up(x, self.ffn_norm, self.w_gate_up.operands(), rows)
        return self.down_projection(act, self.w_down.operands(), x, rows)


class LlamaModel(nn.Cell):
    """Weights and KV cache of the whole model, or of one tensor-parallel rank's slice of it (``shard``: its
    heads, FFN and vocabulary range); ``LlamaStep`` cells run it as prefill or decode graphs."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, max_positions: int,
                 dtype: ms.Type = ms.float32, backend: OpsBackend | None = None,
                 shard: ShardPlan | None = None, lora: LoraShape | None = None) -> None:
        super().__init__()
        backend = backend if backend is not None else PortableBackend()
        shard = shard if shard is not None else ShardPlan(config)
        vocab = shard.vocab_range[1] - shard.vocab_range[0]  # this rank's vocabulary rows
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Parameter(initializer("zeros", (vocab, config.hidden_size), dtype), name="embed_tokens")
        self.embed = parallel.embedding(shard)
        self.layers = nn.CellList([LlamaLayer(config, num_blocks, block_size, dtype, backend, shard, i, lora)
                                   for i in range(config.num_hidden_layers)])
        self.lora = lora  # adapter slots; their per-token masks come from the blocks a step writes
        self.lora_masks = LoraMasks(lora, num_blocks, block_size, dtype, backend.lora_projections() is not None) \
            if lora is not None else None
        self.norm = norm_weight(config.hidden_size, dtype, "norm")
        # float: its errors land on the logits directly
        self.lm_head = ProjectionWeight(config.hidden_size, vocab, dtype, backend.panel_weights,
                                        panel_dtype=backend.panel_dtype)
        self.norm_lm_head = backend.norm_linear(vocab, config.rms_norm_eps)
        self.greedy = parallel.greedy(shard, backend.greedy())
        cos, sin = rotary_tables(config, max_positions)
        self.cos = Tensor(cos, dtype)
        self.sin = Tensor(sin, dtype)

    @staticmethod
    def real_rows(lens: Tensor, is_prefill: bool) -> tuple[Tensor, Tensor]:
        """``[1]`` int32 counts of the real token rows and sequence rows of a step, which lead its padded
        bucket: sequences with a length > 0; tokens are one per sequence in decode, the prompts' sum in a
        (ragged) prefill."""
        sequences = (lens > 0).astype(ms.int32).sum().astype(ms.int32).reshape(1)  # sum gives int64
        return (lens.sum().astype(ms.int32).reshape(1) if is_prefill else sequences), sequences

    def hidden_states(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, lens: Tensor,
                      block_tables: Tensor, token_rows: Tensor, is_prefill: bool,
                      context_lens: Tensor | None = None, adapters: bool = False) -> Tensor:
        """``adapters``: the step graph computes each token's LoRA update (``agents.model.lora``); a graph
        constant, so a model with adapter slots still has its plain graphs for steps without adapters."""
        x = self.embed(self.embed_tokens, input_ids)
        cos = ops.gather(self.cos, positions, 0)
        sin = ops.gather(self.sin, positions, 0)
        chunk_input = positions
        if context_lens is not None:  # once for all layers (an Ascend step's attention mask)
            chunk_input = self.layers[0].attention.chunk_input(positions, block_tables, lens)
        masks = self.lora_masks(slot_mapping) if adapters else None
        for layer in self.layers:
            x = layer(x, cos, sin, slot_mapping, lens, block_tables, token_rows, is_prefill, context_lens, chunk_input,
                      masks)
        return x

    def logits(self, last_hidden: Tensor, sequence_rows: Tensor) -> Tensor:
        """float32 logits ``[batch, vocab]`` of the final norm + lm_head (a rank's vocabulary range under
        tensor parallelism)."""
        return self.norm_lm_head(last_hidden, self.norm, self.lm_head.operands(), sequence_rows).astype(ms.float32)


class LlamaStep(nn.Cell):
    """One compiled step (``is_prefill`` is a graph constant).

    Inputs (static bucket shapes): input_ids/positions/slot_mapping ``[tokens]``; ``batch_valid_length``
    ``[batch]`` (prefill: prompt lengths, decode: context lengths; the name is the graph input's, which Ascend's
    internal kernels read by name); ``block_tables`` ``[batch, width]``; ``last_index`` ``[batch]`` flat index of
    each sequence's last token (prefill only; decode uses every token).

    Returns greedy token ids, their log-probabilities and the float32 logits ``[batch, vocab]``. The logits are
    an output the caller may leave on the device: only sampled batches and logits checks read them (returning
    them did not change decode step time measurably, and it saves compiling a second graph per shape).
    """

    def __init__(self, model: LlamaModel, is_prefill: bool, adapters: bool = False) -> None:
        super().__init__()
        self.model = model
        self.is_prefill = is_prefill
        self.adapters = adapters  # the LoRA adapter graph (LlamaModel.hidden_states)

    def construct(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, batch_valid_length: Tensor,
                  block_tables: Tensor, last_index: Tensor):
        # not rebound to a shorter name: MindSpore would name the graph input after it
        token_rows, sequence_rows = self.model.real_rows(batch_valid_length, self.is_prefill)
        hidden = self.model.hidden_states(input_ids, positions, slot_mapping, batch_valid_length, block_tables,
                                          token_rows, self.is_prefill, None, self.adapters)
        if self.is_prefill:
            hidden = ops.gather(hidden, last_index, 0)
        logits = self.model.logits(hidden, sequence_rows)
        token_ids, logprobs = self.model.greedy(logits)
        return token_ids, logprobs, logits

    def logits_rows(self, *inputs: Tensor) -> int:
        """The rows of the logits these inputs give, known without running (``parallel.ShardedStep.compile``)."""
        return int(inputs[5].shape[0] if self.is_prefill else inputs[0].shape[0])


def _canonical_parameters(model: LlamaModel) -> dict[str, tuple[Parameter, ProjectionWeight | moe.ExpertsHeld | None]]:
    """The model's Parameters under their canonical fused weight names (see ``agents.weights.checkpoints``), each with
    its ProjectionWeight where it is a projection (which may hold it in the panel layout)."""
    params = {"embed_tokens": (model.embed_tokens, None), "norm": (model.norm, None),
              "lm_head": (model.lm_head.weight, model.lm_head)}
    for i, layer in enumerate(model.layers):
        for name in ("attention_norm", "ffn_norm", "qkv_bias", "q_norm", "k_norm"):
            if getattr(layer, name) is not None:
                params[f"layers.{i}.{name}"] = (getattr(layer, name), None)
        for name in ("w_qkv", "wo", "w_gate_up", "w_down"):
            cell = getattr(layer, name)
            if cell is not None:
                params[f"layers.{i}.{name}"] = (cell.weight, cell)
        if layer.moe is not None:  # the expert block's weights (agents.weights.moe_weights), stacked experts and
            # the shared expert's projections through the layouts the backend holds them in
            params.update({f"layers.{i}.{name}": held for name, held in layer.moe.block.named_weights().items()})
    return params


def load_weights_into(model: LlamaModel, weights: dict[str, np.ndarray]) -> None:
    """Copy a canonical fused weight dict into the model's Parameters."""
    targets = _canonical_parameters(model)
    missing = sorted(set(targets) - set(weights))
    if missing:
        raise KeyError(f"weights are missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name, (param, linear) in targets.items():
        value = weights[name]
        expected = linear.shape if linear is not None else tuple(param.shape)
        if tuple(value.shape) != tuple(expected):
            raise ValueError(f"parameter {name}: expected shape {tuple(expected)}, got {tuple(value.shape)}")
        if value.dtype == np.uint16:  # bfloat16 bits (agents.weights.sharded.bf16_bits)
            if linear is None or not (linear.panels or linear.quantized):  # held as they are: no float32 copy
                bits = Tensor(np.ascontiguousarray(value)).view(ms.bfloat16)
                param.set_data(bits if param.dtype == ms.bfloat16 else bits.astype(param.dtype))
                continue
            value = (value.astype(np.uint32) << 16).view(np.float32)
        if linear is not None:
            linear.load(value, weights.get(f"{name}.scale"))  # int8 with scales: quantized already
        else:
            param.set_data(Tensor(np.ascontiguousarray(value), model.dtype))
    for i, layer in enumerate(model.layers):  # an int8 KV cache with static scales (agents.weights.kv_scales)
        if getattr(layer.attention, "kv_scale", None) is not None:
            key = f"layers.{i}.kv_scale"
            if key not in weights:
                raise KeyError(f"weights are missing {key!r}: an int8 KV cache with static scales needs them "
                               "calibrated (agents.weights.kv_scales)")
            layer.attention.load_kv_scales(weights[key])


def model_weights(model: LlamaModel) -> dict[str, np.ndarray]:
    """The model's weights as a canonical fused dict (e.g. to save a converted ``.ckpt``)."""
    return {name: linear.unstored(param.asnumpy()) if linear is not None else param.asnumpy()
            for name, (param, linear) in _canonical_parameters(model).items()}
