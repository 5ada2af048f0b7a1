"""The native projections that add a LoRA update themselves (agents/model/kernels/linear.cc, ``LoraCall``), with
their weights as ``agents.model.lora.LoraSlotWeights`` holds them, against numpy in float64: each row gets its own
slot's ``(x A^T) B^T`` (after the RMSNorm where the op has one, before its SwiGLU or residual), rows without a slot
(-1, or outside the slots) and a bucket's padding rows get none."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from agents.model.lora import LoraSlotWeights
from agents.runtime.device import setup_device
from agents.weights import packed as packed_weights
from tests.op_cell import OpCell, built_ops
from tests.script_runner import run_script
from tests.test_linear_kernel import EPS, padded, rms_norm, silu

SLOTS = 3


@pytest.fixture(scope="module", params=["default", "generic"])
def ops_(request, generic_kernel_dir):
    """The kernels as built for this machine, and built without AVX-512 (the plain loops other CPUs run)."""
    setup_device("CPU")
    return built_ops(request.param, 64, generic_kernel_dir)


def slot_weights(rng: np.random.Generator, k: int, out: int, w: int) -> tuple[LoraSlotWeights, np.ndarray,
                                                                                np.ndarray]:
    """Random stacked ``A [SLOTS * w, k]`` and ``B [out, SLOTS * w]``, and the cell holding them."""
    a = (rng.standard_normal((SLOTS * w, k)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal((out, SLOTS * w)) * 0.5).astype(np.float32)
    held = LoraSlotWeights(k, out, SLOTS, w)
    held.store(a, b)
    return held, a, b


def update(x: np.ndarray, slots: np.ndarray, a: np.ndarray, b: np.ndarray, w: int) -> np.ndarray:
    """Each row's ``(x A_s^T) B_s^T`` for its slot ``s`` (none outside [0, SLOTS)), float64."""
    out = np.zeros((x.shape[0], b.shape[0]))
    for i, s in enumerate(slots):
        if 0 <= s < SLOTS:
            cols = slice(s * w, (s + 1) * w)
            out[i] = (x[i].astype(np.float64) @ a[cols].T.astype(np.float64)) @ b[:, cols].T.astype(np.float64)
    return out


def row_slots(m: int, pattern: str) -> np.ndarray:
    """Every row on slot 1; or rows over the slots, no slot (-1) and slots past the table (3, 7, -5)."""
    if pattern == "one":
        return np.ones(m, np.int32)
    return np.array([(0, 2, -1, 1, 3, 1, 1, 7, 0, -5)[i % 10] for i in range(m)], np.int32)


# rows: one, a partial tile, several tiles of mixed slots, more rows than one task's chunk; widths (w) under a
# panel, across two, not a multiple of 8; outputs not a multiple of the 32-column panel
CASES = [(1, 37, 40, 8, "one", "all"), (5, 64, 72, 24, "mixed", "all"), (13, 37, 8, 40, "mixed", "half"),
         (30, 64, 100, 16, "one", "half"), (130, 1100, 40, 5, "mixed", "all")]


def ints(*values: int) -> list[Tensor]:
    return [Tensor(np.array([v], np.int32)) for v in values]


@pytest.mark.parametrize("m,k,n,w,pattern,which", CASES)
def test_norm_linear_adds_each_row_s_own_update(ops_, m, k, n, w, pattern, which):
    rng = np.random.default_rng(m)
    x, norm_w = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    held, a, b = slot_weights(rng, k, n, w)
    slots, rows = row_slots(m, pattern), m if which == "all" else m // 2
    got = OpCell(ops_.lora_norm_linear(n))(Tensor(x), Tensor(norm_w), Tensor(np.array([EPS], np.float32)),
                                           Tensor(packed_weights.pack(weight)), *ints(rows), held.a, held.b,
                                           Tensor(slots))
    normed = rms_norm(x, norm_w)
    expected = padded(normed @ weight.T.astype(np.float64) + update(normed, slots, a, b, w), rows)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,f,w,pattern,which", CASES)
