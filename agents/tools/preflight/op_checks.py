"""The per-op cases' outputs (``agents.tools.preflight.ops.run_ops``) held to their numpy references, one
``CheckResult`` each (float16 in, float64 references), and the int8 PagedAttention antiquant direction: the one
whose dequantized caches' attention matches the kernel's answer."""

from __future__ import annotations

import numpy as np

from agents.model.moe_routing import swiglu_expert, top_k
from agents.tools.preflight import references as ref
from agents.tools.preflight.ops import EPS, HEAD_DIM, HEADS, KV_HEADS, MOE_EXPERTS, MOE_RANKS, MOE_TOP_K, SCALE
from llm_serving.protocol.preflight_verdict import CheckResult

ATOL = RTOL = 2e-2  # float16 kernels against float64 references: a few float16 ulps of the outputs' range
INT8_ATOL, INT8_RTOL = 5e-2, 2e-2  # int8 caches dequantized in float16 first: one more rounding


def compare(name: str, got: np.ndarray | None, want: np.ndarray, atol: float = ATOL, rtol: float = RTOL,
            error: str = "") -> CheckResult:
    """``got`` within ``atol + rtol * |want|`` of ``want`` everywhere (NaN fails); ``got`` None: the case raised
    (``error``) or gave no output."""
    tolerance = f"{atol:g} + {rtol:g} x |ref|"
    if got is None:
        return CheckResult(name, False, None, tolerance, error or "no output")
    if got.shape != want.shape:
        return CheckResult(name, False, None, tolerance, f"shape {list(got.shape)}, reference {list(want.shape)}")
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else float("nan")
    passed = bool(np.allclose(got.astype(np.float64), want, atol=atol, rtol=rtol))
    nans = int(np.isnan(got.astype(np.float64)).sum())
    return CheckResult(name, passed, worst, tolerance, f"{nans} NaN" if nans else "")


def op_results(got: dict[str, np.ndarray]) -> list[CheckResult]:
    """Each fused primitive's outputs against its reference (``int8_direction`` checks the int8 case)."""
    a = {k.removeprefix("in_"): v for k, v in got.items() if k.startswith("in_")}

    def out(case: str, i: int = 0) -> tuple[np.ndarray | None, str]:
        return got.get(f"out_{case}_{i}"), str(got.get(f"error_{case}", ""))

    want_k, want_v = ref.reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"], a["slots"])
    rows: list[tuple[str, str, int, np.ndarray, float]] = [
        ("RmsNorm", "norm_swiglu", 0, ref.rms_norm(a["x"], a["gamma"], EPS)[0], ATOL),
        ("Swiglu", "norm_swiglu", 1, ref.swiglu(a["gate_up"]), ATOL),
        ("ApplyRotaryPosEmb query", "rope", 0, ref.rope(a["rope_q"], a["cos"], a["sin"], HEAD_DIM), ATOL),
        ("ApplyRotaryPosEmb key", "rope", 1, ref.rope(a["rope_k"], a["cos"], a["sin"], HEAD_DIM), ATOL),
        ("ReshapeAndCache key", "write", 0, want_k, 0.0),  # a copy: exact
        ("ReshapeAndCache value", "write", 1, want_v, 0.0),
        ("PagedAttention decode", "decode", 0, ref.paged_attention(
            a["decode_query"], a["key_cache"], a["value_cache"], a["tables"], a["context_lens"], SCALE), ATOL),
        ("PagedAttention multi-token", "chunk", 0, ref.paged_attention_queries(
            a["chunk_query"], a["key_cache"], a["value_cache"], a["tables"], a["context_lens"], a["q_seq_lens"],
            a["chunk_mask"], SCALE), ATOL),
        ("FlashAttentionScore TH", "flash", 0, ref.flash_attention_th(
            a["flash_q"], a["flash_k"], a["flash_v"], a["flash_mask"], "float16", a["flash_lens"], a["flash_lens"],
            HEADS, SCALE), ATOL),
        ("WeightQuantBatchMatmul", "quant", 0, ref.weight_quant_matmul(a["wq_x"], a["wq_weight"], a["wq_scale"]),
         ATOL),
        ("MoE routed experts", "moe", 0, _moe_reference(a, range(MOE_EXPERTS)), ATOL),
        ("MoE routed experts, expert-parallel rank", "moe_rank", 0,
         _moe_reference(a, range(MOE_EXPERTS - MOE_EXPERTS // MOE_RANKS, MOE_EXPERTS)), ATOL),
        ("MoE routed experts, int8", "moe_int8", 0, _moe_reference(a, range(MOE_EXPERTS), int8=True), ATOL),
    ]
    results = []
    for name, case, i, want, atol in rows:
        value, error = out(case, i)
        if case == "write" and value is not None:  # block 0: the padding tokens', written in any order
            value, want = value[1:], want[1:]
        results.append(compare(name, value, want, atol, atol, error))
    return results


def _moe_reference(a: dict[str, np.ndarray], held: range, int8: bool = False) -> np.ndarray:
    """The routed experts' weighted sum (top-k renormalised) over the picks of the experts in ``held`` (an
    expert-parallel rank's part), in float64; ``int8``: of the w8a16 experts, each row q * its scale."""
    x = a["moe_x"].astype(np.float64)
    if int8:
        a = {**a, **{name: a[f"moe_q_{part}"].astype(np.float64) * a[f"moe_q_{part}_scale"].astype(np.float64)[
            :, :, None] for name, part in (("moe_gate_up", "gate_up"), ("moe_down", "down"))}}
    weights, ids = top_k(a["moe_logits"].astype(np.float64), MOE_TOP_K, True)
    out = np.zeros_like(x)
    for t, j in np.ndindex(ids.shape):
        if ids[t, j] in held:
            expert = swiglu_expert(a["moe_gate_up"][ids[t, j]].astype(np.float64),
                                   a["moe_down"][ids[t, j]].astype(np.float64))
            out[t] += weights[t, j] * expert(x[t:t + 1])[0]
    return out


def int8_direction(got: dict[str, np.ndarray]) -> tuple[str | None, list[CheckResult]]:
    """How the kernel applied the int8 caches' antiquant scale (``model_config.ascend_int8_kv_direction``): the
    one direction whose dequantized caches' attention matches its answer, None if neither or both do; and the
    comparison with each direction."""
    a = {k.removeprefix("in_"): v for k, v in got.items() if k.startswith("in_")}
    scale = a["int8_scale"].astype(np.float64).reshape(2, 1, 1, KV_HEADS, HEAD_DIM)
    caches = a["int8_key_cache"].astype(np.float64), a["int8_value_cache"].astype(np.float64)
    value, error = got.get("out_int8_decode_0"), str(got.get("error_int8_decode", ""))
    results = []
    for direction, (k, v) in (("multiply", (caches[0] * scale[0], caches[1] * scale[1])),
                              ("reciprocal", (caches[0] / scale[0], caches[1] / scale[1]))):
        want = ref.paged_attention(a["decode_query"], k, v, a["tables"], a["context_lens"], SCALE)
        results.append(compare(f"PagedAttention int8 {direction}", value, want, INT8_ATOL, INT8_RTOL, error))
    matching = [r.name.rsplit(" ", 1)[1] for r in results if r.passed]
    return (matching[0] if len(matching) == 1 else None), results
