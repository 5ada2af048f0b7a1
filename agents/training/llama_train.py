"""A causal Llama for training, in MindSpore, whose weights are Hugging Face Llama's tensors.

The serving graphs (``agents.model.llama``) are inference-only (paged cache, in-graph argmax), so training has its
own plain forward: full causal attention over a window, rotary embedding in transformers' rotate-half layout,
grouped-query heads repeated as ``repeat_kv`` does, RMSNorm, SwiGLU, tied or separate lm_head. Projections stay
token-flat ``[tokens, hidden]`` (3-D activations take MindSpore's slow matmul path on CPU, see the shared notes).
``hf_tensors`` names every weight as ``LlamaForCausalLM`` does, so the serving loader reads the result unchanged.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agents.model.rope import rotary_tables
from llm_serving.protocol.model_config import LlamaConfig

INIT_STD = 0.02


def _param(rng: np.random.Generator, shape: tuple[int, ...], std: float, name: str) -> Parameter:
    return Parameter(Tensor(rng.normal(0.0, std, shape).astype(np.float32)), name=name)


def _ones(n: int, name: str) -> Parameter:
    return Parameter(Tensor(np.ones(n, np.float32)), name=name)


def _rms(x: Tensor, weight: Parameter, eps: float) -> Tensor:
    return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + eps) * weight


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), -1)


class TrainLayer(nn.Cell):
    def __init__(self, config: LlamaConfig, rng: np.random.Generator) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.eps = config.rms_norm_eps
        out_std = INIT_STD / math.sqrt(2 * config.num_hidden_layers)  # GPT-2's residual scaling
        self.input_layernorm = _ones(h, "input_layernorm")
        self.q_proj = _param(rng, (self.heads * d, h), INIT_STD, "q_proj")
        self.k_proj = _param(rng, (self.kv_heads * d, h), INIT_STD, "k_proj")
        self.v_proj = _param(rng, (self.kv_heads * d, h), INIT_STD, "v_proj")
        self.o_proj = _param(rng, (h, self.heads * d), out_std, "o_proj")
        self.post_attention_layernorm = _ones(h, "post_attention_layernorm")
        self.gate_proj = _param(rng, (config.intermediate_size, h), INIT_STD, "gate_proj")
        self.up_proj = _param(rng, (config.intermediate_size, h), INIT_STD, "up_proj")
        self.down_proj = _param(rng, (h, config.intermediate_size), out_std, "down_proj")

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        batch, seq = x.shape[0], x.shape[1]
        flat = x.reshape(batch * seq, -1)
        a = _rms(flat, self.input_layernorm, self.eps)
        q = ops.matmul(a, self.q_proj.T).reshape(batch, seq, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        k = ops.matmul(a, self.k_proj.T).reshape(batch, seq, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = ops.matmul(a, self.v_proj.T).reshape(batch, seq, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        group = self.heads // self.kv_heads
        if group > 1:
            k = ops.repeat_interleave(k, group, 1)
            v = ops.repeat_interleave(v, group, 1)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.head_dim) + mask
        attn = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(batch * seq, -1)
        flat = flat + ops.matmul(attn, self.o_proj.T)
        m = _rms(flat, self.post_attention_layernorm, self.eps)
        mlp = ops.silu(ops.matmul(m, self.gate_proj.T)) * ops.matmul(m, self.up_proj.T)
        flat = flat + ops.matmul(mlp, self.down_proj.T)
        return flat.reshape(batch, seq, -1)


class TrainLlama(nn.Cell):
    """``construct(ids [B, T], labels [B, T])`` is the mean next-token cross-entropy."""

    def __init__(self, config: LlamaConfig, seq_len: int, seed: int) -> None:
        super().__init__()
        if config.architecture != "LlamaForCausalLM":
            raise ValueError(f"training builds plain Llama layers, not {config.architecture}")
        rng = np.random.default_rng(seed)
        self.config = config
        self.embed_tokens = _param(rng, (config.vocab_size, config.hidden_size), INIT_STD, "embed_tokens")
        self.layers = nn.CellList([TrainLayer(config, rng) for _ in range(config.num_hidden_layers)])
        self.norm = _ones(config.hidden_size, "norm")
        self.lm_head = None if config.tie_word_embeddings else _param(
            rng, (config.vocab_size, config.hidden_size), INIT_STD, "lm_head")
        cos, sin = rotary_tables(config, seq_len)
        self.cos = Tensor(np.asarray(cos, np.float32)[:seq_len])
        self.sin = Tensor(np.asarray(sin, np.float32)[:seq_len])
        self.mask = Tensor(np.triu(np.full((seq_len, seq_len), -1e9, np.float32), 1))

    def logits(self, ids: Tensor) -> Tensor:
        batch, seq = ids.shape
        x = ops.gather(self.embed_tokens, ids, 0)
        cos, sin, mask = self.cos[:seq], self.sin[:seq], self.mask[:seq, :seq]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = _rms(x.reshape(batch * seq, -1), self.norm, self.config.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return ops.matmul(x, head.T)

    def construct(self, ids: Tensor, labels: Tensor) -> Tensor:
        return ops.cross_entropy(self.logits(ids), labels.reshape(-1))

    def named_parameters_hf(self) -> dict[str, Parameter]:
        """Every weight under its ``LlamaForCausalLM`` name (no ``lm_head.weight`` when tied, as HF saves it)."""
        params = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            params["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                params[f"{p}self_attn.{name}.weight"] = getattr(layer, name)
            for name in ("gate_proj", "up_proj", "down_proj"):
                params[f"{p}mlp.{name}.weight"] = getattr(layer, name)
            params[f"{p}input_layernorm.weight"] = layer.input_layernorm
            params[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm
        return params

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """Every weight under its ``LlamaForCausalLM`` name, float32."""
        return {name: param.asnumpy() for name, param in self.named_parameters_hf().items()}


def load_hf_tensors(net: TrainLlama, tensors: dict[str, np.ndarray]) -> None:
    """Set ``net``'s weights from ``LlamaForCausalLM``-named tensors (the inverse of ``hf_tensors``; a net of fewer
    layers takes the first ones: early exit)."""
    for name, param in net.named_parameters_hf().items():
        value = np.ascontiguousarray(tensors[name], np.float32)
        if value.shape != tuple(param.shape):
            raise ValueError(f"{name}: shape {value.shape}, expected {tuple(param.shape)}")
        param.set_data(Tensor(value))


class TrainStep(nn.Cell):
    """One optimizer step: loss, gradients, global-norm clipping, AdamW."""

    def __init__(self, net: TrainLlama, optimizer: nn.Optimizer, clip_norm: float = 1.0) -> None:
        super().__init__()
        self.net, self.optimizer, self.clip_norm = net, optimizer, clip_norm
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, ids: Tensor, labels: Tensor) -> Tensor:
        loss = self.net(ids, labels)
        grads = self.grad(self.net, self.weights)(ids, labels)
        grads = ops.clip_by_global_norm(grads, self.clip_norm)
        self.optimizer(grads)
        return loss


def set_graph_mode() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