def test_norm_swiglu_updates_gate_and_up_before_the_swiglu(ops_, m, k, f, w, pattern, which):
    rng = np.random.default_rng(m + 1)
    x, norm_w = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    weight = (rng.standard_normal((2 * f, k)) / np.sqrt(k)).astype(np.float32)
    a = (rng.standard_normal((SLOTS * w, k)) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal((2 * f, SLOTS * w)) * 0.5).astype(np.float32)
    held = LoraSlotWeights(k, 2 * 16 * -(-f // 16), SLOTS, w)
    held.store(a, packed_weights.swiglu_rows(b))  # B's rows in the order the SwiGLU panels compute gate and up
    slots, rows = row_slots(m, pattern), m if which == "all" else m // 2
    got = OpCell(ops_.lora_norm_swiglu(f))(Tensor(x), Tensor(norm_w), Tensor(np.array([EPS], np.float32)),
                                           Tensor(packed_weights.pack(weight, swiglu=True)), *ints(rows), held.a,
                                           held.b, Tensor(slots))
    normed = rms_norm(x, norm_w)
    gate_up = normed @ weight.T.astype(np.float64) + update(normed, slots, a, b, w)
    np.testing.assert_allclose(got.asnumpy(), padded(silu(gate_up[:, :f]) * gate_up[:, f:], rows), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("m,k,n,w,pattern,which", CASES)
def test_residual_and_partial_linear_add_each_row_s_own_update(ops_, m, k, n, w, pattern, which):
    rng = np.random.default_rng(m + 2)
    x, residual = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    held, a, b = slot_weights(rng, k, n, w)
    slots, rows = row_slots(m, pattern), m if which == "all" else m // 2
    lora = (held.a, held.b, Tensor(slots))
    partial = x.astype(np.float64) @ weight.T.astype(np.float64) + update(x, slots, a, b, w)
    got = OpCell(ops_.lora_residual_linear())(Tensor(x), Tensor(packed_weights.pack(weight)), Tensor(residual),
                                              *ints(rows), *lora)
    np.testing.assert_allclose(got.asnumpy(), padded(residual + partial, rows), rtol=1e-4, atol=1e-3)
    got = OpCell(ops_.lora_partial_linear(n))(Tensor(x), Tensor(packed_weights.pack(weight)), *ints(rows), *lora)
    np.testing.assert_allclose(got.asnumpy(), padded(partial, rows), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16"])
def test_rows_without_a_slot_get_the_base_op_s_result_exactly_in_every_precision(ops_, fmt):
    """No slot: bit for bit the base op (the update adds nothing, not a rounded zero); with slots, the base op's
    result plus the float32 update of the float32 normed rows, whatever the base weight's precision."""
    rng = np.random.default_rng(9)
    m, k, n, w = 14, 64, 72, 16
    x, norm_w = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    packed = {"float32": packed_weights.pack(weight), "float16": packed_weights.pack(weight).astype(np.float16),
              "bfloat16": packed_weights.pack_bf16(weight)}[fmt]
    held, a, b = slot_weights(rng, k, n, w)
    norm_inputs = (Tensor(x), Tensor(norm_w), Tensor(np.array([EPS], np.float32)), Tensor(packed), *ints(m))
    base = OpCell(ops_.norm_linear(n))(*norm_inputs).asnumpy()
    none = OpCell(ops_.lora_norm_linear(n))(*norm_inputs, held.a, held.b, Tensor(np.full(m, -1, np.int32)))
    np.testing.assert_array_equal(none.asnumpy(), base)
    slots = row_slots(m, "mixed")
    got = OpCell(ops_.lora_norm_linear(n))(*norm_inputs, held.a, held.b, Tensor(slots)).asnumpy()
    np.testing.assert_allclose(got - base, update(rms_norm(x, norm_w), slots, a, b, w), rtol=1e-4, atol=1e-4)


LORA_SHAPE_SCRIPT = """
import numpy as np, mindspore as ms
from mindspore import Tensor
from agents.model.native_kernels import native_ops
from agents.weights import packed
from tests.op_cell import OpCell
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
x, w = np.ones((4, 8), np.float32), packed.pack(np.ones((40, 8), np.float32))
a, b = np.zeros((1, 8, 32), np.float32), np.zeros(({panels}, 3, 4, 32), np.float32)
try:
    OpCell(native_ops(64).lora_partial_linear(40))(Tensor(x), Tensor(w), Tensor(np.array([4], np.int32)), Tensor(a),
                                                  Tensor(b), Tensor(np.zeros(4, np.int32)))
    print("no error")
except RuntimeError as exc:
    print("error:", str(exc).splitlines()[0])
"""


@pytest.mark.parametrize("panels,expected", [(2, "no error"), (1, "is 3")])
def test_lora_weights_of_the_wrong_shape_are_refused(tmp_path, panels, expected):
    """40 outputs are 2 panels: a B of one panel is refused with code 3 instead of being read past its end. In a
    subprocess: MindSpore refuses every later step after a failed kernel."""
    result = run_script(tmp_path, LORA_SHAPE_SCRIPT.replace("{panels}", str(panels)))
    assert expected in result.stdout, result.stdout + result.stderr[-2000:]
