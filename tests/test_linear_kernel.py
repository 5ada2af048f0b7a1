"""The native projections (agents/model/kernels/linear.cc) and their packed weight layout, against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from agents.runtime.device import setup_device
from agents.weights import packed as packed_weights
from tests.op_cell import OpCell, built_ops
from tests.script_runner import run_script

EPS = 1e-5


@pytest.mark.parametrize("out,inner,swiglu", [(40, 37, False), (64, 8, False), (1, 3, False), (40, 37, True),
                                              (64, 5, True), (2, 9, True)])
def test_pack_round_trip_and_shape(out, inner, swiglu):
    w = np.random.default_rng(0).standard_normal((out, inner)).astype(np.float32)
    packed = packed_weights.pack(w, swiglu)
    assert packed.shape == packed_weights.packed_shape(out, inner, swiglu)
    np.testing.assert_array_equal(packed_weights.unpack(packed, out, swiglu), w)


def test_swiglu_panels_hold_gate_then_up_rows_of_the_same_outputs():
    f, inner = 20, 3
    w = np.arange(2 * f * inner, dtype=np.float32).reshape(2 * f, inner)
    panels = packed_weights.pack(w, swiglu=True).reshape(2, inner, 32)
    np.testing.assert_array_equal(panels[1, :, 0], w[16])  # gate row of output 16
    np.testing.assert_array_equal(panels[1, :, 16], w[f + 16])  # its up row
    assert not panels[1, :, 4:16].any() and not panels[1, :, 20:].any()  # outputs 20..31 do not exist


@pytest.fixture(scope="module", params=["default", "generic"])
def ops_(request, generic_kernel_dir):
    """The kernels as built for this machine, and built without AVX-512 (the plain loops other CPUs run)."""
    setup_device("CPU")  # graph mode, as the model runs them (and before any kernel runs in this process)
    ops = built_ops(request.param, 64, generic_kernel_dir)
    assert request.param == "default" or not ops.projections  # the model keeps MindSpore's MatMul with these
    return ops


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# Rows: one, a partial tile, several tiles, and (K = 1100) more rows than one task's chunk holds. Widths not a
# multiple of the 32-column panel.
SHAPES = [(1, 37, 40), (5, 64, 72), (13, 37, 8), (130, 1100, 40)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear(ops_, m, k, n):
    rng = np.random.default_rng(m + 3)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    got = OpCell(ops_.linear(n))(Tensor(x), Tensor(packed_weights.pack(w)))
    np.testing.assert_allclose(got.asnumpy(), x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)


def real_rows(m: int, which: str) -> int:
    """The ``rows`` input of a fused op: all rows real, about half (the rest a bucket's padding), none, or more
    than x has (clamped)."""
    return {"all": m, "half": m // 2, "none": 0, "over": m + 5}[which]


def padded(expected: np.ndarray, rows: int) -> np.ndarray:
    """``expected`` with the rows past ``rows`` zeroed, as the fused ops leave a bucket's padding."""
    out = expected.copy()
    out[rows:] = 0.0
    return out


FUSED_CASES = [(*shape, which) for shape in SHAPES for which in ("all", "half")] + \
    [(13, 37, 8, "none"), (13, 37, 8, "over")]


@pytest.mark.parametrize("m,k,n,which", FUSED_CASES)
def test_norm_linear(ops_, m, k, n, which):
    rng = np.random.default_rng(m)
    x, norm_w = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    rows = real_rows(m, which)
    got = OpCell(ops_.norm_linear(n))(Tensor(x), Tensor(norm_w), Tensor(np.array([EPS], np.float32)),
                                      Tensor(packed_weights.pack(w)), Tensor(np.array([rows], np.int32)))
    expected = padded(rms_norm(x, norm_w) @ w.T.astype(np.float64), rows)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,f,which", FUSED_CASES)
def test_norm_swiglu(ops_, m, k, f, which):
    rng = np.random.default_rng(m + 1)
    x, norm_w = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    w = (rng.standard_normal((2 * f, k)) / np.sqrt(k)).astype(np.float32)
    rows = real_rows(m, which)
    got = OpCell(ops_.norm_swiglu(f))(Tensor(x), Tensor(norm_w), Tensor(np.array([EPS], np.float32)),
                                      Tensor(packed_weights.pack(w, swiglu=True)), Tensor(np.array([rows], np.int32)))
    gate_up = rms_norm(x, norm_w) @ w.T.astype(np.float64)
    expected = padded(silu(gate_up[:, :f]) * gate_up[:, f:], rows)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,k,n,which", FUSED_CASES)
def test_residual_linear(ops_, m, k, n, which):
    rng = np.random.default_rng(m + 2)
    x, residual = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    rows = real_rows(m, which)
    got = OpCell(ops_.residual_linear())(Tensor(x), Tensor(packed_weights.pack(w)), Tensor(residual),
                                         Tensor(np.array([rows], np.int32)))
    expected = padded(residual + x.astype(np.float64) @ w.T.astype(np.float64), rows)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m,k,n,which", FUSED_CASES)
def test_partial_linear(ops_, m, k, n, which):
    """A tensor-parallel rank's partial sum (agents.model.parallel): x @ W^T of the real rows, zeros after them."""
    rng = np.random.default_rng(m + 3)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    rows = real_rows(m, which)
    got = OpCell(ops_.partial_linear(n))(Tensor(x), Tensor(packed_weights.pack(w)),
                                         Tensor(np.array([rows], np.int32)))
    expected = padded(x.astype(np.float64) @ w.T.astype(np.float64), rows)
    np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-4, atol=1e-3)


SHAPE_GUARD_SCRIPT = """
import numpy as np, mindspore as ms
from mindspore import Tensor
from agents.model.native_kernels import native_ops
from tests.op_cell import OpCell
from tests.script_runner import run_script
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
x, norm_w, eps = np.ones((4, 8), np.float32), np.ones(8, np.float32), np.array([1e-5], np.float32)
try:
    OpCell(native_ops(64).norm_linear(40))(Tensor(x), Tensor(norm_w), Tensor(eps), Tensor(np.ones(({rows}, 32),
                                           np.float32)), Tensor(np.array([4], np.int32)))
    print("no error")
except RuntimeError as exc:
    print("error:", str(exc).splitlines()[0])
"""


@pytest.mark.parametrize("rows,expected", [(16, "no error"), (8, "is 3")])
def test_a_packed_weight_of_the_wrong_shape_is_refused(tmp_path, rows, expected):
    """40 outputs over 8 inputs need 2 panels of 8 rows; one panel is refused with code 3 (inconsistent shapes)
    instead of being read past its end. In a subprocess: MindSpore refuses every later step after a failed kernel."""
    result = run_script(tmp_path, SHAPE_GUARD_SCRIPT.replace("{rows}", str(rows)))
    assert expected in result.stdout, result.stdout + result.stderr[-2000:]
