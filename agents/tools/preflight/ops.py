"""Each fused primitive the Ascend backend uses, run alone in a graph of its own (inputs named as the backend's
graphs name them, since the internal kernels read lengths by graph input name) on seeded inputs; ``run_ops``
returns inputs and outputs by name (``in_*``, ``out_*``), which ``agents.tools.preflight.op_checks`` holds to the
numpy references of ``agents.tools.preflight.references``.

On an NPU (``--device Ascend``) the primitives are MindSpore's kernels with ``infer_boost`` on, as the backend
serves; ``--device CPU`` runs the backend's CPU stand-ins through the same cells and inputs, which is how this
script and the comparison are tested where no NPU is.

Usage: python -m agents.tools.preflight.ops --device Ascend|CPU OUT_NPZ (tests/test_ascend_npu.py; ``llm-serving
preflight`` calls ``run_ops`` in its child processes)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agents.model.backends.ascend import FusedOps, causal_mask
from agents.model.backends.ascend_moe import AscendRoutedExperts, ExpertSlice, MoeOps
from agents.model.backends.ascend_moe_reference import MoeReferenceOps
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.device import apply_jit_config, setup_device

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE, EPS = 4, 2, 64, 16, 16, 1e-5
SCALE = HEAD_DIM ** -0.5
# the routed experts (MoE): experts, picks a token, their width, tokens; an expert-parallel rank of MOE_RANKS
MOE_EXPERTS, MOE_TOP_K, MOE_FFN, MOE_TOKENS, MOE_RANKS = 8, 2, 48, 6, 2


class NormSwiglu(nn.Cell):
    def __init__(self, fused) -> None:
        super().__init__()
        self.norm, self.swiglu = fused.rms_norm(EPS), fused.swiglu()

    def construct(self, x, gamma, gate_up):
        return self.norm(x, gamma)[0], self.swiglu(gate_up, -1)


class Rope(nn.Cell):
    def __init__(self, fused) -> None:
        super().__init__()
        self.rope = fused.rope()

    def construct(self, query, key, cos, sin, batch_valid_length):
        return self.rope(query, key, cos, sin, batch_valid_length)


class CachedAttention(nn.Cell):
    """Caches as Parameters (as the backend holds them): the write, then decode and multi-token reads."""

    def __init__(self, fused, key_cache: np.ndarray, value_cache: np.ndarray) -> None:
        super().__init__()
        self.key_cache = Parameter(Tensor(key_cache), name="key_cache")
        self.value_cache = Parameter(Tensor(value_cache), name="value_cache")
        self.write = fused.reshape_and_cache()
        self.paged = fused.paged_attention(HEADS, SCALE, KV_HEADS)


class Write(CachedAttention):
    def construct(self, key, value, slot_mapping):
        written = self.write(key, value, self.key_cache, self.value_cache, slot_mapping)
        return ops.depend(self.key_cache * 1, written), ops.depend(self.value_cache * 1, written)


class Decode(CachedAttention):
    def construct(self, query, block_tables, batch_valid_length):
        return self.paged(query, self.key_cache, self.value_cache, block_tables, batch_valid_length)


class Chunk(CachedAttention):
    def construct(self, query, block_tables, batch_valid_length, q_seq_lens, attn_mask):
        return self.paged(query, self.key_cache, self.value_cache, block_tables, batch_valid_length, None, None,
                          attn_mask, q_seq_lens)


class Int8Decode(nn.Cell):
    """Decode over int8 caches with per-channel antiquant scales (keys' row, values' row) and zero offsets, as
    ``AscendAttention`` reads them: which way the kernel applies the scale is what this case finds out."""

    def __init__(self, fused, key_cache: np.ndarray, value_cache: np.ndarray, scale: np.ndarray) -> None:
        super().__init__()
        self.key_cache = Parameter(Tensor(key_cache), name="key_cache")
        self.value_cache = Parameter(Tensor(value_cache), name="value_cache")
        self.scale = Parameter(Tensor(scale), name="kv_scale")
        self.offset = Parameter(Tensor(np.zeros_like(scale)), name="kv_offset")
        self.paged = fused.paged_attention(HEADS, SCALE, KV_HEADS)

    def construct(self, query, block_tables, batch_valid_length):
        return self.paged(query, self.key_cache, self.value_cache, block_tables, batch_valid_length, self.scale,
                          self.offset)


class Flash(nn.Cell):
    def __init__(self, fused, mask: Tensor) -> None:
        super().__init__()
        self.flash, self.mask = fused.flash_attention(HEADS, SCALE), mask

    def construct(self, query, key, value, batch_valid_length):
        return self.flash(query, key, value, None, None, None, self.mask, None, batch_valid_length,
                          batch_valid_length)[3]


class QuantMatmul(nn.Cell):
    """A w8a16 projection: int8 [out, in] weight and float16 scales as Parameters, as the backend holds them."""

    def __init__(self, fused, weight: np.ndarray, scale: np.ndarray) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(weight), name="weight")
        self.scale = Parameter(Tensor(scale), name="scale")
        self.matmul = fused.weight_quant_matmul()

    def construct(self, x):
        return self.matmul(x, self.weight, self.scale, None, None, None, None)


def inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seeded inputs of every case, float16 as the backend serves (GQA: two query heads per kv head)."""
    h = lambda *shape: rng.normal(size=shape).astype(np.float16)
    q_lens, ctx = np.array([3, 1, 5], np.int32), np.array([40, 17, 5], np.int32)  # a chunk, a decode, a prompt
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx)])
    width = 4
    tables = rng.permutation(np.arange(1, BLOCKS))[: 3 * width].reshape(3, width).astype(np.int32)
    angles = rng.uniform(0, 6.3, size=(7, HEAD_DIM // 2))
    return {
        "x": h(5, 256), "gamma": h(256), "gate_up": h(5, 2 * 96),
        "rope_q": h(7, HEADS * HEAD_DIM), "rope_k": h(7, KV_HEADS * HEAD_DIM),
        "cos": np.cos(np.concatenate([angles, angles], 1)).astype(np.float16),
        "sin": np.sin(np.concatenate([angles, angles], 1)).astype(np.float16),
        "rope_lens": np.array([3, 4], np.int32),
        "key_cache": h(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        "value_cache": h(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        "key": h(6, KV_HEADS * HEAD_DIM), "value": h(6, KV_HEADS * HEAD_DIM),
        "slots": np.array([17, 18, 19, 33, 0, 0], np.int32),  # two sequences' tokens, then padding (dummy block 0)
        "decode_query": h(3, HEADS, HEAD_DIM), "tables": tables, "context_lens": ctx,
        "chunk_query": h(int(q_lens.sum()), HEADS, HEAD_DIM), "q_seq_lens": q_lens,
        "chunk_mask": ((np.arange(width * BLOCK_SIZE)[None, :] > positions[:, None]) * -10000.0).astype(np.float16),
        "flash_q": h(12, HEADS * HEAD_DIM), "flash_k": h(12, KV_HEADS * HEAD_DIM),
        "flash_v": h(12, KV_HEADS * HEAD_DIM), "flash_lens": np.array([5, 1, 6], np.int32),
        "wq_x": h(5, 96), "wq_weight": rng.integers(-127, 128, (64, 96)).astype(np.int8),
        "wq_scale": rng.uniform(0.001, 0.02, 64).astype(np.float16),
        # small int8 values and scales on both sides of 1: the two directions' answers far apart, neither overflows
        "int8_key_cache": rng.integers(-8, 9, (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)).astype(np.int8),
        "int8_value_cache": rng.integers(-8, 9, (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)).astype(np.int8),
        "int8_scale": np.exp(rng.uniform(-1.2, 1.2, (2, KV_HEADS * HEAD_DIM))).astype(np.float16),
        # the experts as stored, [out, in] (agents.weights.moe_weights); the grouped matmul reads them transposed
        # router logits half a unit apart within a row: no near-tie for the kernel's top-k to break otherwise
        "moe_x": h(MOE_TOKENS, 256),
        "moe_logits": np.stack([rng.permutation(MOE_EXPERTS) * 0.5 for _ in range(MOE_TOKENS)]).astype(np.float16),
        "moe_gate_up": (rng.normal(size=(MOE_EXPERTS, 2 * MOE_FFN, 256)) / 16).astype(np.float16),
        "moe_down": (rng.normal(size=(MOE_EXPERTS, 256, MOE_FFN)) / 7).astype(np.float16),
        # w8a16 experts [out, in] int8 and their float16 scale per output row (the grouped matmul's antiquant_scale)
        "moe_q_gate_up": rng.integers(-127, 128, (MOE_EXPERTS, 2 * MOE_FFN, 256)).astype(np.int8),
        "moe_q_gate_up_scale": rng.uniform(0.2, 1.0, (MOE_EXPERTS, 2 * MOE_FFN)).astype(np.float16) / 1200,
        "moe_q_down": rng.integers(-127, 128, (MOE_EXPERTS, 256, MOE_FFN)).astype(np.int8),
        "moe_q_down_scale": rng.uniform(0.2, 1.0, (MOE_EXPERTS, 256)).astype(np.float16) / 520,
    }


def run_ops(device: str) -> dict[str, np.ndarray]:
    """Every case on ``device`` (its kernels as this process's environment selects them; on CPU the stand-ins):
    the inputs as ``in_<name>``, the outputs as ``out_<case>_<i>``; a case whose kernel raised (no kernel for it,
    a shape it refuses) as ``error_<case>``, its message, so the other cases still run."""
    setup_device(device, 0)
    fused = FusedOps() if device == "Ascend" else ReferenceOps(HEAD_DIM)
    a = inputs(np.random.default_rng(0))
    t = {k: Tensor(v) for k, v in a.items()}
    mask = causal_mask(ms.float16)
    k_cache, v_cache = a["key_cache"], a["value_cache"]

    def on(cell: nn.Cell) -> nn.Cell:  # the jit config the device serves with (infer_boost on Ascend)
        apply_jit_config(cell, device)
        return cell

    moe_ops = MoeOps() if device == "Ascend" else MoeReferenceOps()

    def experts(part: ExpertSlice) -> Any:
        cut = slice(part.first, part.first + part.count)
        gate_up, down = (Tensor(np.ascontiguousarray(a[name][cut].transpose(0, 2, 1))) for name in ("moe_gate_up",
                                                                                                    "moe_down"))
        return on(AscendRoutedExperts(moe_ops, MOE_TOP_K, True, part))(t["moe_x"], t["moe_logits"], gate_up, down)

    def int8_experts() -> Any:  # A16W8: int8 [E, in, out] with antiquant_scale [E, out]
        gate_up, down = (Tensor(np.ascontiguousarray(a[name].transpose(0, 2, 1))) for name in ("moe_q_gate_up",
                                                                                              "moe_q_down"))
        return on(AscendRoutedExperts(moe_ops, MOE_TOP_K, True, ExpertSlice(0, MOE_EXPERTS, MOE_EXPERTS)))(
            t["moe_x"], t["moe_logits"], gate_up, down, t["moe_q_gate_up_scale"], t["moe_q_down_scale"])

    cases: dict[str, Callable[[], Any]] = {
        "norm_swiglu": lambda: on(NormSwiglu(fused))(t["x"], t["gamma"], t["gate_up"]),
        "rope": lambda: on(Rope(fused))(t["rope_q"], t["rope_k"], t["cos"], t["sin"], t["rope_lens"]),
        "write": lambda: on(Write(fused, k_cache, v_cache))(t["key"], t["value"], t["slots"]),
        "decode": lambda: on(Decode(fused, k_cache, v_cache))(t["decode_query"], t["tables"], t["context_lens"]),
        "chunk": lambda: on(Chunk(fused, k_cache, v_cache))(t["chunk_query"], t["tables"], t["context_lens"],
                                                        t["q_seq_lens"], t["chunk_mask"]),
        "flash": lambda: on(Flash(fused, mask))(t["flash_q"], t["flash_k"], t["flash_v"], t["flash_lens"]),
        "quant": lambda: on(QuantMatmul(fused, a["wq_weight"], a["wq_scale"]))(t["wq_x"]),
        "int8_decode": lambda: on(Int8Decode(fused, a["int8_key_cache"], a["int8_value_cache"], a["int8_scale"]))(
            t["decode_query"], t["tables"], t["context_lens"]),
        "moe": lambda: experts(ExpertSlice(0, MOE_EXPERTS, MOE_EXPERTS)),
        "moe_rank": lambda: experts(ExpertSlice.of_rank(MOE_EXPERTS, MOE_RANKS, MOE_RANKS - 1)),
        "moe_int8": int8_experts,
    }
    saved = {f"in_{k}": v for k, v in a.items()}
    saved["in_flash_mask"] = mask.asnumpy()
    first_error = ""
    for name, case in cases.items():
        try:
            outputs = case()
        except (RuntimeError, TypeError, ValueError) as exc:  # MindSpore's kernel and inference errors
            message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
            # after a kernel's failure MindSpore may refuse every later step of the process: say which came first
            saved[f"error_{name}"] = np.array(message + (f" (after {first_error}'s error)" if first_error else ""))
            first_error = first_error or name
            continue
        for i, value in enumerate(outputs if isinstance(outputs, tuple) else (outputs,)):
            saved[f"out_{name}_{i}"] = value.asnumpy()
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("Ascend", "CPU"), required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    np.savez(args.out, **run_ops(args.device))


if __name__ == "__main__":
    main()
