"""The MoE block's graph ops (agents.model.moe) against the routing reference (agents.model.moe_routing), which
tests/test_moe_routing.py holds to transformers' blocks: 1 token (fewer picks than experts: the gathered path)
and 32 (the every-expert path), with and without the shared expert."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from agents.model import moe_routing
from agents.model.moe import MoeBlock
from agents.runtime.device import setup_device
from llm_serving.protocol.moe_config import MoeSpec

setup_device("CPU", 0)  # as the agents do: a later module's setup_device in this process is then a no-op
H = 16


def block_weights(rng: np.random.Generator, ffn: int, shared: int, router_scale: float = 1.0) -> dict:
    """Layer 0's 8 experts of width ``ffn`` (and a shared expert where ``shared``), float32; ``router_scale`` 0: a
    zero router (every expert ties)."""
    w = {"layers.0.router": rng.normal(0, 0.5, (8, H)) * router_scale,
         "layers.0.experts_gate_up": rng.normal(0, 0.5, (8, 2 * ffn, H)),
         "layers.0.experts_down": rng.normal(0, 0.5, (8, H, ffn))}
    if shared:
        w.update({"layers.0.shared_gate_up": rng.normal(0, 0.5, (2 * shared, H)),
                  "layers.0.shared_down": rng.normal(0, 0.5, (H, shared)),
                  "layers.0.shared_gate": rng.normal(0, 0.5, (1, H))})
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize(("top_k", "normalise", "shared"), [(2, True, 0), (2, False, 12), (3, True, 0)])
@pytest.mark.parametrize("tokens", [1, 32])
def test_graph_block_matches_reference(top_k: int, normalise: bool, shared: int, tokens: int) -> None:
    spec = MoeSpec(num_experts=8, top_k=top_k, moe_intermediate_size=8, norm_topk_prob=normalise,
                   shared_expert_intermediate_size=shared, sparse_layers=(0,))
    rng = np.random.default_rng(tokens + top_k)
    w = block_weights(rng, 8, shared)
    block = MoeBlock(spec, H, ms.float32)
    block.load(w, 0)
    x = rng.normal(0, 1, (tokens, H)).astype(np.float32)
    got = block(ms.Tensor(x)).asnumpy()
    want = moe_routing.sparse_block(x, w, 0, top_k, normalise)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_load_refuses_misshapen_expert_weights() -> None:
    spec = MoeSpec(8, 2, 8, True, 0, (0,))
    block = MoeBlock(spec, H, ms.float32)
    w = {"layers.0.router": np.zeros((8, H), np.float32), "layers.0.experts_gate_up": np.zeros((8, 16, H + 1)),
         "layers.0.experts_down": np.zeros((8, H, 8), np.float32)}
    with pytest.raises(ValueError, match=r"layers.0.experts_gate_up: expected shape \(8, 16, 16\)"):
        block.load(w, 0)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("tokens", [1, 32])
def test_the_ranks_partial_sums_add_up_to_the_whole_block(tokens: int, expert_parallel: bool) -> None:
    """Each of 4 ranks' blocks (its experts whole, or every expert's slice; its share of the shared expert) on the
    rank's cut of the weights: their outputs summed (what the all-reduce does) are the whole block's, on both the
    gathered path (1 token: picks of other ranks' experts masked) and the every-expert one."""
    from dataclasses import replace

    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.parallel import ShardPlan

    spec = MoeSpec(num_experts=8, top_k=2, moe_intermediate_size=8, norm_topk_prob=False,
                   shared_expert_intermediate_size=12, sparse_layers=(0,))
    config = replace(LlamaConfig(64, H, 32, 1, 4, 4, architecture="Qwen2MoeForCausalLM"), moe=spec)
    rng = np.random.default_rng(5)
    w = block_weights(rng, 8, 12)
    x = ms.Tensor(rng.normal(0, 1, (tokens, H)).astype(np.float32))
    total = np.zeros((tokens, H), np.float32)
    for rank in range(4):
        plan = ShardPlan(config, 4, rank, expert_parallel)
        (e0, e1), (f0, f1), (s0, s1) = plan.expert_range(), plan.expert_ffn_range(), plan.shared_ffn_range()
        gate_up = w["layers.0.experts_gate_up"][e0:e1]
        cut = {"layers.0.router": w["layers.0.router"], "layers.0.shared_gate": w["layers.0.shared_gate"],
               "layers.0.experts_gate_up": np.concatenate([gate_up[:, f0:f1], gate_up[:, 8 + f0:8 + f1]], 1),
               "layers.0.experts_down": w["layers.0.experts_down"][e0:e1, :, f0:f1],
               "layers.0.shared_gate_up": np.concatenate([w["layers.0.shared_gate_up"][s0:s1],
                                                          w["layers.0.shared_gate_up"][12 + s0:12 + s1]]),
               "layers.0.shared_down": w["layers.0.shared_down"][:, s0:s1]}
        block = MoeBlock(spec, H, ms.float32, plan)
        block.load(cut, 0)
        total += block(x).asnumpy()
    want = moe_routing.sparse_block(x.asnumpy(), w, 0, 2, False)
    np.testing.assert_allclose(total, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens, rows", [(1, 1), (32, 32), (32, 20)])
def test_the_native_op_matches_the_reference_and_zeros_the_padding(tokens: int, rows: int) -> None:
    """``MoeExperts`` (agents/model/kernels/moe_experts.cc) in the block's place of the graph paths: the reference
    block on the real rows, zeros on the padding after them; on one rank of two at expert parallelism, that rank's
    share (the picks of the other rank's experts skipped)."""
    from dataclasses import replace

    from agents.model.native_kernels import native_ops
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.parallel import ShardPlan

    spec = MoeSpec(num_experts=8, top_k=3, moe_intermediate_size=40, norm_topk_prob=True,
                   shared_expert_intermediate_size=0, sparse_layers=(0,))
    rng = np.random.default_rng(tokens + rows)
    w = block_weights(rng, 40, 0)
    x = rng.normal(0, 1, (tokens, H)).astype(np.float32)
    op = native_ops(H).moe_experts()
    block = MoeBlock(spec, H, ms.float32, experts_op=op)
    block.load(w, 0)
    got = block(ms.Tensor(x), ms.Tensor(np.array([rows], np.int32))).asnumpy()
    want = moe_routing.sparse_block(x, w, 0, 3, True)
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-4, atol=1e-4)
    assert not got[rows:].any()
    config = replace(LlamaConfig(64, H, 32, 1, 4, 4, architecture="Qwen3MoeForCausalLM"), moe=spec)
    total = np.zeros_like(want)
    for rank in range(2):
        plan = ShardPlan(config, 2, rank, expert_parallel=True)
        e0, e1 = plan.expert_range()
        ranked = MoeBlock(spec, H, ms.float32, plan, experts_op=op)
        ranked.load({**w, "layers.0.experts_gate_up": w["layers.0.experts_gate_up"][e0:e1],
                     "layers.0.experts_down": w["layers.0.experts_down"][e0:e1]}, 0)
        total += ranked(ms.Tensor(x)).asnumpy()
    np.testing.assert_allclose(total, want, rtol=1e-4, atol=1e-4)


def _dequantized(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The experts replaced by what w8a16 holds of them (each expert quantized per output row), dequantized."""
    from agents.weights import packed as pw

    out = dict(w)
    for name in ("layers.0.experts_gate_up", "layers.0.experts_down"):
        e, rows, cols = w[name].shape
        out[name] = pw.dequantize_rows(*pw.quantize_rows(w[name].reshape(e * rows, cols))).reshape(e, rows, cols)
    return out


@pytest.mark.parametrize("ops", ["graph", "experts", "layer"])
@pytest.mark.parametrize("tokens, rows", [(1, 1), (32, 32), (32, 20)])
def test_int8_experts_compute_the_float_block_on_their_dequantized_values(tokens: int, rows: int,
                                                                          ops: str) -> None:
    """w8a16 experts (int8 with a float32 scale per row): the native ops (``MoeExpertsInt8``; ``MoeLayerInt8``,
    the whole MLP slot) and the graph paths (gathered at 1 token, every expert at 32) give bit for bit what the
    float32 block gives on the dequantized experts, and differ from the float block on the original ones (really
    quantized). The block holds a byte a weight, and the loaded values read back (``unstored``) are the
    dequantized ones."""
    from agents.model.moe import MoeMlp
    from agents.model.native_kernels import native_ops

    spec = MoeSpec(num_experts=8, top_k=3, moe_intermediate_size=40, norm_topk_prob=True,
                   shared_expert_intermediate_size=0, sparse_layers=(0,))
    rng = np.random.default_rng(tokens + rows)
    w = block_weights(rng, 40, 0)
    x, n = ms.Tensor(rng.normal(0, 1, (tokens, H)).astype(np.float32)), ms.Tensor(np.array([rows], np.int32))
    native = native_ops(H) if ops != "graph" else None

    def run(weights: dict[str, np.ndarray], quantization: str) -> np.ndarray:
        int8 = quantization != "none"
        if ops == "layer" and native is not None:
            mlp = MoeMlp(spec, H, 1e-6, ms.float32, quantization=quantization, layer_op=native.moe_layer(int8))
            mlp.block.load(weights, 0)
            return mlp(x, ms.Tensor(np.ones(H, np.float32)), n).asnumpy()[:rows]
        op = None if native is None else (native.moe_experts_int8() if int8 else native.moe_experts())
        block = MoeBlock(spec, H, ms.float32, experts_op=op, quantization=quantization)
        block.load(weights, 0)
        if quantization != "none":
            assert str(block.experts_gate_up.dtype) == "Int8" and block.experts_down.nbytes == 8 * H * 40
            held = block.held["experts_down"]
            np.testing.assert_array_equal(held.unstored(block.experts_down.asnumpy()),
                                          _dequantized(w)["layers.0.experts_down"])
        return block(x, n).asnumpy()[:rows]

    int8 = run(w, "w8a16")
    np.testing.assert_array_equal(int8, run(_dequantized(w), "none"))
    assert np.abs(int8 - run(w, "none")).max() > 0


def test_int8_experts_refuse_misshapen_scales() -> None:
    spec = MoeSpec(8, 2, 8, True, 0, (0,))
    block = MoeBlock(spec, H, ms.float32, quantization="w8a16")
    w = {"layers.0.router": np.zeros((8, H), np.float32), "layers.0.experts_gate_up": np.zeros((8, 16, H), np.int8),
         "layers.0.experts_gate_up.scale": np.ones((8, 15), np.float32),
         "layers.0.experts_down": np.zeros((8, H, 8), np.float32)}
    with pytest.raises(ValueError, match=r"expert scales: expected shape \(8, 16\)"):
        block.load(w, 0)
    with pytest.raises(ValueError, match="need model_config.quantization w8a16"):
        MoeBlock(spec, H, ms.float32).load({**w, "layers.0.experts_gate_up.scale": np.ones((8, 16))}, 0)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize(("shared", "router"), [(0, "random"), (12, "random"), (0, "tied")])
@pytest.mark.parametrize("tokens, rows", [(1, 1), (32, 20)])
def test_the_layer_op_is_the_norm_routing_and_block_of_the_reference(tokens: int, rows: int, shared: int,
                                                                      router: str) -> None:
    """``MoeLayer`` (kernels/moe_experts.cc) as the MLP slot (``MoeMlp`` on the native backend; a shared expert
    as its own cell of native projections beside it): x + the reference block on rmsnorm(x) on the real rows, x on
    the padding; at two ranks of expert parallelism and two of tensor parallelism (the shared expert cut), each
    rank's partial sum without the residual, adding up to the block. ``tied``: a zero router, every expert's
    probability equal, so the picks are the k lowest ids (torch.topk's order, held by moe_routing)."""
    from dataclasses import replace

    from mindspore import nn

    from agents.model.backends.native_cpu import NativeCpuBackend
    from agents.model.moe import MoeMlp
    from agents.model.native_kernels import native_ops
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.parallel import ShardPlan

    spec = MoeSpec(num_experts=8, top_k=3, moe_intermediate_size=40, norm_topk_prob=not shared,
                   shared_expert_intermediate_size=shared, sparse_layers=(0,))
    rng = np.random.default_rng(tokens + shared)
    w = block_weights(rng, 40, shared, router_scale=float(router == "random"))
    x, norm = rng.normal(0, 1, (tokens, H)).astype(np.float32), rng.normal(1, 0.1, H).astype(np.float32)
    args = (ms.Tensor(x), ms.Tensor(norm), ms.Tensor(np.array([rows], np.int32)))
    backend = NativeCpuBackend(native_ops(H))  # the shared expert's projections too, as the model holds them

    mlp = MoeMlp(spec, H, 1e-6, ms.float32, projections=backend, layer_op=backend.moe_layer())
    mlp.block.load(w, 0)
    assert mlp.fused
    got = mlp(*args).asnumpy()
    block = moe_routing.sparse_block(_rms_norm(x, norm, 1e-6), w, 0, 3, not shared)
    np.testing.assert_allclose(got[:rows], (x + block)[:rows], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[rows:], x[rows:])
    config = replace(LlamaConfig(64, H, 32, 1, 4, 4, architecture="Qwen2MoeForCausalLM"), moe=spec)
    for expert_parallel in (True, False):
        total = np.zeros_like(x)
        for rank in range(2):
            plan = ShardPlan(config, 2, rank, expert_parallel)
            (e0, e1), (f0, f1), (s0, s1) = plan.expert_range(), plan.expert_ffn_range(), plan.shared_ffn_range()
            gate_up, shared_gate_up = w["layers.0.experts_gate_up"][e0:e1], w.get("layers.0.shared_gate_up")
            cut = {**w, "layers.0.experts_gate_up": np.concatenate([gate_up[:, f0:f1], gate_up[:, 40 + f0:40 + f1]], 1),
                   "layers.0.experts_down": w["layers.0.experts_down"][e0:e1, :, f0:f1]}
            if shared_gate_up is not None:
                cut.update({"layers.0.shared_gate_up": np.concatenate([shared_gate_up[s0:s1],
                                                                       shared_gate_up[shared + s0:shared + s1]]),
                            "layers.0.shared_down": w["layers.0.shared_down"][:, s0:s1]})
            # one rank's all-reduce is the identity: the slot then gives x + this rank's partial sum
            ranked = MoeMlp(spec, H, 1e-6, ms.float32, plan, reduce=nn.Identity(), projections=backend,
                            layer_op=backend.moe_layer())
            ranked.block.load(cut, 0)
            total += ranked(*args).asnumpy() - x
        np.testing.assert_allclose(total[:rows], block[:rows], rtol=1e-4, atol=1e-4)
